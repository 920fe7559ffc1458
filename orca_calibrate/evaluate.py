"""Offline evaluation: replay a bundle's procedure on held-out trajectories (docs/METHOD.md section 6)."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from orca_calibrate.calibrate import Scored, score_split
from orca_method.bundle import Bundle
from orca_method.give_up import last_right, lost_by_giving_up, tokens_used, two_sided_ends
from orca_method.outcomes import Ended
from orca_method.procedure import replay
from orca_method.stop_metrics import stop_indices, summarize
from orca_method.thresholds import lam_to_json
from orca_method.trajectories import ALL, Split, TrajectorySet


def evaluate_bundle(bundle: Bundle, ts: TrajectorySet, split: str = Split.TEST
                    ) -> tuple[dict, Scored]:
    """Savings (both definitions, see `metrics.StopOutcome`), token savings and realized error
    per calibrated delta on one split."""
    if ts.dim != bundle.model.hidden_size:
        raise ValueError(f"the bundle is for {bundle.model.hidden_size}-dim embeddings "
                         f"({bundle.model.name}) but {ts.path} has dim {ts.dim}")
    scored = score_split(bundle.load_probe(), ts, split, bundle.label_mode, bundle.window)
    lengths = np.array([len(s) for s in scored.scores])
    out: dict[str, Any] = {"split": split, "label_mode": bundle.label_mode,
                           "probe": bundle.spec().name, "n": len(scored.ids), "deltas": {}}
    for row in bundle.ltt.rows:
        lam = bundle.lam(row.delta)
        tau = stop_indices(scored.scores, np.array([lam]))[0]
        res = asdict(summarize(tau, lengths, scored.labels, scored.tokens))
        out["deltas"][f"{row.delta:g}"] = {"delta": row.delta,
                                           "lambda": lam_to_json(lam), **res}
    return out, scored


def plot_report(bundle: Bundle, scored: Scored, report: dict, out_dir: Path) -> list[Path]:
    """The four figures a reader needs to trust (or distrust) the bundle."""
    import matplotlib  # deferred: matplotlib (only --plots draws)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: matplotlib (only --plots draws)

    out_dir.mkdir(parents=True, exist_ok=True)
    rows = list(report["deltas"].values())
    deltas = [r["delta"] for r in rows]
    title = f"{report['probe']} / {report['label_mode']} / {report['split']} (n={report['n']})"
    paths = []

    fig, ax = plt.subplots(figsize=(5, 4))
    ax.plot(deltas, [r["savings_per_problem"] for r in rows], "o-",
            label="savings_per_problem: mean of 1 - tau/T (paper)")
    ax.plot(deltas, [r["savings_total_steps"] for r in rows], "^:",
            label="savings_total_steps: 1 - sum tau / sum T")
    if rows[0]["token_savings_total"] is not None:
        ax.plot(deltas, [r["token_savings_total"] for r in rows], "s--",
                label="token_savings_total: 1 - sum used / sum tokens")
    ax.set(xlabel="target risk delta", ylabel="savings", title=title, ylim=(0, 1))
    ax.legend(fontsize=7)
    paths.append(_save(fig, out_dir / "savings_vs_delta.png"))

    fig, ax = plt.subplots(figsize=(5, 4))
    top = max(deltas) * 1.2
    ax.plot([0, top], [0, top], "k:", label="error = delta")
    ax.plot(deltas, [r["error"] for r in rows], "o-", label="realized error")
    ax.set(xlabel="target risk delta", ylabel="realized error", title=title, xlim=(0, top),
           ylim=(0, max(top, max(r["error"] for r in rows) * 1.1)))
    ax.legend()
    paths.append(_save(fig, out_dir / "error_vs_delta.png"))

    lam = bundle.lam(bundle.default_delta)
    lengths = np.array([len(s) for s in scored.scores])
    tau = stop_indices(scored.scores, np.array([lam]))[0]
    fig, ax = plt.subplots(figsize=(5, 4))
    per_problem = 1 - (tau + 1) / lengths
    ax.hist(per_problem, bins=20, range=(0, 1))
    ax.axvline(per_problem.mean(), color="k", label=f"mean = savings_per_problem "
               f"{per_problem.mean():.3f}")
    ax.axvline(np.median(per_problem), color="k", ls="--",
               label=f"median {np.median(per_problem):.3f}")
    ax.legend(fontsize=8)
    ax.set(xlabel="per-problem step savings 1 - tau/T", ylabel="problems",
           title=f"delta={bundle.default_delta:g}, lambda*={lam:.3g}")
    paths.append(_save(fig, out_dir / "savings_histogram.png"))

    i = int(np.argmax((lengths - tau) * (lengths >= np.median(lengths))))  # a long, early stop
    fig, ax = plt.subplots(figsize=(6, 4))
    t = np.arange(1, lengths[i] + 1)
    ax.plot(t, scored.scores[i], label="smoothed score m_t")
    ax.fill_between(t, 0, scored.labels[i], step="post", alpha=0.15, label="label C_t = 1")
    if math.isfinite(lam):
        ax.axhline(lam, color="r", ls="--", label=f"lambda* (delta={bundle.default_delta:g})")
        ax.axvline(tau[i] + 1, color="r", ls=":", label=f"stop at step {tau[i] + 1}")
    ax.set(xlabel="reasoning step", ylabel="score", ylim=(0, 1),
           title=f"problem {scored.ids[i]} ({lengths[i]} steps)")
    ax.legend(fontsize=8)
    paths.append(_save(fig, out_dir / "score_trajectory.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt  # deferred: matplotlib (only --plots draws)
    plt.close(fig)
    return path


TABLE_NOTE = ("cells: savings_per_problem (the paper's definition: mean over problems of "
              "1 - tau/T) / savings_total_steps (1 - sum tau / sum T) / token_savings_total "
              "(1 - sum tokens used / sum tokens) / realized error")


def markdown_table(rows: list[tuple[str, dict]]) -> str:
    """Rows of (name, evaluate_bundle report): both savings, token savings and error per delta."""
    deltas = list(rows[0][1]["deltas"])
    head = ("| probe | n | "
            + " | ".join(f"delta={d}: sav/problem / sav/total / tok total / err" for d in deltas)
            + " |")
    lines = [head, "|" + "---|" * (2 + len(deltas))]
    for name, rep in rows:
        cells = []
        for d in deltas:
            r = rep["deltas"][d]
            tok = "-" if r["token_savings_total"] is None else f"{r['token_savings_total']:.3f}"
            cells.append(f"{r['savings_per_problem']:.3f} / {r['savings_total_steps']:.3f} / "
                         f"{tok} / {r['error']:.3f}")
        lines.append(f"| {name} | {rep['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", TABLE_NOTE])


def interval95(k: int, n: int) -> tuple[float, float]:
    """Clopper-Pearson 95% interval of k events in n."""
    from scipy.stats import binomtest  # deferred: scipy.stats is slow to import

    ci = binomtest(int(k), int(n)).proportion_ci(0.95)
    return float(ci.low), float(ci.high)


def _rate(events: np.ndarray, counted: np.ndarray) -> dict[str, Any]:
    """A realized risk: its rate over the counted traces, n and 95% interval."""
    k, n = int(np.sum(events & counted)), int(np.sum(counted))
    low, high = interval95(k, n) if n else (math.nan, math.nan)
    return {"rate": k / n if n else math.nan, "k": k, "n": n, "ci95": [low, high]}


def evaluate_two_sided(bundle: Bundle, ts: TrajectorySet, split: str = ALL, *,
                       delta: float | None = None, delta_2: float | None = None,
                       reference: str | None = None) -> dict[str, Any]:
    """One-sided ORCA, two-sided ORCA and the oracles on recorded trajectories, offline.

    Every trace of the split counts (solvable or not: a server sees both). Per arm: reasoning
    tokens per request (the steps run; a stop's forced answer is not counted), accuracy (the
    reference answer forced at the end step is right; a given-up trace counts wrong, and
    `accuracy_best_guess` counts its forced answer instead), the share ended early / given up.
    Realized risks with k, n and a 95% Clopper-Pearson interval: `stop_error` as certified (the
    bundle's labels, solvable traces, ended early with a wrong cumulative label) and
    `give_up_error` (every trace: the certified loss of the give-up policy the bundle was
    certified for, under `reference`'s raw labels: for "guess", gave up with a right answer at
    that step or later; for "message", gave up on a trace right at some step).
    Arms: `full` (no stopping), `one_sided` (lambda*(delta)), `two_sided` (lambda*(delta),
    mu*(delta_2)), `oracle_stop` (stop at the first right step) and `oracle_two_sided` (that,
    and give up at the first step after which no step is right). `delta`/`delta_2` default to
    the bundle's defaults; `reference` to the give-up block's label mode (needs a two-sided
    bundle). The function bench scripts call (benchmarks/bench_two_sided.py).
    """
    if bundle.give_up is None:
        raise ValueError("the bundle has no give-up threshold (schema version 1); calibrate "
                         "with calibrate.give_up")
    if ts.dim != bundle.model.hidden_size:
        raise ValueError(f"the bundle is for {bundle.model.hidden_size}-dim embeddings but "
                         f"{ts.path} has dim {ts.dim}")
    delta = bundle.default_delta if delta is None else delta
    delta_2 = bundle.give_up.default_delta if delta_2 is None else delta_2
    reference = reference or bundle.give_up.label_mode
    lam, mu = bundle.lam(delta), bundle.mu(delta_2)
    policy = bundle.give_up.policy
    idx = ts.split(split)
    if not idx:
        raise ValueError(f"the {split} split of {ts.path} is empty")
    embs = [ts.embeddings(i) for i in idx]
    stop = [s.numpy().astype(np.float64)
            for _, s in replay(bundle.load_probe(), embs, window=bundle.window)]
    give_up = [s.numpy().astype(np.float64)
               for _, s in replay(bundle.load_give_up_probe(), embs, window=bundle.give_up.window)]
    raw = [ts.raw_labels(i, reference) for i in idx]
    certified = [ts.labels(i, bundle.label_mode) for i in idx]  # cumulative
    tokens = [np.asarray(ts.problems[i].step_tokens) for i in idx]
    lengths = np.array([len(c) for c in raw])
    last = np.array([last_right(c) for c in raw])
    ends_right = last >= 0  # right at some step
    counted = np.array([c.any() for c in certified])  # the certified stop risk's traces
    first_right = np.array([int(np.argmax(c)) if c.any() else n - 1
                            for c, n in zip(raw, lengths)])
    never = np.full(len(idx), False)

    def arm(end: np.ndarray, early: np.ndarray, gave: np.ndarray) -> dict[str, Any]:
        right_at_end = np.array([c[e] == 1 for c, e in zip(raw, end)])
        wrong_stop = np.array([c[e] == 0 for c, e in zip(certified, end)]) & early
        return {"tokens_per_request": float(np.mean(tokens_used(tokens, end))),
                "accuracy": float(np.mean(right_at_end & ~gave)),
                "accuracy_best_guess": float(np.mean(right_at_end)),
                "ended_early": float(np.mean(early)), "gave_up": float(np.mean(gave)),
                "stop_error": _rate(wrong_stop, counted),
                "give_up_error": _rate(gave & lost_by_giving_up(end, last, policy),
                                       np.full(len(idx), True))}

    one_end = stop_indices(stop, np.array([lam]))[0]
    two_end, ended = two_sided_ends(stop, give_up, lam, mu)
    ended = np.array(ended)
    # the two-sided oracle: a trace that ends right stops at its first right step, one that
    # never gets right gives up after its first step (no step after it is right)
    oracle_two = np.where(ends_right, first_right, 0)
    arms = {
        "full": arm(lengths - 1, never, never),
        "one_sided": arm(one_end, one_end < lengths - 1, never),
        "two_sided": arm(two_end, ended == Ended.EARLY, ended == Ended.GAVE_UP),
        "oracle_stop": arm(first_right, ends_right & (first_right < lengths - 1), never),
        "oracle_two_sided": arm(oracle_two, ends_right & (first_right < lengths - 1),
                                ~ends_right & (lengths > 1)),
    }
    return {"split": split, "n": len(idx), "delta": delta, "delta_2": delta_2,
            "lambda": lam_to_json(lam), "mu": lam_to_json(mu),
            "label_mode": bundle.label_mode, "reference": reference, "arms": arms}
