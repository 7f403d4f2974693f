"""Call the task's tools from code that Tandem runs: tandem_tools.call("name", key=value)
returns the tool's answer as text, or raises ToolError with what went wrong. Each call goes
over a descriptor private to this block (TANDEM_TOOLS_FD) with this session's secret
(TANDEM_TOOLS_TOKEN); there is no socket anyone else can reach, and no network is needed."""
import json
import os
import threading

__all__ = ["call", "ToolError"]

_lock = threading.Lock()
_stream = None


class ToolError(Exception):
    """A call that failed: an unknown tool, bad arguments, a tool that failed or was denied."""


def _channel():
    global _stream
    if _stream is None:
        fd = os.environ.get("TANDEM_TOOLS_FD")
        if fd is None:
            raise ToolError("this block has no tools channel: the task offers no tools, or its executor cannot carry calls")
        _stream = os.fdopen(int(fd), "r+b", buffering=0, closefd=False)
    return _stream


def _read_line(stream):
    # The other end answers one line per call and says nothing else, so nothing past the
    # line can be read here.
    line = bytearray()
    while not line.endswith(b"\n"):
        piece = os.read(stream.fileno(), 1 << 16)
        if not piece:
            raise ToolError("the tools channel closed")
        line += piece
    return bytes(line)


def call(name, arguments=None, **kwargs):
    """Calls tool `name` with `arguments` (a dict) or keyword arguments; returns its answer."""
    args = dict(arguments or {})
    args.update(kwargs)
    request = {"token": os.environ.get("TANDEM_TOOLS_TOKEN", ""), "name": name, "arguments": args}
    data = (json.dumps(request) + "\n").encode()
    with _lock:
        stream = _channel()
        view = memoryview(data)
        while view:
            n = os.write(stream.fileno(), view)
            view = view[n:]
        reply = json.loads(_read_line(stream))
    if reply.get("ok"):
        return reply.get("result", "")
    raise ToolError(reply.get("error", "the call failed"))


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return lambda arguments=None, **kwargs: call(name, arguments, **kwargs)
