"""Choose lambda* per delta by LTT on the calibration split and seal the result in a bundle.

The scores come from `orca_method.procedure.replay`, i.e. the server's own code path, so the
threshold is certified for exactly the procedure that will run online (docs/METHOD.md section 5).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from orca_calibrate.gate import gate_from_trajectories
from orca_calibrate.group_options import GroupOptions  # re-exported
from orca_calibrate.job_options import DEFAULT_DELTAS, DEFAULT_WINDOW, GateOptions, LttOptions
from orca_calibrate.train import solvable
from orca_method.answer_probes import SUPERVISED
from orca_method.audit.drift import build_reference
from orca_method.bundle import (
    COLLECTED_UNDER,
    Bundle,
    DriftReference,
    GateReference,
    GiveUpBlock,
    GiveUpRow,
    Generation,
    GiveUpTable,
    GroupTable,
    Labelling,
    LTTRow,
    LTTTable,
    ModelIdentity,
    ProbeBlock,
    Segmentation,
    ThinkTags,
    encode_weights,
    give_up_label_mode,
    save_bundle,
    schema_version_for,
)
from orca_method.bundle_checks import check_semantics
from orca_method.give_up import calibrate_give_up, last_right, mu_grid
from orca_method.ltt import DEFAULT_EPSILON, DeltaResult, calibrate, default_grid
from orca_method.normalizations import DEFAULT_NORMALIZATION
from orca_method.outcomes import GiveUpPolicy, PValue, Side
from orca_method.probe import Probe
from orca_method.procedure import replay
from orca_method.risk import is_solvable
from orca_method.selective import DecidingSteps, deciding_steps
from orca_method.thresholds import GROUP_NAME_MAX, lam_to_json
from orca_method.trajectories import Problem, Split, TrajectorySet
from orca_serve import __version__

DEFAULT_GIVE_UP_DELTAS = (0.02, 0.05, 0.1)
GRID_SIZE = 1001
PROBLEM_FIELDS = {f.name for f in fields(Problem)}  # a group field is one of these, or an extra
# What a trajectory set's labels and step embeddings depend on besides the model and the step
# cut (`check_bundle` checks those): the answer probe's suffix and length (the loss), the think
# tags (where reasoning ends) and the pooling. Recorded in a set's info by its collector.
MADE_WITH = ("labelling", "think", "normalization")


@dataclass(frozen=True)
class GiveUpOptions:
    """How the give-up threshold is calibrated (docs/METHOD.md section 9); `window` None: the
    bundle's smoothing window, `default_delta` None: 0.05 if calibrated, else the first."""

    label_mode: str = SUPERVISED
    deltas: tuple[float, ...] = DEFAULT_GIVE_UP_DELTAS
    epsilon: float = DEFAULT_EPSILON
    window: int | None = None
    default_delta: float | None = None
    # what a given-up request serves under the server's --orca-give-up-policy, the one mu* is
    # certified for (its own loss, orca_method.give_up.give_up_losses); the server refuses others
    policy: GiveUpPolicy = GiveUpPolicy.GUESS

    def __post_init__(self) -> None:
        LttOptions(tuple(self.deltas), self.epsilon, self.window or DEFAULT_WINDOW)  # LTT's checks
        give_up_label_mode(self.label_mode)  # the bundle's rule, before a job collects


def group_of(ts: TrajectorySet, i: int, field: str) -> str | None:
    """Problem i's group: its `field` (a Problem field, else a key of its `extra`) as a string,
    None when it has none."""
    p = ts.problems[i]
    v = getattr(p, field) if field in PROBLEM_FIELDS else (p.extra or {}).get(field)
    return None if v is None else str(v)


@dataclass
class Scored:
    """Replayed problems of one split: ids, smoothed scores, cumulative labels, step tokens."""

    ids: list[str]
    scores: list[np.ndarray]
    labels: list[np.ndarray]
    tokens: list[np.ndarray] | None

    def solvable(self) -> Scored:
        """The problems with a correct step: those LTT's risk is about."""
        keep = [i for i, c in enumerate(self.labels) if is_solvable(c)]
        return Scored(ids=[self.ids[i] for i in keep], scores=[self.scores[i] for i in keep],
                      labels=[self.labels[i] for i in keep],
                      tokens=None if self.tokens is None else [self.tokens[i] for i in keep])


def score_split(probe: Probe, ts: TrajectorySet, split: str, mode: str, window: int,
                solvable_only: bool = True, members: Sequence[int] | None = None) -> Scored:
    """Replay the deployed procedure on a split's solvable problems (split ALL: every problem;
    ``solvable_only=False``: the unsolvable ones too; `members`: these problems of it only, e.g.
    one group's, with `split` naming them in errors)."""
    if probe.spec.dim != ts.dim:
        raise ValueError(f"the probe takes {probe.spec.dim}-dim embeddings but {ts.path} has "
                         f"dim {ts.dim}: train the probe on this data's model")
    if members is None:
        members = ts.split(split)
    idx = solvable(ts, members, mode) if solvable_only else members
    if not idx or not solvable(ts, idx, mode):
        raise ValueError(f"the {split} split of {ts.path} has no problem with a correct step "
                         f"under label mode '{mode}' (problems in split: {len(members)})")
    runs = replay(probe, [ts.embeddings(i) for i in idx], window=window)
    has_tokens = all(ts.problems[i].step_tokens is not None for i in idx)
    return Scored(ids=[ts.problems[i].id for i in idx],
                  scores=[s.numpy().astype(np.float64) for _, s in runs],
                  labels=[ts.labels(i, mode) for i in idx],
                  tokens=[np.asarray(ts.problems[i].step_tokens) for i in idx] if has_tokens else None)


def deciding_points(probe: Probe, ts: TrajectorySet, members: Sequence[int], *, mode: str,
                    window: int, label_every: int,
                    give_up: tuple[Probe, GiveUpOptions] | None = None
                    ) -> dict[str, dict[str, DecidingSteps]]:
    """id -> label mode -> the steps whose labels decide this stage's LTT on `members` (the
    calibration split; orca_method/selective.py): the stop side under `mode` from the probe's
    replayed scores (as `score_split` replays them), the give-up side under the give-up label
    mode from the give-up probe's. What `orca_calibrate.collect.label_deferred` probes."""
    runs = replay(probe, [ts.embeddings(i) for i in members], window=window)
    lams = default_grid(GRID_SIZE)
    g_runs = None if give_up is None else replay(
        give_up[0], [ts.embeddings(i) for i in members], window=give_up[1].window or window)
    out: dict[str, dict[str, DecidingSteps]] = {}
    for k, i in enumerate(members):
        stop = runs[k][1].numpy().astype(np.float64)
        modes = {mode: deciding_steps(stop, lams, label_every=label_every)}
        if give_up is not None:
            opts, g = give_up[1], g_runs[k][1].numpy().astype(np.float64)
            side = deciding_steps(stop if opts.label_mode == mode else None, lams,
                                  label_every=label_every, give_up_scores=g,
                                  mu_grid=mu_grid(GRID_SIZE),
                                  solvable=opts.label_mode == mode
                                  or opts.policy == GiveUpPolicy.MESSAGE)
            modes[opts.label_mode] = side
        out[ts.problems[i].id] = modes
    return out


def check_labelled(ts: TrajectorySet, members: Sequence[int], side: Side, mode: str) -> None:
    """Refuse traces whose labels were chosen selectively (`extra.selective`) for another label
    mode's LTT on this `side`, or are still pending: their labels are every-step labels only at
    the points that LTT reads."""
    for i in members:
        sel = (ts.problems[i].extra or {}).get("selective")
        if sel is None:
            continue
        resolved = (sel.get("resolved") or {}).get(side)
        if resolved != mode:
            state = "still pending" if not sel.get("resolved") else f"chosen for '{resolved}'"
            raise ValueError(f"problem {ts.problems[i].id!r} of {ts.path} was labelled "
                             f"selectively and its {side.replace('_', '-')} labels are {state}, "
                             f"not for label mode '{mode}'; rerun the job (its label stage "
                             "probes what this calibration reads)")


def run_ltt(scored: Scored, deltas: Sequence[float], epsilon: float, pvalue: PValue) -> list[DeltaResult]:
    return calibrate(scored.scores, scored.labels, deltas, epsilon=epsilon,
                     grid=default_grid(GRID_SIZE), pvalue=pvalue, step_tokens=scored.tokens)


def give_up_block(probe: Probe, ts: TrajectorySet, opts: GiveUpOptions, *, window: int,
                  pvalue: PValue) -> GiveUpBlock:
    """LTT for mu* per give-up delta on EVERY trace of the calibration split (the give-up risk
    is over all requests), with reference labels `opts.label_mode`, certified for the give-up
    policy `opts.policy`."""
    deltas = tuple(float(d) for d in opts.deltas)
    default = opts.default_delta if opts.default_delta is not None else (
        0.05 if 0.05 in deltas else deltas[0])
    if default not in deltas:
        raise ValueError(f"default give-up delta {default} is not among {deltas}")
    window = opts.window or window
    return GiveUpBlock(
        probe=ProbeBlock(spec=json.loads(probe.spec.to_json()), weights=encode_weights(probe),
                         eta=probe.params["log_eta"].exp().item()),
        window=window, label_mode=opts.label_mode, default_delta=default, policy=opts.policy,
        ltt=give_up_table(probe, ts, ts.split(Split.CALIBRATION), opts, window=window,
                          pvalue=pvalue))


def give_up_table(probe: Probe, ts: TrajectorySet, members: Sequence[int], opts: GiveUpOptions,
                  *, window: int, pvalue: PValue, what: str = "calibration") -> GiveUpTable:
    """LTT for mu* per give-up delta on every trace of `members` (the calibration split, or
    one group's part of it: `what` names it)."""
    everything = score_split(probe, ts, what, opts.label_mode, window, solvable_only=False,
                             members=members)
    last = [last_right(ts.raw_labels(i, opts.label_mode)) for i in members]
    results = calibrate_give_up(everything.scores, last, tuple(float(d) for d in opts.deltas),
                                epsilon=opts.epsilon, grid=mu_grid(GRID_SIZE), pvalue=pvalue,
                                policy=opts.policy)
    rows = [GiveUpRow(delta=r.delta, mu=lam_to_json(r.mu), risk=r.risk,
                      pvalue=r.pvalue, give_up_rate=r.give_up_rate) for r in results]
    return GiveUpTable(epsilon=opts.epsilon, n_cal=len(last), pvalue=pvalue,
                       grid_size=GRID_SIZE, rows=rows)


def ltt_table(results: list[DeltaResult], *, epsilon: float, pvalue: PValue,
              n_cal: int) -> LTTTable:
    """LTT's results as a bundle's table (the main one, or a group's)."""
    rows = [LTTRow(delta=r.delta, lam=lam_to_json(round(r.lam, 6)), risk=r.risk,
                   pvalue=r.pvalue, savings=r.savings_total_steps,
                   token_savings=r.token_savings_total)
            for r in results]
    return LTTTable(epsilon=epsilon, n_cal=n_cal, pvalue=pvalue, grid_size=GRID_SIZE, rows=rows)


def group_tables(probe: Probe, ts: TrajectorySet, opts: GroupOptions, *, mode: str,
                 deltas: Sequence[float], epsilon: float, pvalue: PValue, window: int,
                 give_up: tuple[Probe, GiveUpOptions] | None = None,
                 calibration: Sequence[int] | None = None) -> dict[str, GroupTable]:
    """Each group's tables, by LTT on the calibration traces of that group only (the guarantee
    then holds within the group: docs/METHOD.md section 12); `calibration`: those traces of
    `ts` (default: its calibration split; a calibration-only set's: all of them). A group with
    fewer than `opts.min_n` solvable traces (its lambda* n_cal) gets none, with a printed note;
    `give_up` (a give-up probe and its options): mu* on all of the group's traces too."""
    members: dict[str, list[int]] = {}
    for i in ts.split(Split.CALIBRATION) if calibration is None else calibration:
        g = group_of(ts, i, opts.field)
        if g is not None:
            members.setdefault(g, []).append(i)
    if not members:
        where = "calibration split" if calibration is None else "calibration traces"
        raise ValueError(f"calibrate.groups: no problem of {ts.path}'s {where} has a "
                         f"{opts.field!r} tag; tag them, or calibrate without groups")
    out: dict[str, GroupTable] = {}
    for name, idx in sorted(members.items()):
        count = len(solvable(ts, idx, mode))
        if count < opts.min_n or len(name) > GROUP_NAME_MAX:
            why = (f"{count} solvable calibration traces < min_n {opts.min_n}"
                   if count < opts.min_n else f"its name is over {GROUP_NAME_MAX} characters")
            print(f"calibrate: group {name!r:.70} gets no table of its own ({why}); its "
                  "requests are served with the main table, through the shift gate")
            continue
        scored = score_split(probe, ts, f"calibration ({opts.field} {name})", mode, window,
                             members=idx)
        table = ltt_table(run_ltt(scored, deltas, epsilon, pvalue), epsilon=epsilon,
                          pvalue=pvalue, n_cal=len(scored.ids))
        out[name] = GroupTable(ltt=table, give_up=None if give_up is None else give_up_table(
            give_up[0], ts, idx, give_up[1], window=give_up[1].window or window, pvalue=pvalue,
            what=f"calibration ({opts.field} {name})"))
    return out


def calibration_only(ts: TrajectorySet) -> list[int]:
    """Every trace of a group's calibration set, refusing a set that a job split (its training
    split trained the probe, its calibration split chose the main lambda*: traces used for
    either are not exchangeable with fresh traffic given the bundle)."""
    used = next((p for p in ts.problems if p.split is not None), None)
    if used is not None:
        raise ValueError(f"problem {used.id!r:.70} of {ts.path} is in a job's {used.split!r:.20} "
                         "split; a group set holds calibration traces only, none trained on or "
                         "used to choose anything (collect its prompts apart, or use "
                         "calibrate.groups on the job's own calibration split)")
    return list(range(len(ts)))


def check_made_alike(ts: TrajectorySet, reference: dict[str, Any], what: str) -> None:
    """Refuse a group's set recorded with another labelling, think tags or pooling than
    `reference` (the info of the data the bundle was calibrated on, or the bundle's own fields):
    its losses would measure another risk than the one certified, or its embeddings would not be
    the ones the probe reads. A field either side does not record is not compared."""
    for key in MADE_WITH:
        ours, theirs = reference.get(key), ts.info.get(key)
        if ours is not None and theirs is not None and ours != theirs:
            if isinstance(ours, dict) and isinstance(theirs, dict):  # name the setting apart
                sub = next(k for k in sorted(ours.keys() | theirs.keys())
                           if ours.get(k) != theirs.get(k))
                key, ours, theirs = f"{key}.{sub}", ours.get(sub), theirs.get(sub)
            raise ValueError(f"{ts.path} was recorded with {key} {theirs!r:.80}, {what} with "
                             f"{ours!r:.80}: collect a group's set with the job's own collect "
                             "block (its `groups` stage)")


def set_group_tables(probe: Probe, sets: Sequence[TrajectorySet], opts: GroupOptions, *,
                     mode: str, deltas: Sequence[float], epsilon: float, pvalue: PValue,
                     window: int, made_with: tuple[dict[str, Any], str],
                     give_up: tuple[Probe, GiveUpOptions] | None = None
                     ) -> dict[str, GroupTable]:
    """The tables of the groups of calibration-only trajectory sets (`group_tables` on every
    trace of each set): the statement of group g then needs only g's set exchangeable with g's
    traffic (docs/METHOD.md section 12). A group's traces come from one set, recorded as
    `made_with` says the bundle's data was (its fields and its name: `check_made_alike`)."""
    out: dict[str, GroupTable] = {}
    named: dict[str, str] = {}  # group -> the set its traces are in
    for ts in sets:
        check_made_alike(ts, *made_with)
        members = calibration_only(ts)
        check_labelled(ts, members, Side.STOP, mode)
        if give_up is not None:
            check_labelled(ts, members, Side.GIVE_UP, give_up[1].label_mode)
        for g in {group_of(ts, i, opts.field) for i in members} - {None}:
            if named.setdefault(g, str(ts.path)) != str(ts.path):
                raise ValueError(f"group {g!r:.70} has calibration traces in {named[g]} and in "
                                 f"{ts.path}; collect a group's prompts into one set")
        out.update(group_tables(probe, ts, opts, mode=mode, deltas=deltas, epsilon=epsilon,
                                pvalue=pvalue, window=window, give_up=give_up,
                                calibration=members))
    return out


def give_up_options(block: GiveUpBlock) -> GiveUpOptions:
    """The options a bundle's give-up block was certified with, so that a group's mu* is
    certified as the main one was (its deltas, epsilon, window, reference labels, policy)."""
    return GiveUpOptions(label_mode=block.label_mode, deltas=tuple(r.delta for r in block.ltt.rows),
                         epsilon=block.ltt.epsilon, window=block.window,
                         default_delta=block.default_delta, policy=block.policy)


def add_groups(bundle: Bundle, sets: Sequence[TrajectorySet], opts: GroupOptions,
               out: Path) -> Bundle:
    """`orca-calibrate groups`: `bundle` with the tables of the groups of calibration-only sets
    added (`set_group_tables`, with the bundle's own probes, window, label modes, deltas and
    epsilons), every other field as it was: an untagged request, or one of a group the bundle
    does not know, is served exactly as before. A group the bundle has a table for already is
    refused (its calibration set is fixed). The caller checks the sets against the bundle's
    model first (`check_bundle`, as `orca-calibrate groups` does with `--force-model`)."""
    if bundle.give_up is not None and bundle.give_up.ltt.pvalue != bundle.ltt.pvalue:
        raise ValueError("the bundle's lambda* and mu* tables use different p-values; a group's "
                         "tables are certified with one")
    give_up = None if bundle.give_up is None else (bundle.load_give_up_probe(),
                                                   give_up_options(bundle.give_up))
    made_with = {"labelling": None if bundle.labelling is None else bundle.labelling.model_dump(),
                 "think": bundle.think.model_dump(), "normalization": bundle.normalization}
    tables = set_group_tables(bundle.load_probe(), sets, opts, mode=bundle.label_mode,
                              deltas=bundle.deltas(), epsilon=bundle.ltt.epsilon,
                              pvalue=bundle.ltt.pvalue, window=bundle.window,
                              made_with=(made_with, "the bundle's data"), give_up=give_up)
    if not tables:
        raise ValueError(f"no group of {', '.join(str(ts.path) for ts in sets)} has min_n "
                         f"{opts.min_n} solvable traces: no table to add")
    have = sorted(set(tables) & set(bundle.groups or {}))
    if have:
        raise ValueError(f"the bundle has a table for group {have[0]!r:.70} already; its "
                         "calibration set is fixed (calibrate it again from its job instead)")
    grown = bundle.model_copy(update={
        "groups": {**(bundle.groups or {}), **tables}, "checksum": "",
        "provenance": {**bundle.provenance, "group_data": [
            *bundle.provenance.get("group_data", []), *group_data(sets)]}})
    check_semantics(grown)
    return save_bundle(grown, out)


def parent_groups(parent: Bundle, *, same_probe: bool
                  ) -> tuple[dict[str, GroupTable] | None, dict[str, Any]]:
    """The group tables a bundle recalibrated from `parent` keeps (`recalibrate`, `reweight`),
    and what its provenance says of them.

    A group's lambda*_g is certified on that group's own traces with the probe and window it was
    calibrated with (docs/METHOD.md section 12). Neither recalibration touches those traces: the
    live audit leaves known groups out, and reweighting re-draws the mixture's. So with the same
    probe they stay valid as calibrated; a retrained probe voids them."""
    if parent.groups is None:
        return None, {}
    if not same_probe:
        return None, {"groups": "dropped: a group's tables hold for the probe they were "
                                "certified with, and the probe was retrained"}
    said: dict[str, Any] = {"groups": "the parent bundle's, kept as calibrated (the same probe "
                                      "and window)"}
    if "group_data" in parent.provenance:  # where calibration-only group sets came from
        said["group_data"] = parent.provenance["group_data"]
    return parent.groups, said


def group_data(sets: Sequence[TrajectorySet]) -> list[dict[str, Any]]:
    """Where the groups' calibration-only traces came from (provenance's `group_data`)."""
    return [{"data": str(ts.path), "data_sha256": data_hashes(ts)} for ts in sets]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def data_hashes(ts: TrajectorySet) -> dict[str, str]:
    """Content hashes of the data the bundle was calibrated on (provenance)."""
    path = Path(ts.path)
    files = [path] if path.is_file() else [path / "problems.jsonl", path / "embeddings.bin"]
    return {f.name: file_sha256(f) for f in files if f.is_file()}


def make_bundle(probe: Probe, ts: TrajectorySet, results: list[DeltaResult], *, mode: str,
                epsilon: float, pvalue: PValue, window: int, n_cal: int, default_delta: float,
                provenance: dict[str, Any], drift: DriftReference | None = None,
                give_up: GiveUpBlock | None = None,
                shift_gate: GateReference | None = None,
                groups: dict[str, GroupTable] | None = None) -> Bundle:
    """Everything the server needs, taken from the data's own record of how it was collected
    (how its steps were labelled included: the live audit labels the same way; the dtype and
    sampling its traces were generated under into the provenance, `collected_under`: the server
    warns when it serves otherwise)."""
    info = ts.info
    model = info.get("model") or "unknown"
    under = info.get(COLLECTED_UNDER)
    return Bundle(
        schema_version=schema_version_for(give_up is not None), orca_serve_version=__version__,
        model=ModelIdentity(name=model, hidden_size=ts.dim,
                            tokenizer_fingerprint=info.get("tokenizer_fingerprint"),
                            config_fingerprint=info.get("model_config")),
        segmentation=Segmentation(**(info.get("segmentation") or {})),
        think=ThinkTags(**(info.get("think") or {})),
        normalization=info.get("normalization", DEFAULT_NORMALIZATION),
        probe=ProbeBlock(spec=json.loads(probe.spec.to_json()), weights=encode_weights(probe),
                         eta=probe.params["log_eta"].exp().item()),
        window=window, label_mode=mode,
        ltt=ltt_table(results, epsilon=epsilon, pvalue=pvalue, n_cal=n_cal),
        default_delta=default_delta, drift=drift, give_up=give_up, shift_gate=shift_gate,
        groups=groups or None,
        labelling=None if info.get("labelling") is None else Labelling(**info["labelling"]),
        provenance={"data": str(ts.path), "data_sha256": data_hashes(ts),
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    **({} if under is None else
                       {COLLECTED_UNDER: Generation.model_validate(under).record()}),
                    **provenance})


def calibrate_bundle(probe: Probe, ts: TrajectorySet, out: Path, *, mode: str = SUPERVISED,
                     deltas: Sequence[float] = DEFAULT_DELTAS, epsilon: float = DEFAULT_EPSILON,
                     pvalue: PValue = PValue.BINOMIAL, window: int = DEFAULT_WINDOW,
                     default_delta: float | None = None,
                     dump_scores: Path | None = None,
                     provenance: dict[str, Any] | None = None,
                     give_up: tuple[Probe, GiveUpOptions] | GiveUpBlock | None = None,
                     groups: GroupOptions | dict[str, GroupTable] | None = None,
                     group_sets: Sequence[TrajectorySet] = (),
                     gate: GateOptions = GateOptions()) -> Bundle:
    """Replay the calibration split, run LTT for every delta, write bundle.json with the drift
    reference of the whole split (the server sees unsolvable requests too) and the shift gate
    (`gate`'s, fitted on the training split, scored on the calibration split:
    orca_calibrate/gate.py);
    with `give_up` (its probe and options), also mu* per give-up delta (a two-sided bundle,
    schema version 2), or, given a block already certified (`recalibrate` keeps its parent's),
    that block as it is: mu* holds with every lambda* (docs/METHOD.md section 9), so a new
    lambda* leaves it valid. With `groups`, also each group's own tables (`group_tables`; mu*
    per group only when the give-up probe is fitted here), on the calibration split's tagged
    traces or, given `group_sets`, on those calibration-only sets instead (`set_group_tables`);
    given tables already certified (`parent_groups`), those tables, without their mu* when the
    new bundle is one-sided."""
    if group_sets and not isinstance(groups, GroupOptions):
        raise ValueError("group sets need the group options (calibrate.groups: field, min_n)")
    default = default_delta if default_delta is not None else (0.1 if 0.1 in deltas else deltas[0])
    if default not in deltas:
        raise ValueError(f"default delta {default} is not among the calibrated deltas {deltas}")
    check_labelled(ts, ts.split(Split.CALIBRATION), Side.STOP, mode)
    if isinstance(give_up, tuple):
        check_labelled(ts, ts.split(Split.CALIBRATION), Side.GIVE_UP, give_up[1].label_mode)
    everything = score_split(probe, ts, Split.CALIBRATION, mode, window, solvable_only=False)
    scored = everything.solvable()
    results = run_ltt(scored, deltas, epsilon, pvalue)
    tables = None
    if isinstance(groups, dict):
        tables = groups if give_up is not None else {
            name: g.model_copy(update={"give_up": None}) for name, g in groups.items()}
    elif groups is not None:
        how = {"mode": mode, "deltas": deltas, "epsilon": epsilon, "pvalue": pvalue,
               "window": window, "give_up": give_up if isinstance(give_up, tuple) else None}
        tables = set_group_tables(probe, group_sets, groups, **how,
                                  made_with=(ts.info, f"the job's data {ts.path}")) \
            if group_sets else group_tables(probe, ts, groups, **how)
    if dump_scores is not None:
        with open(dump_scores, "w") as f:
            f.writelines(json.dumps({"id": pid, "scores": s.round(6).tolist(),
                                    "labels": c.astype(int).tolist()}) + "\n" for pid, s, c in zip(scored.ids, scored.scores, scored.labels))
    bundle = make_bundle(probe, ts, results, mode=mode, epsilon=epsilon, pvalue=pvalue,
                         window=window, n_cal=len(scored.ids), default_delta=default,
                         provenance={**(provenance or {}), **(
                             {"group_data": group_data(group_sets)} if group_sets else {})},
                         drift=build_reference(everything.scores, window, [r.lam for r in results]),
                         give_up=give_up if give_up is None or isinstance(give_up, GiveUpBlock)
                         else give_up_block(give_up[0], ts, give_up[1], window=window,
                                            pvalue=pvalue),
                         shift_gate=gate_from_trajectories(ts, gate), groups=tables)
    check_semantics(bundle)  # never write a bundle the server would refuse (a saturated probe)
    return save_bundle(bundle, out)
