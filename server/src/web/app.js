// Tandem's web page: the task list at `/`, one task at `/tasks/{id}`.
// Everything a model or program wrote is inserted as text (textContent, text nodes,
// `value`), never parsed as HTML; the page's CSP forbids inline script and style anyway.
(() => {
  'use strict';

  const TOKEN_KEY = 'tandem.token';
  const ACTIVE = new Set(['queued', 'running', 'awaiting_approval', 'interrupted']);
  const STOP = {
    terminated: 'done', answered: 'done: answered', examples_held: "done: the task's examples hold",
    max_turns: 'turn limit reached', timeout: 'timed out',
    cancelled: 'cancelled', error: 'failed', budget: 'budget reached',
    repeated: 'the same code sent again',
  };
  // A cost as people read one: four places, since a task's calls cost cents or less.
  const cost = (c) => (typeof c === 'number' && c > 0 ? `cost ${c.toFixed(4)}` : null);
  // What a budget stop says: which budget, its limit and what was spent.
  const budgetText = (b) => {
    const money = b.budget === 'max_cost';
    const show = (n) => (money ? Number(n).toFixed(4) : String(n));
    return `the task reached its ${b.budget} of ${show(b.limit)} (${show(b.spent)} spent)`;
  };
  const enc = encodeURIComponent;
  const $ = (id) => document.getElementById(id);
  // One formatter each: building Intl formatters per call is slow in long transcripts.
  const clockFmt = new Intl.DateTimeFormat(undefined, { hour: '2-digit', minute: '2-digit', second: '2-digit' });
  const dateFmt = new Intl.DateTimeFormat(undefined, { dateStyle: 'medium', timeStyle: 'short' });

  // Small element builder. Strings among `kids` become text nodes, so data stays text.
  function h(tag, props, ...kids) {
    const e = document.createElement(tag);
    for (const k in props) {
      const v = props[k];
      if (v == null || v === false) continue;
      if (k === 'class') e.className = v;
      else if (k === 'title' || k === 'rows') e[k] = v;
      else e.setAttribute(k, String(v));
    }
    for (const c of kids) if (c != null && c !== false) e.append(c);
    return e;
  }

  const plural = (n, word) => `${n} ${word}${n === 1 ? '' : 's'}`;
  const lastPart = (path) => path.slice(path.lastIndexOf('/') + 1);
  // A name code chose, on one inert line: control characters, line separators and bidi
  // overrides as \u{..} escapes, and a backslash doubled, as the CLI shows it.
  const shownName = (name) => name.replace(
    /[\u0000-\u001f\u007f-\u009f\u2028\u2029\u202a-\u202e\u2066-\u2069\\]/g,
    (c) => (c === '\\' ? '\\\\' : `\\u{${c.codePointAt(0).toString(16)}}`),
  );
  const taskHref = (id) => '/tasks/' + enc(id);

  function duration(ms) {
    if (ms < 1000) return `${ms} ms`;
    if (ms < 60000) return `${(ms / 1000).toFixed(1)} s`;
    const m = Math.floor(ms / 60000);
    return `${m} min ${Math.round((ms % 60000) / 1000)} s`;
  }

  // Decimal units, as the transcript's footer prints them.
  function bytes(n) {
    if (n < 1000) return `${n} B`;
    const units = ['kB', 'MB', 'GB', 'TB'];
    let v = n / 1000, i = 0;
    while (v >= 1000 && i < units.length - 1) { v /= 1000; i++; }
    return `${v.toFixed(1)} ${units[i]}`;
  }

  // What a block used, one phrase per figure measured; the reason when none was.
  function usage(r) {
    if (!r) return '';
    const parts = [];
    if (r.cpu_secs != null) parts.push(`cpu ${r.cpu_secs.toFixed(2)} s`);
    if (r.peak_memory_bytes != null) {
      parts.push(`peak ${bytes(r.peak_memory_bytes)}${r.peak_memory_scope === 'session' ? ' (session)' : ''}`);
    }
    if (r.disk_written_bytes != null) parts.push(`disk ${bytes(r.disk_written_bytes)}`);
    if (r.net_bytes_in != null || r.net_bytes_out != null) {
      parts.push(`net ${bytes(r.net_bytes_in || 0)} in, ${bytes(r.net_bytes_out || 0)} out`);
    }
    if (!parts.length && r.unavailable) parts.push(`usage unavailable: ${r.unavailable}`);
    return parts.join(' · ');
  }

  function ago(ms) {
    const s = Math.round((Date.now() - ms) / 1000);
    if (s < 5) return 'just now';
    if (s < 60) return `${s} s ago`;
    if (s < 3600) return `${Math.floor(s / 60)} min ago`;
    if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
    return dateFmt.format(ms);
  }

  function stateClass(r) {
    const bad = r.state === 'finished' && (r.stop_reason === 'error' || r.stop_reason === 'timeout');
    return `state badge state-${r.state}${bad ? ' bad' : ''}`;
  }

  function tokens(u) {
    return u ? `${u.prompt_tokens} in / ${u.completion_tokens} out tokens` : '';
  }

  // ---- auth and API -------------------------------------------------------------------

  // Storage can be disabled (privacy modes); the token then lives as long as the page.
  let memToken = '';
  function getToken() {
    try { return sessionStorage.getItem(TOKEN_KEY) || ''; } catch (_) { return ''; }
  }
  function setToken(t) {
    try { sessionStorage.setItem(TOKEN_KEY, t); } catch (_) { /* kept for this page only */ }
    memToken = t;
  }

  function authHeaders(extra) {
    const headers = Object.assign({}, extra);
    const t = getToken() || memToken;
    if (t) headers.Authorization = 'Bearer ' + t;
    return headers;
  }

  const apiError = (message, status) => Object.assign(new Error(message), { status });

  // Each view sets what to redo once a token is entered.
  let onAuth = () => {};

  function askToken() {
    const form = $('token-form');
    if (!form.hidden) return;
    $('token-note').textContent = getToken() || memToken
      ? 'The daemon refused the saved token. Enter a valid one.'
      : 'This daemon needs an API token.';
    form.hidden = false;
    $('token').focus();
  }

  function setupTokenForm() {
    $('token-form').addEventListener('submit', (e) => {
      e.preventDefault();
      const value = $('token').value.trim();
      if (!value) return;
      setToken(value);
      $('token').value = '';
      $('token-form').hidden = true;
      onAuth();
    });
  }

  async function readResponse(res) {
    if (res.status === 401) askToken();
    const text = await res.text();
    let data = null;
    try { data = text ? JSON.parse(text) : null; } catch (_) { /* not JSON: reported below */ }
    if (!res.ok) {
      const err = data && data.error;
      throw apiError((err && err.message) || `${res.status} ${res.statusText || 'error'}`, res.status);
    }
    $('token-form').hidden = true;
    return data;
  }

  async function api(method, path, body) {
    const init = { method, headers: authHeaders(), cache: 'no-store' };
    if (body !== undefined) {
      const raw = typeof body === 'string'; // a team file's TOML goes as it is
      init.headers['Content-Type'] = raw ? 'text/plain' : 'application/json';
      init.body = raw ? body : JSON.stringify(body);
    }
    let res;
    try { res = await fetch(path, init); } catch (e) {
      throw apiError(`Cannot reach the daemon (${e.message})`, 0);
    }
    return readResponse(res);
  }

  // The body of an authorised GET, as a Blob (pictures and downloads need the token, which
  // an <img> or a link cannot send).
  async function fetchBlob(path) {
    let res;
    try { res = await fetch(path, { headers: authHeaders(), cache: 'no-store' }); } catch (e) {
      throw apiError(`Cannot reach the daemon (${e.message})`, 0);
    }
    if (!res.ok) return readResponse(res);
    return res.blob();
  }

  // Files as one tar archive (ustar), the form POST /v1/uploads takes.
  const enc8 = new TextEncoder();
  function tarOf(files) {
    const parts = [];
    for (const f of files) {
      const name = enc8.encode(f.name);
      if (name.length > 100) throw new Error(`${f.name}: the name is longer than 100 bytes; rename it`);
      const head = new Uint8Array(512);
      const put = (at, text) => head.set(enc8.encode(text), at);
      head.set(name, 0);
      put(100, '0000644\0');
      put(108, '0000000\0');
      put(116, '0000000\0');
      put(124, f.size.toString(8).padStart(11, '0') + '\0');
      put(136, Math.floor(Date.now() / 1000).toString(8).padStart(11, '0') + '\0');
      put(148, '        ');
      put(156, '0');
      put(257, 'ustar\0');
      put(263, '00');
      let sum = 0;
      for (const b of head) sum += b;
      put(148, sum.toString(8).padStart(6, '0') + '\0 ');
      parts.push(head, f, new Uint8Array((512 - (f.size % 512)) % 512));
    }
    parts.push(new Uint8Array(1024));
    return new Blob(parts, { type: 'application/x-tar' });
  }

  async function upload(files) {
    const init = {
      method: 'POST', cache: 'no-store', body: tarOf(files),
      headers: authHeaders({ 'Content-Type': 'application/x-tar' }),
    };
    let res;
    try { res = await fetch('/v1/uploads', init); } catch (e) {
      throw apiError(`Cannot reach the daemon (${e.message})`, 0);
    }
    return readResponse(res);
  }

  // Saves a blob under `name` through a temporary link.
  function saveBlob(blob, name) {
    const url = URL.createObjectURL(blob);
    const a = h('a', { href: url, download: name });
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60000);
  }

  function size(bytes) {
    if (bytes < 1024) return `${bytes} B`;
    if (bytes < 1048576) return `${(bytes / 1024).toFixed(1)} KiB`;
    return `${(bytes / 1048576).toFixed(1)} MiB`;
  }

  // ---- list view ----------------------------------------------------------------------

  function listView() {
    $('app').replaceChildren($('list-tpl').content.cloneNode(true));
    const list = $('task-list');
    const moreBtn = $('load-more');
    const entries = new Map(); // id -> {row, parts, key, text}
    let nextBefore = null;
    let loaded = false;
    let polling = false;
    let generation = 0; // bumped when the filter changes, so stale answers are dropped

    function query(before) {
      const p = new URLSearchParams({ limit: '50' });
      const state = $('state-filter').value;
      if (state) p.set('state', state);
      if (before) p.set('before', before);
      return '/v1/tasks?' + p;
    }

    function makeRow(t) {
      const parts = {
        link: h('a', { class: 'task-link', href: taskHref(t.id) }),
        state: h('span', { class: 'state badge' }),
        stop: h('span', { class: 'stop' }),
        turns: h('span', { class: 'turns' }),
        time: h('time'),
      };
      const row = h('li', { class: 'task-row', 'data-id': t.id }, parts.link,
        h('div', { class: 'row-meta' }, parts.state, parts.stop, parts.turns, parts.time));
      const entry = { row, parts, key: '', text: '' };
      entries.set(t.id, entry);
      fill(entry, t);
      return entry;
    }

    function fill(entry, t) {
      const task = (t.spec && t.spec.task) || '';
      const key = [t.state, t.stop_reason, t.turns, task].join('\u0000');
      const p = entry.parts;
      if (key !== entry.key) {
        entry.key = key;
        entry.text = task.toLowerCase();
        p.link.textContent = task || '(empty task)';
        p.link.title = task;
        p.state.textContent = t.state;
        p.state.className = stateClass(t);
        p.stop.textContent = t.state === 'finished' && t.stop_reason ? t.stop_reason : '';
        p.stop.title = STOP[t.stop_reason] || '';
        p.turns.textContent = plural(t.turns || 0, 'turn');
        matchSearch(entry);
      }
      entry.created = t.created_ms;
      if (!t.created_ms) return;
      p.time.dateTime = new Date(t.created_ms).toISOString();
      p.time.title = dateFmt.format(t.created_ms);
      p.time.textContent = ago(t.created_ms);
    }

    function matchSearch(entry) {
      const q = $('search').value.trim().toLowerCase();
      entry.row.hidden = q !== '' && !entry.text.includes(q);
    }

    // Drops the rows from `row` up to (not including) `stop`; returns `stop`.
    function dropUntil(row, stop) {
      while (row && row !== stop) {
        const next = row.nextElementSibling;
        entries.delete(row.dataset.id);
        row.remove();
        row = next;
      }
      return stop;
    }

    // Merges a fresh first page into the rows in place: tasks are newest first, so new
    // ones go on top, known ones are updated, and rows between two page entries that the
    // page no longer holds (they left the state filter) are dropped.
    function merge(page, first) {
      let cursor = list.firstElementChild;
      for (const t of page.tasks) {
        const known = entries.get(t.id);
        if (known) {
          cursor = dropUntil(cursor, known.row).nextElementSibling;
          fill(known, t);
        } else {
          list.insertBefore(makeRow(t).row, cursor);
        }
      }
      if (page.next == null) {
        dropUntil(cursor, null);
        nextBefore = null;
      } else if (first) {
        nextBefore = page.next;
      }
    }

    function updateFoot() {
      moreBtn.hidden = nextBefore == null;
      let shown = 0;
      for (const e of entries.values()) if (!e.row.hidden) shown++;
      let text = `${plural(shown, 'task')} shown`;
      if (shown !== entries.size) text += ` (of ${entries.size} loaded)`;
      else if (loaded && shown === 0) text = $('state-filter').value ? 'No tasks in this state' : 'No tasks yet';
      $('list-status').textContent = text;
    }

    async function refresh(force) {
      if (polling && !force) return;
      polling = true;
      const gen = generation;
      try {
        const page = await api('GET', query(null));
        if (gen !== generation) return;
        merge(page, !loaded);
        // For the browser test's measurement: when the first page was on screen.
        if (!loaded) window.tandemTiming = { listRendered: performance.now() };
        loaded = true;
        for (const e of entries.values()) if (e.created) e.parts.time.textContent = ago(e.created);
        $('list-error').textContent = '';
      } catch (e) {
        if (gen === generation) $('list-error').textContent = e.message;
      } finally {
        polling = false;
        if (gen === generation) updateFoot();
      }
    }

    async function loadMore() {
      if (nextBefore == null) return;
      moreBtn.disabled = true;
      const gen = generation;
      try {
        const page = await api('GET', query(nextBefore));
        if (gen !== generation) return;
        const frag = document.createDocumentFragment();
        for (const t of page.tasks) {
          const known = entries.get(t.id);
          if (known) fill(known, t);
          else frag.append(makeRow(t).row);
        }
        list.append(frag);
        nextBefore = page.next;
        $('list-error').textContent = '';
      } catch (e) {
        $('list-error').textContent = e.message;
      } finally {
        moreBtn.disabled = false;
        updateFoot();
      }
    }

    function reset() {
      generation++;
      entries.clear();
      list.replaceChildren();
      nextBefore = null;
      loaded = false;
      updateFoot();
      refresh(true);
    }

    async function loadExecutors() {
      const select = $('executor');
      try {
        const { executors } = await api('GET', '/v1/executors');
        const chosen = select.value;
        while (select.options.length > 1) select.remove(1);
        const hosts = $('hosts');
        hosts.replaceChildren();
        for (const ex of executors || []) {
          if (!ex.offered) continue;
          // A fleet's hosts, each with its health and load.
          for (const host of ex.hosts || []) {
            const labels = Object.entries(host.labels || {}).map(([k, v]) => `${k}=${v}`).join(', ');
            const state = host.up ? 'up' : `down: ${host.reason || ''}`;
            hosts.append(h('li', { class: host.up ? 'host-up' : 'host-down' },
              `${ex.name} host ${host.name} · ${state} · ${host.sessions} of ${host.capacity} sessions${labels ? ` · ${labels}` : ''}`));
          }
          let label = ex.name;
          if (ex.languages && ex.languages.length) label += ` (${ex.languages.join(', ')})`;
          if (ex.health !== 'ok') label += ' · unavailable';
          const opt = new Option(label, ex.name);
          if (ex.problem) opt.title = ex.problem;
          select.add(opt);
        }
        select.value = chosen;
        if (select.selectedIndex < 0) select.value = '';
        hosts.hidden = !hosts.children.length;
        $('placement-row').hidden = hosts.hidden;
      } catch (_) {
        // "default" stays usable; a 401 already asked for a token.
      }
    }

    // Snapshots a task can start from, newest first.
    async function loadSnapshots() {
      const select = $('from-snapshot');
      try {
        const { snapshots } = await api('GET', '/v1/snapshots');
        const chosen = select.value;
        while (select.options.length > 1) select.remove(1);
        for (const snap of (snapshots || []).slice().reverse()) {
          const what = [snap.name || snap.id, `${snap.files} files`, size(snap.bytes)];
          if (snap.saved && snap.saved.length) what.push(`${snap.saved.length} globals`);
          if (snap.created_ms) what.push(dateFmt.format(snap.created_ms));
          select.add(new Option(what.join(' · '), snap.id));
        }
        select.value = chosen;
        if (select.selectedIndex < 0) select.value = '';
      } catch (_) {
        // "none" stays usable; a 401 already asked for a token.
      }
    }

    async function submit(e) {
      e.preventDefault();
      const btn = $('submit');
      const errEl = $('submit-error');
      const text = $('task-text').value;
      errEl.textContent = text.trim() ? '' : 'Write a task first.';
      if (!text.trim()) return;
      btn.disabled = true;
      try {
        const body = { task: text };
        const executor = $('executor').value;
        if (executor) body.executor = executor;
        if ($('keep-state').checked) body.keep_state = true;
        if ($('code-via').value) body.code_via = $('code-via').value;
        const candidates = $('candidates').value.trim();
        if (candidates) {
          const k = Number(candidates);
          if (!Number.isInteger(k) || k < 1 || k > 8) throw new Error('candidates must be a whole number from 1 to 8');
          body.candidates = k;
        }
        for (const [id, field, whole] of [['max-input-tokens', 'max_input_tokens', true], ['max-output-tokens', 'max_output_tokens', true], ['max-cost', 'max_cost', false]]) {
          const raw = $(id).value.trim();
          if (!raw) continue;
          const n = Number(raw);
          if (!Number.isFinite(n) || n <= 0 || (whole && !Number.isInteger(n))) {
            throw new Error(`${field} must be ${whole ? 'a whole number' : 'a number'} above 0`);
          }
          body[field] = n;
        }
        const schema = $('output-schema').value.trim();
        if (schema) {
          try {
            body.output_schema = JSON.parse(schema);
          } catch (err) {
            throw new Error(`Output schema is not JSON: ${err.message}`);
          }
        }
        const placement = $('placement').value.trim();
        if (placement) {
          body.placement = {};
          for (const pair of placement.split(',')) {
            const [k, ...v] = pair.split('=');
            if (!k.trim() || !v.length) throw new Error(`Placement: \`${pair.trim()}\` is not key=value`);
            body.placement[k.trim()] = v.join('=').trim();
          }
        }
        const hosts = $('allow-hosts').value.split(',').map((h) => h.trim()).filter(Boolean);
        if (hosts.length) body.network = { allow: hosts };
        const mounts = $('volumes').value.split(',').map((v) => v.trim()).filter(Boolean);
        if (mounts.length) {
          body.volumes = mounts.map((m) => {
            const [name, path, mode, ...rest] = m.split(':');
            if (!name || !path || rest.length || (mode && mode !== 'ro' && mode !== 'rw')) {
              throw new Error(`Volumes: \`${m}\` is not NAME:PATH or NAME:PATH:ro`);
            }
            return { name, path, read_only: mode === 'ro' };
          });
        }
        const file = $('team-file').files[0];
        if (file) {
          const parsed = await api('POST', '/v1/teams/parse', await file.text()).catch((err) => {
            throw new Error(`Team file ${file.name}: ${err.message}`);
          });
          body.team = parsed.team;
        }
        const snap = $('from-snapshot').value;
        if (snap) body.from_snapshot = snap;
        const files = [...$('data-files').files, ...dropped];
        if (files.length && snap) throw new Error('Files and a snapshot both fill the workspace: choose one');
        if (files.length) {
          const up = await upload(files).catch((err) => {
            throw new Error(`Files: ${err.message}`);
          });
          body.files = up.id;
        }
        const rec = await api('POST', '/v1/tasks', body);
        location.assign(taskHref(rec.id));
      } catch (err) {
        errEl.textContent = err.message;
        btn.disabled = false;
      }
    }

    // Files dropped on the form join those chosen with the picker.
    let dropped = [];
    const form = $('submit-form');
    form.addEventListener('dragover', (e) => { e.preventDefault(); form.classList.add('drop'); });
    form.addEventListener('dragleave', () => form.classList.remove('drop'));
    form.addEventListener('drop', (e) => {
      e.preventDefault();
      form.classList.remove('drop');
      dropped = dropped.concat([...e.dataTransfer.files]);
      const note = $('dropped');
      note.textContent = `Dropped: ${dropped.map((f) => f.name).join(', ')}`;
      note.hidden = false;
    });
    form.addEventListener('submit', submit);
    $('task-text').addEventListener('keydown', (e) => {
      if (e.key === 'Enter' && (e.ctrlKey || e.metaKey)) {
        e.preventDefault();
        $('submit-form').requestSubmit();
      }
    });
    $('state-filter').addEventListener('change', reset);
    $('search').addEventListener('input', () => {
      for (const entry of entries.values()) matchSearch(entry);
      updateFoot();
    });
    moreBtn.addEventListener('click', loadMore);

    // What the embedded model's engine is doing, when the daemon serves one.
    async function loadEngine() {
      const line = $('engine');
      if (!line) return;
      let engine = null;
      try { ({ engine } = await api('GET', '/v1/engine')); } catch (_) { /* shown by the list */ }
      line.hidden = !engine;
      if (!engine) return;
      const rate = (n) => n.toFixed(1);
      line.textContent = `Model engine: ${engine.sequences_live} live, ${engine.sequences_waiting} waiting, `
        + `${engine.sequences_kept} kept · batch of ${engine.batch_sequences} (${engine.batch_tokens} tokens) · `
        + `${rate(engine.generated_per_second)} tokens/s generated, ${rate(engine.read_per_second)} read · `
        + `cache ${engine.cache_tokens_used} of ${engine.cache_tokens} tokens · `
        + `${plural(engine.evictions, 'eviction')}, ${plural(engine.pauses, 'pause')}`
        + (engine.draft ? ` · draft: ${engine.draft_accepted} of ${engine.draft_proposed} guesses kept` : '');
    }

    onAuth = () => { loadExecutors(); loadSnapshots(); refresh(true); loadEngine(); };
    loadExecutors();
    loadSnapshots();
    refresh(true);
    loadEngine();
    setInterval(() => { if (!document.hidden) { refresh(false); loadEngine(); } }, 2000);
    document.addEventListener('visibilitychange', () => { if (!document.hidden) refresh(false); });
  }

  // ---- SSE over fetch -----------------------------------------------------------------

  // EventSource cannot send an Authorization header, so the stream is parsed by hand.
  async function readSse(body, onEvent) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buf = '', data = [], type = '', id = '';
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      let text = buf + decoder.decode(value, { stream: true });
      // A trailing CR may be the first half of a CRLF split across chunks: keep it for later.
      const hold = text.endsWith('\r');
      if (hold) text = text.slice(0, -1);
      // Splitting on a plain '\n' is much faster; CR line ends are normalised only if present.
      if (text.includes('\r')) text = text.replace(/\r\n?/g, '\n');
      const lines = text.split('\n');
      buf = lines.pop() + (hold ? '\r' : '');
      for (const line of lines) {
        if (line === '') { // the blank line ends an event
          if (data.length) onEvent(data.join('\n'), type, id);
          data = [];
          type = '';
        }
        if (line === '' || line[0] === ':') continue; // ':' is a keep-alive or comment
        const colon = line.indexOf(':');
        const field = colon < 0 ? line : line.slice(0, colon);
        let val = colon < 0 ? '' : line.slice(colon + 1);
        if (val[0] === ' ') val = val.slice(1);
        if (field === 'data') data.push(val);
        else if (field === 'event') type = val;
        else if (field === 'id' && !val.includes('\0')) id = val;
      }
    }
  }

  // ---- task view ----------------------------------------------------------------------

  function taskView(id) {
    const timing = { start: performance.now(), firstEvent: null, complete: null };
    window.tandemTiming = timing;
    $('app').replaceChildren($('task-tpl').content.cloneNode(true));
    const transcript = $('transcript');
    const apiPath = '/v1/tasks/' + enc(id);

    let record = null;
    let actionBusy = false;
    let loadFailed = false; // the shown error is loadRecord's, so its next success clears it
    let refreshTimer = 0;
    let portsTimer = 0;
    // Stream state; `finished` means task_finished arrived, so there is nothing to reconnect for.
    let lastSeq = 0, finished = false, streaming = false, fatal = false, ctrl = null, wake = null;
    // Render state: events are queued as they arrive and applied once per frame.
    const queue = [];
    let scheduled = false, frag = null, finishedRendered = false;
    const turns = new Map(); // turn number -> its latest section (team turn numbers can repeat)
    const approvals = new Map(); // n -> card
    let group = null; // a nested team's <details>, while its turns follow each other

    const setError = (msg) => { $('task-error').textContent = msg; };
    const setStream = (msg) => { $('stream-status').textContent = msg; };
    const notFound = (e) => (e.status === 404 ? `No task ${id}.` : e.message);

    // ---- record and actions ----

    function showRecord(r) {
      record = r;
      const task = (r.spec && r.spec.task) || '';
      $('task-title').textContent = task;
      document.title = `${task.slice(0, 60) || r.id} · Tandem`;
      const st = $('task-state');
      st.textContent = r.state;
      st.className = stateClass(r);
      const stop = $('task-stop');
      stop.textContent = r.state === 'finished' && r.stop_reason ? r.stop_reason : '';
      stop.title = STOP[r.stop_reason] || '';
      const spec = r.spec || {};
      $('task-meta').textContent = [
        spec.team ? 'team' : null,
        spec.executor ? `executor ${spec.executor}` : null,
        r.created_ms ? `created ${dateFmt.format(r.created_ms)}` : null,
        plural(r.turns || 0, 'turn'),
        tokens(r.usage),
        cost(r.cost),
        r.started_ms && r.finished_ms ? duration(r.finished_ms - r.started_ms) : null,
        r.trace_id ? `trace ${r.trace_id}` : null,
      ].filter(Boolean).join(' · ');
      if (r.error && r.error.message) setError(r.error.message);
      updateButtons();
    }

    function updateButtons() {
      const state = record ? record.state : '';
      $('cancel').disabled = actionBusy || !ACTIVE.has(state);
      $('resume').disabled = actionBusy || state !== 'interrupted';
      // A task's workspace is snapshotted once it no longer changes.
      $('snapshot').disabled = actionBusy || !state || state === 'queued' || state === 'running';
    }

    // The task's workspace: each file a download, fetched with the token.
    async function loadFiles() {
      const list = $('file-list');
      try {
        const { files } = await api('GET', `${apiPath}/files`);
        list.replaceChildren(...(files || []).map((f) => {
          const link = h('a', { href: `${apiPath}/files/${f.path.split('/').map(enc).join('/')}` }, shownName(f.path));
          link.addEventListener('click', async (e) => {
            e.preventDefault();
            try { saveBlob(await fetchBlob(link.getAttribute('href')), f.path.split('/').pop()); } catch (err) { setError(err.message); }
          });
          return h('li', null, link, h('span', { class: 'muted' }, ` ${size(f.bytes)}`));
        }));
        if (!files || !files.length) list.append(h('li', { class: 'muted' }, 'no files'));
      } catch (e) {
        list.replaceChildren(h('li', { class: 'muted' }, e.status === 410 ? 'removed after the daemon\'s retention time' : e.message));
      }
      $('files').hidden = false;
    }

    // The servers the task's code left listening, each a link signed for it (a page opened
    // in a new tab cannot send the token). Shown while the task runs; gone with its sandbox.
    async function loadPorts() {
      const list = $('port-list');
      let ports = [];
      try {
        ({ ports } = await api('GET', `${apiPath}/ports`));
      } catch (e) {
        ports = [];
      }
      list.replaceChildren(...(ports || []).map((p) => {
        const link = h('a', { href: p.path, target: '_blank', rel: 'noopener', 'data-port': String(p.port) }, `port ${p.port}`);
        link.addEventListener('click', async (e) => {
          e.preventDefault();
          // Opened at once (a popup opened after an await is blocked), then sent to the link.
          const tab = window.open('about:blank', '_blank');
          try {
            const { url } = await api('POST', `${apiPath}/links`, { port: p.port });
            if (tab) tab.location = url;
            link.dataset.link = url;
          } catch (err) {
            if (tab) tab.close();
            setError(err.message);
          }
        });
        return h('li', null, link);
      }));
      $('ports').hidden = !(ports && ports.length);
    }

    async function loadRecord() {
      try {
        const r = await api('GET', apiPath);
        if (loadFailed) setError('');
        loadFailed = false;
        showRecord(r);
      } catch (e) {
        loadFailed = true;
        setError(notFound(e));
      }
    }

    function refreshSoon() {
      clearTimeout(refreshTimer);
      refreshTimer = setTimeout(loadRecord, 250);
    }

    async function act(action) {
      actionBusy = true;
      updateButtons();
      setError('');
      try {
        showRecord(await api('POST', `${apiPath}/${action}`));
        return true;
      } catch (e) {
        setError(e.message);
        return false;
      } finally {
        actionBusy = false;
        updateButtons();
      }
    }

    $('snapshot').addEventListener('click', async () => {
      actionBusy = true;
      updateButtons();
      setError('');
      try {
        const snap = await api('POST', `${apiPath}/snapshot`, {});
        const note = $('snapshot-taken');
        note.textContent = `Snapshot ${snap.id}: ${plural(snap.files, 'file')}, ${size(snap.bytes)}. New tasks can start from it.`;
        note.dataset.id = snap.id;
        note.hidden = false;
      } catch (e) {
        setError(e.message);
      } finally {
        actionBusy = false;
        updateButtons();
      }
    });
    $('cancel').addEventListener('click', () => act('cancel'));
    $('resume').addEventListener('click', async () => { if (await act('resume')) reconnect(); });

    // ---- stream ----

    function pause(ms) {
      return new Promise((resolve) => {
        const t = setTimeout(resolve, ms);
        wake = () => { clearTimeout(t); resolve(); };
      });
    }

    function reconnect() {
      fatal = false;
      if (ctrl) ctrl.abort();
      if (wake) wake();
      if (!streaming) stream();
    }

    function receive(json, type, sseId) {
      let ev;
      try { ev = JSON.parse(json); } catch (_) { return; }
      if (!ev.type) ev.type = type;
      const seq = Number(ev.seq != null ? ev.seq : sseId) || 0;
      if (seq && seq <= lastSeq) return; // already seen before a reconnect
      if (seq) lastSeq = seq;
      if (ev.type === 'task_finished') finished = true;
      queue.push(ev);
      schedule();
    }

    async function stream() {
      streaming = true;
      let backoff = 500;
      while (!finished && !fatal) {
        ctrl = new AbortController();
        let wait = backoff;
        setStream(lastSeq ? 'reconnecting…' : 'connecting…');
        try {
          const res = await fetch(`${apiPath}/events?after=${lastSeq}`, {
            headers: authHeaders({ Accept: 'text/event-stream' }), signal: ctrl.signal, cache: 'no-store',
          });
          if (res.ok) {
            $('token-form').hidden = true;
            setStream('live');
            // Back after a break (a daemon restart interrupts, or re-queues, its tasks).
            if (lastSeq) loadRecord();
            await readSse(res.body, (data, type, sseId) => { backoff = 500; receive(data, type, sseId); });
          } else {
            await readResponse(res).catch((e) => {
              if (res.status === 401) wait = 3600e3; // until a token is entered (wake)
              else if (res.status < 500) { fatal = true; setError(notFound(e)); }
            });
          }
        } catch (e) {
          if (e.name === 'AbortError') continue; // reconnect() wants a fresh stream now
        }
        if (finished || fatal) break;
        setStream('reconnecting…');
        await pause(wait);
        backoff = Math.min(backoff * 2, 8000);
      }
      streaming = false;
      setStream(finished ? '' : 'disconnected');
    }

    // ---- rendering ----

    function schedule() {
      if (scheduled) return;
      scheduled = true;
      // rAF does not run in hidden tabs; the timeout keeps events flowing there.
      requestAnimationFrame(flush);
      setTimeout(flush, 100);
    }

    function flush() {
      if (!scheduled) return;
      scheduled = false;
      if (!queue.length) return;
      // The only layout read of the batch: follow the end only if the reader is there.
      const doc = document.scrollingElement || document.documentElement;
      const follow = doc.scrollTop + window.innerHeight >= doc.scrollHeight - 60;
      frag = document.createDocumentFragment();
      let refresh = false;
      for (const ev of queue) {
        const handle = HANDLERS[ev.type];
        if (!handle) continue;
        try { handle(ev); } catch (e) { console.error('tandem: cannot show event', ev, e); }
        refresh = refresh || changesState(ev);
      }
      queue.length = 0;
      transcript.append(frag);
      frag = null;
      if (timing.firstEvent == null) timing.firstEvent = performance.now();
      if (finishedRendered && timing.complete == null) {
        transcript.dataset.complete = 'true';
        timing.complete = performance.now();
      }
      if (follow) doc.scrollTop = doc.scrollHeight;
      if (refresh) refreshSoon();
    }

    // The record is read again only when an event says its state moved: the events carry
    // the transcript, and the record read with it would be the whole transcript again.
    let decided = false; // an approval was decided: the next block event means it runs again
    function changesState(ev) {
      if (ev.type === 'approval_decided') decided = true;
      if (decided && ev.type.startsWith('exec_')) {
        decided = false;
        return true;
      }
      return ev.type === 'task_started' || ev.type.startsWith('approval_') || ev.type === 'task_finished';
    }

    function top(node) {
      frag.append(node);
      group = null;
    }

    const note = (text, cls) => h('div', { class: cls ? `note ${cls}` : 'note' }, text);

    function newTurn(num, path) {
      const speaker = h('span', { class: 'speaker', title: path || null }, path ? lastPart(path) : 'assistant');
      const head = h('header', { class: 'turn-head' }, speaker, h('span', { class: 'turn-no' }, `turn ${num}`));
      const body = h('div', { class: 'turn-body' });
      const el = h('section', { class: 'turn' }, head, body);
      const t = { head, body, speaker, path, text: null, blocks: new Map() };
      turns.set(num, t);
      const parts = path ? path.split('/') : [];
      if (parts.length <= 2) {
        top(el);
        return t;
      }
      // A nested team's turns fold away; consecutive ones share one <details>.
      const team = parts.slice(0, -1).join('/');
      if (!group || group.team !== team) {
        const count = h('span', { class: 'count' });
        const details = h('details', { class: 'nested' }, h('summary', null, h('span', { class: 'team-path' }, team), count));
        top(details);
        group = { team, details, count, n: 0 };
      }
      group.details.append(el);
      group.count.textContent = ` · ${plural(++group.n, 'turn')}`;
      return t;
    }

    function turnOf(ev) {
      const t = turns.get(ev.turn) || newTurn(ev.turn, ev.path || null);
      if (ev.path && !t.path) {
        t.path = ev.path;
        t.speaker.textContent = lastPart(ev.path);
        t.speaker.title = ev.path;
      }
      return t;
    }

    function textOf(t) {
      if (!t.text) {
        t.text = document.createTextNode('');
        t.body.append(h('pre', { class: 'assistant-text' }, t.text));
      }
      return t.text;
    }

    function blockOf(ev) {
      const t = turnOf(ev);
      let b = t.blocks.get(ev.index);
      if (!b) {
        const lang = h('span', { class: 'lang' }, 'code');
        const el = h('div', { class: 'code-block' }, h('div', { class: 'code-head' }, lang, ` · block ${ev.index}`));
        b = { el, lang, out: null, streamed: false, lastStream: '', lastNode: null };
        t.blocks.set(ev.index, b);
        t.body.append(el);
      }
      return b;
    }

    // Where a note about a block goes: the block if it is shown, else its turn.
    function placeOf(ev) {
      const t = turnOf(ev);
      const b = t.blocks.get(ev.index);
      return b ? b.el : t.body;
    }

    function write(b, stream, text) {
      if (!b.out) b.el.append(b.out = h('pre', { class: 'output' }));
      if (b.lastNode && b.lastStream === stream) return b.lastNode.appendData(text);
      b.lastNode = document.createTextNode(text);
      b.lastStream = stream;
      b.out.append(h('span', { class: stream === 'stderr' ? 'stderr' : 'stdout' }, b.lastNode));
    }

    function resultLine(r) {
      const parts = [r.status === 'exited' ? `exited ${r.exit_code}` : r.status];
      if (r.status === 'exited' || r.duration_ms) parts.push(duration(r.duration_ms || 0));
      if (r.truncated) parts.push('output truncated');
      const used = usage(r.resources);
      if (used) parts.push(used);
      return parts.join(' · ');
    }

    function approvalCard(ev) {
      const code = h('textarea', {
        class: 'approval-code', spellcheck: 'false', 'aria-label': 'Code to run',
        rows: Math.min(20, Math.max(3, (ev.code || '').split('\n').length + 1)),
      });
      code.value = ev.code || '';
      const reason = h('input', { class: 'approval-reason', type: 'text', placeholder: 'reason (optional)', 'aria-label': 'Reason' });
      const approve = h('button', { type: 'button', class: 'approve primary' }, 'Approve');
      const edited = h('button', { type: 'button', class: 'approve-edited' }, 'Run edited');
      const deny = h('button', { type: 'button', class: 'deny danger' }, 'Deny');
      const buttons = h('div', { class: 'approval-actions' }, approve, edited, deny);
      const error = h('p', { class: 'error', role: 'alert' });
      const status = h('p', { class: 'approval-status' });
      const el = h('div', { class: 'approval', 'data-n': ev.n },
        h('div', { class: 'approval-head' }, h('strong', null, 'Approval needed'), ` · ${ev.language || 'code'} block ${ev.index}`),
        h('p', { class: 'approval-why' }, ev.rule ? h('span', { class: 'rule' }, `rule ${ev.rule}: `) : null, ev.reason || ''),
        code, reason, buttons, error, status);
      const card = { el, code, reason, buttons, status, decided: false };
      const setDisabled = (on) => { for (const b of buttons.children) b.disabled = on; };

      async function send(body) {
        setDisabled(true);
        error.textContent = '';
        status.textContent = 'Sending…';
        try {
          await api('POST', `${apiPath}/approvals/${enc(ev.n)}`, body);
          if (!card.decided) status.textContent = 'Sent; waiting for the task…';
          refreshSoon();
        } catch (e) {
          error.textContent = e.message;
          if (card.decided) return;
          status.textContent = '';
          setDisabled(false);
        }
      }
      approve.addEventListener('click', () => send({ decision: 'approve' }));
      edited.addEventListener('click', () => send({ decision: 'approve', code: code.value }));
      deny.addEventListener('click', () => {
        const why = reason.value.trim();
        send(why ? { decision: 'deny', reason: why } : { decision: 'deny' });
      });
      return card;
    }

    function decisionText(ev) {
      const who = ev.rule ? (ev.by === 'rule' ? `rule ${ev.rule}` : `${ev.by} (rule ${ev.rule})`) : ev.by;
      if (ev.decision === 'approve') return `approved by ${who}${ev.code ? ' · edited code ran' : ''}`;
      return ev.reason ? `denied: ${ev.reason} (by ${who})` : `denied by ${who}`;
    }

    function closeCard(card, text, cls) {
      card.decided = true;
      card.buttons.hidden = true;
      for (const b of card.buttons.children) b.disabled = true;
      card.code.readOnly = true;
      card.reason.disabled = true;
      card.reason.hidden = !card.reason.value;
      card.status.textContent = text;
      card.el.classList.add('decided', cls);
    }

    function showSummary(ev) {
      const s = $('summary');
      s.replaceChildren(
        h('h3', null, STOP[ev.stop_reason] || ev.stop_reason || 'finished'),
        h('p', { class: 'muted' }, [plural(ev.turns || 0, 'turn'), tokens(ev.usage), cost(ev.cost), duration(ev.elapsed_ms || 0)].filter(Boolean).join(' · ')));
      if (ev.error && ev.error.message) s.append(h('p', { class: 'error' }, ev.error.message));
      if (ev.budget) s.append(h('p', { class: 'budget' }, budgetText(ev.budget)));
      if (ev.answer) {
        const from = ev.answer_from === 'output' ? 'answer: what the code printed' : 'answer';
        s.append(h('p', { class: `answer-from answer-${ev.answer_from || 'model'}` }, from));
        s.append(h('pre', { class: 'summary-text answer' }, ev.answer));
      } else if (ev.no_answer) {
        s.append(h('p', { class: 'muted no-answer' }, `no answer: ${ev.no_answer}`));
      }
      if (ev.check) {
        const detail = ev.check.detail ? `: ${ev.check.detail.split('\n')[0]}` : '';
        s.append(h('p', { class: `check check-${ev.check.verdict}` }, `check ${ev.check.verdict}${detail}`));
      }
      s.className = `card summary stop-${ev.stop_reason}`;
      s.hidden = false;
    }

    // Each tool call's card, by its id, where its result goes.
    const toolCalls = new Map();

    // One handler per event type; each adds to the DOM, none reads layout.
    const HANDLERS = {
      task_started: (ev) => top(note(`model ${ev.model} at ${ev.base_url} · executor ${ev.executor}`, 'start')),
      turn_started: (ev) => newTurn(ev.turn, ev.agent || ev.path || null),
      team_ended: (ev) => top(note(`${ev.agent} ended: ${ev.by}`, 'team-end')),
      assistant_delta: (ev) => textOf(turnOf(ev)).appendData(ev.text),
      model_retry(ev) {
        const t = turnOf(ev);
        // The retried reply starts over, below the note.
        if (t.text) t.text.parentNode.remove();
        t.text = null;
        t.body.append(note(`model call failed (${ev.reason}); retry ${ev.attempt} in ${duration(ev.delay_ms || 0)}`, 'retry'));
      },
      net(ev) {
        // A connection has no turn of its own: it is told under the latest one.
        const last = [...turns.values()].pop();
        const where = last ? last.body : null;
        // No host: refused before it asked for anywhere.
        const host = !ev.host ? 'a connection'
          : ev.host.includes(':') ? `[${ev.host}]:${ev.port}` : `${ev.host}:${ev.port}`;
        const text = ev.verdict === 'allowed'
          ? `net: ${host} allowed by ${ev.rule}, ${ev.bytes_out || 0} B out, ${ev.bytes_in || 0} B in, ${ev.ms || 0} ms`
          : `net: ${host} denied (rule ${ev.rule}): ${ev.reason || 'refused'}`;
        const line = note(text, ev.verdict === 'allowed' ? 'net' : 'net denied');
        if (where) where.append(line);
        else top(line);
      },
      sandbox_lost(ev) {
        // The block runs again on another host: what it printed so far is void.
        const b = blockOf(ev);
        if (b.out) b.out.remove();
        b.out = null;
        b.lastNode = null;
        b.el.append(note(`the sandbox on ${ev.host} was lost (${ev.reason}); running the block again on another host`, 'retry'));
      },
      replies_drawn(ev) {
        const kept = ev.chosen ? `kept drawn reply ${ev.chosen}` : 'kept the model\'s own';
        const replies = ev.drawn === 1 ? 'reply' : 'replies';
        turnOf(ev).body.append(note(`the task's examples do not all hold against its code: drew ${ev.drawn} more ${replies}; ${kept}, which holds ${ev.held} of ${ev.examples}`, 'drawn'));
      },
      assistant_message(ev) {
        const t = turnOf(ev);
        textOf(t).data = ev.text;
        if (ev.usage) t.head.append(h('span', { class: 'usage' }, tokens(ev.usage)));
      },
      code_block(ev) {
        const b = blockOf(ev);
        b.lang.textContent = ev.language || 'untagged';
        b.el.append(h('pre', { class: 'code' }, h('code', null, ev.code)));
      },
      approval_requested(ev) {
        if (approvals.has(ev.n)) return;
        const card = approvalCard(ev);
        approvals.set(ev.n, card);
        placeOf(ev).append(card.el);
      },
      approval_decided(ev) {
        const card = ev.n ? approvals.get(ev.n) : null;
        if (!card) return placeOf(ev).append(note(decisionText(ev), 'decision'));
        if (ev.code) card.code.value = ev.code;
        closeCard(card, decisionText(ev), ev.decision === 'approve' ? 'approved' : 'denied');
      },
      exec_output(ev) {
        const b = blockOf(ev);
        b.streamed = true;
        write(b, ev.stream, ev.text);
      },
      exec_result(ev) {
        const b = blockOf(ev);
        const r = ev.result || {};
        if (!b.streamed) {
          if (r.stdout) write(b, 'stdout', r.stdout);
          if (r.stderr) write(b, 'stderr', r.stderr);
        }
        const ok = (r.status === 'exited' && r.exit_code === 0) || r.status === 'skipped';
        b.el.append(h('div', { class: `result ${ok ? 'ok' : 'bad'}` }, resultLine(r)));
        // A block may have left a server listening (asked once for a burst of results).
        if (!record || ACTIVE.has(record.state)) {
          clearTimeout(portsTimer);
          portsTimer = setTimeout(loadPorts, 200);
        }
      },
      artifact(ev) {
        const b = blockOf(ev);
        const img = h('img', { alt: ev.file, class: 'picture' });
        const caption = h('figcaption', null, `${ev.file} · ${size(ev.bytes || 0)}`);
        b.el.append(h('figure', { class: 'artifact' }, img, caption));
        if (!ev.href) return;
        fetchBlob(ev.href).then((blob) => {
          img.src = URL.createObjectURL(blob);
        }).catch((e) => caption.append(` · ${e.message}`));
      },
      tool_call(ev) {
        // An execute_code call's code and output are shown as its block's.
        const el = h('div', { class: 'tool-call' }, h('div', { class: 'code-head' },
          h('span', { class: 'lang' }, `call ${ev.name}`), ` · ${ev.id}`));
        if (ev.name !== 'execute_code') el.append(h('pre', { class: 'code' }, h('code', null, ev.arguments)));
        toolCalls.set(ev.id, el);
        turnOf(ev).body.append(el);
      },
      tool_result(ev) {
        const el = toolCalls.get(ev.id) || placeOf(ev);
        if (ev.name !== 'execute_code') el.append(h('pre', { class: 'output' }, ev.result));
        el.append(h('div', { class: `result ${ev.is_error ? 'bad' : 'ok'}` },
          `${ev.is_error ? 'failed' : 'answered'} · ${duration(ev.duration_ms || 0)}`));
      },
      executor_message: (ev) => turnOf(ev).body.append(h('details', { class: 'executor-message' },
        h('summary', null, h('span', { class: 'speaker' }, 'executor'), ' · report to the model'),
        h('pre', null, ev.text))),
      task_finished(ev) {
        for (const card of approvals.values()) {
          if (!card.decided) closeCard(card, 'no longer waiting: the task ended', 'expired');
        }
        if (ev.at_ms) top(note(`finished at ${clockFmt.format(ev.at_ms)}`, 'end'));
        showSummary(ev);
        finishedRendered = true;
        $('ports').hidden = true;
        loadFiles();
      },
    };

    onAuth = () => { loadRecord(); reconnect(); };
    stream();
    loadRecord();
  }

  function notFoundView() {
    $('app').replaceChildren(h('div', { class: 'card' },
      h('p', null, 'There is no page here.'), h('a', { href: '/' }, 'Back to all tasks')));
  }

  setupTokenForm();
  const m = location.pathname.match(/^\/tasks\/([^/]+)\/?$/);
  let taskId = null;
  try { taskId = m && decodeURIComponent(m[1]); } catch (_) { /* malformed: not found */ }
  if (location.pathname === '/' || location.pathname === '/index.html') listView();
  else if (taskId) taskView(taskId);
  else notFoundView();
})();
