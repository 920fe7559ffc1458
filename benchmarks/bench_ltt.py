"""Time LTT calibration at deployment scale; prints one markdown table row.

1,000 problems x ~100 steps x 10,000 thresholds x 4 deltas; target < 1 s.
Run: .venv/bin/python benchmarks/bench_ltt.py
"""

from __future__ import annotations

import platform
import statistics
import time

import numpy as np

from orca_method.ltt import calibrate, default_grid

N_PROBLEMS, N_THRESHOLDS, RUNS = 1000, 10_000, 7
DELTAS = (0.05, 0.1, 0.15, 0.2)


def synthetic(seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Random-walk scores, cumulative labels and token counts, 50 to 150 steps per problem."""
    rng = np.random.default_rng(seed)
    scores, labels, tokens = [], [], []
    for _ in range(N_PROBLEMS):
        steps = int(rng.integers(50, 151))
        scores.append(np.clip(0.2 + np.cumsum(rng.normal(0.005, 0.03, steps)), 0.0, 1.0))
        c = np.zeros(steps, dtype=np.int8)
        c[rng.integers(0, steps) :] = 1
        labels.append(c)
        tokens.append(rng.integers(20, 200, steps))
    return scores, labels, tokens


def main() -> None:
    scores, labels, tokens = synthetic()
    grid = default_grid(N_THRESHOLDS)
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        calibrate(scores, labels, DELTAS, grid=grid, step_tokens=tokens)
        times.append(time.perf_counter() - start)
    steps = sum(len(m) for m in scores) / N_PROBLEMS
    print(
        f"| LTT calibrate ({N_PROBLEMS} problems x {steps:.0f} steps x {N_THRESHOLDS} "
        f"thresholds x {len(DELTAS)} deltas) | median {statistics.median(times):.3f} s "
        f"of {RUNS} runs (min {min(times):.3f} s) | {platform.processor() or platform.machine()} |"
    )


if __name__ == "__main__":
    main()
