"""The long reasoner's task: solve A*x + B = C by walking x one step at a time from a given start.

Each reasoning paragraph (`\\n\\n`-separated) moves x by one and updates the left-hand side by
adding (or subtracting) A, so a trace is as long as the walk: tens to a couple of hundred steps,
~20 tokens each. What makes it a stand-in for real reasoning where early stopping matters:
- the answer becomes right at the step whose value equals C, at a depth set by the problem
  (the distance from the start), widely varying from problem to problem;
- after it, a verification walks back CHECKS steps, numbered so the model can tell when it is
  done: redundant work making up about a third of the steps in distribution (from 60% of the
  shortest traces to 10% of the longest), as "let me double-check" is in real traces;
- slips (a wrong sum) are sometimes followed by a "Wait" paragraph that corrects them; the
  model's own unrepaired slips carry the walk past C, and such a trace never reaches the answer;
- the answer can be forced at any step boundary (`FORCE_SUFFIX`): it is the x the walk stands on
  (during the search) or the x it found (during the verification).

Families: `in-dist` walks up with A in 2..9; `shifted` walks down (the start lies above x; a
little of it is in training); `hard` steps by a two-digit A (11..19) over the longest walks (a
little of it in training too), where the model slips often enough that many traces never get
there.

CLI (prompts for the calibration job):
    python -m orca_demo.long.tasks --family in-dist --n 600 --seed 1 --out prompts.jsonl
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from pathlib import Path

from orca_demo.toy import tasks as toy_tasks
from orca_demo.toy.tasks import (
    ALT_FORCE_SUFFIX,
    FORCE_SUFFIX,
    STEP_DELIMITER,
    THINK_CLOSE,
    THINK_OPEN,
    assistant_text,
    check_answer,
    extract_answer,
)

FAMILIES = ("in-dist", "shifted", "hard")
# Per search step: a wrong sum, corrected by the next ("Wait") paragraph. Kept rare: the model
# learns to slip as often as its data does, and 3% made a 50-step walk slip about once per trace.
SLIP_RATE = 0.01
MIN_WALK, MAX_WALK = 8, 150  # search length, log-uniform: the depth at which the answer appears
HARD_MIN_WALK = 40
# The verification's length. A fixed, numbered count: with a length drawn per trace (25-70% of the
# search, the first design) the model could not tell when to stop and some traces verified until
# max_tokens. The walk up starts at x >= MIN_START so the checks below x stay at x >= 0.
CHECKS = 16
MIN_START = CHECKS
# The decision words: what the walk does next depends on them (weighted in training).
DECISIONS = ("below", "above", "equals")

_STEP_RE = re.compile(r"^(?:Wait, )?x=(\d+): ")
_CHECK_RE = re.compile(r"so x=(\d+) holds\.$")
_FOUND_RE = re.compile(r"^So x=(\d+)\.$")


@dataclass(frozen=True)
class Problem(toy_tasks.Problem):
    """The toy's equation, `A*x + B = C` in every family, to be solved by walking from x = start
    (whose value the prompt gives)."""

    start: int

    @property
    def op(self) -> str:
        return "+"  # the families differ in the walk's direction and A, not in the equation

    @property
    def step(self) -> int:
        """+1 when the walk goes up to x, -1 when it comes down."""
        return 1 if self.start < self.x else -1

    @property
    def question(self) -> str:
        s = self.start
        return (f"Find the integer x with {self.a}*x + {self.b} = {self.c}. "
                f"Start at x={s}, where {self.a}*{s} + {self.b} = {self.value(s)}.")


def _walk_length(rng: random.Random, lo: int, hi: int) -> int:
    """Log-uniform in [lo, hi]: many short walks, a long tail (as reasoning lengths are)."""
    return round(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def make_problem(rng: random.Random, family: str) -> Problem:
    """A fresh problem of one family (see the module docstring)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    b = rng.randint(0, 99)
    if family == "hard":
        a, walk = rng.randint(11, 19), _walk_length(rng, HARD_MIN_WALK, MAX_WALK)
    else:
        a, walk = rng.randint(2, 9), _walk_length(rng, MIN_WALK, MAX_WALK)
    if family == "shifted":  # walk down from above
        x = rng.randint(0, 40)
        start = x + walk
    else:
        start = rng.randint(MIN_START - MIN_WALK, MIN_START - MIN_WALK + 40)
        x = start + walk
    return Problem(a=a, b=b, c=a * x + b, x=x, family=family, start=start)


def _relation(value: int, target: int) -> str:
    if value < target:
        return f"below {target}"
    return f"above {target}" if value > target else f"equals {target}"


def _step_text(p: Problem, t: int, prev: int, value: int, prefix: str = "") -> str:
    sign = "+" if p.step > 0 else "-"
    return f"{prefix}x={t}: {prev}{sign}{p.a}={value}, {_relation(value, p.c)}."


def search_paragraphs(p: Problem, rng: random.Random) -> list[str]:
    """The walk from start to x; with SLIP_RATE a wrong sum followed by its correction (the walk
    then goes on from the right value)."""
    paras, prev = [], p.value(p.start)
    for t in range(p.start + p.step, p.x + p.step, p.step):
        value = p.value(t)
        if t != p.x and rng.random() < SLIP_RATE:
            wrong = value + rng.choice([-10, -2, -1, 1, 2, 10])
            paras.append(_step_text(p, t, prev, wrong))
            paras.append(_step_text(p, t, prev, value, prefix="Wait, ").replace(
                f"={value},", f"={value}, not {wrong},", 1))
        else:
            paras.append(_step_text(p, t, prev, value))
        prev = value
    return paras


def check_paragraphs(p: Problem) -> list[str]:
    """Walk back CHECKS numbered steps from x, undoing each step: redundant once x is found."""
    paras, value = [], p.c
    sign = "-" if p.step > 0 else "+"
    for i in range(1, CHECKS + 1):
        t = p.x - i * p.step
        prev, value = value, p.value(t)
        paras.append(f"Check {i}, x={t}: {prev}{sign}{p.a}={value}, so x={p.x} holds.")
    return paras


def trace_paragraphs(p: Problem, rng: random.Random) -> list[str]:
    """Search, verification, and the conclusion."""
    return search_paragraphs(p, rng) + check_paragraphs(p) + [f"So x={p.x}."]


def trace(p: Problem, rng: random.Random) -> str:
    """A complete, correct trace for p (assistant turn without EOS)."""
    return assistant_text(trace_paragraphs(p, rng), p.x)


def paragraph_candidate(paragraph: str) -> int | None:
    """The answer a reader would give after this paragraph: the x a search step stands on, or
    the x a check or the conclusion confirms."""
    for pattern in (_CHECK_RE, _FOUND_RE, _STEP_RE):
        if m := pattern.search(paragraph):
            return int(m.group(1))
    return None


@dataclass(frozen=True)
class TraceStats:
    """What the evaluation reports about one generated completion."""

    well_formed: bool
    correct: bool
    paragraphs: int
    first_right: int | None  # index of the first paragraph whose candidate is x; None if never
    redundant: int | None  # paragraphs after first_right


_PARA_RE = re.compile(
    r"^(?:(?:Wait, )?x=\d+: \d+[+-]\d+=\d+, (?:not \d+, )?(?:below|above|equals) \d+\."
    r"|Check \d+, x=\d+: \d+[+-]\d+=\d+, so x=\d+ holds\.|So x=\d+\.)$"
)


def trace_stats(text: str, problem: Problem) -> TraceStats:
    """Parse a completion: well-formedness, correctness, paragraph counts and where the
    candidate answer first became right. The completion may open with `<think>` or start inside
    the reasoning (the chat template opens it)."""
    done = THINK_CLOSE in text
    body = text.split(THINK_CLOSE)[0].removeprefix(THINK_OPEN).strip("\n")
    paras = [s for s in body.split(STEP_DELIMITER) if s.strip()]
    first = next((i for i, s in enumerate(paras) if paragraph_candidate(s) == problem.x), None)
    return TraceStats(
        well_formed=done and all(_PARA_RE.match(s) for s in paras),
        correct=check_answer(text, problem),
        paragraphs=len(paras),
        first_right=first,
        redundant=None if first is None else len(paras) - first - 1,
    )


def write_prompts(path: Path, family: str, n: int, seed: int) -> None:
    """Write n fresh problems of one family as JSONL (ids `long-<family>-<i>`)."""
    toy_tasks.write_prompts(path, family, n, seed, make_problem, prefix="long")


def main() -> None:
    toy_tasks.prompts_main(__doc__, FAMILIES, 600, write_prompts)


if __name__ == "__main__":
    main()
