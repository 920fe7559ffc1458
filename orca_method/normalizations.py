"""How a step's token hidden states are pooled into the probe's step embedding (docs/METHOD.md),
named once: the names every part accepts and the default (what the paper's probes were trained
on). No imports beyond typing: vLLM's processes and the CLIs' pre-flight read it cheaply."""

from __future__ import annotations

from typing import Literal, get_args

Normalization = Literal["token-l2", "step-l2", "none"]
NORMALIZATIONS: tuple[str, ...] = get_args(Normalization)
DEFAULT_NORMALIZATION: Normalization = "token-l2"
