"""Toy reasoning task: guess-and-check solving of A*x + B = C, with think traces.

The traces give ORCA something real to calibrate: one `\\n\\n` paragraph per try, occasional
slips fixed by a "Wait" paragraph, and 0-4 redundant checks after the right try (the
overthinking that early stopping should remove).

CLI (prompts for the calibration job):
    python -m orca_demo.toy.tasks --family in-dist --n 400 --seed 1 --out prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FAMILIES = ("in-dist", "shifted")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
STEP_DELIMITER = "\n\n"
# Appended to a reasoning prefix to read off the current answer (trained on, see train.py).
FORCE_SUFFIX = "\n</think>\nThe answer is \\boxed{"
# A common alternative wording; also trained (at a lower rate) so either works.
ALT_FORCE_SUFFIX = "\n</think>\n\nFinal answer: \\boxed{"

SLIP_RATE = 0.06  # per try: chance of an arithmetic slip, followed by a "Wait" paragraph
MAX_CHECKS = 4

_BOXED_RE = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")
_PRODUCT_RE = re.compile(r"(\d+)\*(\d+) = ")
# A whole trace, or a completion of the served chat template, which opens `<think>` itself
_TRACE_RE = re.compile(
    r"^(?:<think>\n)?(?P<body>.+?)\n</think>\nThe answer is \\boxed\{(?P<answer>-?\d+)\}\.$",
    re.DOTALL,
)
_OPENERS = ("Try x = ", "Wait, ", "Check: ", "Let me verify x = ", "To be sure, plug in x = ")
_VERDICTS = ("Too small.", "Too big.", "That matches.", "Correct.", "Yes, it works.", "It holds.")


@dataclass(frozen=True)
class Problem:
    """One equation `A*x op B = C`; op is '+' in distribution and '-' when shifted."""

    a: int
    b: int
    c: int
    x: int
    family: str

    @property
    def op(self) -> str:
        return "+" if self.family == "in-dist" else "-"

    def value(self, t: int) -> int:
        """Left-hand side at x = t."""
        return self.a * t + self.b if self.op == "+" else self.a * t - self.b

    @property
    def question(self) -> str:
        if self.family == "in-dist":
            return f"Find the integer x with {self.a}*x + {self.b} = {self.c}."
        return f"Solve for x: {self.c} = {self.a}*x - {self.b}."


def make_problem(rng: random.Random, family: str) -> Problem:
    """A in 2..9, x in 1..9, B in 0..20 (shifted: B <= A*x so that C stays >= 0)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    a, x = rng.randint(2, 9), rng.randint(1, 9)
    if family == "in-dist":
        b = rng.randint(0, 20)
        return Problem(a, b, a * x + b, x, family)
    b = rng.randint(0, min(20, a * x))
    return Problem(a, b, a * x - b, x, family)


def _verdict(value: int, target: int) -> str:
    if value < target:
        return "Too small."
    return "Too big." if value > target else "That matches."


def _try_paragraphs(p: Problem, t: int, rng: random.Random) -> list[str]:
    """One try at x = t, product first, restating the target C before the verdict (a first
    model that had to fetch C from the prompt got the arithmetic right but the verdicts wrong);
    with SLIP_RATE a slip plus its "Wait" correction."""
    prod, val = p.a * t, p.value(t)
    head, want = f"{p.a}*{t} = {prod}", f"want {p.c}."
    if rng.random() >= SLIP_RATE:
        return [f"Try x = {t}: {head}, {prod} {p.op} {p.b} = {val}, {want} {_verdict(val, p.c)}"]
    d = rng.choice([-p.a, -2, -1, 1, 2, p.a])
    if rng.random() < 0.5 and prod + d > 0:  # slip in the product
        bad = prod + d
        bad_val = bad + p.b if p.op == "+" else bad - p.b
        slip = f"Try x = {t}: {p.a}*{t} = {bad}, {bad} {p.op} {p.b} = {bad_val}, {want} {_verdict(bad_val, p.c)}"
        fix = f"Wait, {head}, not {bad}. {prod} {p.op} {p.b} = {val}, {want} {_verdict(val, p.c)}"
    else:  # slip in the sum
        bad_val = val + d
        slip = f"Try x = {t}: {head}, {prod} {p.op} {p.b} = {bad_val}, {want} {_verdict(bad_val, p.c)}"
        fix = f"Wait, {head} and {prod} {p.op} {p.b} = {val}, not {bad_val}; {want} {_verdict(val, p.c)}"
    return [slip, fix]


def _check_paragraph(p: Problem, rng: random.Random) -> str:
    """A redundant re-check of the (already found) answer, in one of three wordings."""
    prod, x = p.a * p.x, p.x
    sums = f"{prod} {p.op} {p.b} = {p.c}"
    return rng.choice(
        [
            f"Check: {p.a}*{x} = {prod}, {sums}. Correct.",
            f"Let me verify x = {x} again: {p.a}*{x} = {prod}, {sums}. Yes, it works.",
            f"To be sure, plug in x = {x}: {p.a}*{x} = {prod} and {sums}. It holds.",
        ]
    )


def trace_paragraphs(p: Problem, rng: random.Random) -> list[str]:
    """Tries walking by 1 from a random start within 5 of x, then 0-4 redundant checks."""
    t = rng.randint(max(1, p.x - 5), min(9, p.x + 5))
    step = 1 if t < p.x else -1
    paras: list[str] = []
    while True:
        paras += _try_paragraphs(p, t, rng)
        if t == p.x:
            break
        t += step
    return paras + [_check_paragraph(p, rng) for _ in range(rng.randint(0, MAX_CHECKS))]


def assistant_text(paragraphs: list[str], answer: int) -> str:
    """The full assistant turn (without EOS) for given reasoning paragraphs."""
    body = STEP_DELIMITER.join(paragraphs)
    return f"{THINK_OPEN}\n{body}\n{THINK_CLOSE}\nThe answer is \\boxed{{{answer}}}."


def trace(p: Problem, rng: random.Random) -> str:
    """A complete, correct trace for p (assistant turn without EOS)."""
    return assistant_text(trace_paragraphs(p, rng), p.x)


def paragraph_candidate(paragraph: str) -> int | None:
    """The x value a paragraph tries or checks: the t of its first `A*t = ` product."""
    m = _PRODUCT_RE.search(paragraph)
    return int(m.group(2)) if m else None


def extract_answer(text: str) -> int | None:
    """The integer in the last `\\boxed{...}`, or None. Works on forced continuations too
    when given suffix + continuation (e.g. `"\\boxed{" + "7}"`)."""
    found = _BOXED_RE.findall(text)
    return int(found[-1]) if found else None


def check_answer(text: str, problem: Problem) -> bool:
    """True iff the last boxed answer in text equals the problem's x."""
    return extract_answer(text) == problem.x


@dataclass(frozen=True)
class TraceStats:
    """What the evaluation reports about one generated completion."""

    well_formed: bool
    correct: bool
    paragraphs: int
    redundant: int | None  # paragraphs after the first correct try that matches; None if none


def _paragraph_ok(paragraph: str) -> bool:
    return paragraph.startswith(_OPENERS) and paragraph.endswith(_VERDICTS) and "\n" not in paragraph


def _right_try(paragraph: str, p: Problem) -> bool:
    """A paragraph that tries the true x, computes it right and says so."""
    prod = p.a * p.x
    return (
        paragraph_candidate(paragraph) == p.x
        and f"{p.a}*{p.x} = {prod}" in paragraph
        and f"{prod} {p.op} {p.b} = {p.c}" in paragraph
        and paragraph.endswith("That matches.")
    )


def trace_stats(text: str, problem: Problem) -> TraceStats:
    """Parse a completion: well-formedness, correctness, paragraph and redundant-check counts."""
    m = _TRACE_RE.match(text.strip())
    body = m.group("body") if m else text.split(THINK_CLOSE)[0].removeprefix(THINK_OPEN).strip("\n")
    paras = [s for s in body.split(STEP_DELIMITER) if s.strip()]
    first_right = next((i for i, s in enumerate(paras) if _right_try(s, problem)), None)
    return TraceStats(
        well_formed=bool(m) and all(_paragraph_ok(s) for s in paras),
        correct=check_answer(text, problem),
        paragraphs=len(paras),
        redundant=None if first_right is None else len(paras) - first_right - 1,
    )


def prompt_record(index: int, p: Any, prefix: str = "toy") -> dict:
    """One JSONL row for the calibration job (answer as a string, like math datasets); `p` is
    a problem dataclass with `question`, `x` and `family` (this module's or the long reasoner's)."""
    return {
        "id": f"{prefix}-{p.family}-{index}",
        "messages": [{"role": "user", "content": p.question}],
        "answer": str(p.x),
        "family": p.family,
        "problem": asdict(p),
    }


def write_prompts(path: Path, family: str, n: int, seed: int,
                  make: Callable[[random.Random, str], Any] | None = None, prefix: str = "toy") -> None:
    """Write n fresh problems of one family as JSONL (`make`: another task's make_problem)."""
    rng = random.Random(f"{family}:{seed}")
    make = make or make_problem
    with Path(path).open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(prompt_record(i, make(rng, family), prefix)) + "\n" for i in range(n))


def prompts_main(description: str, families: Sequence[str], n: int,
                 write: Callable[[Path, str, int, int], None]) -> None:
    """The prompts command line of a task module."""
    ap = argparse.ArgumentParser(description=description.split("\n")[0])
    ap.add_argument("--family", choices=families, default="in-dist")
    ap.add_argument("--n", type=int, default=n)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    write(args.out, args.family, args.n, args.seed)


def main() -> None:
    prompts_main(__doc__, FAMILIES, 400, write_prompts)


if __name__ == "__main__":
    main()
