"""Offline tools for live audits: what did the audits measure, and a new bundle from them.

`audit_report` reads audits (the trajectory format, appended by the server's live audit to
rotating `audit-NNNNNN` directories: one problem per audited request, in the order they were
labelled) and replays the
bundle's probe on the recorded step embeddings with `orca_method.procedure.replay`, the code the
server runs, so each audit's scores are the ones the deployed procedure computed. It then feeds
each audit's loss at every calibrated lambda* (`orca_method.risk`, the LTT loss) to the
server's statistics (`CensoredAlarm`: anytime-valid confidence sequences restarted every 50
audits and kept at dyadic ages, the whole history's giving the bounds), in audit order, and the
scores to the drift monitor when the bundle has a reference. Only the audits the bundle's live
table counts are read (`served_by`: the ones its live audit took, never those it was
recalibrated on). Audits that did not finish (cut by max_tokens, aborted, the client gone)
enter by the server's rule (`recorded_incomplete`, `cut_feed`): with their loss at a lambda
that stops before where they ended, censored at one that would stop later (loss 0 for the
alarm; for the upper bound the loss at the cut when cut by max_tokens, else 1). Statistics:
docs/AUDIT.md.

`recalibrate` runs the calibration code (`calibrate_bundle`: replay + LTT) on the last N
audits, cut ones included with their labels up to the cut, as calibration includes cut
trajectories (docs/METHOD.md, section 5), optionally retraining the probe on a disjoint part of
them, and refuses a window that reaches back to the first alarm in the audits (`check_window`)
unless forced.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from orca_calibrate.calibrate import calibrate_bundle, parent_groups, score_split
from orca_calibrate.gate import gate_features_of, gate_from_features, options_of
from orca_calibrate.job_options import GateOptions
from orca_calibrate.train import meta_train, train_static, training_settings
from orca_method.answer_probes import CONSISTENT
from orca_method.audit.attrition import recorded_incomplete
from orca_method.audit.drift import DRIFT_WINDOW, DriftMonitor
from orca_method.audit.guards import cut_feed
from orca_method.audit.sequence import CensoredAlarm
from orca_method.bundle import (
    Bundle,
    BundleError,
    Labelling,
    Segmentation,
    labelling_for,
    save_bundle,
)
from orca_method.give_up import request_give_up_loss
from orca_method.outcomes import GiveUpLoss
from orca_method.risk import is_counted, request_losses
from orca_method.thresholds import lam_to_json
from orca_method.trajectories import ALL, Split, TrajectorySet, split_ids
from orca_serve.live_audit.options import EPSILON_SPLITS, EpsilonSplit, guard_epsilon

AUDIT_DIR = re.compile(r"^audit-\d{6}$")  # the server's rotating audit directories
# what differs between the directories of two bundles that cannot share one (store_info); the
# labelling is compared by the bundle's rule (`labelling_of_audits`)
_SAME_SERVER = ("dim", "normalization", "segmentation", "model")


def labelling_of_audits(bundle: Bundle, info: dict[str, Any]) -> Labelling:
    """How the audits with trajectory info `info` were labelled, checked against `bundle` by
    the server's rule (`orca_method.bundle.labelling_for`): a bundle's labelling block must be
    theirs (BundleError otherwise: they measure another risk); a bundle without one takes
    theirs (the server's --orca-audit-* flags set it), or the defaults when they record none."""
    recorded = info.get("labelling") or {}
    return labelling_for(bundle, {k: (f"the audits' labelling {k}", recorded.get(k))
                                  for k in Labelling.model_fields})


def open_audits(path: str | Path, bundle: Bundle | None = None) -> TrajectorySet:
    """One trajectory directory, or the server's audit root: its `audit-NNNNNN` directories,
    oldest first, read as one set (the embeddings stay memory-mapped).

    A hot reload to a bundle with other settings (model, pooling, segmentation) starts a new
    directory (orca_serve.live_audit.store); then only the directories written with `bundle`'s
    settings are read (without a bundle: the newest directory's), and the others are named on
    stderr as skipped.
    """
    root = Path(path)
    parts = (sorted(p for p in root.iterdir() if p.is_dir() and AUDIT_DIR.match(p.name))
             if root.is_dir() and not (root / "info.json").exists() else [])
    if not parts:
        ts = unseen(TrajectorySet.open(root))
        if bundle is None:
            return ts
        labelling_of_audits(bundle, ts.info)
        return served_by(bundle, ts)
    sets = [TrajectorySet.open(p) for p in parts]

    def settings(info: dict[str, Any]) -> dict[str, Any]:
        return {k: info.get(k) for k in _SAME_SERVER}

    want = settings(sets[-1].info) if bundle is None else {
        "dim": bundle.model.hidden_size, "normalization": bundle.normalization,
        "segmentation": bundle.segmentation.model_dump(), "model": bundle.model.name}
    kept = [ts for ts in sets  # a setting a directory does not record (null) is no mismatch
            if all(v is None or v == want[k] for k, v in settings(ts.info).items())
            and (bundle is None or _labelled_for(bundle, ts.info))]
    if not kept:
        shown = ", ".join(f"{k} {v!r:.60}" for k, v in want.items())
        raise ValueError(f"no audit directory under {root} was written with the bundle's "
                         f"settings ({shown}) and labelling: the server ran another bundle; "
                         "pass the bundle it ran")
    if len(kept) < len(sets):
        skipped = [ts.path.name for ts in sets if ts not in kept]
        print(f"note: reading {len(kept)} of {len(sets)} audit directories under {root}; "
              f"skipped {', '.join(skipped)}: written for another bundle's model or settings "
              "(before or after a hot reload)", file=sys.stderr)
    problems = [p for ts in kept for p in ts.problems]
    arrays = [ts.embeddings(i) for ts in kept for i in range(len(ts))]
    joined = TrajectorySet(root, kept[0].info, problems, arrays)
    return joined if bundle is None else served_by(bundle, joined)


def unseen(ts: TrajectorySet) -> TrajectorySet:
    """`ts`, unless it holds traces a job put in its training split: a probe was fitted on
    such traces and scores them better than it scores traffic, so as audits they would make a
    bundle look safer than it is (ValueError, one line). The server's audits carry no split."""
    trained = sum(p.split == Split.TRAIN for p in ts.problems)
    if trained:
        raise ValueError(f"{trained} of the {len(ts)} traces in {ts.path} are a job's training "
                         "split, which a probe was fitted on: they cannot stand for traffic; "
                         "pass the server's audits, or traces no probe was trained on")
    return ts


def served_by(bundle: Bundle, ts: TrajectorySet) -> TrajectorySet:
    """The audits of `ts` that the live table of `bundle` counts, in their order: those its
    live audit took, which the server journals per bundle checksum (a hot reload starts the new
    bundle's table afresh) and records in each audit (`extra.audit.bundle_checksum`). So after
    a reload the report of either bundle counts only its own audits, and a bundle recalibrated
    on audits never counts them: its parent's live audit took them.

    Records without a checksum (written by a server before it was recorded, or not by a server)
    cannot say which bundle took them: all are kept, except, for a bundle recalibrated on them,
    the audits up to the last one it was fitted on (`fitted_through`). Skipped audits are named
    on stderr; none left is a ValueError (one line)."""
    served = [((p.extra or {}).get("audit") or {}).get("bundle_checksum") for p in ts.problems]
    fitted = fitted_through(bundle, ts)
    keep = [i for i, c in enumerate(served)
            if (c == bundle.checksum if c is not None else i > fitted)]
    if len(keep) == len(ts):
        return ts
    others = sum(c is not None and c != bundle.checksum for c in served)
    if not keep:
        raise ValueError(f"none of the {len(ts)} audits in {ts.path} counts for the bundle "
                         f"(checksum {bundle.checksum[:16]}): {others} were taken by other "
                         f"bundles' live audits, {len(ts) - others} are audits it was "
                         "recalibrated on or older; pass the bundle the server ran")
    print(f"note: reading {len(keep)} of {len(ts)} audits in {ts.path}: the ones the bundle's "
          f"live table counts; skipped {others} taken by other bundles (before or after a hot "
          f"reload) and {len(ts) - len(keep) - others} it was recalibrated on or that predate "
          "them", file=sys.stderr)
    return TrajectorySet(ts.path, ts.info, [ts.problems[i] for i in keep],
                         [ts.embeddings(i) for i in keep])


def fitted_through(bundle: Bundle, ts: TrajectorySet) -> int:
    """The position in `ts` of the last audit `bundle` was recalibrated on (its provenance's
    window, `recalibrate`), when `ts` holds that whole window; else -1."""
    prov = bundle.provenance
    if prov.get("calibration_source") != "live audits":
        return -1
    ids = {p.id: i for i, p in enumerate(ts.problems)}
    first, last = ids.get(prov.get("audit_first_id")), ids.get(prov.get("audit_last_id"))
    if first is None or last is None or last - first + 1 != prov.get("audit_window"):
        return -1
    return last


def _labelled_for(bundle: Bundle, info: dict[str, Any]) -> bool:
    """Whether audits with trajectory info `info` were labelled as `bundle` says."""
    try:
        labelling_of_audits(bundle, info)
    except BundleError:
        return False
    return True


def unfinished(ts: TrajectorySet) -> dict[int, str]:
    """Positions of the audits that did not finish (cut by max_tokens, aborted, the client
    gone: `finish_reason` null), each with its attrition count: censored in the risk past
    where they ended, by the server's rule (orca_method.audit.attrition.recorded_incomplete,
    orca_method.audit.guards.cut_feed)."""
    return {i: cause for i, p in enumerate(ts.problems)
            if (cause := recorded_incomplete(p.extra)) is not None}


def audit_label_mode(bundle: Bundle, ts: TrajectorySet, requested: str | None = None) -> str:
    """The bundle's label mode when the audits have it, else `consistent` (what live audits
    label: agreement with the request's own final answer)."""
    modes = ts.label_modes
    mode = requested or (bundle.label_mode if bundle.label_mode in modes else CONSISTENT)
    if mode not in modes:
        raise ValueError(f"label mode {mode!r} is not in {ts.path} (it has {list(modes) or 'none'})")
    return mode


def window_view(ts: TrajectorySet, last: int | None, splits: dict[str, str] | None = None
                ) -> TrajectorySet:
    """The last ``last`` problems (all when None) as a set of their own, no copy of the
    embeddings; every problem's split is ``splits[id]`` (default: calibration)."""
    if last is not None and last < 1:
        raise ValueError(f"--last must be >= 1, got {last}")
    start = 0 if last is None else max(0, len(ts) - last)
    idx = range(start, len(ts))
    problems = [replace(ts.problems[i],
                        split=(splits or {}).get(ts.problems[i].id, Split.CALIBRATION))
                for i in idx]
    return TrajectorySet(ts.path, ts.info, problems, [ts.embeddings(i) for i in idx])


def audit_report(bundle: Bundle, ts: TrajectorySet, *, mode: str, alpha: float | None = None,
                 drift_window: int = DRIFT_WINDOW, epsilon_split: EpsilonSplit = EpsilonSplit.PER_DELTA
                 ) -> dict[str, Any]:
    """Per delta: audits counted, realized risk, confidence bounds, alarm, and their history.

    Audits that did not finish enter as in the server (`cut_feed`): known at a lambda that
    stops before where they ended, censored past it. ``alpha`` (default: the bundle's epsilon) is split across
    the deltas when ``epsilon_split`` is ``joint``, as the server's guards split it."""
    if ts.dim != bundle.model.hidden_size:
        raise ValueError(f"the bundle is for {bundle.model.hidden_size}-dim embeddings "
                         f"({bundle.model.name}) but {ts.path} has dim {ts.dim}")
    if len(ts) == 0:
        raise ValueError(f"{ts.path} holds no audit yet")
    if epsilon_split not in EPSILON_SPLITS:
        raise ValueError(f"epsilon_split must be one of {EPSILON_SPLITS}, got {epsilon_split!r}")
    deltas = bundle.deltas()
    alpha = guard_epsilon(bundle.ltt.epsilon if alpha is None else alpha, len(deltas),
                          epsilon_split)
    cut = unfinished(ts)
    scored = score_split(bundle.load_probe(), ts, ALL, mode, bundle.window, solvable_only=False)
    lams = [bundle.lam(d) for d in deltas]
    cs = CensoredAlarm(alpha, shape=(len(deltas),))  # the server's statistics (live.py)
    drift = DriftMonitor.from_bundle(bundle, window=min(drift_window, max(10, len(ts))))
    history: dict[str, list] = {"mean": [], "lower": [], "upper": []}
    first_alarm: list[int | None] = [None] * len(deltas)
    first_position: list[int | None] = [None] * len(deltas)
    skipped = 0
    for i, (s, c) in enumerate(zip(scored.scores, scored.labels)):
        censored = i in cut
        if drift is not None and len(s) >= 2 and not censored:
            drift.observe(s[:-1])  # the server does not score the step that ends the thinking
        if not censored and not is_counted(c, bundle.ltt.excluded_never_correct):
            skipped += 1
            continue
        if not censored:
            cs.update(request_losses(s, c, lams).astype(float))
        elif not is_counted(c, bundle.ltt.excluded_never_correct):
            cs.update(np.zeros(len(deltas)), True)  # never right up to its end: unknown
        else:
            cs.update(*map(np.asarray, zip(*(cut_feed(s, c, lam, cut[i]) for lam in lams))))
        for key, values in history.items():
            values.append(np.asarray(getattr(cs, key)).tolist())
        for j, fired in enumerate(cs.alarm(np.asarray(deltas))):
            if first_alarm[j] is None and fired:
                first_alarm[j], first_position[j] = cs.n, i + 1
    alarm = cs.alarm(np.asarray(deltas))
    since, since_lower = cs.alarm_source(np.asarray(deltas))
    low, high = cs.risk_range
    rows = []
    for j, (d, lam) in enumerate(zip(deltas, lams)):
        rows.append({"delta": d, "lambda": lam_to_json(lam), "n": cs.n,
                     "censored": int(cs.censored[j]),
                     "risk": None if math.isnan(cs.mean[j]) else float(cs.mean[j]),
                     "risk_range": [float(low[j]), float(high[j])] if cs.n else None,
                     "lower": float(cs.lower[j]), "upper": float(cs.upper[j]),
                     "alarm": bool(alarm[j]), "first_alarm_at": first_alarm[j],
                     "first_alarm_audit": first_position[j],
                     "alarm_since": int(since[j]) if alarm[j] else None,
                     "alarm_lower": float(since_lower[j]) if alarm[j] else None})
    report: dict[str, Any] = {
        "audit": str(ts.path), "audits": len(ts), "unfinished_censored": len(cut),
        "counted": cs.n, "never_correct_skipped": skipped,
        "label_mode": mode, "bundle_label_mode": bundle.label_mode,
        "labels_match": mode == bundle.label_mode, "alpha": alpha,
        "epsilon_split": epsilon_split,
        "confidence_sequence": "hedged capital, Waudby-Smith & Ramdas (2024)", "deltas": rows,
        "history": {k: np.asarray(v).T.tolist() for k, v in history.items()}}
    give_up = give_up_report(bundle, ts, mode, cut, epsilon_split)
    if give_up is not None:
        report["give_up"] = give_up
    if drift is not None:
        report["drift"] = {"window": drift.window, "observed": drift.observed,
                           "tests": drift.tests, "pvalue": drift.pvalue,
                           "alarms": drift.alarms, "alarm": drift.alarm}
    return report



def give_up_report(bundle: Bundle, ts: TrajectorySet, mode: str, cut: dict[int, str],
                   epsilon_split: EpsilonSplit) -> dict[str, Any] | None:
    """Per give-up delta of a two-sided bundle, the server's give-up guard replayed: the
    give-up probe replayed on every audit (never-right ones too: the give-up risk is over all
    requests), its loss at mu* fed in audit order to a CensoredAlarm at the give-up table's
    epsilon (split as the server splits it), unfinished audits censored.

    The loss is the certified one, of the give-up policy the bundle was certified for
    (`GiveUpPolicy.certified_loss`), when the audits carry the give-up's reference labels (a collection); server audits
    label by consistency only, and then it is whether the audit gave up, at least the certified
    loss of either policy (docs/AUDIT.md, "The give-up risk").
    None for a one-sided bundle."""
    gu = bundle.give_up
    if gu is None:
        return None
    known = gu.label_mode in ts.label_modes
    scored = score_split(bundle.load_give_up_probe(), ts, ALL, gu.label_mode if known else mode,
                         gu.window, solvable_only=False)
    deltas = bundle.give_up_deltas()
    mus = [bundle.mu(d) for d in deltas]
    cs = CensoredAlarm(guard_epsilon(gu.ltt.epsilon, len(deltas), epsilon_split),
                       shape=(len(deltas),))
    first_alarm: list[int | None] = [None] * len(deltas)
    for i, g in enumerate(scored.scores):  # every audit, in order (split ALL)
        raw = ts.raw_labels(i, gu.label_mode) if known else None
        cs.update(np.array([request_give_up_loss(g, mu, raw, gu.policy) for mu in mus],
                           dtype=float),
                  i in cut)
        for j, fired in enumerate(cs.alarm(np.asarray(deltas))):
            if first_alarm[j] is None and fired:
                first_alarm[j] = i + 1
    alarm = cs.alarm(np.asarray(deltas))
    return {"label_mode": gu.label_mode if known else mode, "policy": gu.policy,
            "loss": gu.policy.certified_loss if known else GiveUpLoss.GAVE_UP,
            "alpha": guard_epsilon(gu.ltt.epsilon, len(deltas), epsilon_split), "n": cs.n,
            "deltas": [{"delta": d, "mu": None if math.isinf(mu) else mu,
                        "censored": int(cs.censored[j]),
                        "risk": None if math.isnan(cs.mean[j]) else float(cs.mean[j]),
                        "lower": float(cs.lower[j]), "upper": float(cs.upper[j]),
                        "alarm": bool(alarm[j]), "first_alarm_audit": first_alarm[j]}
                       for j, (d, mu) in enumerate(zip(deltas, mus))]}


def format_report(report: dict[str, Any]) -> str:
    lines = [(f"{report['audit']}: {report['audits']} audits, {report['counted']} counted "
              f"({report['unfinished_censored']} unfinished among them, each counted with its "
              f"loss where lambda* stops before its end, else censored: loss 0 for the alarm, "
              f"its loss at the cut (1 if aborted) for the upper bound; "
              f"{report['never_correct_skipped']} never "
              f"correct, left out), labels {report['label_mode']}, alarm at level "
              f"alpha={report['alpha']:g}/2 per delta ({report['epsilon_split']}), bounds at "
              f"alpha={report['alpha'] / 2:g} (anytime-valid)")]
    if not report["labels_match"]:
        lines.append(f"note: the bundle certifies the risk under {report['bundle_label_mode']} "
                     f"labels; these audits measure it under {report['label_mode']} labels, so "
                     "the risk below is not the certified one (a server's guard only reports "
                     "it unless --orca-guard-other-labels)")
    for r in report["deltas"]:
        lam = "never" if r["lambda"] is None else f"{r['lambda']:.4f}"
        risk = "-" if r["risk"] is None else f"{r['risk']:.3f}"
        if r["censored"]:
            risk += f" (range {r['risk_range'][0]:.3f}-{r['risk_range'][1]:.3f}, " \
                    f"{r['censored']} censored)"
        flag = (f"ALARM (first at counted audit {r['first_alarm_at']}, audit "
                f"{r['first_alarm_audit']} of the directory; the audits after "
                f"{r['alarm_since']} have lower bound {r['alarm_lower']:.3f})" if r["alarm"]
                else "ok")
        lines.append(f"  delta={r['delta']:<5g} lambda*={lam:<8} n={r['n']:<5} risk={risk} "
                     f"bounds=[{r['lower']:.3f}, {r['upper']:.3f}] {flag}")
    if "give_up" in report:
        g = report["give_up"]
        what = (g["loss"].replace("_", " ") + f" (certified for give-up policy {g['policy']})"
                if g["loss"] != GiveUpLoss.GAVE_UP else
                "gave up (these audits cannot tell a right end: at least the certified loss, so "
                "the upper bound holds for the certified risk, an alarm only says the give-up "
                "rate exceeds delta_2)")
        lines.append(f"  give-up: {g['n']} audits, loss = {what}, labels {g['label_mode']}, "
                     f"alarm at level alpha={g['alpha']:g}/2 per give-up delta")
        for r in g["deltas"]:
            mu = "never" if r["mu"] is None else f"{r['mu']:.4f}"
            risk = "-" if r["risk"] is None else f"{r['risk']:.3f}"
            flag = (f"ALARM (first at audit {r['first_alarm_audit']} of the directory)"
                    if r["alarm"] else "ok")
            lines.append(f"  give-up delta={r['delta']:<5g} mu*={mu:<8} risk={risk} "
                         f"({r['censored']} censored) bounds=[{r['lower']:.3f}, "
                         f"{r['upper']:.3f}] {flag}")
    if "drift" in report:
        d = report["drift"]
        last = "no test yet" if d["pvalue"] is None else f"last p={d['pvalue']:.3g}"
        lines.append(f"  drift: {d['tests']} tests of {d['window']}-request windows, {last}, "
                     f"alarms={d['alarms']}, {'ALARM' if d['alarm'] else 'ok'}")
    else:
        lines.append("  drift: the bundle has no drift reference (calibrated before it existed)")
    return "\n".join(lines)


def plot_report(report: dict[str, Any], out_dir: Path) -> Path:
    """Realized risk and its confidence bounds over the audits, one panel per delta."""
    import matplotlib  # deferred: matplotlib (only --plots draws)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: matplotlib (only --plots draws)

    out_dir.mkdir(parents=True, exist_ok=True)
    rows, hist = report["deltas"], report["history"]
    fig, axes = plt.subplots(1, len(rows), figsize=(4 * len(rows), 3.5), squeeze=False)
    t = np.arange(1, report["counted"] + 1)
    for j, (ax, r) in enumerate(zip(axes[0], rows)):
        if report["counted"]:
            ax.fill_between(t, hist["lower"][j], hist["upper"][j], alpha=0.25,
                            label=f"{1 - report['alpha'] / 2:.1%} confidence sequence")
            ax.plot(t, hist["mean"][j], label="realized risk")
        ax.axhline(r["delta"], color="r", ls="--", label="delta")
        if r["first_alarm_at"] is not None:
            ax.axvline(r["first_alarm_at"], color="r", ls=":", label="alarm")
        ax.set(xlabel="audit", ylabel="risk", ylim=(0, min(1.0, 3 * max(rows[-1]["delta"], 0.1))),
               title=f"delta={r['delta']:g}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "audit_risk.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def first_alarm(bundle: Bundle, ts: TrajectorySet, mode: str) -> int | None:
    """The 1-based position in `ts` of the audit at which the server's alarm (replayed by
    `audit_report`) first fired at any delta of the bundle; None when it never fired."""
    fired = [r["first_alarm_audit"] for r in audit_report(bundle, ts, mode=mode)["deltas"]
             if r["first_alarm_audit"] is not None]
    return min(fired, default=None)


def check_window(bundle: Bundle, ts: TrajectorySet, mode: str, last: int | None) -> None:
    """Refuse (ValueError, one line) a window holding audits from up to the first alarm.

    An alarm says the traffic changed; audits from before it are not exchangeable with what
    comes after, and choosing the window because of what its audits showed voids LTT's
    statement. The window must hold only audits after the alarm."""
    at = first_alarm(bundle, ts, mode)
    start = 0 if last is None else max(0, len(ts) - last)  # 0-based: audits start+1 .. len
    if at is not None and start < at:
        most = len(ts) - at
        raise ValueError(
            f"the window (audits {start + 1}-{len(ts)} of {ts.path}) reaches back to "
            f"or before the first alarm (audit {at}): "
            + (f"use --last {most} or fewer" if most else "wait for audits after the alarm")
            + ", or --force to use it anyway")


def recalibrate(bundle: Bundle, ts: TrajectorySet, out: Path, *, mode: str,
                last: int | None = None, retrain: bool = False,
                train_options: dict | None = None, seed: int = 0,
                bundle_path: str | None = None, force: bool = False,
                drop_give_up: bool = False) -> Bundle:
    """LTT (the calibrate code) on the audits of the window; the same probe unless ``retrain``.

    A two-sided bundle's give-up block is kept as its parent has it, certified on the parent's
    calibration data: its mu* holds with any lambda* (docs/METHOD.md section 9), and live
    audits cannot re-certify it (they have no reference labels, which a give-up risk needs).
    ``drop_give_up`` writes a one-sided bundle instead (the caller warns: requests asking to
    give up are then refused). Group tables are kept likewise unless ``retrain``
    (`parent_groups`); a consensus block is not (its rows stop samples at the old lambda*).

    Cut audits are in the window with their labels up to the cut, as calibration keeps cut
    trajectories (``last`` counts every audit). Unless ``force``,
    a window reaching back to or before the first alarm is refused (``check_window``). With
    ``retrain`` the window is split by prompt (seeded) into a training half and a
    calibration half: LTT must not see the data the probe was fitted to. ``train_options``
    are `meta_train` settings as `orca-calibrate train` takes them (None: its defaults).
    """
    if ts.dim != bundle.model.hidden_size:
        raise ValueError(f"the bundle is for {bundle.model.hidden_size}-dim embeddings "
                         f"but {ts.path} has dim {ts.dim}")
    settings = {"normalization": (ts.info.get("normalization"), bundle.normalization),
                "segmentation": (Segmentation(**(ts.info.get("segmentation") or {})),
                                 bundle.segmentation)}
    for name, (theirs, ours) in settings.items():
        if theirs != ours:
            raise ValueError(f"the audits' {name} {theirs!r} differs from the bundle's {ours!r}: "
                             "they were not recorded by a server running this bundle")
    labelling = labelling_of_audits(bundle, ts.info)
    if not force:
        check_window(bundle, ts, mode, last)
    view = window_view(ts, last)
    if retrain:
        ids = [p.id for p in view.problems]
        groups = {p.id: p.prompt or p.id for p in view.problems}
        splits = split_ids(ids, (0.5, 0.5, 0.0), seed=seed, groups=groups)
        view = window_view(ts, last, splits)
        probe, facts = _retrain(bundle, view, mode, train_options or {}, seed=seed)
    else:
        probe, facts = bundle.load_probe(), {"probe": "the parent bundle's"}
    # the new bundle records how the audits were labelled (the parent's block if they do not)
    view.info = {**view.info, "labelling": labelling.model_dump()}
    ids = [p.id for p in view.problems]
    provenance = {"calibration_source": "live audits", "audit_window": len(ids),
                  "audit_first_id": ids[0], "audit_last_id": ids[-1],
                  "parent_bundle": bundle_path, "parent_checksum": bundle.checksum,
                  "retrained": retrain, **facts}
    if bundle.give_up is not None:
        provenance["give_up"] = ("dropped (--drop-give-up)" if drop_give_up else
                                 "the parent bundle's, kept as calibrated")
    groups, said = parent_groups(bundle, same_probe=not retrain)
    provenance.update(said)
    # the gate, with the parent's settings, for the traffic the window holds: with `retrain`
    # fitted on its training half and scored on its calibration half (calibrate_bundle); without,
    # the window has no training half, so a seeded half of its audits fits it and the other half
    # scores it (as `orca-calibrate gate` fits one on fresh prompts)
    gate = GateOptions() if bundle.shift_gate is None else options_of(bundle.shift_gate)
    own_gate = None
    if not retrain and bundle.shift_gate is not None:
        features = gate_features_of([view.embeddings(i) for i in range(len(view))], gate.steps)
        try:
            own_gate = gate_from_features(features, gate, fit_fraction=0.5, seed=seed)
            provenance["shift_gate"] = "fitted on a seeded half of the window's audits"
        except ValueError as e:
            provenance["shift_gate"] = f"none: {e}"
    fresh = calibrate_bundle(probe, view, out, mode=mode, deltas=bundle.deltas(),
                             epsilon=bundle.ltt.epsilon, pvalue=bundle.ltt.pvalue,
                             window=bundle.window, default_delta=bundle.default_delta,
                             provenance=provenance, gate=gate, groups=groups,
                             give_up=None if drop_give_up else bundle.give_up)
    if own_gate is None:
        return fresh
    return save_bundle(fresh.model_copy(update={"shift_gate": own_gate}), out)


def _retrain(bundle: Bundle, ts: TrajectorySet, mode: str, options: dict, *,
             seed: int) -> tuple[Any, dict[str, Any]]:
    """A probe of the bundle's variant, trained on the window's training half."""
    spec = bundle.spec()
    if not ts.split(Split.TRAIN):
        raise ValueError("the audit window is too small to retrain: no training problem")
    if not spec.online:
        return train_static(ts, mode, seed=seed), {"probe": "static, retrained"}
    settings = training_settings(spec, options)
    res = meta_train(ts, spec, mode, seed=seed, checkpoints=None, progress=False, **settings)
    return res.probe, {"probe": f"{spec.name}, retrained", **settings,
                       "selected_epoch": res.epoch}
