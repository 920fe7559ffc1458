"""Train the long reasoner (tokenizer + tiny Qwen2), in two phases (calibration/long/README.md):

    python -m calibration.long.train --out runs/long/phase1 --rows 8 --seq-len 1024 --minutes 30
    python -m calibration.long.train --out runs/long/model --init runs/long/phase1 --lr 1e-3

The recipe is the toy's (calibration/toy/train.py: tokenizer, packing, loss, schedule,
checkpoints) with this task's examples and a longer context; what differs is said here.
"""

from __future__ import annotations

import random
import re

from calibration.long.tasks import (
    ALT_FORCE_SUFFIX,
    FORCE_SUFFIX,
    STEP_DELIMITER,
    THINK_OPEN,
    assistant_text,
    make_problem,
    paragraph_candidate,
    trace_paragraphs,
)
from calibration.toy.train import EOS, Example, Recipe, main, render_prompt

# Training mix: the shifted (walking down) and hard (two-digit steps) families are a small share,
# so the model can solve them sometimes without them being in-distribution.
FAMILY_SHARES = (("in-dist", 0.87), ("shifted", 0.08), ("hard", 0.05))
FORCED_SHARE = 0.3  # traces cut after k paragraphs + the answer-forcing suffix + the answer
ALT_SUFFIX_SHARE = 0.25
BOUNDARY_DELIM_SHARE = 0.5
MAX_POSITIONS = 5120  # the longest traces are ~4,300 tokens
_DECISION_RE = re.compile(r" (?:below|above|equals) ")


def make_example(rng: random.Random) -> Example:
    """One training example. A forced example keeps loss on its reasoning prefix (a long trace
    is too costly to train one answer token from) but none on the suffix that closes the
    thinking, so the model never learns to close it early."""
    family = rng.choices([f for f, _ in FAMILY_SHARES], [w for _, w in FAMILY_SHARES])[0]
    problem = make_problem(rng, family)
    prompt = render_prompt(problem.question)
    paras = trace_paragraphs(problem, rng)
    if rng.random() >= FORCED_SHARE:
        return prompt + assistant_text(paras, problem.x) + EOS, len(prompt), None
    k = rng.randint(1, len(paras))
    prefix = THINK_OPEN + "\n" + STEP_DELIMITER.join(paras[:k])
    if rng.random() < BOUNDARY_DELIM_SHARE:
        prefix += STEP_DELIMITER
    suffix = ALT_FORCE_SUFFIX if rng.random() < ALT_SUFFIX_SHARE else FORCE_SUFFIX
    head = prompt + prefix + suffix
    skip = (len(prompt + prefix), len(head))
    return head + f"{paragraph_candidate(paras[k - 1])}}}", len(prompt), skip


LONG = Recipe("long", make_example, _DECISION_RE, max_positions=MAX_POSITIONS)

if __name__ == "__main__":
    main(LONG, __doc__, minutes=30.0, rows=2, seq_len=4608)
