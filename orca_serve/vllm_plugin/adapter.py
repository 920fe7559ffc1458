"""What the two vLLM adapters share: the core built from vLLM's engine config, admission checks,
joining a request to the core, results, and where the model runner comes from.

The V1 adapter (`processor.py`) and the Model Runner V2 adapter (`mrv2.py`) differ only in how
vLLM tells them about the batch (row moves vs. slots) and when they learn token ids; everything
about the core's construction (the engine config read back from `additional_config["orca"]`),
about a request (its child index, its stop tokens, the core call that tracks it) and about
results is here, so the two cannot drift.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from orca_serve.core.engine import OrcaCore
from orca_serve.core.registry import Request
from orca_serve.settings.contract import OrcaSettings
from orca_serve.settings.engine_config import KEY, EngineConfig
from orca_serve.settings.xargs import validate_xargs
from orca_serve.vllm_compat.tokenizer import load_tokenizer
from orca_serve.vllm_plugin.config import (
    ENV_BUNDLE,
    WORKER_EXTENSION,
    calls_worker_extension_hook,
    log_with_vllm,
)

log = logging.getLogger("orca_serve.vllm_plugin")

_CHILD_RE = re.compile(r"^(\d+)_")


def orca_config(vllm_config: Any) -> EngineConfig:
    """The engine config from `additional_config["orca"]`, or the bundle named by $ORCA_BUNDLE
    when a front end dropped the additional config."""
    wire = (getattr(vllm_config, "additional_config", None) or {}).get(KEY)
    if not wire and os.environ.get(ENV_BUNDLE):
        return EngineConfig(bundle=os.environ[ENV_BUNDLE])
    return EngineConfig.from_dict(wire)


def build_core(vllm_config: Any, device: torch.device, pin_memory: bool) -> OrcaCore:
    log_with_vllm()  # the engine process's orca lines (the gate alarm's) in vLLM's format
    mc = vllm_config.model_config
    tok = load_tokenizer(mc)
    eos_ids: set[int] = set()
    if tok.eos_token_id is not None:
        eos_ids.add(int(tok.eos_token_id))
    try:
        gen = mc.try_get_generation_config() or {}
        ge = gen.get("eos_token_id")
        eos_ids |= set([ge] if isinstance(ge, int) else (ge or []))
    except Exception as e:  # noqa: BLE001 - generation config is optional
        log.debug("no generation config for EOS ids: %s", e)
    cfg = orca_config(vllm_config)
    core = OrcaCore(cfg, tok, hidden_size=int(mc.get_hidden_size()), model_name=str(mc.model),
                    eos_ids=eos_ids,
                    default_eos=None if tok.eos_token_id is None else int(tok.eos_token_id),
                    max_num_seqs=int(vllm_config.scheduler_config.max_num_seqs),
                    device=torch.device(device), pin_memory=pin_memory)
    log.info("orca core ready: bundle=%s record=%s", cfg.bundle, core.record_default)
    return core


def hands_over_the_runner(vllm_config: Any) -> bool:
    """Whether this engine's workers will hand orca's processors their model runner through the
    worker extension's `init_worker_extension` (orca_serve/vllm_plugin/worker.py): the running
    vLLM calls that hook (0.33+), and the engine's `worker_extension_cls` is orca's or a subclass
    of it. Otherwise (vLLM 0.31/0.32, or stock vLLM started without `--worker-extension-cls`) the
    processors find the runner on their constructor's call stack."""
    name = getattr(getattr(vllm_config, "parallel_config", None), "worker_extension_cls", None)
    return bool(name) and _is_orca_extension(str(name)) and calls_worker_extension_hook()


def _is_orca_extension(name: str) -> bool:
    """By qualified name: vLLM resolved (imported) the class before building any processor, and
    importing the extension's module here would install its hooks in every process that loads
    the processor (vLLM's front end too)."""
    if name == WORKER_EXTENSION:
        return True
    module, _, attr = name.rpartition(".")
    cls = getattr(sys.modules.get(module), attr, None)
    return isinstance(cls, type) and any(f"{c.__module__}.{c.__qualname__}" == WORKER_EXTENSION
                                         for c in cls.__mro__)


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

    def _join(self, ident: str, params, settings: OrcaSettings, prompt: Sequence[int] | None,
              n_out: int, output: Sequence[int] | None, index: int) -> Request | None:
        """Hand a request entering the batch to the core (a new one or a resumed one), with its
        settings (`OrcaCore.settings`, read once from its extra_args)."""
        eos = getattr(params, "eos_token_id", None)
        return self.core.join(ident, settings, prompt=prompt, n_out=n_out,
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


def child_index(req_id: str | None, settings: OrcaSettings, seed: int | None) -> int:
    """Choice index of an n > 1 child: vLLM names children "<index>_<parent id>"
    (vllm/v1/engine/parallel_sampling.py); without the id, the seed vLLM gives child i
    (`seed`: the parent's seed + i) minus the parent's (`settings.seed`, set in validation)."""
    if settings.n <= 1:
        return 0
    m = _CHILD_RE.match(req_id or "")
    if m:
        return int(m.group(1))
    if settings.seed is not None and seed is not None:
        return int(seed) - settings.seed
    return 0

