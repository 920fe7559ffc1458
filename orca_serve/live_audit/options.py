"""The `orca-serve` options of live auditing and the guard, and the server state they build.

Kept apart from orca_serve/startup/preflight.py, which only calls `add_audit_args`, `check_audit_args` and
`audit_labelling` (before vLLM is imported, so a bad option fails in seconds, in one line); the
server's LiveAudit is built by `orca_serve.live_audit.factory.make_live_audit`.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from orca_method.answer_probes import DEFAULT_ANSWER_TOKENS, DEFAULT_SUFFIX, ProbeSettings
from orca_method.outcomes import LABEL_STEPS, ON_ALARM, LabelSteps, OnAlarm
from orca_method.labels import require_math_verify
from orca_serve.checks.argtypes import fraction, integer
from orca_serve.live_audit.journal import EventJournal, Journal, LocalFallback, journal_path
from orca_serve.live_audit.store import AuditStore

if TYPE_CHECKING:
    from orca_method.bundle import Bundle


class EpsilonSplit(StrEnum):
    """How the guards share the bundle's epsilon (docs/AUDIT.md, "Several deltas"): PER_DELTA,
    each delta its own epsilon, the bundle's per-delta statement (the default); JOINT, epsilon / k
    for each of k deltas, so the bounds hold for all of them at once."""

    PER_DELTA = "per-delta"
    JOINT = "joint"


EPSILON_SPLITS: tuple[str, ...] = tuple(str(s) for s in EpsilonSplit)  # what argparse lists
# the stores a fleet can share its audit journal through (orca_serve/live_audit/fleet.py)
STORE_SCHEMES = ("redis", "rediss", "unix")

@dataclass(frozen=True)
class AuditConfig:
    """What the options below configure (orca_serve/live_audit/live.py `LiveAudit`)."""

    rate: float = 0.0
    vote_rate: float = 0.0  # share of voted groups (`orca.samples`) run to their end (votes.py)
    seed: int | None = None
    directory: Path | None = None
    store: str | None = None  # the fleet's shared journal (a Redis URL); None: the directory's
    on_alarm: OnAlarm = OnAlarm.REPORT
    epsilon_split: EpsilonSplit = EpsilonSplit.PER_DELTA
    other_labels: bool = False  # let on_alarm act although the bundle's label mode is not the audit's
    # let the guards answer the bundle's sequential drift alarm as their own (default: it is
    # reported only: it is evidence that the scores changed, not that the risk grew)
    drift_acts: bool = False
    window: int = 200  # audits LTT recalibrates on (on_alarm=recalibrate)
    # which steps an audit's answer probes label: every one, or only those whose labels the
    # guards read (orca_method/audit/labelling.py)
    label_steps: LabelSteps = LabelSteps.EVERY
    queue: int = 64  # finished audits waiting for labels; more are dropped
    per_dir: int = 1000  # audits per trajectory directory before rotating
    keep: int = 10  # directories kept
    probe: ProbeSettings = field(default_factory=ProbeSettings)

    @property
    def journalled(self) -> bool:
        """Whether the guards' state is kept in a journal (a store's, or the directory's)."""
        return self.store is not None or self.directory is not None


def add_audit_args(g: argparse._ActionsContainer) -> None:
    """The options of live auditing (realized risk on live traffic, docs/AUDIT-OPERATIONS.md),
    added to `g`: orca-serve's option group, so that `--help=orca-serve` lists them."""
    g.add_argument("--orca-audit-rate", type=fraction(open_interval=False), default=0.0, metavar="R",
                   help="Audit each request with probability R (0 = off): it runs in shadow "
                   "(full-budget answer) with record mode on, and is labelled in the background.")
    g.add_argument("--orca-vote-audit-rate", type=fraction(open_interval=False), default=0.0,
                   metavar="R",
                   help="Audit each voted group (orca.samples) with probability R (0 = off): it "
                   "aborts none of its samples, which run to their end after the answer is "
                   "returned, and its vote error (the settled vote differs from the vote of all "
                   "k samples) feeds the vote's anytime-valid bound (docs/AUDIT.md).")
    g.add_argument("--orca-audit-seed", type=int, default=None, metavar="S",
                   help="Seed of the audit sampler (tests; default: random).")
    g.add_argument("--orca-audit-dir", default=None, metavar="DIR",
                   help="Append labelled audits here as trajectory directories (rotated).")
    g.add_argument("--orca-audit-store", default=None, metavar="URL",
                   help="Share the guards' journal with the fleet's other replicas through "
                   "this Redis server (redis://host:port/db): one sequence and one decision "
                   "per bundle (and consensus row, for the vote's audit) for all of them "
                   "(docs/AUDIT.md, 'A fleet'). Default: the "
                   "journal in --orca-audit-dir (the servers of one machine).")
    g.add_argument("--orca-audit-per-dir", type=integer(1), default=1000, metavar="N",
                   help="Audits per trajectory directory before a new one is started.")
    g.add_argument("--orca-audit-keep", type=integer(1), default=10, metavar="K",
                   help="Audit directories kept (older ones are deleted).")
    g.add_argument("--orca-audit-queue", type=integer(1), default=64, metavar="Q",
                   help="Finished audits waiting for labels; beyond that they are dropped.")
    g.add_argument("--orca-audit-suffix", default=None, metavar="TEXT",
                   help="Answer-forcing suffix of the answer probes, for a bundle that does not "
                   "record its collection's (its `labelling` block; a value contradicting the "
                   f"block is refused). Default: the block's, else {DEFAULT_SUFFIX!r}.")
    g.add_argument("--orca-audit-answer-tokens", type=integer(1), default=None, metavar="N",
                   help="Greedy tokens per answer probe, for a bundle that does not record its "
                   "collection's (as --orca-audit-suffix). Default: the bundle's `labelling` "
                   f"block's, else {DEFAULT_ANSWER_TOKENS}.")
    g.add_argument("--orca-audit-label-every", type=integer(1), default=1, metavar="K",
                   help="Probe every K-th step (and the last), as collect's label_every.")
    g.add_argument("--orca-audit-label-steps", choices=LABEL_STEPS, default=str(LabelSteps.EVERY),
                   help="every: probe every (K-th) step of an audit; selective: only the steps "
                   "whose labels decide the guards' losses (the stop steps of the thresholds "
                   "they test, and the steps before a stop until one is right; every step "
                   "while a recalibration window may take the audit): the same bounds, alarms "
                   "and lambdas for fewer probes (docs/AUDIT.md, 'What labelling costs').")
    g.add_argument("--orca-on-alarm", choices=ON_ALARM, default=str(OnAlarm.REPORT),
                   help="When a delta's realized-risk lower bound exceeds delta: report only, "
                   "fallback (that delta stops early no more), or recalibrate (LTT on the "
                   "recent audits).")
    g.add_argument("--orca-guard-other-labels", action="store_true", default=False,
                   help="Let --orca-on-alarm act although the bundle was calibrated with other "
                   "labels than the audits' (consistency): the audited risk is then not the "
                   "certified one. Without it such a bundle's guard only reports.")
    g.add_argument("--orca-audit-drift-acts", action="store_true", default=False,
                   help="Let --orca-on-alarm answer the sequential drift test's alarm (the "
                   "scores of live requests no longer look like the calibration split's) as a "
                   "risk alarm: fallback until later audits clear it, or recalibrate. Without "
                   "it the alarm is reported only (log, table, metrics): it says the traffic "
                   "changed (other prompts, or another temperature), not that the risk grew.")
    g.add_argument("--orca-recalibrate-window", type=integer(1), default=200, metavar="N",
                   help="Audits LTT recalibrates on (--orca-on-alarm recalibrate).")
    g.add_argument("--orca-audit-epsilon-split", choices=EPSILON_SPLITS, default=str(EpsilonSplit.PER_DELTA),
                   help="per-delta: each delta's alarm and recalibrations at the bundle's "
                   "epsilon (LTT's own per-delta statement); joint: epsilon / (number of "
                   "deltas) each, so the bounds hold for all deltas at once.")


def check_audit_args(ns: argparse.Namespace, has_bundle: bool) -> None:
    """Raise ValueError (one line) for settings that cannot work; before vLLM is imported."""
    vote_rate = getattr(ns, "orca_vote_audit_rate", 0.0)
    if not has_bundle:
        if (ns.orca_audit_rate > 0 or vote_rate > 0 or ns.orca_audit_dir or ns.orca_audit_store
                or ns.orca_on_alarm != OnAlarm.REPORT
                or ns.orca_guard_other_labels or ns.orca_audit_drift_acts):
            raise ValueError("auditing (--orca-audit-*, --orca-on-alarm) needs --calib (a bundle)")
        return
    if ns.orca_audit_suffix == "":
        raise ValueError("--orca-audit-suffix is empty: the answer probes need the text that "
                         "forces an answer")
    if ns.orca_audit_rate == 0:  # options that act on audits mean nothing without them
        acts = ns.orca_on_alarm != OnAlarm.REPORT
        # the vote's audit journals its state to the directory or the fleet's store and
        # answers --orca-on-alarm too
        for opt, is_set in (("--orca-audit-dir", ns.orca_audit_dir is not None
                             and vote_rate == 0),
                            ("--orca-audit-store", ns.orca_audit_store is not None
                             and vote_rate == 0),
                            (f"--orca-on-alarm {ns.orca_on_alarm}", acts and vote_rate == 0),
                            ("--orca-audit-drift-acts", ns.orca_audit_drift_acts)):
            if is_set:
                raise ValueError(f"{opt} is set but --orca-audit-rate is 0: no request would be "
                                 "audited")
    if ns.orca_audit_store is not None:
        check_store_url(ns.orca_audit_store)
    if (ns.orca_audit_rate > 0 or vote_rate > 0) and (
            getattr(ns, "api_server_count", None) or 1) > 1:
        raise ValueError("auditing runs in one API server process (it keeps the risk statistics "
                         "and writes --orca-audit-dir); use --api-server-count 1 with "
                         "--orca-audit-rate")
    if ns.orca_audit_rate > 0:
        require_math_verify()
    if ns.orca_audit_dir is not None:
        d = Path(ns.orca_audit_dir)
        if d.exists() and not d.is_dir():
            raise ValueError(f"--orca-audit-dir {d} exists and is not a directory")


def check_store_url(url: str) -> None:
    """A Redis URL that names its server (ValueError, one line, otherwise): redis-py reads
    `redis://` with no host as localhost, which no operator meant."""
    parts = urlsplit(url)
    if parts.scheme not in STORE_SCHEMES:
        raise ValueError(f"--orca-audit-store {url!r} is not a Redis URL "
                         f"(redis://host:port/db; schemes: {', '.join(STORE_SCHEMES)})")
    where = parts.path if parts.scheme == "unix" else parts.hostname
    if not where:
        named = "a socket path (unix:///path/redis.sock)" if parts.scheme == "unix" else \
            f"a host ({parts.scheme}://host:port/db)"
        raise ValueError(f"--orca-audit-store {url!r} names no server: give {named}")
    try:
        parts.port  # read here: a bad port would otherwise surface after vLLM's import
    except ValueError as e:
        raise ValueError(f"--orca-audit-store {url!r}: {e}") from None


def audit_labelling(ns: argparse.Namespace, bundle: Bundle) -> ProbeSettings:
    """The answer probes of `bundle`'s audits: its labelling block, the flags only for a bundle
    without one (`orca_method.bundle.labelling_for`: a flag contradicting the block is a
    BundleError, refused before vLLM starts and on a hot reload)."""
    from orca_method.bundle import labelling_for  # deferred: torch (preflight's parser)

    lab = labelling_for(bundle, {
        "suffix": ("--orca-audit-suffix", ns.orca_audit_suffix),
        "answer_tokens": ("--orca-audit-answer-tokens", ns.orca_audit_answer_tokens)})
    return ProbeSettings(suffix=lab.suffix, answer_tokens=lab.answer_tokens,
                         label_every=ns.orca_audit_label_every)


def audit_config(ns: argparse.Namespace, bundle: Bundle) -> AuditConfig:
    """The live audit of `bundle` as the options configure it."""
    return AuditConfig(
        rate=ns.orca_audit_rate, vote_rate=getattr(ns, "orca_vote_audit_rate", 0.0),
        seed=ns.orca_audit_seed,
        directory=Path(ns.orca_audit_dir).absolute() if ns.orca_audit_dir else None,
        store=ns.orca_audit_store,
        on_alarm=OnAlarm(ns.orca_on_alarm), other_labels=bool(ns.orca_guard_other_labels),
        drift_acts=bool(ns.orca_audit_drift_acts),
        epsilon_split=EpsilonSplit(getattr(ns, "orca_audit_epsilon_split",
                                           EpsilonSplit.PER_DELTA)),
        window=ns.orca_recalibrate_window, queue=ns.orca_audit_queue,
        label_steps=LabelSteps(getattr(ns, "orca_audit_label_steps", LabelSteps.EVERY)),
        per_dir=ns.orca_audit_per_dir, keep=ns.orca_audit_keep,
        probe=audit_labelling(ns, bundle))


def store_info(bundle: Any, probe: ProbeSettings) -> dict[str, Any]:
    """What an audit directory records of the bundle and of how its audits are labelled (audits
    of bundles with equal info can share a directory: same model, same pooling, same labels)."""
    return {"labelling": probe.labelling(),
            "model": bundle.model.name, "normalization": bundle.normalization,
            "segmentation": bundle.segmentation.model_dump(), "think": bundle.think.model_dump(),
            "tokenizer_fingerprint": bundle.model.tokenizer_fingerprint,
            "model_config": None if bundle.model.config_fingerprint is None
            else bundle.model.config_fingerprint.model_dump(),
            "source": "orca-serve live audit"}


# The fold's format: what the journal's events decide under given flags (`fold_flags`), in this
# version. Bump it when a change alters what a fold decides on the same events (an event read
# otherwise, another statistic, another rule for a censored or a lost audit), not for one that
# only changes how audits are picked, labelled or stored: replicas of versions that fold by
# other formats are not let fold one journal together (journal.py `joined`: a rolling upgrade
# across a bump is refused on its first new replica; stop them all, then start the new version)
# and a snapshot folded by another format is not restored (state.py `_settings`). Fold records
# written before they named one read as format 1 (journal.py `UNRECORDED_FORMAT`).
FOLD_FORMAT = 1


def fold_flags(config: AuditConfig) -> dict[str, Any]:
    """The flags that change how the journal's events fold into the guards' decisions (the
    stop audit's, `orca_serve.live_audit.state`, and the vote's, `votes`), by name: the
    processes that fold one journal at once must agree on them (journal.py `joined`: a replica
    of a fleet with others is refused). The one list of them. The window is None unless a
    guard recalibrates, the only time the fold reads it; the others count whatever the bundle
    (a process's flags outlive a hot reload to a bundle for which they matter). What only
    picks, labels or stores audits (the rates, the seed, the directory, the queue, the answer
    probes) is not here."""
    return {"--orca-on-alarm": str(config.on_alarm),
            "--orca-audit-epsilon-split": str(config.epsilon_split),
            "--orca-recalibrate-window": config.window
            if config.on_alarm == OnAlarm.RECALIBRATE else None,
            "--orca-audit-drift-acts": config.drift_acts,
            "--orca-guard-other-labels": config.other_labels}


def guard_epsilon(epsilon: float, deltas: int, split: EpsilonSplit) -> float:
    """The level each delta's guard spends: the bundle's epsilon, or a k-th of it (JOINT)."""
    return epsilon / max(1, deltas) if split == EpsilonSplit.JOINT else epsilon


def audit_journal(config: AuditConfig, bundle: Any, ours: Iterable[str] = ()) -> EventJournal:
    """The bundle's event journal: on the fleet's store (orca_serve/live_audit/fleet.py), else
    in the audit directory (orca_serve/live_audit/journal.py). `ours`: the owners of this
    process's other journals (journal.py `Journal`)."""
    if config.store is not None:
        from orca_serve.live_audit.fleet import FleetJournal  # deferred: the Redis client

        return FleetJournal(config.store, bundle.checksum, config.directory, ours)
    assert config.directory is not None
    return LocalFallback(Journal(journal_path(config.directory, bundle.checksum),
                                 bundle.checksum, ours=ours))


def audit_store(config: AuditConfig, bundle: Any) -> Any:
    """The rotating store of labelled audits under `config.directory`."""
    return AuditStore(config.directory, dim=bundle.model.hidden_size, per_dir=config.per_dir,
                      keep=config.keep, info=store_info(bundle, config.probe))
