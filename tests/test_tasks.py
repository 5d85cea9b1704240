"""Prompt sets (dspec.tasks): MATH500 from MMATH and its answer check."""

from __future__ import annotations

import pytest

from dspec import tasks
from dspec.tasks import Problem, check_math


def test_math500_set_has_answers_and_no_other_sources():
    try:
        items = tasks.math500()
    except ValueError as e:  # the package is optional outside CI
        pytest.skip(str(e))
    assert len(items) == 311
    assert all(p.answer and p.task_id.startswith("math500/") and "\\boxed{}" in p.prompt for p in items)
    assert tasks.prompt_set("math500", 5) == items[:5]


@pytest.mark.parametrize(
    "answer, completion, ok",
    [
        ("9", "It has 9 divisors, so \\boxed{9}.", True),
        ("\\frac{1}{2}", "first \\boxed{3} then \\boxed{\\dfrac{1}{2}}", True),  # the last box counts
        ("\\text{(C)}", "\\boxed{(C)}", True),
        ("x^{2}+1", "\\boxed{x^{2} + 1}", True),
        ("9", "\\boxed{8}", False),
        ("9", "9", False),  # no box
        ("9", "\\boxed{9", False),  # unbalanced
    ],
)
def test_check_math(answer, completion, ok):
    assert check_math(Problem("q", answer), completion) is ok
