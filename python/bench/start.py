"""Start latency measured the way hosted sandbox services are: through the public API, as a
client would, the time from asking for a sandbox to the first command's output (`print(1)`),
for each sandbox kind, three ways: one after another, staggered, and a burst at once; with
p50, p95, p99, the slowest and the success rate. Beside them, in the same run, the floors on
this machine: `docker run --rm IMAGE python3 -c 'print(1)'`, `docker exec` into a running
container, and the engine starting a burst's worth of containers at once.

    python python/bench/start.py [--kinds docker-warm,docker-cold,local,wasm,kubernetes]
        [--count 100] [--stagger-ms 200] [--burst 40] [--floor-count 20] [--pool 4] [--pool-max 16]
        [--split 0]

Each kind gets a daemon of its own (`docker-warm`: `[executors.docker] pool_size` of
--pool and `pool_max` of --pool-max, the pool let fill to what it aims for before each
series, which after a burst is what the burst grew it to; `docker-cold`: no pool;
`kubernetes`: the tests' stand-in API server, started from TANDEM_FAKE_KUBERNETES, the
`fake-kubernetes` binary of the tandem-tests crate, whose every claimed pod is a container
on the system engine started when it is claimed). Needs
TANDEM_BIN (or `tandem` on PATH), the sandbox image (scripts/build-sandbox-image.sh), the WASM
runtimes (scripts/fetch-wasm-runtimes.sh) and the Python environment of
scripts/fetch-python-env.sh.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import subprocess
import sys
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "src"))

import tandem_client  # noqa: E402
from conftest import Daemon, ScriptedModel  # noqa: E402

IMAGE = os.environ.get("TANDEM_DOCKER_IMAGE", "tandem-sandbox:latest")


def config(kind: str, pool: int, kubernetes: str = "", pool_max: int = 16) -> str:
    pool_size = pool if kind == "docker-warm" else 0
    cluster = f'[executors.kubernetes]\nurl = "{kubernetes}"\nready_timeout_secs = 300\n' if kubernetes else ""
    return f"""\
{cluster}
[model]
model = "scripted"

[policy]
executors = ["local", "docker", "wasm"{', "kubernetes"' if kubernetes else ""}]

[sessions]
max = 400
without_task = 300

[executors.docker]
image = "{IMAGE}"
pool_size = {pool_size}
pool_max = {max(pool_max, pool_size)}
"""


def executor_of(kind: str) -> str:
    return "docker" if kind.startswith("docker") else kind


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))] if xs else float("nan")


class Series:
    """The times of one series, in ms, and its failures."""

    def __init__(self, kind: str, mode: str) -> None:
        self.kind, self.mode = kind, mode
        self.times: list[float] = []
        self.failed: list[str] = []
        self.lock = threading.Lock()

    def add(self, ms: float | None, why: str = "") -> None:
        with self.lock:
            if ms is None:
                self.failed.append(why)
            else:
                self.times.append(ms)

    def row(self) -> str:
        n = len(self.times) + len(self.failed)
        ok = 100.0 * len(self.times) / n if n else 0.0
        t = self.times
        return (
            f"| {self.kind} | {self.mode} | {n} | {ok:.0f}% | {pct(t, 0.5):.0f} | {pct(t, 0.95):.0f} | "
            f"{pct(t, 0.99):.0f} | {max(t) if t else float('nan'):.0f} |"
        )


CLIENTS = threading.local()


def client(host: str) -> tandem_client.Client:
    """This thread's client, made once: a client that asks for many sandboxes keeps one."""
    c = getattr(CLIENTS, "c", None)
    if c is None:
        c = CLIENTS.c = tandem_client.Client(host, timeout=300)
    return c


def one(host: str, executor: str, into: Series, closing: list) -> None:
    """Asks for a sandbox and runs print(1) in it; the time to its output, into `into`."""
    c = client(host)
    t = time.perf_counter()
    try:
        s = c.session(executor)
        ran = s.run("print(1)")
        ms = (time.perf_counter() - t) * 1000
        if ran.get("stdout") != "1\n" or ran.get("exit_code") != 0:
            into.add(None, f"ran {ran!r}")
        else:
            into.add(ms)
        closing.append(s.id)
        s.close()
    except Exception as e:  # a refusal or a failure counts against the success rate
        into.add(None, f"{type(e).__name__}: {e}")


def wait_for_pool(daemon: Daemon, want: int) -> None:
    """Waits until the pool holds as many ready containers as it aims for (at least `want`;
    more after a burst grew it), or 90 s: what the pool has then is what the next series
    finds, as a client arriving after a quiet spell would."""
    c = client(daemon.host)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        pools = [p for e in c.executors() if e.get("name") == "docker" for p in e.get("pools", [])]
        if pools and all(p.get("ready", 0) >= max(want, p.get("target", 0)) for p in pools):
            break
        time.sleep(0.5)
    time.sleep(1)
    for p in pools:
        print(f"  pool on {p.get('host')}: {p.get('ready')} ready of a target of {p.get('target')}", file=sys.stderr)


def series(kind: str, daemon: Daemon, args: argparse.Namespace) -> list[Series]:
    executor = executor_of(kind)
    out = []
    closing: list = []
    # One first, not counted: the image checked, the interpreters found, the pool started.
    one(daemon.host, executor, Series(kind, "warm-up"), closing)

    def settle() -> None:
        if kind == "docker-warm":
            wait_for_pool(daemon, args.pool)
        else:
            time.sleep(1)

    if args.count:
        settle()
        seq = Series(kind, f"{args.count} one after another")
        for _ in range(args.count):
            one(daemon.host, executor, seq, closing)
        out.append(seq)

        settle()
        stag = Series(kind, f"{args.count} staggered {args.stagger_ms} ms apart")
        with concurrent.futures.ThreadPoolExecutor(args.count) as pool:
            futures = []
            for _ in range(args.count):
                futures.append(pool.submit(one, daemon.host, executor, stag, closing))
                time.sleep(args.stagger_ms / 1000)
            concurrent.futures.wait(futures)
        out.append(stag)

    for n in args.burst:
        settle()
        burst = Series(kind, f"a burst of {n} at once")
        gate = threading.Barrier(n)

        def at_once() -> None:
            client(daemon.host)
            gate.wait()
            one(daemon.host, executor, burst, closing)

        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            concurrent.futures.wait([pool.submit(at_once) for _ in range(n)])
        out.append(burst)
    return out


def split(kind: str, daemon: Daemon, n: int) -> str:
    """N sandboxes one after another, each opened, run twice and closed: the medians of each
    request, where a sandbox's start spends its time."""
    c = client(daemon.host)
    opens, firsts, seconds = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        s = c.session(executor_of(kind))
        t1 = time.perf_counter()
        s.run("print(1)")
        t2 = time.perf_counter()
        s.run("print(1)")
        t3 = time.perf_counter()
        s.close()
        opens.append((t1 - t0) * 1000)
        firsts.append((t2 - t1) * 1000)
        seconds.append((t3 - t2) * 1000)
    return (
        f"| {kind} | {n} | {pct(opens, 0.5):.1f} | {pct(firsts, 0.5):.1f} | {pct(seconds, 0.5):.1f} |"
    )


def timed(cmd: list[str]) -> float | None:
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    ms = (time.perf_counter() - t) * 1000
    return ms if done.returncode == 0 and done.stdout == "1\n" else None


def floors(args: argparse.Namespace) -> list[Series]:
    out = []
    run = Series("floor: docker run --rm", f"{args.floor_count} one after another")
    for _ in range(args.floor_count):
        ms = timed(["docker", "run", "--rm", "--network", "none", IMAGE, "python3", "-c", "print(1)"])
        run.add(ms, "docker run failed")
    out.append(run)
    name = subprocess.run(
        ["docker", "run", "-d", "--rm", "--network", "none", IMAGE, "sleep", "600"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        ex = Series("floor: docker exec", f"{args.floor_count} one after another")
        for _ in range(args.floor_count):
            ex.add(timed(["docker", "exec", name, "python3", "-c", "print(1)"]), "docker exec failed")
        out.append(ex)
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)
    for n in args.burst:
        burst = Series("floor: docker run --rm", f"a burst of {n} at once")
        gate = threading.Barrier(n)

        def at_once() -> None:
            gate.wait()
            ms = timed(["docker", "run", "--rm", "--network", "none", IMAGE, "python3", "-c", "print(1)"])
            burst.add(ms, "docker run failed")

        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            concurrent.futures.wait([pool.submit(at_once) for _ in range(n)])
        out.append(burst)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--kinds",
        default=None,
        help="comma-separated; by default docker-warm, docker-cold, local and wasm, and kubernetes when TANDEM_FAKE_KUBERNETES is set",
    )
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--stagger-ms", type=int, default=200)
    ap.add_argument("--burst", default="40", help="burst sizes, comma-separated")
    ap.add_argument("--pool", type=int, default=4, help="pool_size for docker-warm")
    ap.add_argument("--pool-max", type=int, default=16, help="pool_max for docker-warm (the setting's default)")
    ap.add_argument("--floor-count", type=int, default=20)
    ap.add_argument("--no-floors", action="store_true")
    ap.add_argument(
        "--split",
        type=int,
        default=0,
        help="also N sandboxes of each kind one after another, timed by request: open, first block, second block",
    )
    args = ap.parse_args()
    if args.kinds is None:
        args.kinds = "docker-warm,docker-cold,local,wasm"
        if os.environ.get("TANDEM_FAKE_KUBERNETES"):
            args.kinds += ",kubernetes"
    args.burst = [int(b) for b in args.burst.split(",") if b]
    rows: list[Series] = []
    splits: list[str] = []
    model = ScriptedModel()
    for kind in [k for k in args.kinds.split(",") if k]:
        CLIENTS.__dict__.clear()
        cluster = None
        url = ""
        if kind == "kubernetes":
            binary = os.environ.get("TANDEM_FAKE_KUBERNETES")
            if not binary:
                sys.exit("kubernetes: set TANDEM_FAKE_KUBERNETES to the fake-kubernetes binary (cargo build -p tandem-tests --bin fake-kubernetes)")
            cluster = subprocess.Popen([binary], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            url = cluster.stdout.readline().strip()
        daemon = Daemon(model.url, config(kind, args.pool, url, args.pool_max))
        try:
            rows.extend(series(kind, daemon, args))
            if args.split:
                splits.append(split(kind, daemon, args.split))
        finally:
            daemon.stop()
            if cluster is not None:
                cluster.stdin.close()
                cluster.wait(timeout=120)
    if not args.no_floors:
        rows.extend(floors(args))
    print(f"start latency through the API (Python client, HTTP on the daemon's socket), {os.cpu_count()} cores")
    print()
    print("| sandbox | series | n | ok | p50 ms | p95 ms | p99 ms | slowest ms |")
    print("|---|---|---|---|---|---|---|---|")
    for s in rows:
        print(s.row())
    if splits:
        print()
        print("| sandbox | n | open, p50 ms | first block, p50 ms | second block, p50 ms |")
        print("|---|---|---|---|---|")
        for line in splits:
            print(line)
    failed = [(s.kind, s.mode, w) for s in rows for w in s.failed[:3]]
    if failed:
        print()
        for kind, mode, why in failed:
            print(f"failed: {kind}, {mode}: {why[:200]}")


if __name__ == "__main__":
    main()
