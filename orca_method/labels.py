"""Answers and step labels (docs/METHOD.md sections 3 and 4).

An intermediate answer ans(y_t) is what the model writes when forced to answer after step t. The
labels compare those answers with the reference (supervised) or with the full-budget answer
(consistent). Equivalence is math-verify's where it can parse both sides, exact match otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

BOXED = "\\boxed{"


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (balanced braces), or None."""
    start = text.rfind(BOXED)
    if start < 0:
        return None
    i, depth = start + len(BOXED), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def extract_forced(continuation: str) -> str | None:
    """The answer written after the answer-forcing suffix (which ends inside `\\boxed{`)."""
    ans = extract_boxed(BOXED + continuation)
    if ans is None:  # no closing brace within the budget: take the first line
        ans = continuation.split("\n", 1)[0].strip() or None
    return ans


def extract_final(text: str) -> str | None:
    """The answer of a complete response: last boxed, else the last non-empty line."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else None


def normalise(ans: str) -> str:
    """The exact-match form of an answer (also the judge's cache key)."""
    return re.sub(r"\s+", "", ans).rstrip(".").lower()


@lru_cache(maxsize=65536)
def equivalent(a: str | None, b: str | None) -> bool:
    """Answer equivalence: math-verify when both parse, exact (whitespace-insensitive) otherwise."""
    if a is None or b is None:
        return False
    if normalise(a) == normalise(b):
        return True
    # deferred: math_verify (~250 ms; the calib extra). Outside the try: a missing install must
    # not pass as "not equivalent".
    from math_verify import parse, verify

    try:
        gold, pred = parse(f"${b}$"), parse(f"${a}$")
        return bool(gold and pred and verify(gold, pred))
    except Exception:  # noqa: BLE001 - math-verify raises many kinds on odd inputs: not equivalent
        return False


def require_math_verify() -> None:
    """Fail before a collection starts if math-verify is missing (it is in the `calib` extra):
    without it no supervised label could be computed."""
    try:
        import math_verify  # noqa: F401 - deferred: math_verify (the calib extra)
    except ImportError:
        raise ValueError("math-verify is not installed; labels need it: "
                         "pip install math-verify (in this project's checkout: "
                         "pip install -e '.[calib]')") from None


def step_labels(answers: Sequence[str | None], target: str | None) -> list[int]:
    """1 where the step's answer is equivalent to `target`."""
    return [int(equivalent(a, target)) for a in answers]


def labelled_steps(n_steps: int, every: int) -> list[int]:
    """0-based steps that get an answer probe: every k-th step and always the last one."""
    if every < 1:
        raise ValueError(f"label_every must be >= 1, got {every}")
    steps = list(range(every - 1, n_steps, every))
    return steps if steps and steps[-1] == n_steps - 1 else steps + [n_steps - 1]


def fill_pessimistic(probed: dict[int, str | None], n_steps: int) -> list[str | None]:
    """Each step takes the answer of the latest probed step at or before it (never a later one)."""
    out: list[str | None] = []
    current: str | None = None
    for t in range(n_steps):
        current = probed.get(t, current)
        out.append(current)
    return out
