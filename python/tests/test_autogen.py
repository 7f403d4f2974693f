"""TandemCodeExecutor: the tests AutoGen's own command-line executors pass
(autogen-ext's tests/code_executors: blocks, timeout, cancellation, errors, lifecycle,
serialization), plus kept state, files and restart, on local and Docker sandboxes; and the
executor unchanged in AutoGen's CodeExecutorAgent and a group chat on a scripted model."""
from __future__ import annotations

import asyncio
import pathlib
import time

import pytest
from autogen_agentchat.agents import AssistantAgent, CodeExecutorAgent
from autogen_agentchat.conditions import TextMentionTermination
from autogen_agentchat.messages import TextMessage
from autogen_agentchat.teams import RoundRobinGroupChat
from autogen_core import CancellationToken
from autogen_core.code_executor import CodeBlock, CodeExecutor
from autogen_ext.models.openai import OpenAIChatCompletionClient

import tandem_client
from tandem_client.autogen import TandemCodeExecutor

from conftest import Daemon, ScriptedModel, docker_image

EXECUTORS = ["local", "docker"]


@pytest.fixture(params=EXECUTORS)
async def executor(request: pytest.FixtureRequest, daemon: Daemon):
    if request.param == "docker":
        docker_image()
    ex = TandemCodeExecutor(executor=request.param, timeout=10, host=daemon.host)
    await ex.start()
    yield ex
    await ex.stop()


async def test_execute_code(executor: TandemCodeExecutor) -> None:
    token = CancellationToken()
    one = await executor.execute_code_blocks([CodeBlock("print('hello world!')", "python")], token)
    assert (one.exit_code, one.output) == (0, "hello world!\n")
    two = await executor.execute_code_blocks(
        [CodeBlock("print('hello world!')", "python"), CodeBlock("print('hello world!')", "python")], token
    )
    assert (two.exit_code, two.output) == (0, "hello world!\n" * 2)
    sh = await executor.execute_code_blocks([CodeBlock("echo 'hello world!'", "bash")], token)
    assert (sh.exit_code, sh.output) == (0, "hello world!\n")
    multi = await executor.execute_code_blocks(
        [CodeBlock("import sys\nfor i in range(3):\n    print(i)\nprint('end', file=sys.stderr)", "python")], token
    )
    assert (multi.exit_code, multi.output) == (0, "0\n1\n2\nend\n")


async def test_a_failing_block_stops_the_rest(executor: TandemCodeExecutor) -> None:
    result = await executor.execute_code_blocks(
        [
            CodeBlock("with open('/nonexistent_dir/test.txt', 'w') as f:\n    f.write('hello')", "python"),
            CodeBlock("open('after.txt', 'w').write('ran')", "python"),
        ],
        CancellationToken(),
    )
    assert result.exit_code != 0 and "No such file or directory" in result.output
    assert [f["path"] for f in await executor.files()] == []


async def test_timeout_is_exit_124_and_the_block_is_killed_in_the_sandbox(daemon: Daemon, request) -> None:
    for name in EXECUTORS:
        async with TandemCodeExecutor(executor=name, timeout=1, host=daemon.host) as ex:
            started = time.monotonic()
            result = await ex.execute_code_blocks(
                [CodeBlock("import time\ntime.sleep(10)\nopen('late.txt', 'w').write('ran on')", "python")],
                CancellationToken(),
            )
            assert result.exit_code == 124 and "Timeout" in result.output
            assert time.monotonic() - started < 9
            await asyncio.sleep(10)
            assert await ex.files() == [], f"{name}: the block outlived its timeout"


async def test_cancellation_kills_the_block(executor: TandemCodeExecutor) -> None:
    token = CancellationToken()
    code = "import time\ntime.sleep(5)\nopen('hello.txt', 'w').write('ran on')"
    coro = executor.execute_code_blocks([CodeBlock(code, "python")], token)
    asyncio.get_running_loop().call_later(2, token.cancel)
    result = await coro
    assert result.exit_code and "Code execution was cancelled" in result.output
    await asyncio.sleep(5)
    assert [f["path"] for f in await executor.files()] == []
    # The session goes on.
    again = await executor.execute_code_blocks([CodeBlock("print('next')", "python")], CancellationToken())
    assert again.output == "next\n"


async def test_a_token_cancelled_before_the_call_runs_nothing(executor: TandemCodeExecutor) -> None:
    token = CancellationToken()
    token.cancel()
    result = await executor.execute_code_blocks([CodeBlock("open('hello.txt', 'w').write('x')", "python")], token)
    assert result.exit_code and "cancelled" in result.output
    assert await executor.files() == []


async def test_files_the_code_writes_are_readable_and_kept_state_survives(daemon: Daemon) -> None:
    for name in EXECUTORS:
        async with TandemCodeExecutor(executor=name, keep_state=True, host=daemon.host) as ex:
            token = CancellationToken()
            await ex.execute_code_blocks([CodeBlock("x = 41\nopen('out.csv', 'w').write('a,b\\n1,2\\n')", "python")], token)
            result = await ex.execute_code_blocks([CodeBlock("print(x + 1)", "python")], token)
            assert result.output == "42\n", name
            assert await ex.read_file("out.csv") == b"a,b\n1,2\n"
            first = ex.session.id
            await ex.restart()
            assert ex.session.id != first
            fresh = await ex.execute_code_blocks([CodeBlock("print('x' in globals())", "python")], token)
            assert fresh.output == "False\n" and await ex.files() == []


async def test_start_stop_and_the_context_manager(daemon: Daemon) -> None:
    ex = TandemCodeExecutor(executor="local", host=daemon.host)
    await ex.start()
    session = ex.session.id
    await ex.stop()
    with daemon.client() as c:
        assert session not in [s["id"] for s in c.sessions()]
    with pytest.raises(RuntimeError, match="not started"):
        await ex.execute_code_blocks([CodeBlock("print(1)", "python")], CancellationToken())
    async with TandemCodeExecutor(executor="local", host=daemon.host) as ex2:
        assert (await ex2.execute_code_blocks([CodeBlock("print(1)", "python")], CancellationToken())).output == "1\n"


def test_serialization_and_an_invalid_timeout() -> None:
    ex = TandemCodeExecutor(executor="docker", timeout=42, keep_state=True, host="unix:///x.sock")
    config = ex.dump_component()
    assert config.provider == "tandem_client.autogen.TandemCodeExecutor"
    loaded = CodeExecutor.load_component(config)
    assert isinstance(loaded, TandemCodeExecutor)
    assert loaded._to_config() == ex._to_config()
    with pytest.raises(ValueError, match="Timeout must be greater than or equal to 1."):
        TandemCodeExecutor(timeout=0)


async def test_an_executor_that_does_not_exist_and_a_daemon_that_is_down_are_named(daemon: Daemon, tmp_path: pathlib.Path) -> None:
    with pytest.raises(tandem_client.TandemError) as unknown:
        await TandemCodeExecutor(executor="nosuch", host=daemon.host).start()
    assert "nosuch" in unknown.value.message
    with pytest.raises(tandem_client.DaemonUnreachable):
        await TandemCodeExecutor(host=f"unix://{tmp_path}/down.sock").start()


async def test_the_code_executor_agent_runs_blocks_unchanged(executor: TandemCodeExecutor) -> None:
    agent = CodeExecutorAgent("runner", code_executor=executor)
    response = await agent.on_messages(
        [TextMessage(content="```python\nprint(6 * 7)\n```", source="user")], CancellationToken()
    )
    assert "42" in response.chat_message.content


def scripted_client(model: ScriptedModel) -> OpenAIChatCompletionClient:
    return OpenAIChatCompletionClient(
        model="scripted",
        base_url=model.url,
        api_key="x",
        model_info={"vision": False, "function_calling": False, "json_output": False, "family": "unknown", "structured_output": False},
    )


async def test_a_group_chat_solves_a_task_with_the_executor(executor: TandemCodeExecutor, model: ScriptedModel) -> None:
    model.script("I will compute it.\n```python\nprint(sum(range(10)))\n```", "The sum is 45. TERMINATE")
    client = scripted_client(model)
    try:
        team = RoundRobinGroupChat(
            [AssistantAgent("coder", model_client=client), CodeExecutorAgent("runner", code_executor=executor)],
            termination_condition=TextMentionTermination("TERMINATE"),
        )
        result = await team.run(task="What is the sum of 0..9? Run code.")
    finally:
        await client.close()
    contents = [str(m.content) for m in result.messages]
    assert any(c.strip() == "45" or "45\n" in c for c in contents[2:3]), contents
    assert "TERMINATE" in contents[-1]
    # The model read the executor's output in its second call.
    assert "45" in str(model.requests[-1]["messages"])
