"""Tandem's sandboxes as smolagents' code executor:

    from smolagents import CodeAgent
    from tandem_client.smolagents import TandemExecutor
    agent = CodeAgent(tools=[...], model=model, executor=TandemExecutor([], agent_logger, executor="docker"))

The agent's code runs in one kept Tandem interpreter (its variables survive from step to
step). Its tools are not sent into the sandbox as source: each is a stub there that calls
back through Tandem's tools-from-code channel, and the tool itself runs here, in the
agent's process, with whatever it holds (clients, keys, state). `final_answer(...)` ends the
run with its value, passed through the agent's own final-answer tool.
"""
from __future__ import annotations

import base64
import io
import json
import uuid
from typing import Any

from smolagents.local_python_executor import CodeOutput
from smolagents.monitoring import AgentLogger, LogLevel
from smolagents.remote_executors import RemotePythonExecutor
from smolagents.utils import AgentError

from ._client import Client, Session
from ._errors import TooLarge

__all__ = ["TandemExecutor"]

# The one session tool every stub calls through; the client routes by the tool's name.
DISPATCH = "smolagents"

REPORT_MAX_BYTES = 8 * 1024 * 1024
"""Most bytes of a step's report read back (its value as JSON, or a picture as PNG): the
step's code can leave anything at the report's path, so it is read no further than this."""

# Defined once in the interpreter: the final-answer signal, tool stubs, and the step runner
# that keeps the last expression's value (as a notebook shows it) and reports how the step
# ended in a file of the workspace, where no output cap can cut it.
PRELUDE = r'''
import ast as __tandem_ast, json as __tandem_json

class FinalAnswerException(BaseException):
    def __init__(self, args, kwargs):
        super().__init__("final answer")
        self.call = (args, kwargs)

def __tandem_encode(value):
    try:
        return {"json": __tandem_json.loads(__tandem_json.dumps(value))}
    except (TypeError, ValueError):
        pass
    if type(value).__module__.startswith("PIL.") and hasattr(value, "save"):
        import base64, io
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return {"png": base64.b64encode(buf.getvalue()).decode()}
    return {"repr": repr(value), "type": type(value).__name__}

def __tandem_stub(name):
    def call(*args, **kwargs):
        import tandem_tools
        answer = tandem_tools.call(%(dispatch)r, tool=name, args=list(args), kwargs=kwargs)
        return __tandem_json.loads(answer)["value"]
    call.__name__ = name
    return call

def __tandem_step(source, report):
    tree = __tandem_ast.parse(source, "<code>")
    last = None
    if tree.body and isinstance(tree.body[-1], __tandem_ast.Expr):
        last = __tandem_ast.Expression(tree.body.pop().value)
    outcome = {"final": False, "output": None}
    try:
        exec(compile(tree, "<code>", "exec"), globals())
        if last is not None:
            value = eval(compile(last, "<code>", "eval"), globals())
            outcome["output"] = None if value is None else __tandem_encode(value)
    except FinalAnswerException as done:
        args, kwargs = done.call
        outcome = {"final": True, "args": [__tandem_encode(a) for a in args],
                   "kwargs": {k: __tandem_encode(v) for k, v in kwargs.items()}}
    with open(report, "w") as f:
        f.write(__tandem_json.dumps(outcome))
''' % {"dispatch": DISPATCH}


def _decode(encoded: dict[str, Any] | None) -> Any:
    if encoded is None:
        return None
    if "json" in encoded:
        return encoded["json"]
    if "png" in encoded:
        data = base64.b64decode(encoded["png"])
        try:
            from PIL import Image
        except ImportError:
            return data
        image = Image.open(io.BytesIO(data))
        image.load()
        return image
    return encoded["repr"]


class TandemExecutor(RemotePythonExecutor):
    """A smolagents executor on a kept Tandem interpreter.

    Args:
        additional_imports: modules the agent may import; they must be importable in the
            sandbox (nothing is installed: Tandem's sandboxes have no network by default).
        logger: the agent's logger.
        executor: the Tandem executor (local or docker, which keep an interpreter).
        timeout: seconds each step's code may run before it is killed.
        host, token: the daemon, found as `tandem_client.Client` finds it when left out.
        max_report_bytes: most bytes of a step's report read back (8 MiB by default,
            REPORT_MAX_BYTES); a larger one fails the step with an AgentError that says so.
    """

    def __init__(
        self,
        additional_imports: list[str],
        logger: AgentLogger | None = None,
        executor: str | None = None,
        timeout: float = 60.0,
        *,
        host: str | None = None,
        token: str | None = None,
        allow_pickle: bool = False,
        max_report_bytes: int = REPORT_MAX_BYTES,
    ) -> None:
        super().__init__(additional_imports, logger or AgentLogger(level=LogLevel.OFF), allow_pickle)
        self.timeout = timeout
        self.max_report_bytes = max_report_bytes
        self.tools: dict[str, Any] = {}
        self.client = Client(host, token)
        self._report = f".smolagents-step-{uuid.uuid4().hex[:12]}.json"
        self.session: Session = self.client.session(executor, keep_state=True, tools={DISPATCH: self._dispatch})
        result = self.session.run(PRELUDE, timeout=self.timeout)
        if result.get("exit_code") != 0:
            raise AgentError(f"the Tandem interpreter did not start: {result['stderr']}", self.logger)
        self.installed_packages = self.install_packages(additional_imports)

    def _dispatch(self, tool: str, args: list[Any], kwargs: dict[str, Any]) -> str:
        if tool not in self.tools:
            raise KeyError(f"no tool `{tool}`; the agent's tools are {sorted(self.tools)}")
        value = self.tools[tool](*args, **kwargs)
        return json.dumps({"value": value}, default=str)

    def install_packages(self, additional_imports: list[str]) -> list[str]:
        """Checks that the modules import in the sandbox (nothing is installed there)."""
        modules = [m for m in additional_imports if m and m != "*"]
        if not modules:
            return []
        probe = (
            "import importlib.util, json\n"
            f"print(json.dumps([m for m in {modules!r} if importlib.util.find_spec(m.split('.')[0]) is None]))"
        )
        result = self.session.run(probe, timeout=self.timeout)
        missing = json.loads(result["stdout"]) if result.get("exit_code") == 0 else modules
        if missing:
            self.logger.log(f"not importable in the Tandem sandbox: {', '.join(missing)}", level=LogLevel.INFO)
        return [m for m in modules if m not in missing]

    def send_tools(self, tools: dict[str, Any]) -> None:
        """Makes each tool callable from the code, as a stub that calls back to this process."""
        self.tools = dict(tools)
        names = [name for name in tools if name != "final_answer" and name.isidentifier()]
        code = "\n".join(f"{name} = __tandem_stub({name!r})" for name in names)
        code += "\ndef final_answer(*args, **kwargs):\n    raise FinalAnswerException(args, kwargs)\n"
        self.run_code_raise_errors(code)

    def run_code_raise_errors(self, code: str) -> CodeOutput:
        """Runs one step's code; its output, logs, and whether it gave the final answer."""
        step = f"__tandem_step({code!r}, {self._report!r})"
        result = self.session.run(step, timeout=self.timeout)
        logs = result["stdout"]
        if result["status"] == "timed_out":
            raise AgentError(f"the code ran past its {self.timeout:g} s timeout and was killed\n{logs}", self.logger)
        if result.get("exit_code") != 0:
            raise AgentError(_cut_prelude(result["stderr"]) or f"the code ended with {result['status']}", self.logger)
        try:
            report = self.session.read_file(self._report, max_bytes=self.max_report_bytes)
        except TooLarge as e:
            raise AgentError(
                f"the step's report was not read: {e.message}. Its value is too big to bring back; "
                "keep it in a variable and print a part of it",
                self.logger,
            ) from e
        outcome = json.loads(report)
        if outcome["final"]:
            args = [_decode(a) for a in outcome["args"]]
            kwargs = {k: _decode(v) for k, v in outcome["kwargs"].items()}
            final = self.tools.get("final_answer")
            value = final(*args, **kwargs) if final is not None else (args[0] if args else None)
            return CodeOutput(output=value, logs=logs, is_final_answer=True)
        return CodeOutput(output=_decode(outcome["output"]), logs=logs, is_final_answer=False)

    def cleanup(self) -> None:
        """Closes the session and its sandbox."""
        try:
            self.session.close()
        finally:
            self.client.close()

    def delete(self) -> None:
        """The same as `cleanup`."""
        self.cleanup()


def _cut_prelude(stderr: str) -> str:
    """The traceback from the model's code on: the runner's own frames say nothing to it."""
    lines = stderr.splitlines()
    for i, line in enumerate(lines):
        if 'File "<code>"' in line:
            return "Traceback (most recent call last):\n" + "\n".join(lines[i:])
    return stderr
