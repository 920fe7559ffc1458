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

The guards' state is a fold of the audited groups' losses in order, one journal event each
(`vote_event`: the row's (delta, delta_vote) and the loss, null when censored), so it goes
through the stop audit's own journal of the bundle (`orca_serve.live_audit.state.AuditState`:
the file journal of `--orca-audit-dir`, or the fleet's store of `--orca-audit-store`, keyed by
the bundle's checksum as every audit event is): a restart replays it (or its snapshot, which
carries the vote guards' state too), and the replicas of a fleet fold one sequence per bundle
and (delta, delta_vote) row and act on one decision. What stays this process's: which groups it
picked and what became of them (the counts; the rows' `n` is the fleet's), and the groups
running when it dies, which are not counted (neither as lost nor censored).
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from enum import StrEnum
from typing import Any

from orca_method.audit.guards import VoteGuard
from orca_method.audit.sequence import CensoredAlarm
from orca_method.bundle import Bundle
from orca_method.outcomes import Source
from orca_serve.live_audit.journal import VOTE, vote_event
from orca_serve.live_audit.options import AuditConfig, guard_epsilon
from orca_serve.live_audit.sampling import AuditSampler
from orca_serve.settings.contract import VoteSettings

logger = logging.getLogger("orca_serve.live_audit")


class VoteCount(StrEnum):
    """What became of this process's picked groups (the fleet's are the rows' `n`): the vote
    audit's table keys and metric states."""

    PICKED = "picked"
    MEASURED = "measured"  # its loss is known
    CENSORED = "censored"  # a sample failed or the client left before the vote was known
    REFUSED = "refused"  # vLLM refused the request (a client error): nothing ran, no loss


SAMPLER_SEED_OFFSET = 1  # the vote's sampler draws apart from the requests' (same --orca-audit-seed)


class VoteAudit:
    """The vote guards of one bundle (one per consensus row with a certified t*) and the sampler
    that picks audited groups (see the module docstring); the guards change only by `apply`,
    the fold of a journalled `vote_event`."""

    def __init__(self, bundle: Bundle, config: AuditConfig) -> None:
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
        self.counts = dict.fromkeys(VoteCount, 0)

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
        self.counts[VoteCount.PICKED] += int(audited)
        return replace(vote, audited=audited, t_source=g.source)

    def event(self, vote: VoteSettings, delta: float, loss: float | None, *,
              refused: bool = False) -> dict[str, Any] | None:
        """The journal event of an audited group's vote loss (None: censored); None for a vote
        whose row has no guard, and for one vLLM `refused` (a client's malformed request ran
        nothing: counted as such, outside the risk, as the stop audit leaves its failures)."""
        if self.guard(delta, vote.delta_vote) is None:
            return None
        if refused:
            self.counts[VoteCount.REFUSED] += 1
            return None
        self.counts[VoteCount.CENSORED if loss is None else VoteCount.MEASURED] += 1
        return vote_event(delta, vote.delta_vote, loss)

    def apply(self, e: dict[str, Any], quiet: bool = False) -> None:
        """Fold one `vote_event` into its row's guard (identically in every process that reads
        it; `quiet`: a replay, whose guard changes are not logged again)."""
        g = self.guard(*e[VOTE])
        if g is None:
            return
        before = g.engaged
        g.observe(e["l"])
        if g.engaged != before and not quiet:
            logger.warning("orca vote audit: delta %g, delta_vote %g: %s (vote error in "
                           "[%.3f, %.3f] after %d audited groups); its groups %s",
                           g.delta, g.delta_vote, "ALARM" if g.engaged else "cleared",
                           g.cs.lower, g.cs.upper, g.cs.n,
                           "settle early" if g.source == Source.BUNDLE else
                           "wait for every sample (fallback)")

    def table(self) -> dict[str, Any]:
        """The vote's part of GET /v1/orca/audit."""
        return {"rate": self.rate, "epsilon": self.epsilon, **self.counts,
                "rows": [g.row() for g in self.guards.values()]}

    # -- in the audit's snapshots (orca_serve/live_audit/state.py) ------------------------------
    def settings(self) -> dict[str, Any]:
        """What the fold depends on besides the events: a snapshot folded under others is not
        used."""
        return {"epsilon": self.epsilon,
                "on_alarm": [str(g.on_alarm) for g in self.guards.values()],
                "rows": [[g.delta, g.delta_vote, g.t] for g in self.guards.values()]}

    def state(self) -> list[dict[str, Any]]:
        return [g.state() for g in self.guards.values()]

    def restore(self, state: list[dict[str, Any]]) -> None:
        for g, s in zip(self.guards.values(), state):
            g.restore(s)
