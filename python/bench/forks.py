"""Fork of N sessions from one snapshot against opening N empty sessions at once, side by
side in one run, through the Python client and a real daemon: p50 and p95 of the time until
all N answer their first block, alternating which goes first each round.

    python python/bench/forks.py [--executor docker] [--count 4] [--rounds 20] [--mb 10]

Needs TANDEM_BIN (or `tandem` on PATH), the sandbox image for Docker
(scripts/build-sandbox-image.sh), and the Python environment of scripts/fetch-python-env.sh.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import pathlib
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "src"))

from conftest import CONFIG, Daemon, ScriptedModel  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--executor", default="docker")
    ap.add_argument("--count", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--mb", type=int, default=10, help="MiB of files in the snapshot")
    args = ap.parse_args()
    model = ScriptedModel()
    daemon = Daemon(model.url, CONFIG)
    try:
        with daemon.client() as c:
            with c.session(args.executor) as s:
                s.run(
                    "import os\nos.makedirs('data', exist_ok=True)\n"
                    f"for i in range({args.mb}):\n"
                    "    open('data/%03d.bin' % i, 'wb').write(os.urandom(1 << 20))"
                )
                snap = s.snapshot(name="bench")

            def first_block(sessions: list) -> None:
                with concurrent.futures.ThreadPoolExecutor(len(sessions)) as pool:
                    list(pool.map(lambda x: x.run("print(1)"), sessions))
                for x in sessions:
                    x.close()

            def fork() -> float:
                t = time.perf_counter()
                first_block(c.fork(snap["id"], args.count, executor=args.executor))
                return time.perf_counter() - t

            def empty() -> float:
                t = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(args.count) as pool:
                    sessions = list(pool.map(lambda _: c.session(args.executor), range(args.count)))
                first_block(sessions)
                return time.perf_counter() - t

            forks: list[float] = []
            empties: list[float] = []
            for r in range(args.rounds):
                order = [(fork, forks), (empty, empties)]
                if r % 2:
                    order.reverse()
                for f, into in order:
                    into.append(f())
            c.remove_snapshot(snap["id"])
        print(f"{args.count} sessions at once on {args.executor}, {args.rounds} rounds, a snapshot of {args.mb} MiB in {snap['files']} files")
        print()
        print("| figure | p50 | p95 | ratio of p50s |")
        print("|---|---|---|---|")
        print(f"| {args.count} empty sessions opened at once, to every first block's answer | {statistics.median(empties) * 1000:.0f} ms | {pct(empties, 0.95) * 1000:.0f} ms | 1.00 |")
        print(f"| fork of {args.count} from the snapshot, to every first block's answer | {statistics.median(forks) * 1000:.0f} ms | {pct(forks, 0.95) * 1000:.0f} ms | {statistics.median(forks) / statistics.median(empties):.2f} |")
    finally:
        daemon.stop()


if __name__ == "__main__":
    main()
