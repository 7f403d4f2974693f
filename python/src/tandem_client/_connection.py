"""Where the daemon is, found as the `tandem` CLI finds it: TANDEM_HOST (unix:///path,
/path or tcp://host:port), else the default socket; over TCP, the token from TANDEM_TOKEN
or the daemon's token file."""
from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Connection:
    """How to reach one daemon."""

    host: str
    base_url: str
    socket: str | None
    token: str | None


def state_dir() -> pathlib.Path:
    """The daemon's default state dir: $XDG_STATE_HOME/tandem, else ~/.local/state/tandem."""
    base = os.environ.get("XDG_STATE_HOME") or (
        str(pathlib.Path.home() / ".local" / "state") if os.environ.get("HOME") else None
    )
    if base is None:
        return pathlib.Path("/tmp") / "tandem"
    return pathlib.Path(base) / "tandem"


def default_socket() -> pathlib.Path:
    """$XDG_RUNTIME_DIR/tandem/tandem.sock, else tandem.sock in the state dir."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return pathlib.Path(runtime) / "tandem" / "tandem.sock"
    return state_dir() / "tandem.sock"


def resolve(host: str | None = None, token: str | None = None) -> Connection:
    """The daemon at `host` (or TANDEM_HOST, or the default socket)."""
    host = host or os.environ.get("TANDEM_HOST") or f"unix://{default_socket()}"
    if host.startswith("/"):
        host = f"unix://{host}"
    if host.startswith("unix://"):
        return Connection(host, "http://tandem", host[len("unix://") :], token)
    if host.startswith("tcp://"):
        if token is None:
            token = os.environ.get("TANDEM_TOKEN") or None
        if token is None:
            try:
                token = (state_dir() / "token").read_text().strip() or None
            except OSError:
                token = None
        return Connection(host, f"http://{host[len('tcp://'):]}", None, token)
    if host.startswith(("http://", "https://")):
        if token is None:
            token = os.environ.get("TANDEM_TOKEN") or None
        return Connection(host, host.rstrip("/"), None, token)
    raise ValueError(f"host `{host}` is neither unix:///path (or /path) nor tcp://host:port")
