"""The V1 runner under speculative decoding: getting the processor built and called on every row.

vLLM 0.32's V1 runner does not run custom logits processors under speculative decoding:
`build_logitsprocs` refuses them when a speculative config is set
(vllm/v1/sample/logits_processor/__init__.py), and the rejection sampler applies only
min-tokens and the thinking budget to the draft rows (vllm/v1/sample/rejection_sampler.py). Two
hooks make ORCA run there:

- `allow_under_speculation()` (installed when the worker loads our worker extension, before the
  model runner is built) wraps `build_logitsprocs`: with a speculative config and ORCA's
  processor as the only custom one, it builds vLLM's own processors for speculation plus ours,
  and refuses a speculative method that is not tested (`config.SPEC_METHODS`).
- `attach(processor, runner)` wraps the runner's `_sample(logits, spec_decode_metadata)`: in a
  step with draft tokens, the processor sees every logits row first (a request owns
  1 + its draft count consecutive rows, in batch order: `spec_decode_metadata.num_draft_tokens`)
  and forces tokens there; the target and bonus logits the rejection sampler reads are rows of
  that same tensor. The sampler's own call of the processor on the bonus rows is then skipped.
  Steps without drafts reach the processor's `apply()` as usual.

What the core does with the rows: orca_serve/core/speculation.py.
"""

from __future__ import annotations

from typing import Any

from orca_serve.vllm_plugin.config import PROCESSOR_FQCN, speculation_refusal

_BUILD = "build_logitsprocs"


def allow_under_speculation() -> None:
    """Wrap vLLM's `build_logitsprocs` where the V1 runner calls it (idempotent)."""
    import sys

    from vllm.v1.sample import logits_processor as lp

    original = getattr(lp, _BUILD)
    if getattr(original, "orca_wrapped", False):
        return

    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model,
                          custom_logitsprocs=()):
        spec = getattr(vllm_config, "speculative_config", None)
        if not spec or is_pooling_model or not custom_logitsprocs \
                or not all(_is_orca(c) for c in custom_logitsprocs):
            return original(vllm_config, device, is_pin_memory, is_pooling_model,
                            custom_logitsprocs)
        refusal = speculation_refusal(getattr(spec, "method", None))
        if refusal:
            raise ValueError(refusal)
        builtin = original(vllm_config, device, is_pin_memory, is_pooling_model, ())
        ours = [cls(vllm_config, device, is_pin_memory)
                for cls in lp._load_custom_logitsprocs(tuple(custom_logitsprocs))]
        return lp.LogitsProcessors([*builtin.all, *ours])

    build_logitsprocs.orca_wrapped = True
    setattr(lp, _BUILD, build_logitsprocs)
    runner_mod = sys.modules.get("vllm.v1.worker.gpu_model_runner")
    if runner_mod is not None:  # imported already: it holds its own reference
        setattr(runner_mod, _BUILD, build_logitsprocs)


def _is_orca(proc: Any) -> bool:
    """Whether an entry of vLLM's `logits_processors` (an FQCN or a class) is ORCA's processor
    or a subclass of it (by name: this module must not import the processor's)."""
    want = PROCESSOR_FQCN.replace(":", ".")
    if isinstance(proc, str):
        return proc.replace(":", ".") == want
    return isinstance(proc, type) and any(f"{c.__module__}.{c.__qualname__}" == want
                                          for c in proc.__mro__)


def attach(processor: Any, runner: Any) -> None:
    """Route the runner's steps with draft tokens through `processor.apply_rows` (see module
    docstring); `processor.sampling_drafts` is True while vLLM samples such a step."""
    sample = runner._sample

    def _sample(logits, spec_decode_metadata):
        if spec_decode_metadata is None or logits is None:
            return sample(logits, spec_decode_metadata)
        processor.apply_rows(logits, [1 + k for k in spec_decode_metadata.num_draft_tokens])
        processor.sampling_drafts = True
        try:
            return sample(logits, spec_decode_metadata)
        finally:
            processor.sampling_drafts = False

    runner._sample = _sample

