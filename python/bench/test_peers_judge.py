"""The judge of python/bench/peers.py: `pytest python/bench/test_peers_judge.py`."""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from peers import judge, printed  # noqa: E402


def test_answer_line_wins_over_later_lines() -> None:
    text = "I ran it.\nAnswer: 1229\nThat is all, 17 was a guess."
    assert judge(text, 1229, None)
    assert not judge("Answer: 17\nnot 1229", 1229, None)


def test_last_answer_line_counts() -> None:
    assert judge("Answer: 12\nthen I fixed it\nAnswer: 13", 13, None)
    assert not judge("Answer: 12\nthen I fixed it\nAnswer: 13", 12, None)


def test_answer_prefix_is_case_insensitive_and_markdown_is_stripped() -> None:
    assert judge("**Answer:** 1229", 1229, None)
    assert judge("### ANSWER: `1229`", 1229, None)
    assert judge("- answer : 1229", 1229, None)
    assert judge("> Answer: *1229*", 1229, None)


def test_no_answer_line_uses_last_non_empty_line() -> None:
    assert judge("Let me think.\nThe count is 1229.\n\n   \n", 1229, None)
    assert not judge("1229 is my first guess.\nThe count is 1230.", 1229, None)


def test_terminate_is_removed() -> None:
    assert judge("Answer: 1229\nTERMINATE", 1229, None)
    assert judge("The result is 42 TERMINATE", 42, None)
    assert judge("Answer: 42TERMINATE", 42, None)


def test_empty_answer_fails() -> None:
    assert not judge("", 1, None)
    assert not judge("TERMINATE", "x", None)
    assert not judge("", [1], None)


def test_integers_match_exactly() -> None:
    assert judge("Answer: 79357", 79357, None)
    assert judge("Answer: 79357.0", 79357, None)
    assert not judge("Answer: 79357.5", 79357, None)
    assert not judge("Answer: 79358", 79357, None)


def test_any_number_in_the_line_may_match() -> None:
    assert judge("Answer: from 10 numbers, 7 are prime", 7, None)
    assert not judge("Answer: from 10 numbers, 7 are prime", 8, None)


def test_thousands_separators_and_signs() -> None:
    assert judge("Answer: 26,771,144,400", 26771144400, None)
    assert judge("Answer: $1,234.50", 1234.5, None)
    assert judge("Answer: 12.5%", 12.5, None)
    assert judge("Answer: -3", -3, None)
    assert not judge("Answer: -3", 3, None)
    assert judge("Answer: 1,234,567", 1234567, None)


def test_a_hyphen_between_numbers_is_no_minus() -> None:
    assert judge("Answer: 1-5", 5, None)
    assert not judge("Answer: 1-5", -5, None)


def test_float_default_tolerance_is_relative() -> None:
    assert judge("Answer: 0.1", 0.1, None)
    assert judge("Answer: 3.14159265359", 3.14159265359, None)
    assert not judge("Answer: 3.1416", 3.14159265359, None)


def test_explicit_tolerance_is_absolute() -> None:
    assert judge("Answer: 3.1416", 3.14159265359, 0.001)
    assert not judge("Answer: 3.15", 3.14159265359, 0.001)
    assert judge("Answer: 101", 100, 1)
    assert not judge("Answer: 102", 100, 1)


def test_numbers_glued_to_text() -> None:
    assert judge("Answer: 237th", 237, None)
    assert judge("Answer: n=1229.", 1229, None)


def test_string_value_at_word_boundaries() -> None:
    assert judge("Answer: The winner is Alice.", "alice", None)
    assert not judge("Answer: Alicent", "Alice", None)
    assert judge('Answer: "Bob Smith"', "bob smith", None)
    assert judge("Answer: 2024-03-01", "2024-03-01", None)
    assert not judge("Answer: 12024-03-01", "2024-03-01", None)
    assert judge("Answer: it is C++ here", "C++", None)


def test_list_in_brackets() -> None:
    assert judge("Answer: [1, 2, 3]", [1, 2, 3], None)
    assert judge("Answer: ['apple', \"Pear\"]", ["Apple", "pear"], None)
    assert judge("The list is [1.0, 2.5]", [1, 2.5], None)
    assert not judge("Answer: [1, 2]", [1, 2, 3], None)
    assert not judge("Answer: [2, 1, 3]", [1, 2, 3], None)


def test_list_split_on_commas() -> None:
    assert judge("Answer: apple, pear, plum", ["apple", "pear", "plum"], None)
    assert judge("**Answer:** `3, 5, 7`", [3, 5, 7], None)
    assert judge("3, 5, 7", [3, 5, 7], None)
    assert not judge("Answer: apple, pear", ["apple", "pear", "plum"], None)
    assert not judge("Answer: apple pear plum", ["apple", "pear", "plum"], None)


def test_list_numbers_use_the_tolerance() -> None:
    assert judge("Answer: [0.333, 0.667]", [1 / 3, 2 / 3], 0.001)
    assert not judge("Answer: [0.333, 0.667]", [1 / 3, 2 / 3], None)
    assert not judge("Answer: [one, 2]", [1, 2], None)


def test_printed_checks_each_line_alone() -> None:
    outputs = ["primes counted\n1229\n", "done"]
    assert printed(outputs, 1229, None)
    assert not printed(["Answer: 12\nnothing"], 1229, None)
    assert printed(["x\nAnswer: 12\ny"], 12, None)
    assert not printed([], 1, None)
    assert not printed(["", "\n\n"], 1, None)


def test_printed_list_on_one_line() -> None:
    assert printed(["result:\n[3, 5, 7]\n"], [3, 5, 7], None)
    assert not printed(["3\n5\n7"], [3, 5, 7], None)
