"""Building the core from a vLLM engine config, and where the model runner comes from (shared by
the V1 and MRV2 adapters)."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import torch

from orca_serve.core.engine import OrcaCore
from orca_serve.settings.engine_config import KEY, EngineConfig
from orca_serve.vllm_compat.tokenizer import load_tokenizer
from orca_serve.vllm_plugin.config import (
    ENV_BUNDLE,
    WORKER_EXTENSION,
    calls_worker_extension_hook,
)

log = logging.getLogger("orca_serve.vllm_plugin")


def orca_config(vllm_config: Any) -> EngineConfig:
    """The engine config from `additional_config["orca"]`, or the bundle named by $ORCA_BUNDLE
    when a front end dropped the additional config."""
    wire = (getattr(vllm_config, "additional_config", None) or {}).get(KEY)
    if not wire and os.environ.get(ENV_BUNDLE):
        return EngineConfig(bundle=os.environ[ENV_BUNDLE])
    return EngineConfig.from_dict(wire)


def build_core(vllm_config: Any, device: torch.device, pin_memory: bool) -> OrcaCore:
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
