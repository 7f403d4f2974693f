"""Tandem's sandboxes as AutoGen's code executor (autogen-core 0.7):

    from tandem_client.autogen import TandemCodeExecutor
    async with TandemCodeExecutor(executor="docker", timeout=60, keep_state=True) as ex:
        agent = CodeExecutorAgent("runner", code_executor=ex)

Blocks run in one Tandem session that lives as long as the executor (from `start()` to
`stop()`): one workspace, and with `keep_state` one Python interpreter. A block past its
timeout is killed in the sandbox; cancelling AutoGen's token kills the running block.
"""
from __future__ import annotations

import asyncio
from typing import Any

from autogen_core import CancellationToken, Component
from autogen_core.code_executor import CodeBlock, CodeExecutor, CodeResult
from pydantic import BaseModel

from ._client import MAX_READ_BYTES, AsyncClient, AsyncSession
from ._errors import TandemError
from ._models import FileInfo

__all__ = ["TandemCodeExecutor", "TandemCodeExecutorConfig", "TandemCodeResult"]

# What AutoGen's command-line executors answer on a timeout and a cancellation.
TIMEOUT_EXIT = 124
CANCELLED_EXIT = 1


class TandemCodeResult(CodeResult):
    """A CodeResult with where the blocks ran (`session`) and, per block, Tandem's status."""

    def __init__(self, exit_code: int, output: str, session: str, statuses: list[str]) -> None:
        super().__init__(exit_code=exit_code, output=output)
        self.session = session
        self.statuses = statuses


class TandemCodeExecutorConfig(BaseModel):
    """TandemCodeExecutor's settings, as AutoGen's component config keeps them."""

    executor: str | None = None
    timeout: int = 60
    keep_state: bool = False
    host: str | None = None
    idle_timeout: int | None = None


class TandemCodeExecutor(CodeExecutor, Component[TandemCodeExecutorConfig]):
    """Runs AutoGen's code blocks in a Tandem sandbox (local, docker, wasm, kubernetes or a
    plugin, as the daemon's operator offers them).

    Args:
        executor: the Tandem executor to run in; the daemon's default when left out.
        timeout: seconds each block may run before it is killed (at least 1).
        keep_state: Python blocks share one interpreter whose variables survive.
        host: the daemon (unix:///path, /path or tcp://host:port); TANDEM_HOST, else the default socket.
        token: the daemon's token over TCP; TANDEM_TOKEN, else its token file.
        idle_timeout: seconds without a block after which the daemon closes the session.
    """

    component_config_schema = TandemCodeExecutorConfig
    component_provider_override = "tandem_client.autogen.TandemCodeExecutor"

    SUPPORTED_LANGUAGES = ["python", "py", "sh", "bash", "shell", "javascript", "js", "node"]

    def __init__(
        self,
        executor: str | None = None,
        timeout: int = 60,
        keep_state: bool = False,
        *,
        host: str | None = None,
        token: str | None = None,
        idle_timeout: int | None = None,
    ) -> None:
        if timeout < 1:
            raise ValueError("Timeout must be greater than or equal to 1.")
        self._executor = executor
        self._timeout = timeout
        self._keep_state = keep_state
        self._host = host
        self._token = token
        self._idle_timeout = idle_timeout
        self._client: AsyncClient | None = None
        self._session: AsyncSession | None = None
        # One block at a time: a session runs its blocks in order.
        self._lock = asyncio.Lock()

    @property
    def timeout(self) -> int:
        """Seconds each block may run."""
        return self._timeout

    @property
    def session(self) -> AsyncSession:
        """The Tandem session the blocks run in (after `start()`)."""
        if self._session is None:
            raise RuntimeError("the executor is not started: call start() or use `async with`")
        return self._session

    async def start(self) -> None:
        """Opens the session (again is a no-op)."""
        if self._session is not None:
            return
        if self._client is None:
            self._client = AsyncClient(self._host, self._token)
        self._session = await self._client.session(
            self._executor, keep_state=self._keep_state, idle_timeout=self._idle_timeout
        )

    async def stop(self) -> None:
        """Closes the session and its sandbox."""
        session, self._session = self._session, None
        client, self._client = self._client, None
        try:
            if session is not None:
                await session.close()
        finally:
            if client is not None:
                await client.aclose()

    async def restart(self) -> None:
        """A fresh session: a new workspace and, with kept state, a new interpreter."""
        session, self._session = self._session, None
        if session is not None:
            try:
                await session.close()
            except TandemError:
                pass
        await self.start()

    async def execute_code_blocks(
        self, code_blocks: list[CodeBlock], cancellation_token: CancellationToken
    ) -> TandemCodeResult:
        """Runs the blocks in order, stopping at the first that fails; their output joined
        (stdout, then stderr of each). A timeout answers exit 124 and a cancellation exit 1,
        as AutoGen's command-line executors do."""
        if not code_blocks:
            raise ValueError("No code blocks to execute.")
        session = self.session
        outputs: list[str] = []
        statuses: list[str] = []
        exit_code = 0
        async with self._lock:
            for block in code_blocks:
                if cancellation_token.is_cancelled():
                    outputs.append("Code execution was cancelled.")
                    statuses.append("cancelled")
                    exit_code = CANCELLED_EXIT
                    break
                run = asyncio.ensure_future(
                    session.run(block.code, block.language.lower(), timeout=self._timeout)
                )
                cancellation_token.link_future(run)
                try:
                    result = await run
                except asyncio.CancelledError:
                    if not cancellation_token.is_cancelled():
                        raise
                    # AsyncSession.run has killed the block in its sandbox already.
                    outputs.append("Code execution was cancelled.")
                    statuses.append("cancelled")
                    exit_code = CANCELLED_EXIT
                    break
                statuses.append(result["status"])
                outputs.append(result["stdout"] + result["stderr"])
                if result["status"] == "timed_out":
                    outputs.append("\n Timeout")
                    exit_code = TIMEOUT_EXIT
                    break
                if result["status"] == "cancelled":
                    outputs.append("Code execution was cancelled.")
                    exit_code = CANCELLED_EXIT
                    break
                code = result.get("exit_code")
                exit_code = 1 if code is None else code
                if exit_code != 0:
                    break
        return TandemCodeResult(exit_code, "".join(outputs), session.id, statuses)

    async def files(self) -> list[FileInfo]:
        """The files the blocks wrote in the session's workspace."""
        return await self.session.files()

    async def read_file(self, path: str, max_bytes: int = MAX_READ_BYTES) -> bytes:
        """One file of the session's workspace, read up to `max_bytes` (64 MiB by default):
        a larger one raises TooLarge."""
        return await self.session.read_file(path, max_bytes)

    async def put_files(self, files: dict[str, Any]) -> None:
        """Places files in the workspace (path -> bytes, text or a local path)."""
        await self.session.put_files(files)

    def _to_config(self) -> TandemCodeExecutorConfig:
        return TandemCodeExecutorConfig(
            executor=self._executor,
            timeout=self._timeout,
            keep_state=self._keep_state,
            host=self._host,
            idle_timeout=self._idle_timeout,
        )

    @classmethod
    def _from_config(cls, config: TandemCodeExecutorConfig) -> TandemCodeExecutor:
        return cls(
            executor=config.executor,
            timeout=config.timeout,
            keep_state=config.keep_state,
            host=config.host,
            idle_timeout=config.idle_timeout,
        )
