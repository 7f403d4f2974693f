"""Real parts for the client's tests: a `tandem serve` started from the binary under test
(TANDEM_BIN) on a socket of its own, and a scripted OpenAI-compatible model server over
HTTP whose replies each test sets."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import tandem_client

REPO = pathlib.Path(__file__).resolve().parents[2]


def tandem_bin() -> str:
    found = os.environ.get("TANDEM_BIN") or shutil.which("tandem")
    if not found:
        pytest.fail("TANDEM_BIN is not set and no `tandem` is on PATH: build it with `cargo build --bin tandem`")
    return found


class ScriptedModel:
    """An OpenAI-compatible chat server that answers with the replies it was given, in
    order (the last one again when they run out), and keeps the requests it saw."""

    def __init__(self) -> None:
        self.replies: list[str] = ["TERMINATE"]
        # When set, the reply is what it makes of the request instead (for many at once).
        self.respond = None
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        model = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
                with model.lock:
                    model.requests.append(body)
                    if model.respond is not None:
                        reply = model.respond(body)
                    else:
                        reply = model.replies.pop(0) if len(model.replies) > 1 else model.replies[0]
                usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream")
                    self.end_headers()
                    chunks = [
                        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": reply}, "finish_reason": None}]},
                        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                        {"choices": [], "usage": usage},
                    ]
                    for chunk in chunks:
                        chunk.update({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": body.get("model", "m")})
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.write(b"data: [DONE]\n\n")
                    return
                answer = {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body.get("model", "m"),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}],
                    "usage": usage,
                }
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def script(self, *replies: str) -> None:
        with self.lock:
            self.replies = list(replies) or ["TERMINATE"]
            self.respond = None
            self.requests.clear()


class Daemon:
    """`tandem serve` on a state dir and socket of its own; killed at the end."""

    def __init__(self, model_url: str, config: str, env: dict[str, str] | None = None) -> None:
        self.state = pathlib.Path(tempfile.mkdtemp(prefix="tandem-py-"))
        (self.state / "tandem").mkdir()
        (self.state / "tandem" / "tandem.toml").write_text(config)
        self.socket = self.state / "tandem.sock"
        self.host = f"unix://{self.socket}"
        self.env = {
            **os.environ,
            "OPENAI_BASE_URL": model_url,
            "TANDEM_MAX_RETRIES": "0",
            "XDG_CONFIG_HOME": str(self.state),
            **(env or {}),
        }
        self.env.pop("OPENAI_API_KEY", None)
        self.env.pop("TANDEM_MODEL", None)
        self.env.pop("TANDEM_HOST", None)
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, *extra: str) -> None:
        log = open(self.state / "daemon.log", "ab")
        self.proc = subprocess.Popen(
            [tandem_bin(), "serve", "--socket", str(self.socket), "--state-dir", str(self.state), *extra],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the daemon exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with tandem_client.Client(self.host, token=self.env.get("TANDEM_TOKEN")) as c:
                    c._call("GET", "/healthz")
                return
            except tandem_client.TandemError:
                time.sleep(0.05)
        pytest.fail(f"the daemon did not answer within 60 s:\n{self.log()}")

    def log(self) -> str:
        return (self.state / "daemon.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def client(self) -> tandem_client.Client:
        return tandem_client.Client(self.host)


CONFIG = """\
[model]
model = "scripted"

[policy]
executors = ["local", "docker"]

[tools.shout]
description = "Upper-cases a text."
command = ["python3", "-c", "import json,sys; print(json.load(sys.stdin)['text'].upper())"]
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def model() -> Iterator[ScriptedModel]:
    m = ScriptedModel()
    yield m
    m.server.shutdown()


@pytest.fixture(scope="session")
def daemon(model: ScriptedModel) -> Iterator[Daemon]:
    d = Daemon(model.url, CONFIG)
    yield d
    d.stop()
    shutil.rmtree(d.state, ignore_errors=True)


@pytest.fixture()
def client(daemon: Daemon) -> Iterator[tandem_client.Client]:
    with daemon.client() as c:
        yield c


def docker_image() -> str:
    image = os.environ.get("TANDEM_DOCKER_IMAGE", "tandem-sandbox:latest")
    check = subprocess.run(["docker", "image", "inspect", image], capture_output=True)
    if check.returncode != 0:
        pytest.fail(f"the Docker image {image} is not there: run scripts/build-sandbox-image.sh")
    return image
