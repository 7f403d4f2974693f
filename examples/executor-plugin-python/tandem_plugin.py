#!/usr/bin/env python3
"""A Tandem executor plugin in Python, with the standard library only.

It speaks the executor protocol (docs/executor-protocol.md): JSON-RPC 2.0, one message per
line, requests on stdin, answers and output notifications on stdout, its own log on stderr.
It runs python and sh blocks as local processes in the workspace Tandem gives it, so it is an
example of the protocol, not a sandbox: its blocks run as your user.

Each block runs under a waiter: a small process of its own (this file with `--wait`) that
becomes a child subreaper, starts the block in a new session with the session's limits as
rlimits, reports the block's wait status, and then kills everything the block left behind,
daemons that called setsid included (orphans are re-parented to the waiter, so none escapes
it). A timeout or `$/cancel` sends the waiter SIGTERM, which does the same at once.

Configure it in tandem.toml:

    [executors.pyplug]
    command = ["python3", "examples/executor-plugin-python/tandem_plugin.py"]

and check it with `tandem executor test pyplug`.
"""

import codecs
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

PROTOCOL_VERSION = 1
LANGUAGES = ["python", "sh"]
# rlimits the waiter applies, by the name Tandem's limits use.
RLIMITS = {
    "memory_bytes": "RLIMIT_AS",
    "cpu_secs": "RLIMIT_CPU",
    "file_size_bytes": "RLIMIT_FSIZE",
    "open_files": "RLIMIT_NOFILE",
}
# Output is read and forwarded in pieces of this size.
CHUNK = 64 << 10
# How long to wait for a block's pipes to close once its processes are dead.
DRAIN_GRACE = 0.5
# A python block that is not saved with `# filename:` runs from the session's scratch
# directory, with the workspace (its working directory) first on sys.path, as a script
# run there would have it.
PYTHON_BOOT = (
    "import sys\n"
    "p = sys.argv[1]\n"
    "sys.argv = [p]\n"
    "sys.path[0] = ''\n"
    "g = {'__name__': '__main__', '__file__': p, '__builtins__': __builtins__}\n"
    "exec(compile(open(p, 'rb').read(), p, 'exec'), g)\n"
)

_out = sys.stdout.buffer
_out_lock = threading.Lock()


def send(message):
    line = json.dumps(message, separators=(",", ":")).encode() + b"\n"
    with _out_lock:
        _out.write(line)
        _out.flush()


def answer(rid, result):
    send({"jsonrpc": "2.0", "id": rid, "result": result})


def fail(rid, code, message):
    send({"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message}})


def log(text):
    sys.stderr.write(f"python plugin: {text}\n")
    sys.stderr.flush()


class Session:
    def __init__(self, workdir, limits):
        self.workdir = os.path.realpath(workdir)
        self.limits = limits
        self.scratch = tempfile.mkdtemp(prefix="tandem-pyplugin-")
        self.blocks = 0
        self.lock = threading.Lock()


class Run:
    """One running block: its waiter and why it was stopped, if it was."""

    def __init__(self):
        self.waiter = None
        self.stopped = None
        self.lock = threading.Lock()

    def stop(self, why):
        with self.lock:
            if self.stopped is None:
                self.stopped = why
            if self.waiter is not None and self.waiter.poll() is None:
                self.waiter.send_signal(signal.SIGTERM)


sessions = {}
runs = {}
state_lock = threading.Lock()
next_session = [0]


def filename_directive(code):
    first = code.split("\n", 1)[0].strip()
    for prefix in ("# filename:", "#filename:"):
        if first.lower().startswith(prefix):
            return first[len(prefix):].strip() or None
    return None


def inside(workdir, rel):
    """The absolute path of `rel` in `workdir`, or None if it would leave it (an absolute
    path, `..`, or a symbolic link on the way)."""
    if rel.startswith("/") or "\\" in rel:
        return None
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        return None
    path = workdir
    for part in parts:
        path = os.path.join(path, part)
        if os.path.islink(path):
            return None
    return path


def run_block(rid, params):
    session = sessions.get(params.get("session"))
    if session is None:
        return fail(rid, -32602, f"no session {params.get('session')!r}")
    language, code = params.get("language"), params.get("code", "")
    if language not in LANGUAGES:
        return fail(rid, -32602, f"language {language!r} is not supported")
    timeout = float(params.get("timeout_secs") or session.limits.get("wall") or 60)
    with session.lock:
        session.blocks += 1
        n = session.blocks
    started = time.monotonic()
    name = filename_directive(code)
    if name is not None:
        path = inside(session.workdir, name)
        if path is None:
            return answer(rid, {
                "status": {"exited": 1},
                "stderr": f"tandem: `# filename: {name}` must stay inside the workspace\n",
            })
        os.makedirs(os.path.dirname(path), exist_ok=True)
    else:
        path = os.path.join(session.scratch, f"block_{n}.{'py' if language == 'python' else 'sh'}")
    with open(path, "w", encoding="utf-8") as f:
        f.write(code)
    if language == "python":
        argv = [sys.executable, path] if name else [sys.executable, "-c", PYTHON_BOOT, path]
    else:
        argv = ["sh", path]
    tmp = os.path.join(session.scratch, "tmp")
    os.makedirs(tmp, exist_ok=True)
    status_r, status_w = os.pipe()
    spec = {
        "argv": argv,
        "cwd": session.workdir,
        "env": {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "HOME": session.workdir,
            "TMPDIR": tmp,
            # Output reaches Tandem as it is printed, also from a block that is then killed,
            # and saved modules leave no __pycache__ in the workspace.
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
        },
        "rlimits": [
            [RLIMITS[k], v] for k, v in session.limits.items() if k in RLIMITS and v is not None
        ],
        "status_fd": status_w,
    }
    run = Run()
    with state_lock:
        runs[rid] = run
    try:
        waiter = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), "--wait", json.dumps(spec)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(status_w,),
        )
    finally:
        os.close(status_w)
    with run.lock:
        run.waiter = waiter
        stopped = run.stopped
    if stopped is not None:
        run.stop(stopped)
    readers = [
        threading.Thread(target=forward, args=(rid, waiter.stdout, "stdout"), daemon=True),
        threading.Thread(target=forward, args=(rid, waiter.stderr, "stderr"), daemon=True),
    ]
    for t in readers:
        t.start()
    raw = read_status(status_r, started + timeout, run)
    os.close(status_r)
    deadline = time.monotonic() + DRAIN_GRACE
    for t in readers:
        t.join(max(0.0, deadline - time.monotonic()))
    waiter.wait()
    with state_lock:
        runs.pop(rid, None)
    if run.stopped is not None:
        status = run.stopped
    elif raw is None:
        status = {"exited": 1}
    elif os.WIFSIGNALED(raw):
        status = {"signaled": os.WTERMSIG(raw)}
    else:
        status = {"exited": os.WEXITSTATUS(raw)}
    answer(rid, {"status": status, "duration_secs": time.monotonic() - started})


def read_status(fd, deadline, run):
    """The block's raw wait status from its waiter; None if it stopped without one. Past
    `deadline` the run is stopped as timed out."""
    data = b""
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            run.stop("timed_out")
            deadline = left = None
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 64)
        if not chunk:
            break
        data += chunk
    try:
        return int(data.decode().strip())
    except ValueError:
        return None


def forward(rid, pipe, stream):
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    fd = pipe.fileno()
    while True:
        chunk = os.read(fd, CHUNK)
        text = decoder.decode(chunk, final=not chunk)
        if text:
            send({"jsonrpc": "2.0", "method": "session/output",
                  "params": {"run": rid, "stream": stream, "text": text}})
        if not chunk:
            break
    pipe.close()


def close_session(sid):
    session = sessions.pop(sid, None)
    if session is not None:
        shutil.rmtree(session.scratch, ignore_errors=True)


def handle(message):
    rid, method = message.get("id"), message.get("method")
    params = message.get("params") or {}
    if method == "initialize":
        answer(rid, {
            "protocol_version": PROTOCOL_VERSION,
            "name": "python example",
            "languages": LANGUAGES,
            "enforces": ["wall", "memory_bytes", "cpu_secs", "file_size_bytes", "open_files"],
        })
    elif method == "session/open":
        with state_lock:
            next_session[0] += 1
            sid = f"s{next_session[0]}"
            sessions[sid] = Session(params["workdir"], params.get("limits") or {})
        answer(rid, {"session": sid})
    elif method == "session/run":
        threading.Thread(target=guarded, args=(run_block, rid, params), daemon=True).start()
    elif method == "$/cancel":
        with state_lock:
            run = runs.get(params.get("id"))
        if run is not None:
            run.stop("cancelled")
    elif method == "session/close":
        close_session(params.get("session"))
        if rid is not None:
            answer(rid, {})
    elif method == "shutdown":
        stop_everything()
        answer(rid, {})
    elif rid is not None:
        fail(rid, -32601, f"unknown method {method!r}")


def guarded(fn, rid, params):
    try:
        fn(rid, params)
    except Exception as e:  # the block's request fails; the plugin goes on
        log(f"{fn.__name__} failed: {e!r}")
        fail(rid, -32603, str(e))


def stop_everything():
    with state_lock:
        pending = list(runs.values())
    for run in pending:
        run.stop("cancelled")
    for sid in list(sessions):
        close_session(sid)


def serve():
    for line in sys.stdin.buffer:
        if not line.strip():
            continue
        try:
            message = json.loads(line)
        except ValueError as e:
            fail(None, -32700, f"not JSON: {e}")
            continue
        try:
            handle(message)
        except Exception as e:
            log(f"{message.get('method')} failed: {e!r}")
            if message.get("id") is not None:
                fail(message["id"], -32603, str(e))
    # Tandem closed stdin: it wants the plugin gone.
    stop_everything()


# --- the waiter ---------------------------------------------------------------------------

def descendants_of_me():
    me, kids = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may hold spaces and parentheses; the fields after it do not.
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == me:
            kids.append(int(entry))
    return kids


def kill_all():
    """Kills every process below this one until none is left; orphans come to this
    process, a subreaper, so they are found on the next round."""
    while True:
        for pid in descendants_of_me():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def wait(spec):
    import ctypes
    import resource

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    status_fd = spec["status_fd"]

    def on_term(signum, frame):
        kill_all()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)

    def limits():
        for name, value in spec["rlimits"]:
            resource.setrlimit(getattr(resource, name), (value, value))

    try:
        block = subprocess.Popen(
            spec["argv"], cwd=spec["cwd"], env=spec["env"], stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=limits,
        )
    except OSError as e:
        os.write(2, f"tandem: cannot start {spec['argv'][0]}: {e}\n".encode())
        os.write(status_fd, b"256\n")
        return
    # Only the block may hold its pipes now, so they close when the last of it dies.
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    _, raw = os.waitpid(block.pid, 0)
    os.write(status_fd, f"{raw}\n".encode())
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    kill_all()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--wait":
        wait(json.loads(sys.argv[2]))
    else:
        serve()
