#!/usr/bin/env python3
"""How often a model follows Tandem's protocol on easy tasks: for each task, `tandem run
--json` with the local executor; a task counts as solved when the run ends with the
termination string (exit 0) and the expected answer appears in a program's output.

    scripts/eval-protocol.py [TANDEM] [-- extra tandem run arguments]

Uses whichever model `tandem` is configured for (the embedded one when no server is named).
Prints one line per task and `solved N/M` at the end.
"""
import json
import subprocess
import sys
import time

TASKS = [
    ("Print the sum of the first 100 prime numbers.", "24133"),
    ("Print the 10th Fibonacci number, where the first two are 1 and 1.", "55"),
    ("How many days are there from 2024-01-01 to 2024-03-01? Compute it with code.", "60"),
    ("Print the factorial of 10.", "3628800"),
    ("Count the vowels (a, e, i, o, u) in the text 'programming language' and print the count.", "7"),
    ("Reverse the string 'tandem' and print it.", "medmat"),
    ("Print the largest prime number below 1000.", "997"),
    ("Print 2 to the power of 64.", "18446744073709551616"),
    ("Print how many words the sentence 'the quick brown fox jumps over the lazy dog' has.", "9"),
    ("Print the sum of the squares of the integers from 1 to 10.", "385"),
]


def main():
    args = sys.argv[1:]
    extra = []
    if "--" in args:
        at = args.index("--")
        args, extra = args[:at], args[at + 1:]
    tandem = args[0] if args else "tandem"
    solved = 0
    for task, answer in TASKS:
        started = time.monotonic()
        run = subprocess.run(
            [tandem, "run", "--json", "--executor", "local", "--max-turns", "4", *extra, task],
            capture_output=True, text=True, timeout=900,
        )
        outputs, turns = [], 0
        for line in run.stdout.splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            msg = event.get("msg", event)
            if msg.get("type") == "exec_result":
                outputs.append(json.dumps(msg.get("result", {})))
            if msg.get("type") == "turn_started":
                turns += 1
        found = any(answer in o for o in outputs)
        ok = run.returncode == 0 and found
        solved += ok
        why = "solved" if ok else f"exit {run.returncode}, answer {'seen' if found else 'not seen'}"
        print(f"{'ok  ' if ok else 'FAIL'} {time.monotonic() - started:5.0f}s {turns} turns  {why}: {task}", flush=True)
    print(f"solved {solved}/{len(TASKS)}")


if __name__ == "__main__":
    main()
