"""Meta-training speed at paper scale: ~100 steps x d = 5,120 (float16), our default vs the paper.

Usage: python benchmarks/bench_train.py [--problems 5000] [--epochs 20] [--arms default paper]

Paper scale is 5,000 problems (3,000 training problems at the 0.6 split) and 20 epochs. The set
is generated once into DATA (about 1 MB per problem; 5,000 take ~40 s) and reused. The arms run
one after the other in one process, and `default` runs again at the end. Times are CPU seconds
of the (single-threaded, `--threads 1`) process, which a busy machine slows far less than wall
time; wall time is shown too. On a busy machine use fewer
problems or epochs: the time per problem and epoch of either arm is flat in both after the
first epoch (which also builds the Gram cache), so the table extrapolates to paper scale as
first epoch + 19 x later epochs, scaled by 3,000 / training problems.
"""

import argparse
import os
import platform
import time
from pathlib import Path

import torch

from orca_calibrate.synth import generate
from orca_calibrate.train import DEFAULTS, lr_for_batch, meta_train, solvable
from orca_method.probe import ProbeSpec
from orca_method.trajectories import TrajectorySet

ARMS = {"default": dict(DEFAULTS),
        "paper": {"batch_size": 1, "lr": 1e-3, "epochs": 20, "epoch_select": "last",
                  "warmup": 0.0}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=None, help="default .cache/bench-paper-scale[-N]")
    ap.add_argument("--problems", type=int, default=5000, help="total (0.6 of them train)")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--probe", choices=["noqk", "qk"], default="noqk")
    ap.add_argument("--arms", nargs="+", default=["default"], choices=sorted(ARMS))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    data = Path(a.data or ".cache/bench-paper-scale" + ("" if a.problems == 5000 else
                                                        f"-{a.problems}"))
    if not (data / "problems.jsonl").exists():
        generate(data, n_problems=a.problems, dim=5120, mean_steps=100, seed=0,
                 splits=(0.6, 0.2, 0.2))
    ts = TrajectorySet.open(data)
    spec = ProbeSpec(dim=5120) if a.probe == "noqk" else ProbeSpec(dim=5120, kind="qk", d_h=128)
    n = len(solvable(ts, ts.split("train"), "supervised"))
    scale = 3000 / len(ts.split("train"))
    arms = a.arms + (["default"] if len(a.arms) > 1 and "default" in a.arms else [])
    print(f"{len(ts.split('train'))} training problems ({n} solvable) x ~100 steps x 5120, "
          f"{a.epochs} epochs, {spec.name}; {platform.machine()}, {os.cpu_count()} cores, "
          f"torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f} at start")
    print("| arm | settings | wall, all epochs | CPU: first epoch | CPU: later epochs (mean) "
          "| CPU extrapolated to 20 epochs x 3,000 problems | load after |")
    print("|---|---|---|---|---|---|---|")
    for arm in arms:
        settings = ARMS[arm] | {"epochs": a.epochs}
        t0 = time.perf_counter()
        res = meta_train(ts, spec, "supervised", progress=False, **settings)
        dt = time.perf_counter() - t0
        cpu = [h["cpu_seconds"] for h in res.history]
        first, later = cpu[0], (cpu[-1] - cpu[0]) / max(1, len(cpu) - 1)
        paper = (first + 19 * (later if len(cpu) > 1 else first)) * scale
        lr = settings["lr"] or lr_for_batch(settings["batch_size"])
        print(f"| {arm} | batch {settings['batch_size']}, lr {lr:.3g}, "
              f"{settings['epoch_select']} | {dt:.0f} s ({a.epochs} epochs) | {first:.1f} s "
              f"| {later:.1f} s | {paper:.0f} s | {os.getloadavg()[0]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
