"""The client: `Client` (blocking) and `AsyncClient` (asyncio), the same API over httpx.

Each method is built from one description of its request (method, path, body) and one
reading of its answer, shared by the two classes, so they cannot say different things.
"""
from __future__ import annotations

import asyncio
import inspect
import io
import json
import os
import pathlib
import tarfile
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, List, Union
from urllib.parse import quote

import httpx

from ._connection import Connection, resolve
from ._errors import (
    DaemonUnreachable,
    SandboxError,
    TandemError,
    TaskFailed,
    TooLarge,
    from_answer,
)
from ._models import BlockResult, FileInfo, SessionInfo, Task, Upload

FileSource = Union[bytes, str, os.PathLike]
"""A file to send: its bytes, its text, or a path on this machine."""

ToolFn = Callable[..., Any]
"""A tool the session's code may call: called with the call's arguments as keywords."""

OutputFn = Callable[[str, str], Any]
"""Called with (stream, text) as a block writes: stream is "stdout" or "stderr"."""

NetFn = Callable[[dict[str, Any]], Any]
"""Called with each connection a block made through the egress proxy (a `net` event:
host, port, verdict, rule, reason, bytes_out, bytes_in, ms, brokered)."""

# A block's stream may say nothing for as long as the block runs; the daemon bounds the
# block, so the client waits that long and this much more before it gives up on the daemon.
_STREAM_GRACE = 60.0
_DEFAULT_BLOCK_WAIT = 3600.0

MAX_READ_BYTES = 64 * 1024 * 1024
"""Most bytes the client reads of one workspace file (`read_file`'s default `max_bytes`), and of
any other one answer, NDJSON line or event (`Client`'s default `max_answer_bytes`): 64 MiB.
What a session's code leaves can be any size; a body past the cap is not read further, and
`TooLarge` names it, its size when the daemon said it, and how to raise the cap."""

_RAISE_ANSWER = "raise the cap with Client(max_answer_bytes=N) or AsyncClient(max_answer_bytes=N)"
_RAISE_FILE = (
    "read_file(path, max_bytes=N) reads up to N bytes; or have the sandbox's code read a part "
    "of it (head -c, f.read(n)) and print that"
)


@dataclass
class Event:
    """One event of a task's stream: its sequence number, type, and data."""

    seq: int
    type: str
    data: dict[str, Any] = field(repr=False)


# The stop reasons of a task whose work was done; any other is TaskFailed's.
_DONE = frozenset(["terminated", "answered", "examples_held"])


def _q(part: str) -> str:
    return quote(part, safe="")


def _pack(files: Mapping[str, FileSource]) -> bytes:
    """A tar archive of `files` (path in the workspace -> content or local path)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, source in files.items():
            if isinstance(source, str):
                data = source.encode()
            elif isinstance(source, bytes):
                data = source
            else:
                data = pathlib.Path(source).read_bytes()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            info.mtime = int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _cap(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number of bytes, at least 1, not {value!r}")
    return value


def _told_size(response: httpx.Response) -> int | None:
    """The body's length as the daemon said it (before any content encoding), if it did."""
    try:
        size = int(response.headers.get("content-length", ""))
    except ValueError:
        return None
    return size if size >= 0 else None


class _Body:
    """One body read up to `cap` bytes, else TooLarge naming `what` and how to raise the cap."""

    def __init__(self, response: httpx.Response, cap: int, what: str, hint: str) -> None:
        self.cap, self.what, self.hint = cap, what, hint
        self.size = _told_size(response)
        if self.size is not None and self.size > cap:
            raise self.over()
        self.data = bytearray()

    def over(self) -> TooLarge:
        return TooLarge(self.what, self.size, self.cap, self.hint)

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > self.cap:
            raise self.over()


def _read(response: httpx.Response, cap: int, what: str, hint: str) -> bytes:
    body = _Body(response, cap, what, hint)
    for chunk in response.iter_bytes():
        body.add(chunk)
    return bytes(body.data)


async def _aread(response: httpx.Response, cap: int, what: str, hint: str) -> bytes:
    body = _Body(response, cap, what, hint)
    async for chunk in response.aiter_bytes():
        body.add(chunk)
    return bytes(body.data)


class _Lines:
    """Lines cut from a body's chunks, none longer than `cap` bytes (else TooLarge): the line
    ends of NDJSON and of the daemon's Server-Sent Events, `\n` with an optional `\r`."""

    def __init__(self, cap: int, what: str, hint: str) -> None:
        self.cap, self.what, self.hint = cap, what, hint
        self.rest = bytearray()

    def feed(self, chunk: bytes) -> List[str]:
        self.rest += chunk
        lines, start = [], 0
        while True:
            end = self.rest.find(b"\n", start)
            if end < 0:
                break
            lines.append(self._text(self.rest[start:end]))
            start = end + 1
        del self.rest[:start]
        if len(self.rest) > self.cap:
            raise TooLarge(f"a line of {self.what}", None, self.cap, self.hint)
        return lines

    def end(self) -> List[str]:
        return [self._text(self.rest)] if self.rest else []

    def _text(self, line: bytearray) -> str:
        return line.rstrip(b"\r").decode("utf-8", "replace")


def _lines(chunks: Iterable[bytes], cap: int, what: str, hint: str) -> Iterator[str]:
    cut = _Lines(cap, what, hint)
    for chunk in chunks:
        yield from cut.feed(chunk)
    yield from cut.end()


async def _alines(chunks: AsyncIterable[bytes], cap: int, what: str, hint: str) -> AsyncIterator[str]:
    cut = _Lines(cap, what, hint)
    async for chunk in chunks:
        for line in cut.feed(chunk):
            yield line
    for line in cut.end():
        yield line


def _answer(status: int, headers: httpx.Headers, body: bytes, raw: bool = False) -> Any:
    if status >= 400:
        raise from_answer(status, body)
    if raw:
        return body
    if headers.get("content-type", "").startswith("application/json"):
        return json.loads(body)
    return body


def _tool_reply(fn: ToolFn | None, name: str, arguments: Any) -> dict[str, str]:
    """What a tool call is answered with: the function's value as text, or its error."""
    if fn is None:
        return {"error": f"no tool `{name}` in this client"}
    try:
        value = fn(**arguments) if isinstance(arguments, dict) else fn(arguments)
    except Exception as e:  # the code's call raises it; the client goes on
        return {"error": f"{type(e).__name__}: {e}"}
    return {"result": value if isinstance(value, str) else json.dumps(value, default=str)}


def _block_end(event: dict[str, Any]) -> BlockResult:
    if event["type"] == "error":
        error = event["error"]
        raise SandboxError(error["code"], error["message"])
    return event["result"]


class _Sse:
    """Server-Sent Events read line by line: `feed` returns an event when a blank line ends one.
    An event's data past `cap` bytes raises TooLarge."""

    def __init__(self, cap: int = MAX_READ_BYTES, hint: str = _RAISE_ANSWER) -> None:
        self.cap, self.hint = cap, hint
        self.seq, self.kind, self.size = 0, "", 0
        self.data: List[str] = []

    def feed(self, line: str) -> Event | None:
        if line == "":
            event = None
            if self.data:
                payload = json.loads("\n".join(self.data))
                event = Event(self.seq or int(payload.get("seq", 0)), self.kind or payload.get("type", ""), payload)
            self.seq, self.kind, self.data, self.size = 0, "", [], 0
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "id":
            self.seq = int(value)
        elif name == "event":
            self.kind = value
        elif name == "data":
            self.size += len(value) + 1
            if self.size > self.cap:
                raise TooLarge("an event of the task's stream", None, self.cap, self.hint)
            self.data.append(value)
        return None


def _sse_events(lines: Iterator[str], cap: int = MAX_READ_BYTES) -> Iterator[Event]:
    sse = _Sse(cap)
    for line in lines:
        event = sse.feed(line)
        if event is not None:
            yield event


def _link_body(port: int, ttl_secs: int | None) -> dict[str, int]:
    body = {"port": port}
    if ttl_secs is not None:
        body["ttl_secs"] = ttl_secs
    return body


def _session_spec(
    executor: str | None,
    keep_state: bool,
    tools: Mapping[str, ToolFn] | None,
    files: str | None,
    limits: Mapping[str, int] | None,
    idle_timeout: int | None,
    network: Mapping[str, Any] | None = None,
    from_snapshot: str | None = None,
    volumes: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"keep_state": keep_state}
    if volumes:
        spec["volumes"] = [dict(v) for v in volumes]
    if network is not None:
        spec["network"] = dict(network)
    if from_snapshot:
        spec["from_snapshot"] = from_snapshot
    if executor:
        spec["executor"] = executor
    if files:
        spec["files"] = files
    if limits:
        spec["limits"] = dict(limits)
    if idle_timeout is not None:
        spec["idle_timeout_secs"] = int(idle_timeout)
    if tools:
        spec["tools"] = [
            {"name": name, **({"description": inspect.getdoc(fn)} if inspect.getdoc(fn) else {})}
            for name, fn in tools.items()
        ]
    return spec


def _name_body(name: str | None) -> dict[str, Any]:
    return {"name": name} if name is not None else {}


def _volume_body(name: str, max_mb: int | None) -> dict[str, Any]:
    return {"name": name, **({"max_mb": int(max_mb)} if max_mb is not None else {})}


def _exec_body(code: str, language: str, timeout: float | None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"language": language, "code": code}
    if timeout is not None:
        body["timeout_secs"] = timeout
    body.update({k: v for k, v in extra.items() if v is not None})
    return body


def _stream_timeout(timeout: float | None) -> httpx.Timeout:
    return httpx.Timeout(5.0, read=(timeout or _DEFAULT_BLOCK_WAIT) + _STREAM_GRACE)


_NDJSON = {"accept": "application/x-ndjson"}


class _Base:
    def __init__(self, host: str | None, token: str | None, max_answer_bytes: int) -> None:
        self._conn: Connection = resolve(host, token)
        self._max_answer = _cap(max_answer_bytes, "max_answer_bytes")
        self._headers = {"authorization": f"Bearer {self._conn.token}"} if self._conn.token else {}

    @property
    def host(self) -> str:
        """Where the daemon is (unix://PATH or tcp://HOST:PORT)."""
        return self._conn.host

    def _unreachable(self, e: Exception) -> DaemonUnreachable:
        return DaemonUnreachable(self._conn.host, str(e) or type(e).__name__)


class Client(_Base):
    """A blocking client of one Tandem daemon.

    `host` is unix:///path/to.sock (or /path/to.sock) or tcp://host:port; left out, the
    TANDEM_HOST variable, else the default socket. Over TCP the token is `token`, else
    TANDEM_TOKEN, else the daemon's token file. No answer, NDJSON line or event is read past
    `max_answer_bytes` (and no file past `read_file`'s `max_bytes`): `TooLarge` instead.
    """

    def __init__(
        self,
        host: str | None = None,
        token: str | None = None,
        timeout: float = 30.0,
        *,
        max_answer_bytes: int = MAX_READ_BYTES,
    ) -> None:
        super().__init__(host, token, max_answer_bytes)
        transport = httpx.HTTPTransport(uds=self._conn.socket) if self._conn.socket else None
        self._http = httpx.Client(
            base_url=self._conn.base_url,
            transport=transport,
            headers=self._headers,
            timeout=httpx.Timeout(timeout, connect=5.0),
        )

    def close(self) -> None:
        """Closes the client's connections."""
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, raw: bool = False, *, file: tuple[str, int] | None = None, **kw: Any) -> Any:
        """The answer to one request, read whole up to the answer cap, or for `file` (its name
        and cap) up to that file's cap."""
        try:
            with self._http.stream(method, path, **kw) as response:
                if file is None:
                    body = _read(response, self._max_answer, f"the answer to {method} {path}", _RAISE_ANSWER)
                else:
                    body = _read(response, file[1], f"the workspace file `{file[0]}`", _RAISE_FILE)
        except httpx.TransportError as e:
            raise self._unreachable(e) from e
        return _answer(response.status_code, response.headers, body, raw)

    def _error(self, response: httpx.Response, what: str) -> TandemError:
        body = _read(response, self._max_answer, what, _RAISE_ANSWER)
        return from_answer(response.status_code, body)

    # Tasks

    def submit(self, task: str, *, files: Mapping[str, FileSource] | str | None = None, **spec: Any) -> Task:
        """Queues a task; `spec` takes a TaskSpec's fields (executor, max_turns, keep_state, ...).
        `files` is an upload's id, or files to upload first (path -> content or local path)."""
        body: dict[str, Any] = {"task": task, **spec}
        if files is not None:
            body["files"] = files if isinstance(files, str) else self.upload(files)["id"]
        return self._call("POST", "/v1/tasks", json=body)

    def get(self, task_id: str) -> Task:
        """The task's record, with its `transcript`."""
        return self._call("GET", f"/v1/tasks/{_q(task_id)}")

    def list(self, state: str | None = None, limit: int | None = None, before: str | None = None) -> List[Task]:
        """Tasks: all, oldest first; or with `limit`, a page of the newest."""
        params = {k: v for k, v in {"state": state, "limit": limit, "before": before}.items() if v is not None}
        return self._call("GET", "/v1/tasks", params=params)["tasks"]

    def cancel(self, task_id: str) -> Task:
        """Cancels a queued, running or interrupted task."""
        return self._call("POST", f"/v1/tasks/{_q(task_id)}/cancel")

    def resume(self, task_id: str) -> Task:
        """Queues an interrupted task again."""
        return self._call("POST", f"/v1/tasks/{_q(task_id)}/resume")

    def approve(self, task_id: str, n: int, code: str | None = None) -> dict[str, Any]:
        """Approves the block that waits under number `n`, or runs `code` instead."""
        body: dict[str, Any] = {"decision": "approve", **({"code": code} if code else {})}
        return self._call("POST", f"/v1/tasks/{_q(task_id)}/approvals/{int(n)}", json=body)

    def deny(self, task_id: str, n: int, reason: str | None = None) -> dict[str, Any]:
        """Declines the block that waits under number `n`; the model is told `reason`."""
        body: dict[str, Any] = {"decision": "deny", **({"reason": reason} if reason else {})}
        return self._call("POST", f"/v1/tasks/{_q(task_id)}/approvals/{int(n)}", json=body)

    def follow(self, task_id: str, after: int = 0, follow: bool = True) -> Iterator[Event]:
        """The task's events as they come, from after `after`; ends after `task_finished`.
        A dropped connection is picked up again from the last event seen."""
        last, retries = after, 0
        while True:
            params: dict[str, Any] = {"after": last, **({} if follow else {"follow": "false"})}
            try:
                with self._http.stream(
                    "GET", f"/v1/tasks/{_q(task_id)}/events", params=params, timeout=httpx.Timeout(5.0, read=None)
                ) as response:
                    if response.status_code >= 400:
                        raise self._error(response, "the task's events")
                    lines = _lines(response.iter_bytes(), self._max_answer, "the task's events", _RAISE_ANSWER)
                    for event in _sse_events(lines, self._max_answer):
                        last, retries = event.seq, 0
                        yield event
                        if event.type == "task_finished":
                            return
                    if not follow:
                        return
            except httpx.TransportError as e:
                retries += 1
                if retries > 3:
                    raise self._unreachable(e) from e
                time.sleep(0.5 * retries)

    def wait(self, task_id: str, timeout: float | None = None) -> Task:
        """Waits for the task to finish and returns its record; TimeoutError after `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            record = self.get(task_id)
            if record["state"] == "finished":
                return record
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"task {task_id} is still {record['state']} after {timeout} s")
            # Events say when it ends; a poll bounds the wait when no event comes.
            try:
                with self._http.stream(
                    "GET",
                    f"/v1/tasks/{_q(task_id)}/events",
                    params={"after": 0},
                    timeout=httpx.Timeout(5.0, read=min(15.0, timeout or 15.0)),
                ) as response:
                    lines = _lines(response.iter_bytes(), self._max_answer, "the task's events", _RAISE_ANSWER)
                    for event in _sse_events(lines, self._max_answer):
                        if event.type == "task_finished":
                            break
                        if deadline is not None and time.monotonic() > deadline:
                            break
            except httpx.ReadTimeout:
                pass
            except httpx.TransportError as e:
                raise self._unreachable(e) from e

    def run(self, task: str, timeout: float | None = None, **spec: Any) -> Task:
        """Submits a task and waits for it; raises TaskFailed unless its work was done
        (`terminated`, `answered` or `examples_held`). The record's `answer` is the answer."""
        record = self.wait(self.submit(task, **spec)["id"], timeout=timeout)
        if record.get("stop_reason") not in _DONE:
            raise TaskFailed(record)
        return record

    # Files

    def upload(self, files: Mapping[str, FileSource]) -> Upload:
        """Uploads files for tasks or sessions (path in the workspace -> content or local path)."""
        return self._call(
            "POST", "/v1/uploads", content=_pack(files), headers={"content-type": "application/x-tar"}
        )

    def files(self, task_id: str) -> List[FileInfo]:
        """The regular files of the task's workspace."""
        return self._call("GET", f"/v1/tasks/{_q(task_id)}/files")["files"]

    def read_file(self, task_id: str, path: str, max_bytes: int = MAX_READ_BYTES) -> bytes:
        """One file of the task's workspace, read up to `max_bytes` (64 MiB by default,
        MAX_READ_BYTES): a larger one raises TooLarge, having read none of it or no more."""
        cap = _cap(max_bytes, "max_bytes")
        return self._call("GET", f"/v1/tasks/{_q(task_id)}/files/{quote(path)}", raw=True, file=(path, cap))

    def executors(self) -> List[dict[str, Any]]:
        """The daemon's executors, their languages and health."""
        return self._call("GET", "/v1/executors")["executors"]

    # Published ports

    def ports(self, task_id: str) -> List[dict[str, Any]]:
        """The ports the running task's code listens on: `[{"port", "path"}]`, each served
        by the daemon at `path` behind its token (docs/network.md)."""
        return self._call("GET", f"/v1/tasks/{_q(task_id)}/ports")["ports"]

    def link(self, task_id: str, port: int, ttl_secs: int | None = None) -> dict[str, Any]:
        """A link that opens one port of the running task's sandbox without the token until
        it expires (an hour by default): `{"url", "port", "expires"}`."""
        return self._call("POST", f"/v1/tasks/{_q(task_id)}/links", json=_link_body(port, ttl_secs))

    # Sandboxes

    def exec(
        self,
        code: str,
        language: str = "python",
        *,
        executor: str | None = None,
        timeout: float | None = None,
        files: str | None = None,
    ) -> BlockResult:
        """Runs one block in a sandbox of its own (what `tandem exec` does, on the daemon)."""
        body = _exec_body(code, language, timeout, executor=executor, files=files)
        return self._call("POST", "/v1/exec", json=body, timeout=_stream_timeout(timeout))

    def session(
        self,
        executor: str | None = None,
        *,
        keep_state: bool = False,
        tools: Mapping[str, ToolFn] | None = None,
        files: str | None = None,
        limits: Mapping[str, int] | None = None,
        idle_timeout: int | None = None,
        network: Mapping[str, Any] | None = None,
        from_snapshot: str | None = None,
        volumes: Sequence[Mapping[str, Any]] | None = None,
    ) -> Session:
        """Opens a sandbox that lives until closed: blocks share its workspace, and with
        `keep_state` one Python interpreter. `tools`' functions are callable from its code
        (`tandem_tools.call(name, **args)`), run here in this process. `network`
        (`{"allow": ["pypi.test"]}`) lets its code reach those hosts through the daemon's
        egress proxy (docs/network.md). `from_snapshot` starts its workspace as that
        snapshot's (docs/snapshots.md). `volumes` (`[{"name": "data", "path": "/data"}]`)
        mounts volumes made with `create_volume` (docs/volumes.md)."""
        spec = _session_spec(executor, keep_state, tools, files, limits, idle_timeout, network, from_snapshot, volumes)
        info = self._call("POST", "/v1/sessions", json=spec)
        return Session(self, info, dict(tools or {}))

    def sessions(self) -> List[SessionInfo]:
        """The daemon's open sessions."""
        return self._call("GET", "/v1/sessions")["sessions"]

    # Snapshots

    def snapshots(self) -> List[dict[str, Any]]:
        """The daemon's snapshots, oldest first (docs/snapshots.md)."""
        return self._call("GET", "/v1/snapshots")["snapshots"]

    def snapshot(self, snapshot_id: str) -> dict[str, Any]:
        """One snapshot's record."""
        return self._call("GET", f"/v1/snapshots/{_q(snapshot_id)}")

    def snapshot_task(self, task_id: str, name: str | None = None) -> dict[str, Any]:
        """Takes a snapshot of a finished (or waiting) task's workspace; its record."""
        return self._call("POST", f"/v1/tasks/{_q(task_id)}/snapshot", json=_name_body(name))

    def remove_snapshot(self, snapshot_id: str) -> dict[str, Any]:
        """Removes a snapshot; its record."""
        return self._call("DELETE", f"/v1/snapshots/{_q(snapshot_id)}")

    def fork(self, snapshot_id: str, count: int, executor: str | None = None) -> List[Session]:
        """Opens `count` sessions at once, each starting from the snapshot's files."""
        body: dict[str, Any] = {"count": int(count)}
        if executor:
            body["executor"] = executor
        answer = self._call("POST", f"/v1/snapshots/{_q(snapshot_id)}/fork", json=body)
        return [Session(self, info, {}) for info in answer["sessions"]]

    # Volumes

    def volumes(self) -> List[dict[str, Any]]:
        """The daemon's volumes, by name (docs/volumes.md)."""
        return self._call("GET", "/v1/volumes")["volumes"]

    def volume(self, name: str) -> dict[str, Any]:
        """One volume."""
        return self._call("GET", f"/v1/volumes/{_q(name)}")

    def create_volume(self, name: str, max_mb: int | None = None) -> dict[str, Any]:
        """Makes a volume; with `max_mb`, a write past that many MiB fails as on a full disk."""
        return self._call("POST", "/v1/volumes", json=_volume_body(name, max_mb))

    def remove_volume(self, name: str) -> dict[str, Any]:
        """Removes a volume and its files; refused (409) while a sandbox has it mounted."""
        return self._call("DELETE", f"/v1/volumes/{_q(name)}")


class Session:
    """A sandbox held open on the daemon (`Client.session`). Close it, or use `with`."""

    def __init__(self, client: Client, info: SessionInfo, tools: dict[str, ToolFn]) -> None:
        self._client = client
        self.info = info
        self.id = info["id"]
        self.tools = tools
        self.closed = False

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(
        self,
        code: str,
        language: str = "python",
        *,
        timeout: float | None = None,
        on_output: OutputFn | None = None,
        on_net: NetFn | None = None,
    ) -> BlockResult:
        """Runs one block and returns its result; its output goes to `on_output` as it comes,
        and each connection it made through the egress proxy to `on_net`. Interrupted
        (KeyboardInterrupt, or any exception meanwhile), the block is killed."""
        c = self._client
        try:
            with c._http.stream(
                "POST",
                f"/v1/sessions/{_q(self.id)}/exec",
                json=_exec_body(code, language, timeout),
                headers=_NDJSON,
                timeout=_stream_timeout(timeout),
            ) as response:
                if response.status_code >= 400:
                    raise c._error(response, "the block's run")
                try:
                    for line in _lines(response.iter_bytes(), c._max_answer, "the block's run", _RAISE_ANSWER):
                        if not line:
                            continue
                        event = json.loads(line)
                        kind = event["type"]
                        if kind == "output" and on_output is not None:
                            on_output(event["stream"], event["text"])
                        elif kind == "net" and on_net is not None:
                            on_net({k: v for k, v in event.items() if k != "type"})
                        elif kind == "tool_call":
                            reply = _tool_reply(self.tools.get(event["name"]), event["name"], event["arguments"])
                            c._call("POST", f"/v1/sessions/{_q(self.id)}/calls/{_q(event['call'])}", json=reply)
                        elif kind in ("result", "error"):
                            return _block_end(event)
                except BaseException:
                    self.cancel()
                    raise
        except httpx.TransportError as e:
            raise c._unreachable(e) from e
        raise TandemError("internal", "the block's run ended without a result")

    def cancel(self) -> bool:
        """Kills the block that runs now; whether one did."""
        try:
            return bool(self._client._call("POST", f"/v1/sessions/{_q(self.id)}/cancel")["cancelled"])
        except TandemError:
            return False

    def refresh(self) -> SessionInfo:
        """The session as the daemon shows it now (`state`: `running` or `paused`), kept in
        `info`."""
        self.info = self._client._call("GET", f"/v1/sessions/{_q(self.id)}")
        return self.info

    def files(self) -> List[FileInfo]:
        """The regular files of the session's workspace."""
        return self._client._call("GET", f"/v1/sessions/{_q(self.id)}/files")["files"]

    def read_file(self, path: str, max_bytes: int = MAX_READ_BYTES) -> bytes:
        """One file of the workspace, read up to `max_bytes` (64 MiB by default,
        MAX_READ_BYTES): a larger one raises TooLarge, having read none of it or no more."""
        cap = _cap(max_bytes, "max_bytes")
        return self._client._call("GET", f"/v1/sessions/{_q(self.id)}/files/{quote(path)}", raw=True, file=(path, cap))

    def ports(self) -> List[dict[str, Any]]:
        """The ports the session's code listens on: `[{"port", "path"}]`, each served by the
        daemon at `path` behind its token while the session is open (docs/network.md)."""
        return self._client._call("GET", f"/v1/sessions/{_q(self.id)}/ports")["ports"]

    def link(self, port: int, ttl_secs: int | None = None) -> dict[str, Any]:
        """A link that opens `port` without the token until it expires (an hour by
        default), for a browser: `{"url", "port", "expires"}`."""
        return self._client._call("POST", f"/v1/sessions/{_q(self.id)}/links", json=_link_body(port, ttl_secs))

    def snapshot(self, name: str | None = None) -> dict[str, Any]:
        """Takes a snapshot of the workspace, between blocks: its record, `{"id", "name",
        "bytes", "files", "saved", "not_saved", "created", ...}` (docs/snapshots.md)."""
        return self._client._call("POST", f"/v1/sessions/{_q(self.id)}/snapshot", json=_name_body(name))

    def put_files(self, files: Mapping[str, FileSource]) -> Upload:
        """Places files in the workspace (path -> content or local path), between blocks."""
        return self._client._call(
            "POST",
            f"/v1/sessions/{_q(self.id)}/files",
            content=_pack(files),
            headers={"content-type": "application/x-tar"},
        )

    def close(self) -> None:
        """Closes the session and its sandbox (again is a no-op)."""
        if self.closed:
            return
        self.closed = True
        try:
            self._client._call("DELETE", f"/v1/sessions/{_q(self.id)}")
        except TandemError as e:
            if e.code != "not_found":
                raise


class AsyncClient(_Base):
    """`Client` for asyncio: the same methods, awaited; `follow` is an async iterator. The
    same caps: `max_answer_bytes`, and `read_file`'s `max_bytes`."""

    def __init__(
        self,
        host: str | None = None,
        token: str | None = None,
        timeout: float = 30.0,
        *,
        max_answer_bytes: int = MAX_READ_BYTES,
    ) -> None:
        super().__init__(host, token, max_answer_bytes)
        transport = httpx.AsyncHTTPTransport(uds=self._conn.socket) if self._conn.socket else None
        self._http = httpx.AsyncClient(
            base_url=self._conn.base_url,
            transport=transport,
            headers=self._headers,
            timeout=httpx.Timeout(timeout, connect=5.0),
        )

    async def aclose(self) -> None:
        """Closes the client's connections."""
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _call(
        self, method: str, path: str, raw: bool = False, *, file: tuple[str, int] | None = None, **kw: Any
    ) -> Any:
        """The answer to one request (see `Client._call`)."""
        try:
            async with self._http.stream(method, path, **kw) as response:
                if file is None:
                    body = await _aread(response, self._max_answer, f"the answer to {method} {path}", _RAISE_ANSWER)
                else:
                    body = await _aread(response, file[1], f"the workspace file `{file[0]}`", _RAISE_FILE)
        except httpx.TransportError as e:
            raise self._unreachable(e) from e
        return _answer(response.status_code, response.headers, body, raw)

    async def _error(self, response: httpx.Response, what: str) -> TandemError:
        body = await _aread(response, self._max_answer, what, _RAISE_ANSWER)
        return from_answer(response.status_code, body)

    async def submit(self, task: str, *, files: Mapping[str, FileSource] | str | None = None, **spec: Any) -> Task:
        """Queues a task (see `Client.submit`)."""
        body: dict[str, Any] = {"task": task, **spec}
        if files is not None:
            body["files"] = files if isinstance(files, str) else (await self.upload(files))["id"]
        return await self._call("POST", "/v1/tasks", json=body)

    async def get(self, task_id: str) -> Task:
        """The task's record, with its `transcript`."""
        return await self._call("GET", f"/v1/tasks/{_q(task_id)}")

    async def list(self, state: str | None = None, limit: int | None = None, before: str | None = None) -> List[Task]:
        """Tasks (see `Client.list`)."""
        params = {k: v for k, v in {"state": state, "limit": limit, "before": before}.items() if v is not None}
        return (await self._call("GET", "/v1/tasks", params=params))["tasks"]

    async def cancel(self, task_id: str) -> Task:
        """Cancels a queued, running or interrupted task."""
        return await self._call("POST", f"/v1/tasks/{_q(task_id)}/cancel")

    async def resume(self, task_id: str) -> Task:
        """Queues an interrupted task again."""
        return await self._call("POST", f"/v1/tasks/{_q(task_id)}/resume")

    async def approve(self, task_id: str, n: int, code: str | None = None) -> dict[str, Any]:
        """Approves the block that waits under number `n`, or runs `code` instead."""
        body: dict[str, Any] = {"decision": "approve", **({"code": code} if code else {})}
        return await self._call("POST", f"/v1/tasks/{_q(task_id)}/approvals/{int(n)}", json=body)

    async def deny(self, task_id: str, n: int, reason: str | None = None) -> dict[str, Any]:
        """Declines the block that waits under number `n`."""
        body: dict[str, Any] = {"decision": "deny", **({"reason": reason} if reason else {})}
        return await self._call("POST", f"/v1/tasks/{_q(task_id)}/approvals/{int(n)}", json=body)

    async def follow(self, task_id: str, after: int = 0, follow: bool = True) -> AsyncIterator[Event]:
        """The task's events as they come (see `Client.follow`)."""
        last, retries = after, 0
        while True:
            params: dict[str, Any] = {"after": last, **({} if follow else {"follow": "false"})}
            try:
                async with self._http.stream(
                    "GET", f"/v1/tasks/{_q(task_id)}/events", params=params, timeout=httpx.Timeout(5.0, read=None)
                ) as response:
                    if response.status_code >= 400:
                        raise await self._error(response, "the task's events")
                    sse = _Sse(self._max_answer)
                    lines = _alines(response.aiter_bytes(), self._max_answer, "the task's events", _RAISE_ANSWER)
                    async for line in lines:
                        event = sse.feed(line)
                        if event is None:
                            continue
                        last, retries = event.seq, 0
                        yield event
                        if event.type == "task_finished":
                            return
                    if not follow:
                        return
            except httpx.TransportError as e:
                retries += 1
                if retries > 3:
                    raise self._unreachable(e) from e
                await asyncio.sleep(0.5 * retries)

    async def wait(self, task_id: str, timeout: float | None = None) -> Task:
        """Waits for the task to finish (see `Client.wait`)."""
        async def finished() -> Task:
            async for event in self.follow(task_id):
                if event.type == "task_finished":
                    break
            return await self.get(task_id)

        try:
            return await asyncio.wait_for(finished(), timeout)
        except asyncio.TimeoutError:
            record = await self.get(task_id)
            raise TimeoutError(f"task {task_id} is still {record['state']} after {timeout} s") from None

    async def run(self, task: str, timeout: float | None = None, **spec: Any) -> Task:
        """Submits a task and waits for it; raises TaskFailed unless its work was done
        (`terminated`, `answered` or `examples_held`). The record's `answer` is the answer."""
        record = await self.wait((await self.submit(task, **spec))["id"], timeout=timeout)
        if record.get("stop_reason") not in _DONE:
            raise TaskFailed(record)
        return record

    async def upload(self, files: Mapping[str, FileSource]) -> Upload:
        """Uploads files for tasks or sessions."""
        return await self._call(
            "POST", "/v1/uploads", content=_pack(files), headers={"content-type": "application/x-tar"}
        )

    async def files(self, task_id: str) -> List[FileInfo]:
        """The regular files of the task's workspace."""
        return (await self._call("GET", f"/v1/tasks/{_q(task_id)}/files"))["files"]

    async def read_file(self, task_id: str, path: str, max_bytes: int = MAX_READ_BYTES) -> bytes:
        """One file of the task's workspace, read up to `max_bytes` (see `Client.read_file`)."""
        cap = _cap(max_bytes, "max_bytes")
        return await self._call("GET", f"/v1/tasks/{_q(task_id)}/files/{quote(path)}", raw=True, file=(path, cap))

    async def executors(self) -> List[dict[str, Any]]:
        """The daemon's executors, their languages and health."""
        return (await self._call("GET", "/v1/executors"))["executors"]

    async def ports(self, task_id: str) -> List[dict[str, Any]]:
        """The ports the running task's code listens on (see `Client.ports`)."""
        return (await self._call("GET", f"/v1/tasks/{_q(task_id)}/ports"))["ports"]

    async def link(self, task_id: str, port: int, ttl_secs: int | None = None) -> dict[str, Any]:
        """A link that opens one port of the running task's sandbox (see `Client.link`)."""
        return await self._call("POST", f"/v1/tasks/{_q(task_id)}/links", json=_link_body(port, ttl_secs))

    async def exec(
        self,
        code: str,
        language: str = "python",
        *,
        executor: str | None = None,
        timeout: float | None = None,
        files: str | None = None,
    ) -> BlockResult:
        """Runs one block in a sandbox of its own."""
        body = _exec_body(code, language, timeout, executor=executor, files=files)
        return await self._call("POST", "/v1/exec", json=body, timeout=_stream_timeout(timeout))

    async def session(
        self,
        executor: str | None = None,
        *,
        keep_state: bool = False,
        tools: Mapping[str, ToolFn] | None = None,
        files: str | None = None,
        limits: Mapping[str, int] | None = None,
        idle_timeout: int | None = None,
        network: Mapping[str, Any] | None = None,
        from_snapshot: str | None = None,
        volumes: Sequence[Mapping[str, Any]] | None = None,
    ) -> AsyncSession:
        """Opens a sandbox that lives until closed (see `Client.session`); a tool may be a
        coroutine function."""
        spec = _session_spec(executor, keep_state, tools, files, limits, idle_timeout, network, from_snapshot, volumes)
        info = await self._call("POST", "/v1/sessions", json=spec)
        return AsyncSession(self, info, dict(tools or {}))

    async def sessions(self) -> List[SessionInfo]:
        """The daemon's open sessions."""
        return (await self._call("GET", "/v1/sessions"))["sessions"]

    async def snapshots(self) -> List[dict[str, Any]]:
        """The daemon's snapshots, oldest first (see `Client.snapshots`)."""
        return (await self._call("GET", "/v1/snapshots"))["snapshots"]

    async def snapshot(self, snapshot_id: str) -> dict[str, Any]:
        """One snapshot's record."""
        return await self._call("GET", f"/v1/snapshots/{_q(snapshot_id)}")

    async def snapshot_task(self, task_id: str, name: str | None = None) -> dict[str, Any]:
        """Takes a snapshot of a finished (or waiting) task's workspace; its record."""
        return await self._call("POST", f"/v1/tasks/{_q(task_id)}/snapshot", json=_name_body(name))

    async def remove_snapshot(self, snapshot_id: str) -> dict[str, Any]:
        """Removes a snapshot; its record."""
        return await self._call("DELETE", f"/v1/snapshots/{_q(snapshot_id)}")

    async def fork(self, snapshot_id: str, count: int, executor: str | None = None) -> List[AsyncSession]:
        """Opens `count` sessions at once from the snapshot (see `Client.fork`)."""
        body: dict[str, Any] = {"count": int(count)}
        if executor:
            body["executor"] = executor
        answer = await self._call("POST", f"/v1/snapshots/{_q(snapshot_id)}/fork", json=body)
        return [AsyncSession(self, info, {}) for info in answer["sessions"]]

    async def volumes(self) -> List[dict[str, Any]]:
        """The daemon's volumes, by name (see `Client.volumes`)."""
        return (await self._call("GET", "/v1/volumes"))["volumes"]

    async def volume(self, name: str) -> dict[str, Any]:
        """One volume."""
        return await self._call("GET", f"/v1/volumes/{_q(name)}")

    async def create_volume(self, name: str, max_mb: int | None = None) -> dict[str, Any]:
        """Makes a volume (see `Client.create_volume`)."""
        return await self._call("POST", "/v1/volumes", json=_volume_body(name, max_mb))

    async def remove_volume(self, name: str) -> dict[str, Any]:
        """Removes a volume and its files; refused (409) while a sandbox has it mounted."""
        return await self._call("DELETE", f"/v1/volumes/{_q(name)}")


class AsyncSession:
    """`Session` for asyncio. Cancelling the task that awaits `run` kills the block."""

    def __init__(self, client: AsyncClient, info: SessionInfo, tools: dict[str, ToolFn]) -> None:
        self._client = client
        self.info = info
        self.id = info["id"]
        self.tools = tools
        self.closed = False

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _reply(self, name: str, arguments: Any) -> dict[str, str]:
        fn = self.tools.get(name)
        if fn is not None and inspect.iscoroutinefunction(fn):
            try:
                value = await (fn(**arguments) if isinstance(arguments, dict) else fn(arguments))
            except Exception as e:
                return {"error": f"{type(e).__name__}: {e}"}
            return {"result": value if isinstance(value, str) else json.dumps(value, default=str)}
        return await asyncio.to_thread(_tool_reply, fn, name, arguments)

    async def run(
        self,
        code: str,
        language: str = "python",
        *,
        timeout: float | None = None,
        on_output: OutputFn | None = None,
        on_net: NetFn | None = None,
    ) -> BlockResult:
        """Runs one block and returns its result (see `Session.run`)."""
        c = self._client
        try:
            async with c._http.stream(
                "POST",
                f"/v1/sessions/{_q(self.id)}/exec",
                json=_exec_body(code, language, timeout),
                headers=_NDJSON,
                timeout=_stream_timeout(timeout),
            ) as response:
                if response.status_code >= 400:
                    raise await c._error(response, "the block's run")
                try:
                    async for line in _alines(response.aiter_bytes(), c._max_answer, "the block's run", _RAISE_ANSWER):
                        if not line:
                            continue
                        event = json.loads(line)
                        kind = event["type"]
                        if kind == "output" and on_output is not None:
                            shown = on_output(event["stream"], event["text"])
                            if inspect.isawaitable(shown):
                                await shown
                        elif kind == "net" and on_net is not None:
                            told = on_net({k: v for k, v in event.items() if k != "type"})
                            if inspect.isawaitable(told):
                                await told
                        elif kind == "tool_call":
                            reply = await self._reply(event["name"], event["arguments"])
                            await c._call("POST", f"/v1/sessions/{_q(self.id)}/calls/{_q(event['call'])}", json=reply)
                        elif kind in ("result", "error"):
                            return _block_end(event)
                except BaseException:
                    # Shielded: the cancel must reach the daemon even as this task is cancelled.
                    await asyncio.shield(self.cancel())
                    raise
        except httpx.TransportError as e:
            raise c._unreachable(e) from e
        raise TandemError("internal", "the block's run ended without a result")

    async def cancel(self) -> bool:
        """Kills the block that runs now; whether one did."""
        try:
            return bool((await self._client._call("POST", f"/v1/sessions/{_q(self.id)}/cancel"))["cancelled"])
        except TandemError:
            return False

    async def refresh(self) -> SessionInfo:
        """The session as the daemon shows it now (`state`: `running` or `paused`), kept in
        `info`."""
        self.info = await self._client._call("GET", f"/v1/sessions/{_q(self.id)}")
        return self.info

    async def files(self) -> List[FileInfo]:
        """The regular files of the session's workspace."""
        return (await self._client._call("GET", f"/v1/sessions/{_q(self.id)}/files"))["files"]

    async def read_file(self, path: str, max_bytes: int = MAX_READ_BYTES) -> bytes:
        """One file of the workspace, read up to `max_bytes` (see `Session.read_file`)."""
        cap = _cap(max_bytes, "max_bytes")
        return await self._client._call(
            "GET", f"/v1/sessions/{_q(self.id)}/files/{quote(path)}", raw=True, file=(path, cap)
        )

    async def ports(self) -> List[dict[str, Any]]:
        """The ports the session's code listens on (see `Session.ports`)."""
        return (await self._client._call("GET", f"/v1/sessions/{_q(self.id)}/ports"))["ports"]

    async def link(self, port: int, ttl_secs: int | None = None) -> dict[str, Any]:
        """A link that opens `port` without the token until it expires (see `Session.link`)."""
        return await self._client._call(
            "POST", f"/v1/sessions/{_q(self.id)}/links", json=_link_body(port, ttl_secs)
        )

    async def snapshot(self, name: str | None = None) -> dict[str, Any]:
        """Takes a snapshot of the workspace, between blocks (see `Session.snapshot`)."""
        return await self._client._call("POST", f"/v1/sessions/{_q(self.id)}/snapshot", json=_name_body(name))

    async def put_files(self, files: Mapping[str, FileSource]) -> Upload:
        """Places files in the workspace, between blocks."""
        return await self._client._call(
            "POST",
            f"/v1/sessions/{_q(self.id)}/files",
            content=_pack(files),
            headers={"content-type": "application/x-tar"},
        )

    async def close(self) -> None:
        """Closes the session and its sandbox (again is a no-op)."""
        if self.closed:
            return
        self.closed = True
        try:
            await self._client._call("DELETE", f"/v1/sessions/{_q(self.id)}")
        except TandemError as e:
            if e.code != "not_found":
                raise
