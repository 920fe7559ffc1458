"""Building the core from a vLLM engine config (shared by the V1 and MRV2 adapters)."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from orca_serve.core.engine import OrcaCore
from orca_serve.vllm_compat.tokenizer import load_tokenizer
from orca_serve.vllm_plugin.config import ENV_BUNDLE

log = logging.getLogger("orca_serve.vllm_plugin")


def orca_config(vllm_config: Any) -> dict[str, Any]:
    """`additional_config["orca"]`, or the bundle named by $ORCA_BUNDLE when a front end dropped
    the additional config."""
    cfg = dict((getattr(vllm_config, "additional_config", None) or {}).get("orca") or {})
    if not cfg and os.environ.get(ENV_BUNDLE):
        cfg = {"bundle": os.environ[ENV_BUNDLE]}
    return cfg


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
    log.info("orca core ready: bundle=%s record=%s", cfg.get("bundle"), core.record_default)
    return core

