"""Time of one batched probe step (score, smooth, decide, update) as the server runs it.

Usage: python benchmarks/bench_probe_step.py [--rows 256] [--dim 5120]
Reports the median of many steps for all rows at once, and for a scattered subset of rows
(the usual engine step, where only requests that just finished a reasoning step are due).
"""

import argparse
import platform
import statistics
import time

import torch

from orca_method.probe import Probe, ProbeSpec
from orca_method.procedure import ProbeBank
from orca_method.thresholds import NEVER


def bench(bank: ProbeBank, rows: torch.Tensor, dim: int, reps: int) -> float:
    phi = torch.nn.functional.normalize(torch.randn(len(rows), dim), dim=-1)
    lam = torch.full((len(rows),), NEVER)
    for _ in range(10):
        bank.step(rows, phi, lam)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        bank.step(rows, phi, lam)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--dim", type=int, default=5120)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (vLLM's CPU worker uses 1 here)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    for spec in (ProbeSpec(dim=a.dim), ProbeSpec(dim=a.dim, kind="qk", d_h=128)):
        bank = ProbeBank(Probe(spec, seed=0), capacity=a.rows)
        rows = torch.arange(a.rows)
        full = bench(bank, rows, a.dim, a.reps)
        some = bench(bank, rows[torch.randperm(a.rows)[: max(1, a.rows // 16)]], a.dim, a.reps)
        print(f"| probe step {spec.name}, d={a.dim} | {a.rows} rows: {full:.3f} ms | "
              f"{max(1, a.rows // 16)} scattered rows: {some:.3f} ms | {a.threads} thread(s), "
              f"{platform.machine()} |")


if __name__ == "__main__":
    main()
