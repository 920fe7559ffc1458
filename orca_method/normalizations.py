"""How a step's token hidden states are pooled into the probe's step embedding (docs/METHOD.md),
named once: the names every part accepts and the default (what the paper's probes were trained
on). No imports beyond the standard library: vLLM's processes and the CLIs' pre-flight read it
cheaply."""

from __future__ import annotations

from enum import StrEnum


class Normalization(StrEnum):
    """TOKEN_L2: each token's state scaled to unit length, then the step's mean; STEP_L2: the
    mean of the raw states, scaled to unit length; NONE: the mean of the raw states."""

    TOKEN_L2 = "token-l2"
    STEP_L2 = "step-l2"
    NONE = "none"


NORMALIZATIONS: tuple[str, ...] = tuple(str(n) for n in Normalization)  # what argparse lists
DEFAULT_NORMALIZATION = Normalization.TOKEN_L2
