"""Selective labelling: answer-probe only the steps whose labels decide LTT's losses.

LTT (orca_method/ltt.py) reads a calibration trace's labels at a few points only. On the stop
side, its loss under lambda is ``1 - C[tau(lambda)]`` with ``C`` the cumulative labels, so over
a fixed grid of lambdas it needs ``C`` at the trace's distinct stop steps, plus ``C`` at the
last step (whether the trace is solvable, i.e. counted in n_cal). On the give-up side
(orca_method/give_up.py), the loss under mu needs whether a right step lies at or after each
distinct give-up step before the last (and, under the "message" policy, whether any step is
right). These points follow from the scores alone, which the trained probes give before any
label of the calibration split is read; their values follow from few labels:

- ``C[s] = 1`` as soon as one probed step at or before ``s`` is right; ``C[s] = 0`` only when
  every candidate step up to ``s`` is probed and wrong.
- "right at or after g" is 1 as soon as one probed step from g's candidate on is right; 0 only
  when every candidate from there to the end is probed and wrong.

So the collector probes in rounds (`DecidingSteps.first_round`, then `still_needed` until it is
empty): first the deciding points themselves, then, where those did not settle a point, every
candidate step the point depends on. The candidates are the steps every-step labelling probes
(`orca_method.labels.labelled_steps`, `label_every` included), and the record fills the
unprobed steps as every-step labelling fills its gaps (`fill_pessimistic`: a step takes the
answer of the latest probed step before it). With that fill every deciding point has the value
every-step labelling gives it, so the loss matrix, n_cal and each lambda* (and mu*) are exactly
those of every-step labelling, for every delta and epsilon on this grid (tested in
tests/test_selective_labels.py; docs/METHOD.md section 5, "Selective labelling"). Labels of
other steps, and of label modes the rounds did not resolve, are not every-step labels.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from orca_method.give_up import give_up_indices
from orca_method.labels import labelled_steps
from orca_method.risk import stop_indices


@dataclass(frozen=True)
class DecidingSteps:
    """One trace's deciding points for one label mode and the candidate steps behind them.

    `stops`: steps whose cumulative label LTT reads (the distinct stop steps over the lambda
    grid, and the last step); `give_ups`: steps before the last at which some mu of the grid
    gives up (whether a right step lies at or after them); `raws`: steps whose own label is read
    (the give-up loss under consistency labels, `orca_method.give_up.changed_by_giving_up`),
    which their own candidate's probe settles.
    """

    candidates: tuple[int, ...]  # ascending; always ends with the last step
    stops: tuple[int, ...] = ()
    give_ups: tuple[int, ...] = ()
    raws: tuple[int, ...] = ()

    def _source(self, t: int) -> int:
        """Index into `candidates` of the latest candidate at or before step t (-1: none, so
        the step takes no answer and is wrong under the fill)."""
        return bisect.bisect_right(self.candidates, t) - 1

    def first_round(self) -> set[int]:
        """The candidates whose answers fill the deciding points themselves."""
        src = (self._source(t) for t in (*self.stops, *self.give_ups, *self.raws))
        return {self.candidates[k] for k in src if k >= 0}

    def still_needed(self, right: Mapping[int, int]) -> set[int]:
        """Candidates still to probe, given the labels (0/1) of the probed ones (`right`, step ->
        label): those on which an undecided point depends. Empty when every point is decided."""
        ones = sorted(t for t, v in right.items() if v)
        need: set[int] = set()
        # C[s] = 1 iff a candidate <= s is right: undecided while every right one is after s
        open_stops = [s for s in self.stops if not ones or s < ones[0]]
        if open_stops:
            need.update(self.candidates[:self._source(max(open_stops)) + 1])
        # right ahead of g iff a candidate from g's source on (all, when g has none) is right
        start = [max(self._source(g), 0) for g in self.give_ups]
        open_from = [k for k in start if not ones or ones[-1] < self.candidates[k]]
        if open_from:
            need.update(self.candidates[min(open_from):])
        return need - set(right)


def deciding_steps(stop_scores: Sequence[float] | np.ndarray, lam_grid: np.ndarray, *,
                   label_every: int = 1, give_up_scores: Sequence[float] | None = None,
                   mu_grid: np.ndarray | None = None, solvable: bool = True,
                   raw: bool = False) -> DecidingSteps:
    """The deciding points of one trace for one label mode: the stop side when `stop_scores`
    are given (None: not calibrated under this mode), the give-up side when `give_up_scores`
    and `mu_grid` are (`raw`: the give-up steps' own labels, the loss under consistency labels;
    else whether a right step lies at or after each); `solvable` adds the last step (whether
    any step is right: LTT's n_cal, and the give-up loss under the "message" policy)."""
    n = len(stop_scores if stop_scores is not None else give_up_scores)
    stops: set[int] = {n - 1} if solvable else set()
    if stop_scores is not None:
        stops.update(int(t) for t in stop_indices([np.asarray(stop_scores)], lam_grid)[:, 0])
    give_ups: set[int] = set()
    if give_up_scores is not None and mu_grid is not None:
        tau = give_up_indices([np.asarray(give_up_scores)], mu_grid)[:, 0]
        give_ups.update(int(t) for t in tau if t < n - 1)
    ordered = tuple(sorted(give_ups))
    return DecidingSteps(candidates=tuple(labelled_steps(n, label_every)),
                         stops=tuple(sorted(stops)), give_ups=() if raw else ordered,
                         raws=ordered if raw else ())


def next_round(deciding: Mapping[str, DecidingSteps], labels: Mapping[str, Sequence[int]],
               probed: Collection[int]) -> set[int]:
    """The steps of one trace to probe next (empty: its labels are settled for every mode).

    `deciding`: label mode -> its deciding points; `labels`: the trace's record labels per mode
    with the answers probed so far (filled: exact at the probed steps); `probed`: those steps.
    The deciding points' own candidates come first (a rerun with a retrained probe starts with
    its new points), then whatever the undecided ones depend on.
    """
    done = set(probed)
    first = set().union(*(d.first_round() for d in deciding.values())) - done
    if first:
        return first
    return set().union(*(d.still_needed({t: int(labels[mode][t]) for t in done})
                         for mode, d in deciding.items()))
