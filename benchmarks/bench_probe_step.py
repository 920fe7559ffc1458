"""Time of one batched probe step (score, smooth, decide, update) as the server runs it.

Usage: python benchmarks/bench_probe_step.py [--rows 256] [--dim 5120] [--device cuda]
Reports the median of many steps for all rows at once, and for a scattered subset of rows
(the usual engine step, where only requests that just finished a reasoning step are due). On a
GPU each step is timed to the device's end of it (synchronised after the step; the server does
not wait there, its readback comes a step later).
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
    dev = bank.device
    phi = torch.nn.functional.normalize(torch.randn(len(rows), dim, device=dev), dim=-1)
    lam = torch.full((len(rows),), NEVER, device=dev)
    rows_dev = rows.to(dev)
    done = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(10):
        bank.step(rows, phi, lam, rows_dev=rows_dev)
    done()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        bank.step(rows, phi, lam, rows_dev=rows_dev)
        done()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--dim", type=int, default=5120)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (vLLM's CPU worker uses 1 here)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (a GPU)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    where = torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device
    for spec in (ProbeSpec(dim=a.dim), ProbeSpec(dim=a.dim, kind="qk", d_h=128)):
        bank = ProbeBank(Probe(spec, seed=0), capacity=a.rows, device=a.device)
        rows = torch.arange(a.rows)
        full = bench(bank, rows, a.dim, a.reps)
        some = bench(bank, rows[torch.randperm(a.rows)[: max(1, a.rows // 16)]], a.dim, a.reps)
        print(f"| probe step {spec.name}, d={a.dim} | {a.rows} rows: {full:.3f} ms | "
              f"{max(1, a.rows // 16)} scattered rows: {some:.3f} ms | {a.threads} thread(s), "
              f"{platform.machine()}, {where} |")


if __name__ == "__main__":
    main()
