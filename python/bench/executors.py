"""Side by side in one run: AutoGen's CodeExecutorAgent and smolagents' CodeAgent on a
scripted model, each with its framework's own Docker executor and with Tandem's Docker
executor behind the Tandem-backed one; and one block's latency through the Python client
against `tandem exec`. Prints a table with ratios (median of per-round ratios; rounds
alternate which side goes first).

    python python/bench/executors.py [--rounds 3] [--tasks 8] [--concurrency 4] [--blocks 20]

Needs TANDEM_BIN (or `tandem` on PATH), the sandbox image (scripts/build-sandbox-image.sh),
and the Python environment of scripts/fetch-python-env.sh. It builds two images from the
sandbox image, locally and offline: one with `python` (AutoGen's Docker executor runs
`python FILE`) and one with a Jupyter kernel gateway (smolagents' Docker executor talks to
one), whose packages pip fetches on this host.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Awaitable, Callable

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from conftest import CONFIG, Daemon, ScriptedModel, tandem_bin  # noqa: E402

SANDBOX = os.environ.get("TANDEM_DOCKER_IMAGE", "tandem-sandbox:latest")
AUTOGEN_IMAGE = "tandem-bench-autogen:latest"
SMOL_IMAGE = "tandem-bench-smolagents:latest"


def build_images() -> None:
    """The two comparison images, from the sandbox image, with no registry."""
    with tempfile.TemporaryDirectory() as ctx:
        (pathlib.Path(ctx) / "Dockerfile").write_text(
            f"FROM {SANDBOX}\nUSER root\nRUN ln -sf /usr/bin/python3 /usr/local/bin/python\n"
        )
        subprocess.run(["docker", "build", "-q", "-t", AUTOGEN_IMAGE, ctx], check=True, capture_output=True)
    have = subprocess.run(["docker", "image", "inspect", SMOL_IMAGE], capture_output=True).returncode == 0
    if have:
        return
    with tempfile.TemporaryDirectory() as ctx:
        site = pathlib.Path(ctx) / "site"
        # The image's Python is Debian 12's 3.11: wheels for it, installed into a folder.
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(site),
             "--python-version", "3.11", "--only-binary=:all:", "--platform", "manylinux2014_x86_64",
             "--platform", "manylinux_2_28_x86_64", "--implementation", "cp",
             "jupyter_kernel_gateway", "ipykernel", "jupyter_client", "numpy", "pillow"],
            check=True,
        )
        (pathlib.Path(ctx) / "Dockerfile").write_text(
            f"FROM {SANDBOX}\nUSER root\nCOPY site /opt/jkg\n"
            "ENV PYTHONPATH=/opt/jkg HOME=/tmp JUPYTER_RUNTIME_DIR=/tmp/jupyter PATH=/opt/jkg/bin:$PATH\n"
            "RUN ln -sf /usr/bin/python3 /usr/local/bin/python\n"
            "EXPOSE 8888\n"
            'CMD ["python3", "-m", "kernel_gateway", "--KernelGatewayApp.ip=0.0.0.0", "--KernelGatewayApp.port=8888"]\n'
        )
        subprocess.run(["docker", "build", "-q", "-t", SMOL_IMAGE, ctx], check=True, capture_output=True)


PRIMES = "print(sum(1 for n in range(2, 2000) if all(n % d for d in range(2, int(n ** 0.5) + 1))))"


async def autogen_task(model: ScriptedModel, tandem: bool, host: str) -> None:
    """One task: an executor started for it, CodeExecutorAgent asks the model for code,
    runs it and reflects, and the executor is stopped."""
    from autogen_agentchat.agents import CodeExecutorAgent
    from autogen_ext.code_executors.docker import DockerCommandLineCodeExecutor
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    from tandem_client.autogen import TandemCodeExecutor

    client = OpenAIChatCompletionClient(
        model="scripted", base_url=model.url, api_key="x",
        model_info={"vision": False, "function_calling": False, "json_output": False, "family": "unknown", "structured_output": False},
    )
    executor = (
        TandemCodeExecutor(executor="docker", timeout=60, host=host)
        if tandem
        else DockerCommandLineCodeExecutor(image=AUTOGEN_IMAGE, timeout=60)
    )
    try:
        async with executor:
            agent = CodeExecutorAgent("runner", code_executor=executor, model_client=client)
            result = await agent.run(task="Count the primes below 2000.")
            assert "303" in str([m.content for m in result.messages]), result.messages
    finally:
        await client.close()


def smol_task(model: ScriptedModel, tandem: bool, host: str) -> None:
    from smolagents import CodeAgent, OpenAIServerModel
    from smolagents.monitoring import AgentLogger, LogLevel
    from smolagents.remote_executors import DockerExecutor

    from tandem_client.smolagents import TandemExecutor

    logger = AgentLogger(level=LogLevel.OFF)
    executor = (
        TandemExecutor([], logger, executor="docker", host=host)
        if tandem
        else DockerExecutor([], logger, image_name=SMOL_IMAGE, build_new_image=False, port=free_port())
    )
    agent = CodeAgent(
        tools=[], model=OpenAIServerModel(model_id="scripted", api_base=model.url, api_key="x"),
        executor=executor, max_steps=3, verbosity_level=LogLevel.OFF,
    )
    with agent:
        assert agent.run("Count the primes below 2000.") == 303


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rate(n: int, concurrency: int, one: Callable[[], Awaitable[None]]) -> float:
    async def all_of() -> float:
        gate = asyncio.Semaphore(concurrency)

        async def guarded() -> None:
            async with gate:
                await one()

        started = time.perf_counter()
        await asyncio.gather(*(guarded() for _ in range(n)))
        return n / (time.perf_counter() - started)

    return asyncio.run(all_of())


def side_by_side(name: str, rounds: int, base: Callable[[], float], ours: Callable[[], float]) -> dict:
    ratios, bases, oursides = [], [], []
    for r in range(rounds):
        if r % 2 == 0:
            b, o = base(), ours()
        else:
            o, b = ours(), base()
        bases.append(b)
        oursides.append(o)
        ratios.append(o / b)
        print(f"  {name} round {r + 1}: baseline {b:.3f}, Tandem {o:.3f}, ratio {o / b:.2f}x", flush=True)
    return {"name": name, "base": statistics.median(bases), "ours": statistics.median(oursides), "ratio": statistics.median(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--only", choices=["autogen", "smolagents", "latency"], action="append")
    args = parser.parse_args()
    # AutoGen warns that its agent runs code with no approval function; that is the point here.
    warnings.simplefilter("ignore", UserWarning)
    only = set(args.only or ["autogen", "smolagents", "latency"])
    build_images()
    model = ScriptedModel()
    daemon = Daemon(model.url, CONFIG, env={"TANDEM_DOCKER_IMAGE": SANDBOX})
    rows = []
    try:
        import tandem_client

        if "autogen" in only:
            def ag(tandem: bool) -> float:
                # Per task: the model writes the block, then reflects on its output.
                def one() -> Awaitable[None]:
                    return autogen_task(model, tandem, daemon.host)

                model.script()
                # Tasks run at once: each request is answered by what it asks, not by order.
                model.respond = lambda body: (
                    "There are 303 primes below 2000."
                    if "303" in str(body["messages"][-1])
                    else f"```python\n{PRIMES}\n```"
                )
                return rate(args.tasks, args.concurrency, one)

            rows.append(side_by_side("AutoGen CodeExecutorAgent, tasks/s", args.rounds, lambda: ag(False), lambda: ag(True)))

        if "smolagents" in only:
            def sm(tandem: bool) -> float:
                reply = f"Thought: count.\n<code>\nn = {PRIMES[6:-1]}\nfinal_answer(n)\n</code>"
                model.script(reply)

                async def one() -> None:
                    await asyncio.to_thread(smol_task, model, tandem, daemon.host)

                # One at a time: CodeAgent parses code with `ast` in the agent's process, and
                # CPython 3.11's parser fails when threads parse at once.
                return rate(args.tasks, 1, one)

            rows.append(side_by_side("smolagents CodeAgent, one at a time, tasks/s", args.rounds, lambda: sm(False), lambda: sm(True)))

        if "latency" in only:
            env = {**os.environ, "TANDEM_DOCKER_IMAGE": SANDBOX}
            client = tandem_client.Client(daemon.host)

            def cli() -> float:
                started = time.perf_counter()
                for _ in range(args.blocks):
                    out = subprocess.run(
                        [tandem_bin(), "exec", "-e", "docker", "--lang", "python", "-"],
                        input="print(1)", capture_output=True, text=True, env=env,
                    )
                    assert out.stdout == "1\n", out.stderr
                return (time.perf_counter() - started) / args.blocks * 1000

            def py() -> float:
                started = time.perf_counter()
                for _ in range(args.blocks):
                    assert client.exec("print(1)", executor="docker")["stdout"] == "1\n"
                return (time.perf_counter() - started) / args.blocks * 1000

            rows.append(side_by_side("one block, ms (tandem exec vs Client.exec)", args.rounds, cli, py))

            with client.session("docker") as box:
                def in_session() -> float:
                    started = time.perf_counter()
                    for _ in range(args.blocks):
                        assert box.run("print(1)")["stdout"] == "1\n"
                    return (time.perf_counter() - started) / args.blocks * 1000

                rows.append(side_by_side("one block, ms (tandem exec vs Session.run)", args.rounds, cli, in_session))
            client.close()
    finally:
        daemon.stop()
        model.server.shutdown()
    print()
    print("tasks/s: higher is better, goal Tandem at least 3x; ms: lower is better, goal at most 1.2x")
    print("| measure | baseline | Tandem | Tandem / baseline (median of per-round ratios) |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['name']} | {row['base']:.3f} | {row['ours']:.3f} | {row['ratio']:.2f}x |")


if __name__ == "__main__":
    main()
