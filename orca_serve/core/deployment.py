"""A deployment: one bundle (or record-mode settings) made ready for one engine.

Each request keeps a reference to the deployment it started with (its token table, forced text,
probe bank and thresholds), so a new bundle can serve new requests while running ones finish on
theirs (hot reload: `OrcaCore.load_bundle`). A deployment's probe bank has one row per slot of
the core, so two live deployments cost two banks until the old one's last request leaves.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import math

import torch

from orca_method.bundle import BundleError, Segmentation, ThinkTags, check_model, load_bundle
from orca_method.gate_alarm import ArrivalFeed, GateAlarm
from orca_method.procedure import ProbeBank
from orca_method.shift_gate import ShiftGate
from orca_method.steps import TokenTable
from orca_serve.settings.contract import DEFAULTS, ShiftAction, safe_lam
from orca_serve.settings.engine_config import EngineConfig

log = logging.getLogger("orca_serve.core")


def alarm_feed(gate: ShiftGate | None, alpha: float | None, level: float) -> ArrivalFeed | None:
    """The gate alarm on `gate`'s stream (core/gate_alarm.py) at level `level` and the engine's
    default gate level `alpha` (None: the bundle's); None without a gate, with the gate off
    (alpha 0) or the alarm off (level 0)."""
    if gate is None or level <= 0:
        return None
    a = gate.alpha if alpha is None else float(alpha)
    return ArrivalFeed(GateAlarm(len(gate.scores), a, level)) if a > 0 else None


class Deployment:
    """Bundle (None in record-only mode), segmentation table, forced text ids, probe bank."""

    def __init__(self, cfg: EngineConfig, tokenizer: Any, *, hidden_size: int,
                 model_name: str, eos_ids: set[int], capacity: int,
                 device: torch.device, shift_action: ShiftAction = ShiftAction.FULL,
                 shift_alpha: float | None = None,
                 gate_alarm: float = DEFAULTS.gate_alarm) -> None:
        self.bundle = None
        if cfg.bundle:
            self.bundle = load_bundle(cfg.bundle)
            check_model(self.bundle, hidden_size, tokenizer.get_vocab(), model_name)
            seg_cfg, think = self.bundle.segmentation, self.bundle.think
            self.normalization = self.bundle.normalization
        else:
            seg_cfg = Segmentation(**(cfg.segmentation or {}))
            think = ThinkTags(**(cfg.think or {}))
            self.normalization = cfg.normalization
        self.table = TokenTable.from_tokenizer(tokenizer, segmentation=seg_cfg, think=think,
                                               eos_ids=eos_ids)
        self.force_ids: list[int] = (tokenizer.encode(think.force_text, add_special_tokens=False)
                                     if think.force_text else [])
        self.bank: ProbeBank | None = None
        # the shift gate (None: the bundle has none, or the operator turned it off)
        self.gate: ShiftGate | None = None
        if self.bundle is not None:
            g = self.bundle.give_up
            if shift_action != ShiftAction.OFF:
                self.gate = self.bundle.load_gate(device)
            self.bank = ProbeBank(self.bundle.load_probe(), window=self.bundle.window,
                                  capacity=capacity, device=device,
                                  give_up=None if g is None else
                                  (self.bundle.load_give_up_probe(), g.window),
                                  gate=self.gate, gate_lam=safe_lam(self.bundle, shift_action))
        # the gate alarm on this deployment's stream (core/gate_alarm.py; None: none): a bundle
        # loaded again keeps its deployment and so its alarm, a new bundle's starts afresh
        self.alarm: ArrivalFeed | None = alarm_feed(self.gate, shift_alpha, gate_alarm)

    def gate_thresholds(self, alpha: float | None, give_up_alpha: float | None
                        ) -> tuple[float, float]:
        """The gate's score thresholds (stop side, give-up side) for a request at levels
        `alpha` and `give_up_alpha` (None: the bundle's; `ShiftGate.levels`); inf when the gate
        does not run for it (no gate, or alpha 0)."""
        if self.gate is None:
            return math.inf, math.inf
        return self.gate.thresholds(alpha, give_up_alpha)

    @property
    def checksum(self) -> str | None:
        """The bundle's checksum: the deployment's name in the core (None: record mode)."""
        return None if self.bundle is None else self.bundle.checksum

    @property
    def lam_of(self):
        return None if self.bundle is None else self.bundle.lam

    @property
    def groups(self) -> tuple[str, ...]:
        """The groups its bundle has tables for (a request's `orca_group`)."""
        return () if self.bundle is None or self.bundle.groups is None else \
            tuple(self.bundle.groups)

    @property
    def default_delta(self) -> float | None:
        return None if self.bundle is None else self.bundle.default_delta


class Deployments:
    """The live deployments of one core, by checksum: the current one (for requests naming no
    bundle) and the older ones still used by running requests (hot reload)."""

    def __init__(self, cfg: EngineConfig, tokenizer: Any, **dep_args: Any) -> None:
        self._tokenizer = tokenizer
        self._args = dep_args
        self.current = Deployment(cfg, tokenizer, **dep_args)
        self.live: dict[str | None, Deployment] = {self.current.checksum: self.current}
        self._retired: set[str | None] = set()  # dropped when no live request uses them

    def get(self, checksum: str | None) -> Deployment | None:
        return self.live.get(checksum)

    def load(self, path: str) -> Deployment:
        """Stage a bundle, checked as at start (its checksum, `check_model` against this engine's
        model): requests naming its checksum join it from now on; `use` makes it the one for
        requests naming none. Raises BundleError; the live deployments are left untouched.
        Loading a bundle that is live already returns that deployment (and un-retires it)."""
        dep = Deployment(EngineConfig(bundle=str(path)), self._tokenizer, **self._args)
        if dep.normalization != self.current.normalization:
            # the token rows of one step are normalised together, for every deployment
            raise BundleError(f"bundle {path} normalises token states with "
                              f"{dep.normalization!r} but this engine runs "
                              f"{self.current.normalization!r}; restart the server to change it")
        known = self.live.get(dep.checksum)
        if known is not None:
            self._retired.discard(dep.checksum)
            return known
        self.live[dep.checksum] = dep
        return dep

    def use(self, checksum: str | None) -> Deployment:
        """Make a live deployment the current one (for requests that name no bundle)."""
        dep = self.live.get(checksum)
        if dep is None:
            raise BundleError(f"bundle {checksum} is not loaded in this engine")
        self._retired.discard(checksum)
        self.current = dep
        return dep

    def retire(self, keep: Sequence[str | None], used: Iterable[Deployment]) -> list[str | None]:
        """Retire every deployment but the current one and those in `keep`: each is dropped (its
        probe bank freed) when its last request leaves. Returns the checksums still live."""
        for c, dep in self.live.items():
            if dep is not self.current and c not in keep:
                self._retired.add(c)
        self.drop_unused(used)
        return list(self.live)

    def drop_unused(self, used: Iterable[Deployment]) -> None:
        """Drop the retired deployments no request in `used` runs on."""
        if not self._retired:
            return
        in_use = {id(d) for d in used}
        for c in list(self._retired):
            dep = self.live.get(c)
            if dep is None or (dep is not self.current and id(dep) not in in_use):
                self.live.pop(c, None)
                self._retired.discard(c)
