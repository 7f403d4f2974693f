"""TandemExecutor: what smolagents' own remote-executor integration suite asks of an
executor (state across steps, final answers in their patterns, custom final-answer tools,
syntax errors), plus tools called back into this process, timeouts and cleanup, on local and
Docker; and CodeAgent end to end on a scripted model over HTTP."""
from __future__ import annotations

import time

import pytest
from smolagents import CodeAgent, OpenAIServerModel, Tool, tool
from smolagents.default_tools import FinalAnswerTool
from smolagents.monitoring import AgentLogger, LogLevel
from smolagents.utils import AgentError

from tandem_client.smolagents import TandemExecutor

from conftest import Daemon, ScriptedModel, docker_image

LOGGER = AgentLogger(level=LogLevel.OFF)


@pytest.fixture(params=["local", "docker"])
def executor(request: pytest.FixtureRequest, daemon: Daemon):
    if request.param == "docker":
        docker_image()
    ex = TandemExecutor([], LOGGER, executor=request.param, timeout=10, host=daemon.host)
    ex.send_tools({"final_answer": FinalAnswerTool()})
    yield ex
    ex.cleanup()


def test_state_persists_between_steps(executor: TandemExecutor) -> None:
    executor("import math\na = 2")
    out = executor("print(math.sqrt(a * 8))")
    assert out.logs == "4.0\n" and not out.is_final_answer


def test_the_last_expression_is_the_output(executor: TandemExecutor) -> None:
    assert executor("x = 20\nx + 22").output == 42
    assert executor("print('no value')").output is None


@pytest.mark.parametrize(
    "code,expected",
    [
        ("final_answer('This is the final answer')", "This is the final answer"),
        ('final_answer("""This is\na multiline\nfinal answer""")', "This is\na multiline\nfinal answer"),
        ("text = 'final_answer(5)'\nfinal_answer(text)", "final_answer(5)"),
        ("x = 3\nif x > 5:\n    final_answer('big')\nelif x > 1:\n    final_answer('medium')\nelse:\n    final_answer('small')", "medium"),
        ("final_answer({'x': 5, 'items': [1, 2]})", {"x": 5, "items": [1, 2]}),
    ],
)
def test_final_answer_patterns(executor: TandemExecutor, code: str, expected: object) -> None:
    out = executor(code)
    assert out.is_final_answer is True and out.output == expected


def test_a_custom_final_answer_tool_shapes_the_answer(daemon: Daemon) -> None:
    class CustomFinalAnswerTool(FinalAnswerTool):
        inputs = {
            "answer1": {"type": "string", "description": "the first"},
            "answer2": {"type": "string", "description": "the second"},
        }

        def forward(self, answer1: str, answer2: str) -> str:  # type: ignore[override]
            return answer1 + "_CUSTOM_" + answer2

    ex = TandemExecutor([], LOGGER, executor="local", host=daemon.host)
    try:
        ex.send_tools({"final_answer": CustomFinalAnswerTool()})
        out = ex("final_answer(answer1='answer1', answer2='answer2')")
        assert out.is_final_answer and out.output == "answer1_CUSTOM_answer2"
    finally:
        ex.cleanup()


def test_a_syntax_error_is_an_agent_error(executor: TandemExecutor) -> None:
    with pytest.raises(AgentError) as error:
        executor("a = 'unterminated")
    assert "SyntaxError" in str(error.value)
    with pytest.raises(AgentError) as error:
        executor("def f():\n    return 1 / 0\nf()")
    assert "ZeroDivisionError" in str(error.value) and "__tandem" not in str(error.value)


def test_tools_run_in_this_process_called_from_the_sandbox(executor: TandemExecutor) -> None:
    seen = []

    @tool
    def lookup(city: str) -> str:
        """Looks a city's code up.

        Args:
            city: the city
        """
        seen.append(city)
        return {"Paris": "PAR", "Oslo": "OSL"}[city]

    executor.send_tools({"final_answer": FinalAnswerTool(), "lookup": lookup})
    out = executor("codes = [lookup(city=c) for c in ('Paris', 'Oslo')]\nprint(codes)\nfinal_answer('-'.join(codes))")
    assert out.logs == "['PAR', 'OSL']\n" and out.output == "PAR-OSL"
    assert seen == ["Paris", "Oslo"]
    with pytest.raises(AgentError) as failed:
        executor("lookup(city='Nowhere')")
    assert "Nowhere" in str(failed.value)


def test_a_step_past_its_timeout_is_killed(daemon: Daemon) -> None:
    ex = TandemExecutor([], LOGGER, executor="local", timeout=1, host=daemon.host)
    try:
        ex.send_tools({"final_answer": FinalAnswerTool()})
        started = time.monotonic()
        with pytest.raises(AgentError) as late:
            ex("import time\ntime.sleep(30)")
        assert "timeout" in str(late.value) and time.monotonic() - started < 20
    finally:
        ex.cleanup()


def test_cleanup_closes_the_sandbox(daemon: Daemon) -> None:
    ex = TandemExecutor([], LOGGER, executor="local", host=daemon.host)
    session = ex.session.id
    with daemon.client() as c:
        assert session in [s["id"] for s in c.sessions()]
        ex.cleanup()
        assert session not in [s["id"] for s in c.sessions()]


def test_imports_that_are_not_there_are_named(daemon: Daemon) -> None:
    ex = TandemExecutor(["json", "no_such_module_here"], LOGGER, executor="local", host=daemon.host)
    try:
        assert ex.installed_packages == ["json"]
    finally:
        ex.cleanup()


@pytest.mark.parametrize("name", ["local", "docker"])
def test_a_code_agent_solves_a_task_on_a_scripted_model(daemon: Daemon, model: ScriptedModel, name: str) -> None:
    if name == "docker":
        docker_image()

    @tool
    def add(a: int, b: int) -> int:
        """Adds two integers.

        Args:
            a: the first
            b: the second
        """
        return a + b

    model.script(
        "Thought: I add them with the tool.\n<code>\nx = add(a=2, b=3)\nprint(x)\n</code>",
        "Thought: x holds it; I double it.\n<code>\nfinal_answer(x * 2)\n</code>",
    )
    executor = TandemExecutor([], LOGGER, executor=name, host=daemon.host)
    agent = CodeAgent(
        tools=[add],
        model=OpenAIServerModel(model_id="scripted", api_base=model.url, api_key="x"),
        executor=executor,
        max_steps=4,
        verbosity_level=LogLevel.OFF,
    )
    with agent:
        assert agent.run("Add 2 and 3, then double it.") == 10
    # The observation of step one reached the model.
    assert "5" in str(model.requests[-1]["messages"][-1])
    with daemon.client() as c:
        assert executor.session.id not in [s["id"] for s in c.sessions()]
