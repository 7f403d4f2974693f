"""Kept globals through snapshots and pauses, through the Python client and a real daemon:
the time to snapshot 100 MB of a kept interpreter's globals and to restore them (a new
session's first block), the time of a paused session's first block (its resume) against a
running one's, and what a paused session holds in memory against a running one.

    python python/bench/kept.py [--executor docker] [--mb 100] [--rounds 3]

Memory is what the session's sandboxes hold above what ran before it opened: on Docker, the
sum of `docker stats` of every container, on local the resident memory of the daemon's
descendants. Needs TANDEM_BIN (or `tandem` on PATH), the sandbox image for Docker
(scripts/build-sandbox-image.sh), and the Python environment of scripts/fetch-python-env.sh.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "src"))

from conftest import CONFIG, Daemon, ScriptedModel  # noqa: E402

UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "kB": 1000, "MB": 10**6, "GB": 10**9}


def docker_memory() -> int:
    """Bytes every running container uses now, by `docker stats`."""
    out = subprocess.run(
        ["docker", "stats", "--no-stream", "--format", "{{.MemUsage}}"],
        check=True, capture_output=True, text=True,
    ).stdout
    total = 0
    for line in out.splitlines():
        used = line.split("/")[0].strip()
        for unit in sorted(UNITS, key=len, reverse=True):
            if used.endswith(unit):
                total += int(float(used[: -len(unit)]) * UNITS[unit])
                break
    return total


def tree_memory(root: int) -> int:
    """Resident bytes of `root`'s descendants (not `root` itself)."""
    children: dict[int, list[int]] = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def wait_paused(s, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while s.refresh()["state"] != "paused":
        if time.monotonic() > deadline:
            raise SystemExit(f"session {s.id} never paused: {s.info}")
        time.sleep(0.1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--executor", default="docker")
    ap.add_argument("--mb", type=int, default=100, help="MiB of kept globals")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = ScriptedModel()
    daemon = Daemon(model.url, CONFIG + "\n[sessions]\npause_after_secs = 2\n")
    memory = docker_memory if args.executor == "docker" else (lambda: tree_memory(daemon.proc.pid))
    fill = f"import os\nblob = os.urandom({args.mb} << 20)\nrows = list(range(1000))"
    snaps: list[float] = []
    restores: list[float] = []
    warm: list[float] = []
    resumes: list[float] = []
    base_mem: list[int] = []
    running_mem: list[int] = []
    paused_mem: list[int] = []
    state_bytes = 0
    try:
        with daemon.client() as c:
            for _ in range(args.rounds):
                base_mem.append(memory())
                with c.session(args.executor, keep_state=True) as s:
                    s.run(fill)
                    t = time.perf_counter()
                    s.run("print(len(blob))")
                    warm.append(time.perf_counter() - t)
                    running_mem.append(memory())
                    t = time.perf_counter()
                    snap = s.snapshot()
                    snaps.append(time.perf_counter() - t)
                    state_bytes = snap["state_bytes"]
                    wait_paused(s)
                    time.sleep(1)
                    paused_mem.append(memory())
                    t = time.perf_counter()
                    out = s.run("print(len(blob))")
                    resumes.append(time.perf_counter() - t)
                    assert out["stdout"] == f"{args.mb << 20}\n", out
                t = time.perf_counter()
                with c.session(args.executor, from_snapshot=snap["id"]) as again:
                    out = again.run("print(len(blob))")
                    restores.append(time.perf_counter() - t)
                    assert out["stdout"] == f"{args.mb << 20}\n", out
                c.remove_snapshot(snap["id"])
        per = (100 << 20) / state_bytes
        mib = 1 << 20
        print(f"{args.executor}, {args.mb} MiB of kept globals ({state_bytes / mib:.1f} MiB pickled), {args.rounds} rounds, medians")
        print()
        print("| figure | value | per 100 MB of kept state |")
        print("|---|---|---|")
        print(f"| snapshot of the session (its globals pickled in the sandbox, kept by the daemon) | {statistics.median(snaps) * 1000:.0f} ms | {statistics.median(snaps) * per:.2f} s |")
        print(f"| a new session from it, to its first block's answer (globals loaded) | {statistics.median(restores) * 1000:.0f} ms | {statistics.median(restores) * per:.2f} s |")
        print(f"| a block in the running session | {statistics.median(warm) * 1000:.0f} ms | |")
        print(f"| the first block of the paused session (its resume) | {statistics.median(resumes) * 1000:.0f} ms | |")
        print()
        print("| memory of the session's sandboxes (above what ran before it opened) | bytes | ratio |")
        print("|---|---|---|")
        base = statistics.median(base_mem)
        run = max(statistics.median(running_mem) - base, 1)
        paused = max(statistics.median(paused_mem) - base, 0)
        print(f"| running, holding the globals | {run / mib:.1f} MiB | 1.00 |")
        print(f"| paused | {paused / mib:.1f} MiB | {paused / run:.3f} |")
    finally:
        daemon.stop()


if __name__ == "__main__":
    main()
