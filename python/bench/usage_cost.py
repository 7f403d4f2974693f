"""What measuring a block's use of the machine costs, against a `print(1)` block's own time.

    python python/bench/usage_cost.py [--blocks 200] [--repeat 2000]

In one run, against one daemon:

1. the baseline: `print(1)` blocks in an open Docker session and in a local one, through the
   API as a client runs them; the median wall time of each block, as the result reports it;
2. the measuring, each part timed `--repeat` times where it runs:
   - inside the Docker sandbox, the runner's own measuring code (the `Usage` section of
     executors/runner/src/runner.py, read from the repository and run unchanged), taking a
     block's start and end counts;
   - on the host, the reset and read of the container's peak in its cgroup file, as the
     Docker executor does before and after each block (as root, on the daemon's engine);
   - inside a local block's waiter, the `usage()` of executors/local/src/forkserver.py.

It prints each part's median cost and its share of the block it belongs to. Needs TANDEM_BIN
(or `tandem` on PATH), the sandbox image and the Python environment of
scripts/fetch-python-env.sh.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "src"))

import tandem_client  # noqa: E402
from conftest import Daemon, ScriptedModel  # noqa: E402

IMAGE = os.environ.get("TANDEM_DOCKER_IMAGE", "tandem-sandbox:latest")

CONFIG = f"""\
[model]
model = "scripted"

[policy]
executors = ["local", "docker"]

[executors.docker]
image = "{IMAGE}"
pool_size = 0
"""


def section(path: pathlib.Path, start: str, end: str) -> str:
    text = path.read_text()
    a = text.index(start)
    return text[a : text.index(end, a)]


def timed_in_block(session: tandem_client.Session, code: str, call: str, repeat: int) -> float:
    """Median microseconds of `call` run `repeat` times inside a block of `session`."""
    program = (
        "import json, os, resource, time\n"
        f"{code}\n"
        "times = []\n"
        f"for _ in range({repeat}):\n"
        "    t = time.perf_counter_ns()\n"
        f"    {call}\n"
        "    times.append(time.perf_counter_ns() - t)\n"
        "times.sort()\n"
        "print(times[len(times) // 2] / 1000)\n"
    )
    ran = session.run(program)
    if ran["exit_code"] != 0:
        raise SystemExit(f"the measuring code failed in the sandbox: {ran['stderr']}")
    return float(ran["stdout"].strip())


def block_ms(session: tandem_client.Session, blocks: int) -> float:
    times = []
    for _ in range(blocks):
        ran = session.run("print(1)")
        assert ran["stdout"] == "1\n", ran
        times.append(ran["duration_ms"])
    return statistics.median(times)


def host_peak_us(repeat: int) -> float | None:
    """Median microseconds of one reset and one read of a Tandem container's peak file."""
    ids = subprocess.run(
        ["docker", "ps", "-q", "--no-trunc", "--filter", "label=tandem.session"],
        capture_output=True,
        text=True,
    ).stdout.split()
    for cid in ids:
        for path in (
            f"/sys/fs/cgroup/memory/docker/{cid}/memory.max_usage_in_bytes",
            f"/sys/fs/cgroup/system.slice/docker-{cid}.scope/memory.peak",
        ):
            if not os.path.exists(path):
                continue
            reset = b"0\n" if path.endswith("max_usage_in_bytes") else b"reset\n"
            fd = os.open(path, os.O_RDWR)
            try:
                times = []
                for _ in range(repeat):
                    t = time.perf_counter_ns()
                    os.pwrite(fd, reset, 0)
                    int(os.pread(fd, 64, 0))
                    times.append(time.perf_counter_ns() - t)
                return statistics.median(times) / 1000
            finally:
                os.close(fd)
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()
    runner = section(ROOT / "executors/runner/src/runner.py", "# What a block uses:", "def oom_kills():")
    waiter = section(ROOT / "executors/local/src/forkserver.py", "def usage():", "def waiter(")
    model = ScriptedModel()
    daemon = Daemon(model.url, CONFIG)
    rows = []
    try:
        client = tandem_client.Client(daemon.host, timeout=300)
        with client.session("docker") as docker:
            docker_ms = block_ms(docker, args.blocks)
            inside = timed_in_block(docker, runner, "Usage().report()", args.repeat)
            host = host_peak_us(args.repeat)
        with client.session("local") as local:
            local_ms = block_ms(local, args.blocks)
            local_us = timed_in_block(local, waiter, "usage()", args.repeat)
    finally:
        daemon.stop()
    rows.append(("docker", "runner: counts at start and end", inside, docker_ms))
    if host is not None:
        rows.append(("docker", "host: reset and read the peak", host, docker_ms))
        rows.append(("docker", "all of it", inside + host, docker_ms))
    else:
        rows.append(("docker", "host: reset and read the peak", float("nan"), docker_ms))
    rows.append(("local", "waiter: getrusage and I/O counts", local_us, local_ms))
    print(f"the cost of measuring each block, {os.cpu_count()} cores, medians")
    print()
    print("| executor | part | cost µs | print(1) block ms | share |")
    print("|---|---|---|---|---|")
    for executor, part, us, ms in rows:
        print(f"| {executor} | {part} | {us:.1f} | {ms:.0f} | {us / 1000 / ms:.3%} |")


if __name__ == "__main__":
    main()
