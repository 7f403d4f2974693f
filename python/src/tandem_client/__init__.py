"""Tandem from Python: a client of the daemon (`tandem serve`), and its sandboxes behind
AutoGen's (`tandem_client.autogen`) and smolagents' (`tandem_client.smolagents`) executors."""
from ._client import MAX_READ_BYTES, AsyncClient, AsyncSession, Client, Event, Session
from ._connection import default_socket
from ._errors import (
    Conflict,
    DaemonUnreachable,
    Gone,
    InvalidRequest,
    NotAllowed,
    NotFound,
    SandboxError,
    TandemError,
    TaskFailed,
    TooLarge,
    TooMany,
    Unauthorized,
    Unavailable,
)
from ._models import BlockResult, FileInfo, SessionInfo, Task, TaskSpec, Upload

__all__ = [
    "MAX_READ_BYTES",
    "AsyncClient",
    "AsyncSession",
    "BlockResult",
    "Client",
    "Conflict",
    "DaemonUnreachable",
    "Event",
    "FileInfo",
    "Gone",
    "InvalidRequest",
    "NotAllowed",
    "NotFound",
    "SandboxError",
    "Session",
    "SessionInfo",
    "TandemError",
    "Task",
    "TaskFailed",
    "TaskSpec",
    "TooLarge",
    "TooMany",
    "Unauthorized",
    "Unavailable",
    "Upload",
    "default_socket",
]
