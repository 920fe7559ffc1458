"""The hidden-state capture: keep the rows that vLLM's LM head turns into logits.

Checked against vLLM 0.31 and 0.32 (engine tests, CPU build) and 0.33 (its source: the layer,
its `forward` signature and `op_registry_oot` are unchanged).

Why private: vLLM offers no hook that hands a logits processor the hidden states behind its
logits. Its logits layer (`vllm.model_executor.layers.logits_processor.LogitsProcessor`) is a
`PluggableLayer`, and `register_oot` swaps in our subclass for every model that builds it (the
out-of-tree mechanism is meant for platform plugins; we use it process-wide). Its
`forward(lm_head, hidden_states)` receives `hidden_states[logits_indices]`: one row per logits
row, in the batch's row order, post final norm (the tensor that feeds the LM head, METHOD.md
section 1). We keep a reference to that tensor (no copy) in a module-level stash; the custom
logits processor takes it in the same engine step, in `apply()`, where `logits` has the same
rows. Both model runners (V1 and MRV2) compute logits through this layer.

Importing this module registers the layer once per process. The plugin's processor module
imports it (after refusing an unsupported vLLM release), and vLLM imports the processor (from
the engine's `logits_processors`) in the model runner's constructor, before the model is built:
that is how a spawned worker process gets it.
"""

from __future__ import annotations

import torch
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.logits_processor import (
    LogitsProcessor as _VllmLogitsLayer,
)

TOUCH_POINTS: tuple[str, ...] = (
    "vllm.model_executor.custom_op:op_registry_oot",
    "vllm.model_executor.layers.logits_processor:LogitsProcessor",
    "vllm.model_executor.layers.logits_processor:LogitsProcessor.register_oot",
    "vllm.model_executor.layers.logits_processor:LogitsProcessor.forward",
)


class _Stash:
    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None


STASH = _Stash()


class OrcaCaptureLogitsLayer(_VllmLogitsLayer):
    """vLLM's logits layer, plus: remember the hidden rows of the last call."""

    def forward(self, lm_head, hidden_states: torch.Tensor, embedding_bias=None,
                skip_gather: bool = False):
        STASH.rows = hidden_states  # [rows, hidden]
        return super().forward(lm_head, hidden_states, embedding_bias, skip_gather)


def take_rows() -> torch.Tensor | None:
    """The [rows, hidden] input of the last LM-head call, forgotten afterwards (one consumer per
    engine step)."""
    rows, STASH.rows = STASH.rows, None
    return rows


def register() -> bool:
    """Install the capture layer (idempotent: a second registration of the name asserts in
    vLLM); True if ours is the registered one."""
    name = _VllmLogitsLayer.__name__
    current = op_registry_oot.get(name)
    if current is None:
        _VllmLogitsLayer.register_oot(OrcaCaptureLogitsLayer, name=name)
        return True
    return current is OrcaCaptureLogitsLayer or issubclass(current, OrcaCaptureLogitsLayer)


REGISTERED = register()
