"""Online equals offline: orca-serve's stop step vs the offline replay of recorded trajectories.

1. record held-out toy prompts greedily with the plugin in record mode (the collection code);
2. replay the recordings through the bundle's procedure (orca_method.procedure.replay) and take
   the first step whose smoothed score reaches lambda*(delta) (the final step, emitted at
   `</think>`, is never scored online, so a crossing there is no early stop);
3. serve the same prompts through a live `orca-serve` with greedy decoding and read `stop_step`.

Usage: python benchmarks/bench_parity.py [--n 300] [--delta 0.1] [--bundle orca_serve/demo/bundle.json]
Writes benchmarks/parity.json (every prompt: its steps, both stop steps, and the scores around a
mismatch).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests package's helpers

from calibration.collect import Collector, CollectSettings, read_prompts
from calibration.toy.demo_bundle import DEMO_MODEL_NAME
from calibration.toy.tasks import write_prompts
from orca_method.bundle import load_bundle
from orca_method.procedure import replay
from orca_method.trajectories import TrajectorySet
from tests.serving import Server, orca_serve_cmd

MODEL = ROOT / "orca_serve" / "demo" / "model"


def offline_stops(bundle, data: Path, lam: float) -> dict[str, tuple[int | None, list[float]]]:
    ts = TrajectorySet.open(data)
    runs = replay(bundle.load_probe(), [ts.embeddings(i) for i in range(len(ts))],
                  window=bundle.window)
    out = {}
    for p, (_, smooth) in zip(ts.problems, runs):
        s = smooth.numpy()[:-1]  # the final step is not scored online
        hit = np.flatnonzero(s >= lam)
        out[p.id] = (int(hit[0]) + 1 if hit.size else None, smooth.numpy().tolist())
    return out


async def online_stops(srv: Server, prompts: list[dict], delta: float, max_tokens: int,
                       concurrency: int) -> dict[str, dict]:
    client = srv.aclient()
    sem = asyncio.Semaphore(concurrency)

    async def one(rec: dict) -> tuple[str, dict]:
        async with sem:
            r = await client.chat.completions.create(
                model=str(MODEL), messages=rec["messages"], temperature=0, max_tokens=max_tokens,
                extra_body={"orca": {"delta": delta, "policy": "answer"}})
            return str(rec["id"]), r.model_extra["orca"]

    return dict(await asyncio.gather(*(one(r) for r in prompts)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--delta", type=float, default=0.1)
    ap.add_argument("--bundle", default=str(ROOT / "orca_serve" / "demo" / "bundle.json"))
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--work", default=str(ROOT / ".cache" / "parity"))
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    bundle = load_bundle(a.bundle)
    lam = bundle.lam(a.delta)
    prompts_file = work / "prompts.jsonl"
    write_prompts(prompts_file, "in-dist", a.n, seed=4242)
    prompts = read_prompts(prompts_file)
    # recordings are reused only for the same model weights and settings (a stale cache from an
    # earlier model once made every stop step disagree)
    key = hashlib.sha256(f"{(MODEL / 'SHA256SUMS').read_text()}|{a.n}|{a.max_tokens}".encode())
    data = work / f"recorded-{key.hexdigest()[:12]}"
    t0 = time.perf_counter()
    if not (data / "problems.jsonl").exists():
        settings = CollectSettings(temperature=0.0, max_tokens=a.max_tokens, label_every=10**6,
                                   answer_tokens=4, batch=64,
                                   think=bundle.think.model_dump(),
                                   segmentation=bundle.segmentation.model_dump(),
                                   normalization=bundle.normalization)
        collector = Collector(str(MODEL), settings)
        collector.run(prompts, data, progress=True)
        del collector
    offline = offline_stops(bundle, data, lam)
    t1 = time.perf_counter()
    srv = Server(orca_serve_cmd("--model", str(MODEL), "--calib", a.bundle), work / "serve.log",
                 ["--served-model-name", str(MODEL), DEMO_MODEL_NAME,  # the bundle's name for it
                  "--host", "127.0.0.1", "--enforce-eager", "--dtype", "float32",
                  "--max-model-len", "1024", "--seed", "0"])
    try:
        srv.wait()
        online = asyncio.run(online_stops(srv, prompts, a.delta, a.max_tokens, a.concurrency))
    finally:
        srv.stop()
    rows, match = [], 0
    for rec in prompts:
        pid = str(rec["id"])
        off_step, scores = offline.get(pid, (None, []))
        on = online[pid]
        on_step = on["stop_step"] if on["stopped_early"] else None
        ok = off_step == on_step
        match += ok
        row = {"id": pid, "steps": len(scores), "offline": off_step, "online": on_step,
               "match": ok}
        if not ok:
            k = (off_step or on_step or 1) - 1
            row["offline_scores_near"] = scores[max(0, k - 2):k + 3]
            row["online_last_score"] = on["last_score"]
        rows.append(row)
    result = {"n": len(prompts), "delta": a.delta, "lambda": None if math.isinf(lam) else lam,
              "matches": match, "match_rate": match / len(prompts),
              "stopped_offline": sum(r["offline"] is not None for r in rows),
              "stopped_online": sum(r["online"] is not None for r in rows),
              "mean_steps": float(np.mean([r["steps"] for r in rows])),
              "mean_stop_step_online": float(np.mean([r["online"] or r["steps"] for r in rows])),
              "record_s": round(t1 - t0, 1), "prompts": rows}
    (ROOT / "benchmarks" / "parity.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "prompts"}))
    for r in [r for r in rows if not r["match"]][:20]:
        print(r)


if __name__ == "__main__":
    main()
