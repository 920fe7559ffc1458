"""The consensus stop in the calibration job: hold prompts out, certify t, seal it, evaluate it.

A job that records k samples per prompt (`collect: {samples: k}`) and asks for it
(`calibrate: {consensus: {...}}`) divides its calibration split's prompts in two: lambda* is
certified on one part as before, the consensus margin t on the other (docs/METHOD.md section 14
says why the groups that certify t must not have chosen lambda*). The per-sample stops come from
the server's code path (`orca_method.procedure.replay`), the rule from orca_method/consensus.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from orca_method.bundle import (
    Bundle,
    ConfidentPath,
    ConsensusBlock,
    ConsensusRow,
    load_bundle,
    save_bundle,
)
from orca_method.consensus_ltt import calibrate_consensus
from orca_method.ltt import DEFAULT_EPSILON
from orca_method.consensus import (
    DEFAULT_CAP_MAX,
    DEFAULT_CAP_STEP,
    DEFAULT_GRID_SIZE,
    Group,
    block_version,
    check_waves,
    confident_path,
    launched,
    outcomes,
    plurality,
    prompt_of,
)
from orca_method.outcomes import Weighting
from orca_method.probe import Probe
from orca_method.procedure import replay
from orca_method.stop_metrics import stop_indices
from orca_method.trajectories import Split, TrajectorySet, split_ids


@dataclass(frozen=True)
class ConsensusOptions:
    """`calibrate.consensus` of a job: the delta_vote levels, LTT's epsilon, the vote weighting
    and the share of the calibration split's prompts held out from lambda* to certify t; with
    `confident`, the two-parameter rule (one early stop within c reasoning tokens settles too),
    its caps c tested from `cap_step` up to `cap_max` (docs/METHOD.md section 14)."""

    deltas: tuple[float, ...] = (0.05, 0.1)
    epsilon: float = DEFAULT_EPSILON
    weighting: Weighting = Weighting.SCORE
    holdout: float = 0.5
    seed: int = 0
    waves: tuple[int, ...] | None = None  # the launch schedule t is certified for; None: at once
    confident: bool = False
    cap_step: float = DEFAULT_CAP_STEP
    cap_max: float = DEFAULT_CAP_MAX

    def __post_init__(self) -> None:
        if self.weighting not in list(Weighting):
            raise ValueError(f"consensus weighting must be one of {', '.join(Weighting)}, "
                             f"got {self.weighting!r:.40}")
        object.__setattr__(self, "weighting", Weighting(self.weighting))
        if not 0.0 < self.holdout < 1.0:
            raise ValueError(f"consensus holdout is a share of the calibration prompts in (0, 1), "
                             f"got {self.holdout!r:.20}")
        if not self.deltas or not all(0.0 < d < 1.0 for d in self.deltas) \
                or not 0.0 < self.epsilon < 1.0:
            raise ValueError("consensus deltas and epsilon must be in (0, 1)")
        if not 0.0 < self.cap_step <= self.cap_max:
            raise ValueError(f"consensus caps need 0 < cap_step <= cap_max, got "
                             f"{self.cap_step!r:.20} and {self.cap_max!r:.20}")
        if self.waves is not None:
            object.__setattr__(self, "waves", tuple(self.waves))  # a job's YAML gives a list
            if len(self.waves) < 2:
                raise ValueError("consensus waves need two waves or more (omit them: all at once)")
            check_waves(self.waves, sum(self.waves))


def hold_out(ts: TrajectorySet, opts: ConsensusOptions) -> tuple[TrajectorySet, list[int]]:
    """(the set as lambda*'s calibration sees it, the held-out traces for t): a seeded share of
    the calibration split's prompts, all samples of a prompt together, leaves that split (in
    memory only; problems.jsonl keeps its splits)."""
    cal = ts.split(Split.CALIBRATION)
    out = held_ids([ts.problems[i].id for i in cal], opts)
    held = [i for i in cal if ts.problems[i].id in out]
    return ts.with_splits({i: None for i in held}), held


def held_ids(ids: Sequence[str], opts: ConsensusOptions) -> set[str]:
    """Which of the calibration traces `ids` `hold_out` holds out (ValueError when either side
    would be empty): the split is by prompt and seeded, so a job's check knows it before the
    collection from the trace ids the collection will write."""
    # split_ids' second part ("calibration") is the held-out one, its first stays for lambda*
    parts = split_ids(ids, (1 - opts.holdout, opts.holdout, 0.0), seed=opts.seed,
                      groups={pid: prompt_of(pid)[0] for pid in ids})
    held = {pid for pid in ids if parts[pid] == Split.CALIBRATION}
    if not held or len(held) == len(ids):
        raise ValueError(f"consensus holdout {opts.holdout} of {len(ids)} calibration traces "
                         "leaves one side empty; collect more prompts")
    return held


def sample_groups(ts: TrajectorySet, members: Sequence[int]) -> list[list[int]]:
    """`members` by prompt, each prompt's traces in sample order; only prompts with the most
    samples any has (a trace the collector dropped leaves its prompt short: it is skipped)."""
    by: dict[str, list[tuple[int, int]]] = {}
    for i in members:
        prompt, sample = prompt_of(ts.problems[i].id)
        by.setdefault(prompt, []).append((sample, i))
    k = max((len(v) for v in by.values()), default=0)
    return [[i for _, i in sorted(v)] for _, v in sorted(by.items()) if len(v) == k]


def replayed(probe: Probe, ts: TrajectorySet, groups: Sequence[Sequence[int]],
             window: int) -> dict[int, np.ndarray]:
    """Every trace's smoothed scores as the server computes them, by trace index (replayed once
    for every lambda* and weighting that reads them)."""
    flat = [i for g in groups for i in g]
    return {i: s.numpy().astype(np.float64)
            for i, (_, s) in zip(flat, replay(probe, [ts.embeddings(i) for i in flat], window))}


def stopped_groups(ts: TrajectorySet, groups: Sequence[Sequence[int]],
                   scores: dict[int, np.ndarray], lam: float, weighting: Weighting) -> list[Group]:
    """Each prompt's k samples, each stopped at `lam` as the server stops it (`scores`:
    `replayed`): its finish time (reasoning tokens through its stop step), answer there (the
    probed answer; the final answer when it ran to its end), vote weight (its smoothed score
    there, or 1), and its early-stop tokens (the confidence clause's signal: its finish when ORCA
    stopped it, inf when it ran to its end); the reference is maj@k of the samples' final
    answers."""
    out = []
    for g in groups:
        tau = stop_indices([scores[i] for i in g], np.array([lam]))[0]  # [k]
        finish, answers, weights, early = [], [], [], []
        for i, t in zip(g, tau):
            p = ts.problems[i]
            if p.step_tokens is None or p.step_answers is None:
                raise ValueError(f"trace {p.id!r} has no step tokens or step answers: the "
                                 "consensus needs traces recorded by orca-calibrate collect")
            end = t == p.n_steps - 1
            finish.append(float(np.sum(p.step_tokens[:t + 1])))
            answers.append(p.final_answer if end else p.step_answers[t])
            weights.append(weighting.weight(float(scores[i][t])))
            early.append(np.inf if end else finish[-1])
        out.append(Group(finish=np.array(finish), answers=tuple(answers),
                         weights=np.array(weights), stop_tokens=np.array(early),
                         reference=plurality([ts.problems[i].final_answer for i in g])))
    return out


def consensus_block(bundle: Bundle, probe: Probe, ts: TrajectorySet, members: Sequence[int],
                    opts: ConsensusOptions) -> ConsensusBlock:
    """t* (and c*, `opts.confident`) per (delta of the bundle, delta_vote) on the groups of
    `members`."""
    groups = sample_groups(ts, members)
    if not groups or len(groups[0]) < 2:
        raise ValueError("the consensus needs k >= 2 samples per prompt: collect with "
                         "`collect: {samples: k}`")
    if opts.waves is not None:
        check_waves(opts.waves, len(groups[0]))
    grid, caps = (confident_path(len(groups[0]), cap_step=opts.cap_step, cap_max=opts.cap_max)
                  if opts.confident else (None, None))
    rows, scores = [], replayed(probe, ts, groups, bundle.window)
    for row in bundle.ltt.rows:
        stopped = launched(stopped_groups(ts, groups, scores, bundle.lam(row.delta),
                                          opts.weighting), opts.waves)
        for r in calibrate_consensus(stopped, opts.deltas, epsilon=opts.epsilon, grid=grid,
                                     caps=caps):
            rows.append(ConsensusRow(delta=row.delta, delta_vote=r.delta_vote, t=r.t,
                                     risk=r.risk, pvalue=r.pvalue, confident_tokens=r.cap,
                                     token_savings=max(r.token_savings, 0.0)))
    return ConsensusBlock(version=block_version(opts.waves, opts.confident),
                          samples=len(groups[0]), weighting=opts.weighting,
                          epsilon=opts.epsilon, n_cal=len(groups),
                          grid_size=DEFAULT_GRID_SIZE, rows=rows,
                          waves=None if opts.waves is None else list(opts.waves),
                          confident=ConfidentPath(step=opts.cap_step, max=opts.cap_max)
                          if opts.confident else None)


def add_consensus(bundle_file: Path, probe: Probe, ts: TrajectorySet, members: Sequence[int],
                  opts: ConsensusOptions) -> Bundle:
    """Seal the bundle at `bundle_file` again with its consensus block."""
    bundle = load_bundle(bundle_file)
    block = consensus_block(bundle, probe, ts, members, opts)
    return save_bundle(bundle.model_copy(update={"consensus": block}), bundle_file)


def evaluate_consensus(bundle: Bundle, ts: TrajectorySet, split: str = Split.TEST
                       ) -> dict[str, Any]:
    """Realized vote error (against maj@k of the full samples) and token savings per certified
    pair on one split's groups; a pair with t null runs its samples to their end (no error)."""
    block = bundle.consensus
    if block is None:
        raise ValueError("the bundle has no consensus block")
    groups = sample_groups(ts, ts.split(split))
    if groups and len(groups[0]) != block.samples:
        raise ValueError(f"the consensus was certified for k = {block.samples} samples, the "
                         f"{split} split has {len(groups[0])} per prompt")
    rows, scores = [], replayed(bundle.load_probe(), ts, groups, bundle.window)
    for row in block.rows:
        stopped = launched(stopped_groups(ts, groups, scores, bundle.lam(row.delta),
                                          block.weighting), block.waves)
        full = sum(g.spent(np.inf) for g in stopped)
        loss, tokens = outcomes(stopped, np.array([1.0 if row.t is None else row.t]),
                                None if row.confident_tokens is None
                                else np.array([row.confident_tokens]))
        errors = 0 if row.t is None else int(loss.sum())
        used = full if row.t is None else float(tokens.sum())
        rows.append({"delta": row.delta, "delta_vote": row.delta_vote, "t": row.t,
                     "errors": errors, "n": len(stopped),
                     "realized_vote_error": errors / len(stopped) if stopped else None,
                     "token_savings": 1 - used / full if full else 0.0})
    return {"split": split, "samples": block.samples, "weighting": block.weighting, "rows": rows}

