#!/usr/bin/env python3
"""An executor plugin that breaks the protocol in the way its first argument names, for
Tandem's tests of what it does with a bad plugin. With `well` it behaves: every block prints
`ok` and exits 0 at once (the benchmark's no-op plugin).

Modes: well, env (each block prints the plugin's own environment's names), garbage, silent,
wrong-version, wrong-id, crash-once (needs a state file as its second argument), flood,
oversized, ignore-cancel, hang-close.
"""
import json
import os
import subprocess
import sys

mode = sys.argv[1]
state = sys.argv[2] if len(sys.argv) > 2 else None
out = sys.stdout.buffer


def send(message):
    out.write(json.dumps(message).encode() + b"\n")
    out.flush()


def answer(rid, result):
    send({"jsonrpc": "2.0", "id": rid, "result": result})


def output(rid, text, stream="stdout"):
    send({"jsonrpc": "2.0", "method": "session/output",
          "params": {"run": rid, "stream": stream, "text": text}})


if mode == "garbage":
    out.write(b"hello, I am not JSON-RPC\n\x00\xff{]\n")
    out.flush()

for line in sys.stdin.buffer:
    message = json.loads(line)
    rid, method = message.get("id"), message.get("method")
    params = message.get("params") or {}
    if method == "initialize":
        if mode in ("silent", "garbage"):
            continue
        version = 99 if mode == "wrong-version" else 1
        answer(rid, {"protocol_version": version, "languages": ["sh"], "enforces": []})
    elif method == "session/open":
        answer(rid, {"session": "only"})
    elif method == "session/run":
        if mode == "wrong-id":
            answer(rid + 1000, {"status": {"exited": 0}})
        elif mode == "crash-once" and not os.path.exists(state):
            open(state, "w").close()
            output(rid, "about to crash\n")
            sys.stderr.write("misbehaving plugin: crashing on purpose\n")
            sys.stderr.flush()
            os._exit(3)
        elif mode == "flood":
            chunk = "x" * 65536
            for _ in range(800):  # 50 MiB
                output(rid, chunk)
            output(rid, "\nEND\n")
            answer(rid, {"status": {"exited": 0}})
        elif mode == "oversized":
            output(rid, "y" * (20 << 20))
            output(rid, "small\n")
            answer(rid, {"status": {"exited": 0}})
        elif mode == "ignore-cancel":
            # A child in the plugin's process group, which must die with the plugin.
            child = subprocess.Popen(["sleep", "300"])
            output(rid, f"child {child.pid}\n")
            continue
        elif mode == "env":
            output(rid, " ".join(sorted(os.environ)) + "\n")
            answer(rid, {"status": {"exited": 0}})
        else:
            output(rid, "ok\n")
            answer(rid, {"status": {"exited": 0}, "duration_secs": 0.0})
    elif method == "session/close":
        if mode == "hang-close":
            continue
        if rid is not None:
            answer(rid, {})
    elif method == "shutdown":
        answer(rid, {})
