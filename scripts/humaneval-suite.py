#!/usr/bin/env python3
"""A `tandem eval` suite from HumanEval's problems, to measure the loop on the public
benchmark the embedded models are reported on. The problems are not in this repository:
give the path of `HumanEval.jsonl.gz` (from the benchmark's own repository).

    scripts/humaneval-suite.py HumanEval.jsonl.gz [--half odd|even|all] [--max-turns N] > he.toml
    tandem eval he.toml --local --parallel 4 --model MODEL.gguf --json > he.json

Each task asks for the problem's function in a module `solution.py`; its check imports that
module and runs the problem's own tests against the function, in the task's sandbox after
the task ends, where the model never sees them.
"""
import argparse
import gzip
import json


def toml_string(text):
    # A JSON string is a TOML basic string: the same escapes, never `\/` from json.dumps.
    return json.dumps(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("problems", help="HumanEval.jsonl.gz")
    ap.add_argument("--half", choices=["odd", "even", "all"], default="all",
                    help="the problems whose index is odd, even, or all of them")
    ap.add_argument("--max-turns", type=int, default=6)
    args = ap.parse_args()
    opener = gzip.open if args.problems.endswith(".gz") else open
    with opener(args.problems, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    out = [
        "[defaults]",
        'executor = "docker"',
        f"max_turns = {args.max_turns}",
        "timeout_secs = 600",
        "block_timeout_secs = 60",
        "",
    ]
    for i, p in enumerate(problems):
        if (args.half == "odd" and i % 2 != 1) or (args.half == "even" and i % 2 != 0):
            continue
        task = (
            "Write a Python module `solution.py` in the working directory (put `# filename: "
            "solution.py` on the first line of its block) that implements this function, "
            "completed:\n\n```python\n" + p["prompt"].rstrip() + "\n```\n"
        )
        check = (
            "import sys\nsys.path.insert(0, '.')\nfrom solution import *\n"
            + p["test"]
            + "\ncheck(" + p["entry_point"] + ")\n"
        )
        out += [
            "[[tasks]]",
            "id = " + toml_string("he-%03d" % i),
            'split = "test"',
            "task = " + toml_string(task),
            'languages = ["python"]',
            "[tasks.check]",
            "program = " + toml_string(check),
            "",
        ]
    print("\n".join(out))


if __name__ == "__main__":
    main()
