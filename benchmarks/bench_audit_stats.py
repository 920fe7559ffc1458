"""Cost of the live audit's statistics per request; prints markdown table rows.

The server updates one confidence sequence per delta for every labelled audit, and the drift
monitor for every finished request (a KS test every `window` requests).
Run: .venv/bin/python benchmarks/bench_audit_stats.py
"""

from __future__ import annotations

import time

import numpy as np

from orca_serve.audit import ConfidenceSequence, DriftMonitor, build_reference

N = 5000


def per_call_us(fn, args) -> float:
    start = time.perf_counter()
    for a in args:
        fn(a)
    return (time.perf_counter() - start) / len(args) * 1e6


def paths(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    out = []
    for _ in range(n):
        z = rng.normal(-1, 1) + np.cumsum(rng.normal(0.08, 0.3, int(rng.integers(20, 200))))
        out.append(1 / (1 + np.exp(-z)))
    return out


def main() -> None:
    rng = np.random.default_rng(0)
    cs = ConfidenceSequence(alpha=0.05)
    losses = (rng.random(N) < 0.1).astype(float).tolist()
    cs_us = per_call_us(cs.update, losses)
    state = cs.to_dict()
    start = time.perf_counter()
    ConfidenceSequence.from_dict(state)
    restore_ms = (time.perf_counter() - start) * 1e3
    mon = DriftMonitor(build_reference(paths(rng, 2000), 10, [0.8, 0.9]))
    drift_us = per_call_us(mon.observe, paths(rng, N))
    print("| what | cost |\n| --- | --- |")
    print(f"| ConfidenceSequence.update (grid 501), per audit and delta | {cs_us:.1f} us |")
    print(f"| ConfidenceSequence state restore (from_dict) | {restore_ms:.2f} ms |")
    print(f"| DriftMonitor.observe, mean over {N} requests incl. a KS test every 500 | "
          f"{drift_us:.1f} us ({mon.tests} tests) |")


if __name__ == "__main__":
    main()
