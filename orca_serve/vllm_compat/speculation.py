"""vLLM's V1 runner under speculative decoding: building a custom logits processor there.

Checked against vLLM 0.32 (engine tests, CPU build: n-gram and draft-model speculation). vLLM's
`build_logitsprocs` (vllm/v1/sample/logits_processor/__init__.py) refuses every custom logits
processor when a speculative config is set. `allow_under_speculation` wraps it where the V1
runner calls it (the module attribute, and the runner module's own reference when that module
is imported already): for the processors the caller accepts (`ours`), vLLM's own processors
for speculation are built and ours are added; anything else goes to vLLM unchanged (and is
refused there). The per-step hook (every logits row of a step with drafts) is
`runner.V1Runner.intercept_draft_steps`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

TOUCH_POINTS: tuple[str, ...] = (
    "vllm.v1.sample.logits_processor:build_logitsprocs",
    "vllm.v1.sample.logits_processor:_load_custom_logitsprocs",
    "vllm.v1.sample.logits_processor:LogitsProcessors",
    "vllm.v1.worker.gpu_model_runner:build_logitsprocs",
)

_NAME = "build_logitsprocs"


def allow_under_speculation(ours: Callable[[Sequence[Any]], bool],
                            refusal: Callable[[Any], str | None]) -> None:
    """Let vLLM build the custom processors `ours(custom_logitsprocs)` accepts under a
    speculative config; `refusal(speculative_config)` may refuse the config (a ValueError with
    that line). Idempotent; call before the model runner is built."""
    from vllm.v1.sample import logits_processor as lp  # deferred: vllm (resolved at use)

    original = getattr(lp, _NAME)
    if getattr(original, "orca_wrapped", False):
        return

    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model,
                          custom_logitsprocs=()):
        spec = getattr(vllm_config, "speculative_config", None)
        if not spec or is_pooling_model or not custom_logitsprocs or not ours(custom_logitsprocs):
            return original(vllm_config, device, is_pin_memory, is_pooling_model,
                            custom_logitsprocs)
        why = refusal(spec)
        if why:
            raise ValueError(why)
        builtin = original(vllm_config, device, is_pin_memory, is_pooling_model, ())
        added = [cls(vllm_config, device, is_pin_memory)
                 for cls in lp._load_custom_logitsprocs(tuple(custom_logitsprocs))]
        return lp.LogitsProcessors([*builtin.all, *added])

    build_logitsprocs.orca_wrapped = True
    setattr(lp, _NAME, build_logitsprocs)
    runner_module = sys.modules.get("vllm.v1.worker.gpu_model_runner")
    if runner_module is not None:  # imported already: it holds its own reference
        setattr(runner_module, _NAME, build_logitsprocs)
