"""docs/python.md's examples run as written, against a real daemon and a scripted model."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, Daemon, ScriptedModel, docker_image

PAGE = (REPO / "docs" / "python.md").read_text()
EXAMPLES = dict(
    (m.group(1), m.group(0)[len("```python\n") : -len("```\n")])
    for m in re.finditer(r"```python\n# example: (\w+)\n.*?\n```\n", PAGE, re.S)
)

CASES = {
    "client": (
        ["Let me check.\n```python\nprint(6 * 7)\n```", "The answer is 42. TERMINATE"],
        ["block printed: 42", "answer: The answer is 42. (terminated, 2 turns)", "exec: 1024", "basket: 1.75", "file: 1.75"],
    ),
    "autogen": (
        [
            "```python\nprint(sum(1 for n in range(2, 1000) if all(n % d for d in range(2, int(n ** 0.5) + 1))))\n```",
            "There are 168 primes below 1000. TERMINATE",
        ],
        ["runner: 168", "coder: There are 168 primes below 1000. TERMINATE", "files: []"],
    ),
    "smolagents": (
        [
            "Thought: I convert both.\n<code>\ntotal = 120 * exchange_rate(currency='USD') + 50 * exchange_rate(currency='GBP')\nfinal_answer(round(total, 2))\n</code>"
        ],
        ["answer: 168.9"],
    ),
}


def test_the_page_has_the_three_examples() -> None:
    assert sorted(EXAMPLES) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_example_runs_as_written(name: str, daemon: Daemon, model: ScriptedModel, tmp_path) -> None:
    docker_image()
    replies, expected = CASES[name]
    model.script(*replies)
    env = {**os.environ, "TANDEM_HOST": daemon.host, "MODEL_BASE_URL": model.url, "MODEL": "scripted", "OPENAI_API_KEY": "x"}
    # From a file, as a person runs it (smolagents' @tool reads its function's source).
    program = tmp_path / f"example_{name}.py"
    program.write_text(EXAMPLES[name])
    run = subprocess.run([sys.executable, str(program)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    for line in expected:
        assert line in lines, f"{line!r} is not in:\n{run.stdout}"
