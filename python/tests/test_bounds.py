"""Nothing the client reads is unbounded: a workspace file the session's code left (1 GiB,
sparse), the smolagents executor's step report at the same size, and answers, NDJSON lines
and events with no end from a server that never stops sending. Each raises TooLarge naming
it, and the client's peak memory stays small."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import tandem_client
from tandem_client import AsyncClient, AsyncSession, Client, Session, TooLarge

from conftest import Daemon

GIB = 1 << 30
# The client's whole peak resident memory, its interpreter and imports included (about
# 30 MiB for the client alone, 55 MiB with smolagents).
PEAK_MIB = 300

# Run in a process of its own, so that its peak memory is the client's alone: prints what
# the read raised and the process's peak resident memory in MiB.
READ_PROBE = r"""
import json, resource, sys
import tandem_client
host, session, path = sys.argv[1:4]
with tandem_client.Client(host) as c:
    s = tandem_client.Session(c, {"id": session}, {})
    try:
        got = len(s.read_file(path))
        error = None
    except tandem_client.TooLarge as e:
        got, error = None, str(e)
print(json.dumps({"read": got, "error": error,
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

# The step's code swaps the `open` the step runner writes its report with (they share
# globals in the kept interpreter), so the report it leaves is 1 GiB, sparse.
BIG_REPORT_STEP = r"""
import builtins as _b, os as _os
def open(path, mode="r", *args, **kwargs):
    f = _b.open(path, mode, *args, **kwargs)
    if str(path).startswith(".smolagents-step-") and "w" in mode:
        _os.truncate(f.fileno(), 1 << 30)
    return f
1 + 1
"""

STEP_PROBE = r"""
import json, resource, sys
from smolagents.utils import AgentError
from tandem_client.smolagents import TandemExecutor
host, step = sys.argv[1:3]
ex = TandemExecutor([], executor="local", timeout=30, host=host)
try:
    small = ex.run_code_raise_errors("20 + 22").output
    try:
        ex.run_code_raise_errors(step)
        error = None
    except AgentError as e:
        error = str(e)
finally:
    ex.cleanup()
print(json.dumps({"small": small, "error": error,
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def probe(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_read_file_of_a_huge_file_the_code_left_raises_and_reads_none_of_it(client: Client, daemon: Daemon) -> None:
    with client.session("local") as s:
        made = s.run(f"with open('big.bin', 'wb') as f:\n    f.truncate({GIB})\nopen('small.txt', 'w').write('fits')")
        assert made["exit_code"] == 0, made
        assert s.read_file("small.txt") == b"fits"
        assert s.read_file("small.txt", max_bytes=4) == b"fits"
        with pytest.raises(TooLarge) as small_cap:
            s.read_file("small.txt", max_bytes=3)
        assert small_cap.value.code == "too_large" and small_cap.value.size == 4
        with pytest.raises(ValueError, match="max_bytes"):
            s.read_file("small.txt", max_bytes=0)

        got = probe(READ_PROBE, daemon.host, s.id, "big.bin")
        assert got["read"] is None, got
        error = got["error"]
        assert error == (
            f"too_large: the workspace file `big.bin` is {GIB} bytes, over this client's cap of "
            f"{tandem_client.MAX_READ_BYTES} bytes (64 MiB); read_file(path, max_bytes=N) reads up to N "
            "bytes; or have the sandbox's code read a part of it (head -c, f.read(n)) and print that"
        )
        assert got["peak_mib"] < PEAK_MIB, got


def test_a_step_report_the_code_made_huge_fails_the_step_and_the_client_stays_small(daemon: Daemon) -> None:
    got = probe(STEP_PROBE, daemon.host, BIG_REPORT_STEP)
    assert got["small"] == 42, got
    error = got["error"]
    assert error is not None, got
    assert "the step's report was not read" in error, error
    assert f"is {GIB} bytes, over this client's cap of 8388608 bytes (8 MiB)" in error, error
    assert "print a part of it" in error, error
    assert got["peak_mib"] < PEAK_MIB, got


class Endless:
    """An HTTP server that answers every request with a body that never ends (no length,
    no line end, one event's data that goes on), until the client hangs up or 512 MiB went."""

    LIMIT = 512 << 20

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args: object) -> None:
                pass

            def answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                if length:
                    self.rfile.read(length)
                if "/events" in self.path:
                    kind, head, fill = "text/event-stream", b"id: 1\ndata: ", b"x" * (1 << 16) + b"\ndata: "
                elif self.path.endswith("/exec"):
                    kind, head, fill = "application/x-ndjson", b'{"type": "output", "text": "', b"x" * (1 << 16)
                else:
                    kind, head, fill = "application/json", b'{"tasks": ["', b"x" * (1 << 16)
                self.send_response(200)
                self.send_header("content-type", kind)
                self.end_headers()
                sent = 0
                try:
                    self.wfile.write(head)
                    while sent < Endless.LIMIT:
                        self.wfile.write(fill)
                        sent += len(fill)
                except OSError:
                    pass

            do_GET = do_POST = answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture()
def endless() -> Iterator[Endless]:
    e = Endless()
    yield e
    e.server.shutdown()


CAP = 4 << 20


def test_answers_lines_and_events_without_end_stop_at_the_cap(endless: Endless) -> None:
    with Client(endless.host, max_answer_bytes=CAP) as c:
        with pytest.raises(TooLarge, match=r"the answer to GET /v1/tasks is larger than this client's cap of 4194304 bytes"):
            c.list()
        with pytest.raises(TooLarge, match=r"a line of the block's run is larger than this client's cap of 4194304 bytes \(4 MiB\); .*max_answer_bytes"):
            Session(c, {"id": "s"}, {}).run("print(1)")
        with pytest.raises(TooLarge, match=r"an event of the task's stream is larger than this client's cap of 4194304 bytes"):
            list(c.follow("t", follow=False))
    with pytest.raises(ValueError, match="max_answer_bytes"):
        Client(endless.host, max_answer_bytes=-1)


async def test_the_async_client_stops_at_the_same_caps(endless: Endless) -> None:
    async with AsyncClient(endless.host, max_answer_bytes=CAP) as c:
        with pytest.raises(TooLarge, match=r"the answer to GET /v1/tasks is larger than"):
            await c.list()
        with pytest.raises(TooLarge, match=r"a line of the block's run is larger than"):
            await AsyncSession(c, {"id": "s"}, {}).run("print(1)")
        with pytest.raises(TooLarge, match=r"an event of the task's stream is larger than"):
            async for _ in c.follow("t", follow=False):
                pass
