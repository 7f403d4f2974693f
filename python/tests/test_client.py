"""The client against a real daemon: tasks, events, approvals, files, sessions, exec, and
every failure as an exception that names it."""
from __future__ import annotations

import asyncio
import os
import pathlib
import time

import pytest

import tandem_client
from tandem_client import AsyncClient, Client

from conftest import CONFIG, Daemon, ScriptedModel, docker_image, free_port

SIX_BY_SEVEN = "Let me compute it.\n```python\nprint(6 * 7)\n```"


def test_a_task_is_submitted_followed_and_its_answer_read(client: Client, model: ScriptedModel) -> None:
    model.script(SIX_BY_SEVEN, "The answer is 42. TERMINATE")
    task = client.submit("What is 6 times 7?", executor="local", max_turns=4)
    assert task["state"] in ("queued", "running")
    kinds = []
    outputs = []
    for event in client.follow(task["id"]):
        kinds.append(event.type)
        if event.type == "exec_result":
            outputs.append(event.data["result"]["stdout"])
    assert kinds[0] == "task_started" and kinds[-1] == "task_finished"
    assert outputs == ["42\n"]
    record = client.wait(task["id"])
    assert record["stop_reason"] == "terminated"
    assert record["result"] == "The answer is 42."
    assert [m["role"] for m in record["transcript"]][:2] == ["system", "user"]
    assert any(t["id"] == task["id"] for t in client.list())


def test_every_task_ends_with_its_answer_and_where_it_came_from(client: Client, model: ScriptedModel) -> None:
    # A guessed output block the run contradicts is told to the model, whose answer in words
    # ends the task as `answered`.
    model.script("```python\nprint(12 + 7)\n```\n```output\n20\n```\nTERMINATE", "She has 19 apples.")
    record = client.run("How many apples?", executor="local", max_turns=4)
    assert record["stop_reason"] == "answered"
    assert (record["answer"], record["answer_from"]) == ("She has 19 apples.", "model")
    told = [m["content"] for m in record["transcript"] if m["role"] == "user"][1]
    assert "Your code printed 19; your reply says 20." in told
    # The turn limit with code that printed: the answer is what it printed.
    model.script("```python\nprint(6 * 7)\n```")
    with pytest.raises(tandem_client.TaskFailed) as failed:
        client.run("Loop once", executor="local", max_turns=1)
    assert (failed.value.task["answer"], failed.value.task["answer_from"]) == ("42", "output")


def test_run_raises_task_failed_naming_the_stop_reason(client: Client, model: ScriptedModel) -> None:
    model.script(SIX_BY_SEVEN)
    with pytest.raises(tandem_client.TaskFailed) as failed:
        client.run("Loop forever", executor="local", max_turns=1)
    assert failed.value.stop_reason == "max_turns"
    assert "max_turns" in str(failed.value) and failed.value.task["id"] in str(failed.value)


def test_a_block_waits_for_approval_and_runs_once_approved(client: Client, model: ScriptedModel) -> None:
    model.script(SIX_BY_SEVEN, "TERMINATE")
    task = client.submit("6*7", executor="local", approval={"mode": "always"})
    for event in client.follow(task["id"]):
        if event.type == "approval_requested":
            client.approve(task["id"], event.data["n"], code="print(6 * 7 + 1)")
        if event.type == "exec_result":
            assert event.data["result"]["stdout"] == "43\n"
    assert client.wait(task["id"])["stop_reason"] == "terminated"
    with pytest.raises(tandem_client.Conflict):
        client.approve(task["id"], 1)


def test_a_denied_block_never_runs_and_the_model_is_told(client: Client, model: ScriptedModel) -> None:
    model.script("```sh\ntouch denied-ran\n```", "TERMINATE")
    task = client.submit("touch a file", executor="local", approval={"mode": "always"})
    for event in client.follow(task["id"]):
        if event.type == "approval_requested":
            client.deny(task["id"], event.data["n"], reason="not today")
    record = client.wait(task["id"])
    assert record["stop_reason"] == "terminated"
    assert [f["path"] for f in client.files(task["id"])] == []
    assert "not today" in model.requests[-1]["messages"][-1]["content"]


def test_files_go_in_and_come_out_of_a_task(client: Client, model: ScriptedModel, tmp_path: pathlib.Path) -> None:
    local = tmp_path / "numbers.csv"
    local.write_text("n\n1\n2\n3\n")
    model.script(
        "```python\nimport csv\nrows = list(csv.DictReader(open('numbers.csv')))\nopen('sum.txt', 'w').write(str(sum(int(r['n']) for r in rows)))\n```",
        "TERMINATE",
    )
    task = client.run("Sum the numbers", executor="local", files={"numbers.csv": local})
    files = {f["path"]: f for f in client.files(task["id"])}
    assert files["numbers.csv"].get("given") is True
    assert client.read_file(task["id"], "sum.txt") == b"6"
    with pytest.raises(tandem_client.NotFound) as missing:
        client.read_file(task["id"], "nope.txt")
    assert "nope.txt" in missing.value.message


def test_cancel_and_resume_answer_with_the_record_or_a_conflict(client: Client, model: ScriptedModel) -> None:
    model.script("```python\nimport time\ntime.sleep(60)\n```")
    task = client.submit("sleep", executor="local")
    for event in client.follow(task["id"]):
        if event.type == "code_block":
            break
    client.cancel(task["id"])
    record = client.wait(task["id"], timeout=60)
    assert record["stop_reason"] == "cancelled"
    with pytest.raises(tandem_client.Conflict) as conflict:
        client.resume(task["id"])
    assert conflict.value.status == 409


def test_exec_runs_one_block_in_a_sandbox_of_its_own(client: Client) -> None:
    result = client.exec("import sys; print('hi'); print('err', file=sys.stderr); sys.exit(3)", executor="local")
    assert (result["status"], result["exit_code"]) == ("exited", 3)
    assert result["stdout"] == "hi\n" and result["stderr"] == "err\n"
    assert client.exec("echo $((2+3))", language="sh", executor="local")["stdout"] == "5\n"


def test_an_unknown_executor_or_language_is_an_exception_naming_it(client: Client) -> None:
    with pytest.raises(tandem_client.TandemError) as unknown:
        client.exec("print(1)", executor="nosuch")
    assert "nosuch" in unknown.value.message and unknown.value.status == 400
    with pytest.raises(tandem_client.InvalidRequest) as language:
        client.exec("1", language="cobol", executor="local")
    assert "cobol" in language.value.message
    with pytest.raises(tandem_client.InvalidRequest) as field:
        client.submit("x", executr="local")
    assert "executr" in field.value.message


def test_a_session_keeps_files_and_with_keep_state_its_variables(client: Client) -> None:
    with client.session("local", keep_state=True) as s:
        assert s.run("x = 41\nopen('kept.txt', 'w').write('yes')")["exit_code"] == 0
        assert s.run("print(x + 1)")["stdout"] == "42\n"
        assert s.run("cat kept.txt", language="sh")["stdout"] == "yes"
        assert [f["path"] for f in s.files()] == ["kept.txt"]
        assert s.read_file("kept.txt") == b"yes"
        import io
        import tarfile

        packed = client._call("GET", f"/v1/sessions/{s.id}/files", params={"format": "tar"}, raw=True)
        with tarfile.open(fileobj=io.BytesIO(packed)) as tar:
            files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
        assert files["kept.txt"] == b"yes"
        s.put_files({"data/in.txt": "from the client"})
        assert s.run("print(open('data/in.txt').read())")["stdout"] == "from the client\n"
        assert s.id in [i["id"] for i in client.sessions()]
    assert s.id not in [i["id"] for i in client.sessions()]
    with pytest.raises(tandem_client.NotFound) as closed:
        s.run("print(1)")
    assert s.id in closed.value.message


def test_each_block_says_what_it_used_and_the_session_sums_it(client: Client) -> None:
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass"
    with client.session("local") as s:
        first = s.run(spin)
        used = first["resources"]
        assert 0.45 <= used["cpu_secs"] <= 2.0, first
        assert used["peak_memory_bytes"] > 0 and used["peak_memory_scope"] == "block", first
        assert "disk_written_bytes" in used, first
        second = s.run(spin)
        total = s.refresh()["resources"]
        assert total["cpu_secs"] >= first["resources"]["cpu_secs"] + second["resources"]["cpu_secs"] - 1e-6, total
        assert total["peak_memory_scope"] == "session", total


def test_a_sessions_snapshot_starts_new_sessions_and_forks_each_of_its_own(client: Client) -> None:
    with client.session("local") as s:
        s.run("open('model.txt', 'w').write('v1')")
        snap = s.snapshot(name="trained")
    assert snap["name"] == "trained" and snap["files"] == 1 and snap["not_saved"] == []
    assert snap["id"] in [x["id"] for x in client.snapshots()]
    assert client.snapshot(snap["id"]) == snap
    with client.session("local", from_snapshot=snap["id"]) as again:
        assert again.run("print(open('model.txt').read())")["stdout"] == "v1\n"
    forks = client.fork(snap["id"], 2, executor="local")
    try:
        for i, fork in enumerate(forks):
            fork.run(f"open('model.txt', 'a').write('-{i}')")
        assert [f.read_file("model.txt") for f in forks] == [b"v1-0", b"v1-1"]
    finally:
        for fork in forks:
            fork.close()
    with pytest.raises(tandem_client.NotFound) as missing:
        client.session("local", from_snapshot="snap_missing")
    assert "snap_missing" in missing.value.message
    assert client.remove_snapshot(snap["id"])["id"] == snap["id"]
    with pytest.raises(tandem_client.NotFound):
        client.snapshot(snap["id"])


def test_kept_globals_last_through_a_snapshot_and_a_pause(model: ScriptedModel) -> None:
    d = Daemon(model.url, CONFIG + "\n[sessions]\npause_after_secs = 1\n")
    try:
        with d.client() as c:
            with c.session("local", keep_state=True) as s:
                s.run("total = sum(range(10))")
                snap = s.snapshot()
                assert snap["saved"] == ["total"] and snap["state_bytes"] > 0
                deadline = time.monotonic() + 60
                while s.refresh()["state"] != "paused":
                    assert time.monotonic() < deadline, s.info
                    time.sleep(0.2)
                assert s.run("print(total)")["stdout"] == "45\n"
                assert s.refresh()["blocks"] == 2
            with c.session("local", from_snapshot=snap["id"]) as again:
                ran = again.run("print(total * 2)")
                assert ran["stdout"] == "90\n"
                assert "restored from the snapshot: total" in ran["stderr"]
    finally:
        d.stop()


def test_a_volume_outlives_sessions_and_is_not_removed_while_mounted(daemon: Daemon) -> None:
    with daemon.client() as c:
        made = c.create_volume("pydata")
        assert made["name"] == "pydata" and made["mounted_by"] == 0
        with c.session("local", volumes=[{"name": "pydata", "path": "data"}]) as s:
            s.run("open('data/kept.txt', 'w').write('from python')")
            with pytest.raises(tandem_client.TandemError) as held:
                c.remove_volume("pydata")
            assert held.value.status == 409 and "mounted by 1" in str(held.value)
        with c.session("local", volumes=[{"name": "pydata", "path": "in", "read_only": True}]) as s:
            ran = s.run("print(open('in/kept.txt').read())")
            assert ran["stdout"] == "from python\n"
        assert [v["name"] for v in c.volumes()] == ["pydata"]
        c.remove_volume("pydata")
        with pytest.raises(tandem_client.TandemError) as gone:
            c.volume("pydata")
        assert gone.value.status == 404 and "no volume `pydata`" in str(gone.value)


async def test_the_async_client_makes_and_removes_volumes(daemon: Daemon) -> None:
    async with AsyncClient(daemon.host) as client:
        await client.create_volume("asyncdata")
        s = await client.session("local", volumes=[{"name": "asyncdata", "path": "v"}])
        try:
            await s.run("open('v/a.txt', 'w').write('async')")
        finally:
            await s.close()
        assert (await client.volume("asyncdata"))["mounted_by"] == 0
        await client.remove_volume("asyncdata")
        assert await client.volumes() == []


async def test_the_async_client_takes_and_forks_snapshots(daemon: Daemon) -> None:
    async with AsyncClient(daemon.host) as client:
        s = await client.session("local")
        try:
            await s.run("open('a.txt', 'w').write('async')")
            snap = await s.snapshot()
        finally:
            await s.close()
        forks = await client.fork(snap["id"], 1, executor="local")
        try:
            assert await forks[0].read_file("a.txt") == b"async"
        finally:
            await forks[0].close()
        assert snap["id"] in [x["id"] for x in await client.snapshots()]
        await client.remove_snapshot(snap["id"])


# The block waits (up to a minute) until this process says it has seen the first line:
# it ends well only if the line reached the caller while the block still ran. No timing.
WAIT_UNTIL_SEEN = """import sys, time, tandem_tools
print('first', flush=True)
deadline = time.time() + 60
while tandem_tools.call('seen') != 'yes' and time.time() < deadline:
    time.sleep(0.05)
print('second' if time.time() < deadline else 'never seen', file=sys.stderr)
"""


def test_output_streams_to_the_caller_as_the_block_writes(client: Client) -> None:
    seen: list[tuple[str, str]] = []

    def was_seen() -> str:
        return "yes" if "".join(t for st, t in seen if st == "stdout") == "first\n" else "no"

    with client.session("local", tools={"seen": was_seen}) as s:
        result = s.run(WAIT_UNTIL_SEEN, on_output=lambda stream, text: seen.append((stream, text)))
    assert result["stdout"] == "first\n" and result["stderr"] == "second\n", result
    # A write may arrive in pieces (an unbuffered print writes its text and its newline
    # apart); joined, each stream is what was written, stdout's before stderr's.
    streams = [stream for stream, _ in seen]
    assert streams == sorted(streams, key=lambda x: x != "stdout"), streams
    assert "".join(t for st, t in seen if st == "stderr") == "second\n"


def pids_in(marker: str) -> list[int]:
    """Host processes whose working directory holds the file `marker`: a sandbox's, seen
    from outside its PID namespace."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cwd" / marker).exists() and "zombie" not in (entry / "status").read_text().lower():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def _gone(marker: str, within: float = 30.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not pids_in(marker):
            return True
        time.sleep(0.1)
    return False


def test_a_block_past_its_timeout_is_killed_in_the_sandbox(client: Client) -> None:
    marker = f"marker-{os.getpid()}-{time.monotonic_ns()}"
    with client.session("local") as s:
        started = time.monotonic()
        result = s.run(f"import time\nopen('{marker}', 'w').write('x')\ntime.sleep(120)", timeout=2)
        assert result["status"] == "timed_out"
        assert time.monotonic() - started < 60
        # Killed where it ran, not only abandoned by the client.
        assert _gone(marker, within=10)
        assert s.run("print('next')")["stdout"] == "next\n"


def test_tools_are_called_from_the_code_and_run_in_this_process(client: Client) -> None:
    calls = []

    def add(a: int, b: int) -> int:
        """Adds two numbers."""
        calls.append((a, b))
        return a + b

    def broken() -> str:
        raise RuntimeError("out of order")

    with client.session("local", tools={"add": add, "broken": broken}) as s:
        assert s.info["tools"] == ["add", "broken"]
        result = s.run(
            "import tandem_tools\nprint(tandem_tools.call('add', a=2, b=3))\n"
            "try:\n    tandem_tools.call('broken')\nexcept tandem_tools.ToolError as e:\n    print('error:', e)\n"
            "try:\n    tandem_tools.call('nosuch')\nexcept tandem_tools.ToolError as e:\n    print('error:', e)\n"
        )
    assert calls == [(2, 3)]
    lines = result["stdout"].splitlines()
    assert lines[0] == "5"
    assert lines[1] == "error: RuntimeError: out of order"
    assert lines[2].startswith("error: no tool `nosuch` in this session")


def test_a_link_the_code_plants_leads_nowhere(client: Client) -> None:
    with client.session("local") as s:
        s.run("import os\nos.symlink('/etc/passwd', 'passwd')\nos.symlink('/', 'root')")
        assert s.files() == []
        for path in ("passwd", "root/etc/passwd", "../../../../etc/passwd"):
            with pytest.raises(tandem_client.NotFound):
                s.read_file(path)


def test_a_second_block_while_one_runs_is_a_conflict(client: Client) -> None:
    import threading

    release = threading.Event()
    # The first block holds the session until the second has been refused: order, not time.
    hold = "import time, tandem_tools\nwhile tandem_tools.call('go') != 'yes':\n    time.sleep(0.05)\nprint('done')"
    with client.session("local", tools={"go": lambda: "yes" if release.is_set() else "no"}) as s:
        first: dict = {}
        t = threading.Thread(target=lambda: first.update(s.run(hold, timeout=120)))
        t.start()
        try:
            deadline = time.monotonic() + 60
            while not client._call("GET", f"/v1/sessions/{s.id}")["busy"]:
                assert time.monotonic() < deadline, "the first block never started"
                time.sleep(0.02)
            with pytest.raises(tandem_client.Conflict) as busy:
                s.run("print(1)")
            assert s.id in busy.value.message
        finally:
            release.set()
            t.join()
        assert first["stdout"] == "done\n"
        assert s.run("print(2)")["stdout"] == "2\n"


async def test_cancelling_the_awaiting_task_kills_the_block(daemon: Daemon) -> None:
    async with AsyncClient(daemon.host) as client:
        s = await client.session("local")
        try:
            running = asyncio.create_task(
                s.run("import time\ntime.sleep(5)\nopen('late', 'w').write('ran on')")
            )
            while not (await client._call("GET", f"/v1/sessions/{s.id}"))["busy"]:
                await asyncio.sleep(0.02)
            running.cancel()
            with pytest.raises(asyncio.CancelledError):
                await running
            await asyncio.sleep(6)
            assert await s.files() == []
            assert (await s.run("print('alive')"))["stdout"] == "alive\n"
        finally:
            await s.close()


async def test_the_async_client_follows_and_waits(daemon: Daemon, model: ScriptedModel) -> None:
    model.script(SIX_BY_SEVEN, "TERMINATE")
    async with AsyncClient(daemon.host) as client:
        task = await client.submit("6*7", executor="local")
        kinds = [e.type async for e in client.follow(task["id"])]
        assert kinds[0] == "task_started" and kinds[-1] == "task_finished"
        assert (await client.wait(task["id"], timeout=60))["stop_reason"] == "terminated"
        assert (await client.exec("print(2)", executor="local"))["stdout"] == "2\n"

        async def double(n: int) -> int:
            return n * 2

        async with await client.session("local", tools={"double": double}) as s:
            assert (await s.run("import tandem_tools\nprint(tandem_tools.double(n=21))"))["stdout"] == "42\n"


def test_a_daemon_that_is_down_is_named(tmp_path: pathlib.Path) -> None:
    with Client(f"unix://{tmp_path}/none.sock") as client:
        with pytest.raises(tandem_client.DaemonUnreachable) as down:
            client.submit("x")
    assert str(tmp_path) in str(down.value) and "tandem serve" in str(down.value)
    with Client(f"tcp://127.0.0.1:{free_port()}") as client:
        started = time.monotonic()
        with pytest.raises(tandem_client.DaemonUnreachable):
            client.exec("print(1)")
        assert time.monotonic() - started < 30


def test_the_wrong_token_is_unauthorized_and_the_right_one_found_as_the_cli_finds_it(model: ScriptedModel) -> None:
    port = free_port()
    token = "t" * 48
    d = Daemon(model.url, CONFIG, env={"TANDEM_TOKEN": token})
    d.stop()
    d.host = f"tcp://127.0.0.1:{port}"
    try:
        d.start("--listen", f"127.0.0.1:{port}")
        with Client(d.host, token="w" * 48) as wrong:
            with pytest.raises(tandem_client.Unauthorized) as refused:
                wrong.executors()
        assert refused.value.status == 401 and "token" in refused.value.message
        old = os.environ.get("TANDEM_TOKEN"), os.environ.get("TANDEM_HOST")
        os.environ["TANDEM_TOKEN"], os.environ["TANDEM_HOST"] = token, d.host
        try:
            with Client() as found:
                assert {e["name"] for e in found.executors()} >= {"local", "docker"}
        finally:
            for name, value in zip(("TANDEM_TOKEN", "TANDEM_HOST"), old):
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    finally:
        d.stop()


@pytest.mark.parametrize("how", ["stop", "kill -9"])
def test_a_sessions_sandbox_is_gone_after_the_daemon_stops_or_dies(model: ScriptedModel, how: str) -> None:
    d = Daemon(model.url, CONFIG)
    try:
        with d.client() as client:
            s = client.session("local", keep_state=True)
            marker = f"kept-{os.getpid()}-{time.monotonic_ns()}"
            s.run(f"open('{marker}', 'w').write('x')")
            assert pids_in(marker), "the kept interpreter is not found"
            if how == "stop":
                d.stop()
                assert _gone(marker), "the kept interpreter outlived the daemon"
                d.start()
            else:
                d.kill()
                d.start()
                assert _gone(marker), "the kept interpreter outlived a restart after kill -9"
            with pytest.raises(tandem_client.NotFound):
                s.run("print(1)")
    finally:
        d.stop()


def test_a_session_with_a_network_reaches_what_it_asked_for_and_its_connections_are_told(model: ScriptedModel) -> None:
    import http.server
    import threading

    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            hits.append(self.path)
            body = b"hello from the host\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # This machine's own address is reached only when a CIDR entry names it.
    entry = f"127.0.0.1/32:{port}"
    d = Daemon(model.url, CONFIG + f'\n[network]\nallow = ["{entry}"]\n')
    try:
        with d.client() as c:
            with pytest.raises(tandem_client.TandemError) as refused:
                c.session(executor="local", network={"allow": ["evil.test"]})
            assert "evil.test" in str(refused.value)
            seen: list[dict] = []
            code = (
                "import os, urllib.request\n"
                "for name in ('NO_PROXY', 'no_proxy'):\n"
                "    os.environ.pop(name, None)\n"
                "via = urllib.request.ProxyHandler({'http': os.environ['HTTP_PROXY']})\n"
                f"print(urllib.request.build_opener(via).open('http://127.0.0.1:{port}/x', timeout=30).read().decode())\n"
            )
            with c.session(executor="local", network={"allow": [entry]}) as s:
                result = s.run(code, on_net=seen.append)
            assert "hello from the host" in result["stdout"], result["stderr"]
            assert hits == ["/x"]
            assert [(n["host"], n["port"], n["verdict"], n["rule"]) for n in seen] == [
                ("127.0.0.1", port, "allowed", entry)
            ]
            # A task asks the same way: its code reaches the host, and its events tell it.
            with pytest.raises(tandem_client.TandemError) as refused:
                c.submit("fetch", executor="local", network={"allow": ["evil.test"]})
            assert "evil.test" in str(refused.value)
            model.script(f"```python\n{code}```", "Fetched. TERMINATE")
            task = c.submit("fetch", executor="local", max_turns=3, network={"allow": [entry]})
            nets = [e.data for e in c.follow(task["id"]) if e.type == "net"]
            record = c.wait(task["id"])
            assert record["stop_reason"] == "terminated", record
            assert hits == ["/x", "/x"]
            assert [(n["host"], n["port"], n["verdict"], n["rule"]) for n in nets] == [
                ("127.0.0.1", port, "allowed", entry)
            ]
    finally:
        d.stop()
        server.shutdown()


SERVE = (
    "import socket, subprocess, sys, time\n"
    "app = 'import http.server\\n"
    "class H(http.server.BaseHTTPRequestHandler):\\n"
    "    def do_GET(self):\\n"
    "        body = (\"served %s, token %s\" % (self.path, self.headers.get(\"Authorization\"))).encode()\\n"
    "        self.send_response(200)\\n"
    "        self.send_header(\"Content-Length\", str(len(body)))\\n"
    "        self.end_headers()\\n"
    "        self.wfile.write(body)\\n"
    "http.server.HTTPServer((\"127.0.0.1\", 8000), H).serve_forever()\\n'\n"
    "open('app.py', 'w').write(app)\n"
    "subprocess.Popen([sys.executable, 'app.py'])\n"
    "for _ in range(400):\n"
    "    try:\n"
    "        socket.create_connection(('127.0.0.1', 8000), timeout=1).close()\n"
    "        break\n"
    "    except OSError:\n"
    "        time.sleep(0.05)\n"
    "print('serving')\n"
)


def test_a_sessions_server_is_listed_and_a_signed_link_opens_it_without_the_token(model: ScriptedModel) -> None:
    import urllib.error
    import urllib.request

    docker_image()
    port = free_port()
    token = "p" * 48
    d = Daemon(model.url, CONFIG, env={"TANDEM_TOKEN": token})
    d.stop()
    d.host = f"tcp://127.0.0.1:{port}"
    try:
        d.start("--listen", f"127.0.0.1:{port}")
        with Client(d.host, token=token) as c:
            with c.session("docker") as s:
                assert s.run(SERVE)["stdout"] == "serving\n"
                listed = s.ports()
                assert listed == [{"port": 8000, "path": f"/v1/sessions/{s.id}/ports/8000/"}]
                base = f"http://127.0.0.1:{port}"
                # Without the token the port is refused; a link opens it, and the server never
                # sees a token.
                with pytest.raises(urllib.error.HTTPError) as refused:
                    urllib.request.urlopen(base + listed[0]["path"], timeout=60)
                assert refused.value.code == 401
                link = s.link(8000, ttl_secs=60)
                assert link["port"] == 8000 and link["expires"] > time.time()
                page = urllib.request.urlopen(base + link["url"] + "hi", timeout=60).read().decode()
                assert page == "served /hi, token None"
                with pytest.raises(tandem_client.InvalidRequest):
                    s.link(0)
            # Closed: the link opens nothing.
            with pytest.raises(urllib.error.HTTPError) as gone:
                urllib.request.urlopen(base + link["url"], timeout=60)
            assert gone.value.code == 404
    finally:
        d.stop()
