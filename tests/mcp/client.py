"""Drives Tandem's MCP server with the official Python MCP SDK, as an agent from outside the
project would, and prints what it saw as one JSON object for the Rust test to check.

    client.py stdio TANDEM_BINARY [ARGS...]    (the server is `TANDEM_BINARY ARGS...`)
    client.py http URL TOKEN
"""
import asyncio
import json
import os
import sys

import httpx2
from mcp import ClientSession, MCPError, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client


def text_of(result):
    return "".join(c.text for c in result.content if getattr(c, "text", None) is not None)


async def call(session, name, args, **kw):
    """A tool's structured result, or the JSON-RPC error it got."""
    try:
        r = await session.call_tool(name, args, read_timeout_seconds=60, **kw)
    except MCPError as e:
        return {"error": str(e)}
    return {"structured": r.structured_content, "text": text_of(r), "is_error": r.is_error}


async def scenario(session):
    seen = {}
    await session.initialize()
    tools = await session.list_tools()
    seen["tools"] = sorted(t.name for t in tools.tools)
    seen["once"] = await call(session, "execute_code", {"language": "python", "code": "print(6 * 7)"})
    seen["write"] = await call(session, "execute_code", {
        "language": "python", "code": "open('kept.txt', 'w').write('still here')",
        "session_id": "s1"})
    seen["read"] = await call(session, "execute_code", {
        "language": "sh", "code": "cat kept.txt", "session_id": "s1"})
    seen["other_session"] = await call(session, "execute_code", {
        "language": "sh", "code": "cat kept.txt", "session_id": "s2"})
    seen["unknown_tool"] = await call(session, "rm_rf", {})
    seen["no_code"] = await call(session, "execute_code", {"language": "python"})
    seen["bad_language"] = await call(session, "execute_code", {"language": "cobol", "code": "x"})
    seen["bad_executor"] = await call(session, "execute_code", {
        "language": "python", "code": "1", "executor": "nope"})
    seen["huge"] = await call(session, "execute_code", {"language": "python", "code": "#" * (2 << 20)})
    # Denied where the daemon's approval policy says so (the daemon's test); run elsewhere.
    seen["denied"] = await call(session, "execute_code", {"language": "sh", "code": "echo DENY_ME"})
    # Over the operator's block timeout cap: refused, with or without a session, as HTTP does.
    seen["over_cap"] = await call(session, "execute_code", {
        "language": "python", "code": "print(1)", "timeout_secs": 1e9})
    seen["over_cap_session"] = await call(session, "execute_code", {
        "language": "python", "code": "print(1)", "timeout_secs": 1e9, "session_id": "s1"})
    progress = []

    async def on_progress(value, total, message):
        progress.append(message)

    seen["task"] = await call(session, "run_task", {"task": "mcp task: print 6 * 7",
                                                    "check": {"expect": "42"}},
                              progress_callback=on_progress)
    seen["progress"] = [json.loads(m)["type"] for m in progress if m]
    resources = await session.list_resources()
    seen["resources"] = [str(r.uri) for r in resources.resources]
    task_id = (seen["task"].get("structured") or {}).get("task_id")
    if task_id:
        contents = await session.read_resource(f"tandem://tasks/{task_id}/transcript")
        seen["transcript"] = contents.contents[0].text
    try:
        await session.read_resource("tandem://tasks/nope/transcript")
        seen["missing_resource"] = "no error"
    except MCPError as e:
        seen["missing_resource"] = str(e)
    seen["repeated"] = await call(session, "run_task", {"task": "mcp task: send the same code again"})
    return seen


async def read_each(session, uris):
    """Reads each resource; what came back, an error's text, or that it hung."""
    await session.initialize()
    seen = {}
    for uri in uris:
        try:
            r = await asyncio.wait_for(session.read_resource(uri), 60)
            body = getattr(r.contents[0], "text", None) or getattr(r.contents[0], "blob", "")
            seen[uri] = "read %d" % len(body)
        except MCPError as e:
            seen[uri] = "error: " + str(e)
        except asyncio.TimeoutError:
            seen[uri] = "hung"
    return seen


async def main():
    mode = sys.argv[1]
    if mode == "read":
        # read URL TOKEN URI...: reads resources over the daemon's endpoint.
        url, token, uris = sys.argv[2], sys.argv[3], sys.argv[4:]
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=120) as http:
            async with streamable_http_client(url, http_client=http) as (read, write):
                async with ClientSession(read, write) as session:
                    seen = await read_each(session, uris)
        print(json.dumps(seen))
        return
    if mode == "stdio":
        # The SDK passes only a few variables to a server unless told; this test's are its
        # configuration (model server, executor).
        params = StdioServerParameters(command=sys.argv[2], args=sys.argv[3:], env=dict(os.environ))
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as session:
                seen = await scenario(session)
    else:
        url, token = sys.argv[2], sys.argv[3]
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with httpx2.AsyncClient(headers=headers, timeout=60) as http:
            async with streamable_http_client(url, http_client=http) as (read, write):
                async with ClientSession(read, write) as session:
                    seen = await scenario(session)
    print(json.dumps(seen))


asyncio.run(main())
