"""LM-head capture: keep the hidden-state rows that vLLM turns into logits.

vLLM's logits layer (`vllm.model_executor.layers.logits_processor.LogitsProcessor`) is a
`PluggableLayer`; `register_oot` swaps in our subclass for every model that builds it. Its
`forward(lm_head, hidden_states)` receives `hidden_states[logits_indices]`: one row per scheduled
request, in the persistent batch's row order, post final norm (the tensor that feeds the LM head,
METHOD.md section 1). We keep a reference to that tensor (no copy); the custom logits processor
consumes it in the same engine step, in `apply()`, where `logits` has the same rows.

Importing this module refuses an unsupported vLLM release (`config.check_vllm_version`: the
layer and the runner internals this plugin uses move between releases) and registers the layer
once per process. The processor module imports it,
and vLLM imports the processor (from the engine's `logits_processors`) in the model runner's
constructor, before the model is built: that is how a spawned worker process gets it.
"""

from __future__ import annotations

import torch
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.logits_processor import LogitsProcessor as _VllmLogitsLayer

from orca_serve.vllm_plugin.config import check_vllm_version


class _Stash:
    __slots__ = ("calls", "rows")

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None
        self.calls = 0


STASH = _Stash()


class OrcaCaptureLogitsLayer(_VllmLogitsLayer):
    """vLLM's logits layer, plus: remember the hidden rows of the last call."""

    def forward(self, lm_head, hidden_states: torch.Tensor, embedding_bias=None,
                skip_gather: bool = False):
        STASH.rows = hidden_states
        STASH.calls += 1
        return super().forward(lm_head, hidden_states, embedding_bias, skip_gather)


def take_rows() -> torch.Tensor | None:
    """The rows of the last LM-head call, forgotten afterwards (one consumer per engine step)."""
    rows, STASH.rows = STASH.rows, None
    return rows


def register() -> bool:
    """Install the capture layer (idempotent); returns True if ours is the registered one."""
    name = _VllmLogitsLayer.__name__
    current = op_registry_oot.get(name)
    if current is None:
        _VllmLogitsLayer.register_oot(OrcaCaptureLogitsLayer, name=name)
        return True
    return current is OrcaCaptureLogitsLayer or issubclass(current, OrcaCaptureLogitsLayer)


check_vllm_version()  # every process that loads the plugin imports this module first
REGISTERED = register()
