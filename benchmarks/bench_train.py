"""Meta-training speed at paper scale: 3,000 training problems x ~100 steps x d = 5,120 (float16).

Usage: python benchmarks/bench_train.py [--data DIR] [--epochs 20]
Generates the synthetic set once (about 3 GB; ~40 s) into DIR and reuses it.
"""

import argparse
import platform
import time
from pathlib import Path

from calibration.synth import generate
from calibration.train import meta_train
from calibration.trajectories import TrajectorySet
from orca_serve.probe import ProbeSpec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=".cache/bench-paper-scale")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--probe", choices=["noqk", "qk"], default="noqk")
    a = ap.parse_args()
    data = Path(a.data)
    if not (data / "problems.jsonl").exists():
        # 5,000 problems split 0.6/0.2/0.2 gives the paper's 3,000 training problems.
        generate(data, n_problems=5000, dim=5120, mean_steps=100, seed=0, splits=(0.6, 0.2, 0.2))
    ts = TrajectorySet.open(data)
    spec = ProbeSpec(dim=5120) if a.probe == "noqk" else ProbeSpec(dim=5120, kind="qk", d_h=128)
    t0 = time.perf_counter()
    res = meta_train(ts, spec, "supervised", epochs=a.epochs, progress=False)
    dt = time.perf_counter() - t0
    n = len(ts.split("train"))
    print(f"| meta-train {spec.name}, {a.epochs} epochs, {n} train problems x ~100 steps x 5120 "
          f"| {dt:.0f} s ({dt / a.epochs:.1f} s/epoch, incl. per-epoch validation) "
          f"| selected epoch {res.epoch} | {platform.machine()}, {__import__('os').cpu_count()} cores |")


if __name__ == "__main__":
    main()
