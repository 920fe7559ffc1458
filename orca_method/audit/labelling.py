"""Selective audit labelling: which steps of an audited request the guards' decisions read.

Labelling an audit with every step's answer probe costs about as much as serving the request
(docs/AUDIT.md, "What labelling costs"). The guards read far less: a stop guard feeds its
statistics the loss of the audit at the few thresholds it tests (the bundle's lambda* of its
delta, and the lambda it serves after a recalibration when the audit measures that one), the
loss is ``1 - C[tau(lambda)]`` with ``C`` the cumulative labels, and the audit is counted only
when some step is right (``C`` at the last step). Those are the stop points of
`orca_method.selective` for a grid of those few thresholds, so `DecidingSteps` and its rounds
(`next_round`) find the probes that settle them exactly, as they do for calibration's grid:
with the pessimistic fill every point has the value every-step labelling gives it, so every
loss a guard reads, whether the audit is counted, and so every bound, alarm and served lambda
are those of every-step labelling (tests/test_audit_selective.py). A recalibration window needs
every threshold of LTT's grid (and the give-up side, whether each step's answer is the final
one at every give-up step of its grid): an audit that may enter one is labelled in full
(`AuditState.label_needs`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from orca_method.audit.guards import aligned_scores
from orca_method.selective import DecidingSteps, deciding_steps


def audit_points(scores: Sequence[float], n_steps: int, lams: Sequence[float], *,
                 label_every: int = 1, give_up_scores: Sequence[float] | None = None,
                 mus: Sequence[float] = ()) -> DecidingSteps | None:
    """The deciding points of one audit of `n_steps` recorded steps for the thresholds `lams`
    (its stop scores as the plugin reported them) and, with `give_up_scores`, the give-up
    thresholds `mus` (whose loss reads the raw label at each give-up step). None when the
    scores do not align with the steps: the audit is then left out of the risk, and is labelled
    in full (the counts need whether it is ever right)."""
    s = aligned_scores(scores, n_steps)
    if s is None:
        return None
    g = None if give_up_scores is None or len(give_up_scores) != n_steps else give_up_scores
    return deciding_steps(s, np.asarray(sorted(set(lams)), dtype=float),
                          label_every=label_every, give_up_scores=g,
                          mu_grid=np.asarray(sorted(set(mus)), dtype=float) if mus else None,
                          raw=True)
