"""Exercises: check() says whether an answer is right, and why.

Every lesson ends with two or three exercises. Each states its question in a markdown cell, leaves
the answer to a variable the learner fills in, and checks it against the value picockpt's own code
computes (a closed form, the planner, or a measurement made in the lesson), never a number typed
into the check:

    answer = 80.8                                        # the learner's answer
    check("A/X of Llama 3 70B at s = 8192", answer, expected=A / X,
          why=f"A = {A:,} bytes (one stored layer) / X = {X:,} bytes (its input)")

prints

    ✓ right: A/X of Llama 3 70B at s = 8192 = 80.75 (your answer: 80.8, within 1%)
      why: A = 10,838,147,072 bytes (one stored layer) / X = 134,217,728 bytes (its input)

or "✗ not yet: ..." with how far the answer is, the expected value and the same reason. A number
is right within `rel` of the expected value (1% unless said otherwise: answers read off a table
are rounded); a whole number that is expected exactly is given rel=0; text is compared without
case or surrounding spaces, or with `same(answer, expected)` when given (two spellings of one
policy). Every check is also recorded in CHECKS, which `python -m picockpt reproduce` and the
tests read: a lesson whose committed answers no longer match its code fails its tests.
"""
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Checked:
    question: str
    answer: object
    expected: object
    right: bool


CHECKS = []  # every check() of this process, in order


def check(question, answer, expected, why, rel=0.01, unit="", same=None):
    """Print whether `answer` is right (see the top of this file); record it in CHECKS."""
    if same is not None:
        right = bool(same(answer, expected))
    elif isinstance(expected, str):
        right = isinstance(answer, str) and answer.strip().lower() == expected.strip().lower()
    elif _number(expected) and _number(answer):
        right = math.isclose(answer, expected, rel_tol=rel, abs_tol=0 if expected else 1e-12)
    else:
        right = answer == expected
    CHECKS.append(Checked(question, answer, expected, right))
    shown, yours = _show(expected, unit), _show(answer, unit)
    if right:
        within = "" if yours == shown or rel == 0 or not _number(expected) else f", within {rel:.0%}"
        print(f"✓ right: {question} = {shown} (your answer: {yours}{within})")
    elif answer is None or answer is Ellipsis:
        print(f"… no answer yet: {question}. Fill in `answer` above and run this cell again.")
        return
    else:
        print(f"✗ not yet: {question}: your answer {yours}{_how_far(answer, expected)}; the code says {shown}")
    print(f"  why: {why}")


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _how_far(answer, expected):
    if not (_number(answer) and _number(expected)) or expected == 0:
        return ""
    change = answer / expected - 1
    return f" is {abs(change):.0%} {'above' if change > 0 else 'below'} it" if abs(change) >= 0.005 else \
        f" is {abs(change):.2%} {'above' if change > 0 else 'below'} it"


def _show(value, unit=""):
    """A number as a reader writes it: 48.06, 0.0269, 2,176, 1.96; text as it is."""
    if isinstance(value, bool) or not _number(value):
        return f"{value}{unit}" if isinstance(value, str) else repr(value)
    if isinstance(value, int) or float(value).is_integer() and abs(value) >= 1000:
        text = f"{int(value):,}"
    elif abs(value) >= 1000:
        text = f"{value:,.1f}"
    else:
        text = f"{value:.4g}"
    return f"{text}{unit}"
