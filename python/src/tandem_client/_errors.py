"""Exceptions: each carries the daemon's error code and message, or says why no daemon answered."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class TandemError(Exception):
    """An error answer from the daemon: its HTTP status, error code and message."""

    def __init__(self, code: str, message: str, status: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status


class DaemonUnreachable(TandemError):
    """No daemon answers where the client looked."""

    def __init__(self, host: str, why: str) -> None:
        super().__init__(
            "unreachable",
            f"no Tandem daemon answers at {host} ({why}); start one with `tandem serve`, "
            "or point TANDEM_HOST at a running one",
        )
        self.host = host


class InvalidRequest(TandemError):
    """400 `invalid_request`: the request is malformed or asks for something impossible."""


class NotAllowed(TandemError):
    """400 `not_allowed`: the operator's policy refuses it."""


class Unauthorized(TandemError):
    """401: no token, or the wrong one."""


class NotFound(TandemError):
    """404: no such task, session, file or endpoint."""


class Conflict(TandemError):
    """409: the task's or session's state does not allow it."""


class Gone(TandemError):
    """410: the task's files were removed by the operator's retention."""


class TooMany(TandemError):
    """429: too many of something already; try again later."""


class Unavailable(TandemError):
    """503: the executor, store or model cannot serve now, or the daemon is stopping."""


class SandboxError(TandemError):
    """The sandbox itself failed while a block ran (not the program); its session is closed."""


class TooLarge(TandemError):
    """An answer, file, line or event larger than the client reads: it stopped reading there.
    `what` it was, its `size` in bytes when the daemon said it (else None), and the `cap`."""

    def __init__(self, what: str, size: int | None, cap: int, hint: str) -> None:
        told = f"is {size} bytes, over" if size is not None else "is larger than"
        super().__init__("too_large", f"{what} {told} this client's cap of {cap} bytes ({_mib(cap)}); {hint}")
        self.what = what
        self.size = size
        self.cap = cap


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):g} MiB"


class TaskFailed(TandemError):
    """A task that ended without solving: its stop reason, and the record."""

    def __init__(self, task: Mapping[str, Any]) -> None:
        reason = task.get("stop_reason", "unknown")
        error = task.get("error") or {}
        detail = f": {error.get('message')}" if error.get("message") else ""
        super().__init__("task_failed", f"task {task.get('id')} ended with {reason}{detail}")
        self.task = task
        self.stop_reason = reason


_BY_CODE: dict[str, type[TandemError]] = {
    "invalid_request": InvalidRequest,
    "not_allowed": NotAllowed,
    "unauthorized": Unauthorized,
    "not_found": NotFound,
    "conflict": Conflict,
    "gone": Gone,
    "too_many": TooMany,
    "payload_too_large": InvalidRequest,
    "executor_unavailable": Unavailable,
    "store_unavailable": Unavailable,
    "shutting_down": Unavailable,
    "model_unavailable": Unavailable,
}


def from_answer(status: int, body: bytes) -> TandemError:
    """The exception for an error answer: its code picks the class."""
    import json

    try:
        error = json.loads(body)["error"]
        code, message = str(error["code"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        code = "http_error"
        message = f"HTTP {status}: {body[:200].decode('utf-8', 'replace')}"
    return _BY_CODE.get(code, TandemError)(code, message, status)
