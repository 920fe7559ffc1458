"""What the two vLLM adapters share: admission checks, joining a request to the core, results.

The V1 adapter (`processor.py`) and the Model Runner V2 adapter (`mrv2.py`) differ only in how
vLLM tells them about the batch (row moves vs. slots) and when they learn token ids; everything
about a request (its child index, its stop tokens, the core call that tracks it) and about
results is here, so the two cannot drift.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from orca_serve.settings.contract import XARG_N, XARG_SEED
from orca_serve.core.engine import OrcaCore
from orca_serve.core.registry import Request
from orca_serve.vllm_plugin.engine_setup import build_core
from orca_serve.settings.xargs import validate_xargs

_CHILD_RE = re.compile(r"^(\d+)_")

# every live processor of this process, of either adapter
PROCESSORS: weakref.WeakSet = weakref.WeakSet()


class CoreAdapter:
    """Mixin of both adapters: one `OrcaCore`, guarded by a lock (RPCs for results arrive on
    another thread than the engine step)."""

    core: OrcaCore

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        """Refuse malformed orca_* extra_args at admission (vLLM answers HTTP 400)."""
        validate_xargs(sampling_params.extra_args, int(getattr(sampling_params, "n", 1) or 1),
                       sampling_params.seed)

    def _start_core(self, vllm_config, device: torch.device, pin_memory: bool) -> None:
        self._lock = threading.RLock()
        self.core = build_core(vllm_config, torch.device(device), bool(pin_memory))
        PROCESSORS.add(self)

    def _join(self, ident: str, params, prompt: Sequence[int] | None, n_out: int,
              output: Sequence[int] | None, index: int) -> Request | None:
        """Hand a request entering the batch to the core (a new one or a resumed one)."""
        eos = getattr(params, "eos_token_id", None)
        return self.core.join(ident, params.extra_args or {}, prompt=prompt, n_out=n_out,
                              index=index, max_tokens=params.max_tokens,
                              eos=None if eos is None else int(eos),
                              ignore_eos=bool(params.ignore_eos),
                              structured=getattr(params, "structured_outputs", None) is not None,
                              handle=params, output=output)

    # -- results (worker extension) ---------------------------------------------------------
    def pop_results(self, keys: list[str]) -> dict[str, dict[str, Any]]:
        with self._lock:
            return self.core.pop_results(keys)

    def get_stats(self) -> dict[str, Any]:
        with self._lock:
            return self.core.get_stats()

    # -- hot reload (worker extension) ------------------------------------------------------
    def load_bundle(self, path: str) -> str | None:
        with self._lock:
            return self.core.load_bundle(path).checksum

    def use_bundle(self, checksum: str) -> None:
        with self._lock:
            self.core.use_bundle(checksum)

    def retire_bundles(self, keep: list[str]) -> list[str | None]:
        with self._lock:
            return self.core.retire_bundles(keep)


def child_index(req_id: str | None, params) -> int:
    """Choice index of an n > 1 child: vLLM names children "<index>_<parent id>"
    (vllm/v1/engine/parallel_sampling.py); without the id, the seed vLLM gives child i
    (parent seed + i) minus the parent's seed (`orca_seed`, set in validation)."""
    xa = params.extra_args or {}
    if int(xa.get(XARG_N, 1)) <= 1:
        return 0
    m = _CHILD_RE.match(req_id or "")
    if m:
        return int(m.group(1))
    if XARG_SEED in xa and params.seed is not None:
        return int(params.seed) - int(xa[XARG_SEED])
    return 0

