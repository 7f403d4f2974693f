"""Baselines for Tandem's value-check evaluation suite (evals/values.toml): the same tasks,
the same model and the same OpenAI-compatible server (llama.cpp's server on loopback) run
by three systems that are not Tandem, to put Tandem's own numbers beside:

  alone       the model alone: one chat request at temperature 0, no code is run;
  autogen     AutoGen 0.7's documented two-agent team: an AssistantAgent (its default system
              message) and a CodeExecutorAgent with a Docker (or local) command-line
              executor, in a RoundRobinGroupChat that ends on TERMINATE or on
              2 * max_turns + 1 messages;
  smolagents  smolagents' CodeAgent with OpenAIServerModel, max_steps = max_turns, and its
              default local Python executor, run in the task's working directory (with
              `open` handed to that executor, which refuses it by default; see
              --smolagents-open).

Every system gets the task text plus the same request to end with a line
`Answer: <value>`; the answer is judged against the suite's hidden value by `judge` below.
For each task it prints one JSON line as the task ends: the answer, whether it is solved,
whether any code output of the run already held the value ("printed"), wall seconds, the
prompt and completion tokens the server reported summed over all model calls, turns or
steps, and the error if the run failed. A totals line ends the run: tasks, solved (count and
percent), seconds and tokens per task, and printed_not_answered (the value was printed by
code but the final answer missed it).

AutoGen's answer is its assistant's last message that is not empty once TERMINATE is
removed; its turns are the assistant's messages, its code outputs the executor agent's
messages, and `teardown_seconds` (inside `seconds`) the executor's stop. smolagents' steps
are its ActionSteps, the extra model call that answers after max_steps included; its code
outputs the steps' observations. `--transcripts DIR` keeps each run's messages or steps.

    python python/bench/peers.py evals/values.toml --base-url http://127.0.0.1:8091/v1 \
        --model qwen2.5-coder-1.5b-instruct --system autogen --split test

Needs the Python environment of scripts/fetch-python-env.sh (httpx, autogen-agentchat,
autogen-ext[docker,openai], smolagents), and for `--autogen-executor docker` (the default)
the sandbox image of scripts/build-sandbox-image.sh.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import traceback
import warnings
from typing import Any

ANSWER_REQUEST = "\n\nEnd your reply with a line `Answer: <value>`."
ALONE_SYSTEM = "You are a helpful assistant."
SMOL_IMPORTS = ["datetime", "csv", "json", "collections", "itertools", "math", "statistics", "re", "calendar"]
SANDBOX_IMAGE = "tandem-sandbox:latest"
AUTOGEN_IMAGE = "tandem-bench-autogen:latest"

# ----------------------------------------------------------------------------- judge ---

# A number: optional minus (not when glued to a word, as in "1-5"), digits with optional
# comma thousands separators, optional decimal part.
# A digit glued to a letter or `_` is part of a name (`x2`, `log10`), as Tandem reads it.
_NUMBER = re.compile(r"(?<![\w.])(?:(?<!\w)-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_ANSWER_LINE = re.compile(r"^answer\s*:", re.IGNORECASE)
_QUOTES = "\"'\u201c\u201d\u2018\u2019 \t."


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _close(got: float, value: float, tolerance: float | None) -> bool:
    if tolerance is not None:
        return abs(got - value) <= tolerance
    if isinstance(value, int):
        return got == value
    return abs(got - value) <= 1e-9 * max(1.0, abs(value))


def _value_line(answer: str) -> str:
    """The line that holds the answer: the text after the colon of the last `Answer:` line,
    else the last non-empty line."""
    lines = answer.replace("TERMINATE", "").splitlines()
    for line in reversed(lines):
        bare = line.lstrip("*#-> \t")
        if _ANSWER_LINE.match(bare):
            return bare.split(":", 1)[1]
    for line in reversed(lines):
        if line.strip():
            return line
    return ""


def _numbers(line: str) -> list[float]:
    line = line.replace("$", "").replace("%", "")
    return [float(m.group(0).replace(",", "")) for m in _NUMBER.finditer(line)]


def _item_matches(item: str, want: Any, tolerance: float | None) -> bool:
    if _is_number(want):
        try:
            got = float(item.replace("$", "").replace("%", "").replace(",", ""))
        except ValueError:
            return False
        return _close(got, want, tolerance)
    return item.casefold() == str(want).casefold()


def judge(answer: str, value: Any, tolerance: float | None = None) -> bool:
    """Whether `answer` states `value` (int, float, string or list) in its value line."""
    line = _value_line(answer).replace("*", "").replace("`", "")
    if isinstance(value, list):
        # As Tandem reads a list: from the first `[` to the last `]`, else the whole line.
        open_at, close_at = line.find("["), line.rfind("]")
        if 0 <= open_at < close_at:
            body = line[open_at + 1 : close_at]
        else:
            body = line.strip()
            if _ANSWER_LINE.match(body):
                body = body.split(":", 1)[1]
        items = [item.strip(_QUOTES) for item in body.split(",")]
        items = [item for item in items if item]
        return len(items) == len(value) and all(
            _item_matches(item, want, tolerance) for item, want in zip(items, value)
        )
    if _is_number(value):
        return any(_close(got, value, tolerance) for got in _numbers(line))
    text = str(value)
    return re.search(r"(?<!\w)" + re.escape(text) + r"(?!\w)", line, re.IGNORECASE) is not None


def printed(outputs: list[str], value: Any, tolerance: float | None = None) -> bool:
    """Whether any line of any code output, judged alone, holds `value`."""
    return any(
        judge(line, value, tolerance)
        for output in outputs
        for line in output.splitlines()
        if line.strip()
    )


# ----------------------------------------------------------------------------- suite ---


def load_suite(path: pathlib.Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    with open(path, "rb") as f:
        data = tomllib.load(f)
    defaults = data.get("defaults", {})
    tasks = data.get("tasks", [])
    for task in tasks:
        task["files"] = [str((path.parent / name).resolve()) for name in task.get("files", [])]
    return defaults, tasks


def make_workdir(task: dict[str, Any]) -> str:
    """A fresh temporary directory holding the task's files under their base names."""
    workdir = tempfile.mkdtemp(prefix=f"peers-{task['id']}-")
    os.chmod(workdir, 0o777)  # the sandbox's user may not be root
    for name in task["files"]:
        dest = os.path.join(workdir, os.path.basename(name))
        shutil.copyfile(name, dest)
        os.chmod(dest, 0o644)
    return workdir


def strip_terminate(text: str) -> str:
    return text.replace("TERMINATE", "").strip()


# ------------------------------------------------------------------------ the systems ---


async def run_alone(task: dict[str, Any], opts: argparse.Namespace) -> dict[str, Any]:
    import httpx

    body = {
        "model": opts.model,
        "temperature": 0,
        "messages": [
            {"role": "system", "content": ALONE_SYSTEM},
            {"role": "user", "content": task["task"] + ANSWER_REQUEST},
        ],
    }
    async with httpx.AsyncClient(timeout=None) as client:
        reply = await client.post(
            opts.base_url.rstrip("/") + "/chat/completions",
            json=body,
            headers={"Authorization": "Bearer none"},
        )
        reply.raise_for_status()
        data = reply.json()
    usage = data.get("usage") or {}
    return {
        "answer": data["choices"][0]["message"].get("content") or "",
        "outputs": None,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", 0),
        "turns": 1,
        "transcript": body["messages"] + [data["choices"][0]["message"]],
    }


async def run_autogen(
    task: dict[str, Any], opts: argparse.Namespace, max_turns: int, timeout: float, partial: dict[str, Any]
) -> dict[str, Any]:
    from autogen_agentchat.agents import AssistantAgent, CodeExecutorAgent
    from autogen_agentchat.conditions import MaxMessageTermination, TextMentionTermination
    from autogen_agentchat.teams import RoundRobinGroupChat
    from autogen_core import CancellationToken
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    workdir = make_workdir(task)
    model_client = OpenAIChatCompletionClient(
        model=opts.model,
        base_url=opts.base_url,
        api_key="none",
        temperature=0,
        model_info={
            "vision": False,
            "function_calling": False,
            "json_output": False,
            "family": "unknown",
            "structured_output": False,
        },
    )
    if opts.autogen_executor == "docker":
        from autogen_ext.code_executors.docker import DockerCommandLineCodeExecutor

        executor: Any = DockerCommandLineCodeExecutor(
            image=opts.autogen_image, work_dir=workdir, timeout=opts.block_timeout
        )
    else:
        from autogen_ext.code_executors.local import LocalCommandLineCodeExecutor

        executor = LocalCommandLineCodeExecutor(work_dir=workdir, timeout=opts.block_timeout)
    assistant = AssistantAgent("assistant", model_client=model_client)
    # It warns that no approval function is set: code runs unreviewed, as in its docs.
    warnings.filterwarnings("ignore", message="No approval function set for CodeExecutorAgent")
    runner = CodeExecutorAgent("code_executor", code_executor=executor)
    team = RoundRobinGroupChat(
        [assistant, runner],
        termination_condition=TextMentionTermination("TERMINATE") | MaxMessageTermination(2 * max_turns + 1),
    )
    outputs: list[str] = []
    # The timeout cancels through the team's token: cancelling the coroutine alone leaves
    # the team waiting, as it ends, for the model call in flight.
    token = CancellationToken()
    timer = asyncio.get_running_loop().call_later(timeout, token.cancel)
    try:
        await executor.start()
        # Streamed, so that a run cut by the timeout still reports what it got so far.
        async for item in team.run_stream(task=task["task"] + ANSWER_REQUEST, cancellation_token=token):
            if hasattr(item, "messages") and hasattr(item, "stop_reason"):
                partial["stop_reason"] = item.stop_reason
                continue
            content = getattr(item, "content", None)
            partial.setdefault("transcript", []).append({
                "source": getattr(item, "source", None),
                "type": type(item).__name__,
                "content": content if isinstance(content, str) else repr(content),
            })
            usage = getattr(item, "models_usage", None)
            if usage is not None:
                partial["prompt_tokens"] = partial.get("prompt_tokens", 0) + usage.prompt_tokens
                partial["completion_tokens"] = partial.get("completion_tokens", 0) + usage.completion_tokens
            if not isinstance(content, str):
                continue
            if item.source == "assistant" and type(item).__name__ == "TextMessage":
                partial["turns"] = partial.get("turns", 0) + 1
                if strip_terminate(content):
                    partial["answer"] = strip_terminate(content)
            elif item.source == "code_executor" and type(item).__name__ == "TextMessage":
                outputs.append(content)
                partial["outputs"] = outputs
    except asyncio.CancelledError:
        if not token.is_cancelled():
            raise
        raise asyncio.TimeoutError from None
    finally:
        timer.cancel()
        stopping = time.monotonic()
        try:
            await executor.stop()
        finally:
            # Part of `seconds`: the Docker container takes 10 s to stop (its shell
            # ignores SIGTERM and docker waits for its grace period).
            partial["teardown_seconds"] = round(time.monotonic() - stopping, 2)
            await model_client.close()
            shutil.rmtree(workdir, ignore_errors=True)
    return {
        "answer": partial.get("answer", ""),
        "outputs": outputs,
        "prompt_tokens": partial.get("prompt_tokens", 0),
        "completion_tokens": partial.get("completion_tokens", 0),
        "turns": partial.get("turns", 0),
        "stop_reason": partial.get("stop_reason"),
        "transcript": partial.get("transcript", []),
    }


def _smolagents_summary(agent: Any) -> dict[str, Any]:
    """What a smolagents run has got so far, from its memory's steps."""
    from smolagents.memory import ActionStep

    steps = [s for s in agent.memory.steps if isinstance(s, ActionStep)]
    # Every model call's usage is on its step (the call that gives an answer after
    # max_steps too, which is an ActionStep of its own).
    usages = [s.token_usage for s in agent.memory.steps if getattr(s, "token_usage", None)]
    return {
        "outputs": [s.observations for s in steps if s.observations],
        "prompt_tokens": sum(u.input_tokens for u in usages),
        "completion_tokens": sum(u.output_tokens for u in usages),
        "turns": len(steps),
        "transcript": [
            {
                "step": s.step_number,
                "model_output": s.model_output if isinstance(s.model_output, str) else repr(s.model_output),
                "code_action": s.code_action,
                "observations": s.observations,
                "error": str(s.error) if s.error else None,
            }
            for s in steps
        ],
    }


def _smolagents_child(conn: Any, task: dict[str, Any], opts: dict[str, Any], max_turns: int) -> None:
    """One smolagents run, in a process of its own: the working directory is the
    process's, and a run past its time can be ended. It sends what it has after each
    step ({"partial": ...}), then the result."""
    # Its logs (errors included, at any verbosity) go to stderr: stdout is the JSON lines.
    sys.stdout.flush()
    os.dup2(2, 1)
    try:
        from smolagents import CodeAgent, OpenAIServerModel

        def after_step(step: Any, agent: Any) -> None:
            conn.send({"partial": _smolagents_summary(agent)})

        workdir = make_workdir(task)
        model = OpenAIServerModel(
            model_id=opts["model"], api_base=opts["base_url"], api_key="none", temperature=0
        )
        agent = CodeAgent(
            tools=[],
            model=model,
            max_steps=max_turns,
            additional_authorized_imports=SMOL_IMPORTS,
            verbosity_level=opts["verbosity"],
            step_callbacks=[after_step],
            # Its local executor refuses `open` unless it is handed in: the one way to let
            # the agent read the task's files.
            executor_kwargs={"additional_functions": {"open": open}} if opts["open"] else None,
        )
        os.chdir(workdir)
        error = None
        answer = ""
        try:
            answer = str(agent.run(task["task"] + ANSWER_REQUEST))
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            error = f"{type(exc).__name__}: {exc}"
        finally:
            os.chdir("/")
            shutil.rmtree(workdir, ignore_errors=True)
        conn.send({"answer": answer, "error": error, **_smolagents_summary(agent)})
    except BaseException as exc:  # noqa: BLE001
        conn.send({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
    finally:
        conn.close()


async def run_smolagents(
    task: dict[str, Any], opts: argparse.Namespace, max_turns: int, timeout: float, partial: dict[str, Any]
) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child_opts = {"model": opts.model, "base_url": opts.base_url, "verbosity": opts.verbosity,
                  "open": opts.smolagents_open == "yes"}
    proc = ctx.Process(target=_smolagents_child, args=(send, task, child_opts, max_turns), daemon=True)
    proc.start()
    send.close()
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await asyncio.to_thread(receive.poll, left):
                raise asyncio.TimeoutError
            try:
                message = receive.recv()
            except EOFError:
                raise RuntimeError(f"the smolagents process died (exit code {proc.exitcode})") from None
            if "partial" in message:
                partial.update(message["partial"])
                continue
            break
    finally:
        if proc.is_alive():
            proc.terminate()
        await asyncio.to_thread(proc.join, 5)
        receive.close()
    if "answer" not in message:
        raise RuntimeError(message.get("error", "unknown failure"))
    return message


# ------------------------------------------------------------------------------ runs ---


async def run_task(task: dict[str, Any], opts: argparse.Namespace, defaults: dict[str, Any]) -> dict[str, Any]:
    max_turns = int(defaults.get("max_turns", 4))
    timeout = float(defaults.get("timeout_secs", 600))
    check = task.get("check", {})
    value, tolerance = check.get("value"), check.get("tolerance")
    record: dict[str, Any] = {"id": task["id"], "split": task.get("split"), "system": opts.system}
    partial: dict[str, Any] = {}
    result: dict[str, Any] = {}
    error = None
    start = time.monotonic()
    try:
        if opts.system == "alone":
            result = await asyncio.wait_for(run_alone(task, opts), timeout)
        elif opts.system == "autogen":
            # Its own timeout, through the team's token; this one only if that hangs.
            result = await asyncio.wait_for(run_autogen(task, opts, max_turns, timeout, partial), timeout + 60)
        else:
            result = await run_smolagents(task, opts, max_turns, timeout, partial)
        error = result.get("error")
    except asyncio.TimeoutError:
        error = f"timeout after {timeout:g} s"
    except Exception as exc:  # noqa: BLE001 - one task's failure never stops the run
        error = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - start
    if not result:  # failed: what the run had got so far
        result = {k: partial.get(k) for k in ("answer", "outputs", "prompt_tokens", "completion_tokens", "turns", "transcript")}
        if opts.system != "alone" and result["outputs"] is None:
            result["outputs"] = []
    answer = result.get("answer") or ""
    outputs = result.get("outputs")
    record.update(
        answer=answer,
        solved=judge(answer, value, tolerance) if value is not None else False,
        printed=None if outputs is None else printed(outputs, value, tolerance),
        seconds=round(seconds, 2),
        prompt_tokens=result.get("prompt_tokens") or 0,
        completion_tokens=result.get("completion_tokens") or 0,
        turns=result.get("turns") or 0,
        error=error,
    )
    if result.get("stop_reason"):
        record["stop_reason"] = result["stop_reason"]
    if "teardown_seconds" in partial:
        record["teardown_seconds"] = partial["teardown_seconds"]
    if opts.transcripts:
        path = pathlib.Path(opts.transcripts, f"{opts.system}-{task['id']}.json")
        path.write_text(json.dumps({**record, "transcript": result.get("transcript") or []}, indent=1))
    return record


def totals(records: list[dict[str, Any]], system: str) -> dict[str, Any]:
    n = len(records)
    solved = sum(1 for r in records if r["solved"])

    def per_task(key: str) -> float:
        return round(sum(r[key] for r in records) / n, 2) if n else 0.0

    return {
        "totals": True,
        "system": system,
        "tasks": n,
        "solved": solved,
        "solved_pct": round(100.0 * solved / n, 1) if n else 0.0,
        "seconds_per_task": per_task("seconds"),
        "prompt_tokens_per_task": per_task("prompt_tokens"),
        "completion_tokens_per_task": per_task("completion_tokens"),
        "printed_not_answered": sum(1 for r in records if r["printed"] and not r["solved"]),
        "errors": sum(1 for r in records if r["error"]),
    }


def autogen_image(image: str) -> str:
    """The image for AutoGen's Docker executor. It pulls an image it does not find, and
    there is no registry here: say so before the first task instead. It runs a Python
    block as `python FILE`, and the sandbox image has only `python3`: then a local image
    from it with a `python` link, built offline (the one python/bench/executors.py uses)."""
    def run(*args: str) -> bool:
        return subprocess.run(list(args), capture_output=True).returncode == 0

    if not run("docker", "image", "inspect", image):
        sys.exit(f"peers: the image {image} is not here (scripts/build-sandbox-image.sh builds "
                 f"{SANDBOX_IMAGE}); or use --autogen-executor local")
    if run("docker", "run", "--rm", "--entrypoint", "sh", image, "-c", "command -v python"):
        return image
    with tempfile.TemporaryDirectory() as ctx:
        pathlib.Path(ctx, "Dockerfile").write_text(
            f"FROM {image}\nUSER root\nRUN ln -sf /usr/bin/python3 /usr/local/bin/python\n"
        )
        if not run("docker", "build", "-q", "-t", AUTOGEN_IMAGE, ctx):
            sys.exit(f"peers: could not build {AUTOGEN_IMAGE} from {image}")
    print(f"peers: {image} has no `python`; AutoGen runs in {AUTOGEN_IMAGE} (it, plus a python link)",
          file=sys.stderr)
    return AUTOGEN_IMAGE


async def main_async(opts: argparse.Namespace) -> None:
    defaults, tasks = load_suite(pathlib.Path(opts.suite))
    if opts.split:
        tasks = [t for t in tasks if t.get("split") == opts.split]
    if opts.only:
        wanted = set(opts.only)
        unknown = wanted - {t["id"] for t in tasks}
        if unknown:
            sys.exit(f"peers: no such task: {', '.join(sorted(unknown))}")
        tasks = [t for t in tasks if t["id"] in wanted]
    opts.block_timeout = int(defaults.get("block_timeout_secs", 60))
    if opts.system == "autogen" and opts.autogen_executor == "docker":
        opts.autogen_image = autogen_image(opts.autogen_image)
    if opts.transcripts:
        os.makedirs(opts.transcripts, exist_ok=True)
    out = open(opts.out, "w") if opts.out else None
    records: list[dict[str, Any]] = []
    gate = asyncio.Semaphore(max(1, opts.parallel))

    async def one(task: dict[str, Any]) -> None:
        async with gate:
            record = await run_task(task, opts, defaults)
        records.append(record)
        line = json.dumps(record)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    await asyncio.gather(*(one(t) for t in tasks))
    line = json.dumps(totals(records, opts.system))
    print(line, flush=True)
    if out:
        out.write(line + "\n")
        out.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", help="the suite's TOML file (evals/values.toml)")
    p.add_argument("--base-url", required=True, help="the OpenAI-compatible server, e.g. http://127.0.0.1:8091/v1")
    p.add_argument("--model", required=True, help="the served model id")
    p.add_argument("--system", required=True, choices=["alone", "autogen", "smolagents"])
    p.add_argument("--split", choices=["tune", "test"], help="only the tasks of this split")
    p.add_argument("--only", nargs="+", metavar="ID", help="only these task ids")
    p.add_argument("--parallel", type=int, default=1, help="tasks run at once (default 1)")
    p.add_argument("--out", help="also write the JSON lines to this file")
    p.add_argument("--autogen-executor", choices=["docker", "local"], default="docker",
                   help="AutoGen's code executor (default docker)")
    p.add_argument("--autogen-image", default=SANDBOX_IMAGE,
                   help=f"the image of AutoGen's Docker executor (default {SANDBOX_IMAGE})")
    p.add_argument("--smolagents-open", choices=["yes", "no"], default="yes",
                   help="hand `open` to smolagents' local executor, which refuses it by default, so "
                        "that the task's files can be read (default yes)")
    p.add_argument("--transcripts", metavar="DIR",
                   help="write each task's messages or steps to DIR/SYSTEM-ID.json")
    p.add_argument("--verbosity", type=int, default=0, help="smolagents' verbosity_level (default 0)")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main_async(parse_args()))
