"""The live audit of the vote (`orca.samples`): a share of voted groups run to their end.

A voted group settles as soon as the samples already finished make its vote settled at the
bundle's certified margin t* (`orca_serve.api_server.voting`), and its running samples are
aborted. The vote's loss needs no reference answer: it is 1 when the vote the rule settled on
differs from the vote of all k samples, each run to its own (ORCA) stop. So an audited group
(picked with probability `--orca-vote-audit-rate` by a private RNG, a uniform sample of the voted
groups) aborts nothing: its answer is returned once the vote settles, as any group's, and its
other samples run on in the background until the whole vote is known. The loss feeds the
consensus row's `VoteGuard` (`orca_method.audit.guards`): the same anytime-valid restarted,
censored confidence sequence, engagement rule and `--orca-on-alarm` reaction as a delta's guard
(an alarm: the lower bound on the vote error exceeds delta_vote; with `fallback` or
`recalibrate` the row's groups then settle no more early, every sample runs to its ORCA stop,
until the upper bound is back at delta_vote or below). docs/AUDIT.md, "The vote's audit".

With an audit directory the guards' state is saved after every audited group
(`vote-<checksum>.json`, replaced atomically) and read back at start-up, so a restart resumes
the bound and the engagement. Unlike the stop-side journal, nothing else is kept: an audited
group still running when its process dies is not counted (neither as lost nor censored), and the
state is this process's (a fleet's replicas, `--orca-audit-store`, do not share it).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from orca_method.audit.guards import VoteGuard
from orca_method.audit.sequence import CensoredAlarm
from orca_method.bundle import Bundle
from orca_method.files import write_atomic
from orca_method.outcomes import Source
from orca_serve.live_audit.options import AuditConfig, guard_epsilon
from orca_serve.live_audit.sampling import AuditSampler
from orca_serve.settings.contract import VoteSettings

logger = logging.getLogger("orca_serve.live_audit")

# what became of the picked groups: measured (their loss is known), censored (a sample failed
# or the client left before the vote was known: any loss in [0, 1])
VOTE_COUNTS = ("picked", "measured", "censored")
SAMPLER_SEED_OFFSET = 1  # the vote's sampler draws apart from the requests' (same --orca-audit-seed)


def vote_state_path(directory: Path, checksum: str) -> Path:
    """Where the vote guards' state of the bundle with this checksum lives in an audit
    directory (beside its stop-side journal, `journal.journal_path`)."""
    return Path(directory) / f"vote-{checksum[:16]}.json"


class VoteAudit:
    """The vote guards of one bundle (one per consensus row with a certified t*), the sampler
    that picks audited groups, and the state file (see the module docstring)."""

    def __init__(self, bundle: Bundle, config: AuditConfig, path: Path | None = None) -> None:
        block = bundle.consensus
        rows = [] if block is None else [r for r in block.rows if r.t is not None]
        self.rate = config.vote_rate
        self.sampler = AuditSampler(config.vote_rate, None if config.seed is None
                                    else config.seed + SAMPLER_SEED_OFFSET)
        self.epsilon = None if block is None else guard_epsilon(block.epsilon, max(1, len(rows)),
                                                                config.epsilon_split)
        self.guards = {(r.delta, r.delta_vote): VoteGuard(r.delta, r.delta_vote, float(r.t),
                                                          CensoredAlarm(self.epsilon),
                                                          config.on_alarm)
                       for r in rows if self.epsilon is not None and r.t is not None}
        self.counts = dict.fromkeys(VOTE_COUNTS, 0)
        self.path = path
        if path is not None and path.exists():
            self._load(path)

    def guard(self, delta: float, delta_vote: float) -> VoteGuard | None:
        for (d, dv), g in self.guards.items():
            if math.isclose(d, delta, abs_tol=1e-9) and math.isclose(dv, delta_vote,
                                                                    abs_tol=1e-9):
                return g
        return None

    def admit(self, vote: VoteSettings, delta: float) -> VoteSettings:
        """The vote a group runs with: its row's t* acting (the guard's source BUNDLE) or only
        measured (FALLBACK: the group waits for every sample), and whether it is audited. A
        vote without t* (maj@k itself) has nothing to audit."""
        g = None if vote.t is None else self.guard(delta, vote.delta_vote)
        if g is None:
            return vote
        audited = self.sampler.pick()
        self.counts["picked"] += int(audited)
        return replace(vote, audited=audited, t_source=g.source)

    def finished(self, vote: VoteSettings, delta: float, loss: float | None) -> None:
        """An audited group's vote loss (None: censored), to its row's guard."""
        g = self.guard(delta, vote.delta_vote)
        if g is None:
            return
        before = g.engaged
        g.observe(loss)
        self.counts["censored" if loss is None else "measured"] += 1
        if g.engaged != before:
            logger.warning("orca vote audit: delta %g, delta_vote %g: %s (vote error in "
                           "[%.3f, %.3f] after %d audited groups); its groups %s",
                           g.delta, g.delta_vote, "ALARM" if g.engaged else "cleared",
                           g.cs.lower, g.cs.upper, g.cs.n,
                           "settle early" if g.source == Source.BUNDLE else
                           "wait for every sample (fallback)")
        if self.path is not None:
            self._save(self.path)

    def table(self) -> dict[str, Any]:
        """The vote's part of GET /v1/orca/audit."""
        return {"rate": self.rate, "epsilon": self.epsilon, **self.counts,
                "rows": [g.row() for g in self.guards.values()],
                "state": None if self.path is None else str(self.path)}

    # -- the state file ------------------------------------------------------------------------
    def _settings(self) -> dict[str, Any]:
        """What the saved state depends on besides the audits: state saved under others is not
        used."""
        return {"epsilon": self.epsilon,
                "on_alarm": [str(g.on_alarm) for g in self.guards.values()],
                "rows": [[g.delta, g.delta_vote, g.t] for g in self.guards.values()]}

    def _save(self, path: Path) -> None:
        write_atomic(path, json.dumps({"settings": self._settings(), "counts": self.counts,
                                       "guards": [g.state() for g in self.guards.values()]}))

    def _load(self, path: Path) -> None:
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            logger.warning("orca vote audit: %s unreadable (%r): starting afresh", path, e)
            return
        if d.get("settings") != self._settings():
            logger.warning("orca vote audit: %s was saved under other settings: starting "
                           "afresh", path)
            return
        for g, s in zip(self.guards.values(), d["guards"]):
            g.restore(s)
        self.counts.update({k: int(v) for k, v in d["counts"].items() if k in self.counts})
        logger.info("orca vote audit: resumed from %s (%d audited groups)", path,
                    self.counts["measured"] + self.counts["censored"])


def make_vote_audit(bundle: Bundle, config: AuditConfig) -> VoteAudit:
    """The vote audit of `bundle` as `config` sets it up (its state in the audit directory)."""
    path = None if config.directory is None else vote_state_path(config.directory,
                                                                 bundle.checksum)
    return VoteAudit(bundle, config, path)
