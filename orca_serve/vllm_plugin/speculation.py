"""The V1 runner under speculative decoding: ORCA's processor built there and fed every row.

Two hooks, both in `orca_serve/vllm_compat/` (they reach past vLLM's extension points):
`install()` (run when the worker imports our worker extension, before it builds its model
runner) lets vLLM build ORCA's processor under a speculative config, refusing a method that is
not tested (`config.speculation_refusal`); `attach(processor, runner)` routes the runner's
steps with draft tokens through `processor.apply_rows`, and marks vLLM's own sampling of such a
step (`processor.sampling_drafts`). What the core does with the rows:
orca_serve/core/speculation.py; docs/PLUGIN.md, "Speculative decoding".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from orca_serve.vllm_compat import speculation as compat
from orca_serve.vllm_plugin.config import (
    PROCESSOR_FQCN,
    speculation_refusal,
    speculative_method,
)

if TYPE_CHECKING:
    from torch import Tensor

    from orca_serve.vllm_compat.runner import V1Runner


def install() -> None:
    compat.allow_under_speculation(
        lambda procs: all(_is_orca(p) for p in procs),
        lambda spec: speculation_refusal(speculative_method(spec)))


def _is_orca(proc: Any) -> bool:
    """Whether an entry of vLLM's `logits_processors` (an FQCN or a class) is ORCA's processor
    or a subclass of it (by name: this module must not import the processor's)."""
    want = PROCESSOR_FQCN.replace(":", ".")
    if isinstance(proc, str):
        return proc.replace(":", ".") == want
    return isinstance(proc, type) and any(f"{c.__module__}.{c.__qualname__}" == want
                                          for c in proc.__mro__)


class DraftRows(Protocol):
    """What `attach` wires of ORCA's V1 processor (`vllm_plugin.processor`, which imports this
    module): the step's rows, and the flag of vLLM's own sampling of a step with drafts."""

    sampling_drafts: bool

    def apply_rows(self, logits: Tensor, rows_per_request: list[int] | None) -> None: ...


def attach(processor: DraftRows, runner: V1Runner) -> None:
    """`runner`: the V1 runner view."""
    def sampling(on: bool) -> None:
        processor.sampling_drafts = on

    runner.intercept_draft_steps(processor.apply_rows, sampling)
