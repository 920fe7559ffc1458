"""Offline evaluation: replay a bundle's procedure on held-out trajectories (docs/METHOD.md section 6)."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from calibration.calibrate import Scored, score_split
from orca_method.bundle import Bundle
from orca_method.stop_metrics import stop_indices, summarize
from orca_method.trajectories import TrajectorySet


def evaluate_bundle(bundle: Bundle, ts: TrajectorySet, split: str = "test") -> tuple[dict, Scored]:
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
                                           "lambda": None if math.isinf(lam) else lam, **res}
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
