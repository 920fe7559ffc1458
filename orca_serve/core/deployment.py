"""A deployment: one bundle (or record-mode settings) made ready for one engine.

Each request keeps a reference to the deployment it started with (its token table, forced text,
probe bank and thresholds), so a new bundle can serve new requests while running ones finish on
theirs (hot reload: `OrcaCore.load_bundle`). A deployment's probe bank has one row per slot of
the core, so two live deployments cost two banks until the old one's last request leaves.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from orca_method.procedure import ProbeBank
from orca_method.steps import TokenTable

log = logging.getLogger("orca_serve.core")


class Deployment:
    """Bundle (None in record-only mode), segmentation table, forced text ids, probe bank."""

    def __init__(self, cfg: Mapping[str, Any], tokenizer: Any, *, hidden_size: int,
                 model_name: str, eos_ids: set[int], capacity: int,
                 device: torch.device) -> None:
        from orca_method.bundle import Segmentation, ThinkTags, check_model, load_bundle

        self.bundle = None
        path = cfg.get("bundle")
        if path:
            self.bundle = load_bundle(path)
            check_model(self.bundle, hidden_size, tokenizer.get_vocab(), model_name)
            seg_cfg, think = self.bundle.segmentation, self.bundle.think
            self.normalization = self.bundle.normalization
        else:
            seg_cfg = Segmentation(**(cfg.get("segmentation") or {}))
            think = ThinkTags(**(cfg.get("think") or {}))
            self.normalization = cfg.get("normalization") or "token-l2"
        self.path = path
        self.think = think
        self.table = TokenTable.from_tokenizer(tokenizer, segmentation=seg_cfg, think=think,
                                               eos_ids=eos_ids)
        self.force_ids: list[int] = (tokenizer.encode(think.force_text, add_special_tokens=False)
                                     if think.force_text else [])
        self.bank: ProbeBank | None = None
        if self.bundle is not None:
            self.bank = ProbeBank(self.bundle.load_probe(), window=self.bundle.window,
                                  capacity=capacity, device=device)

    @property
    def checksum(self) -> str | None:
        """The bundle's checksum: the deployment's name in the core (None: record mode)."""
        return None if self.bundle is None else self.bundle.checksum

    @property
    def lam_of(self):
        return None if self.bundle is None else self.bundle.lam

    @property
    def default_delta(self) -> float | None:
        return None if self.bundle is None else self.bundle.default_delta

    def summary(self) -> dict[str, Any]:
        b = self.bundle
        return {"bundle": self.path, "checksum": None if b is None else b.checksum,
                "default_delta": self.default_delta, "normalization": self.normalization}
