"""Online equals offline: orca-serve's stop step vs the offline replay of recorded trajectories.

1. record held-out toy prompts greedily with the plugin in record mode (the collection code);
2. replay the recordings through the bundle's procedure (orca_method.procedure.replay) and take
   the first step whose smoothed score reaches lambda*(delta) (the final step, emitted at
   `</think>`, is never scored online, so a crossing there is no early stop); with
   `--give-up-delta`, the first step where the pair (lambda*, mu*) ends the trace and how
   (`orca_method.give_up.two_sided_ends`: answered early or gave up); through the bundle's shift
   gate as the server runs it by default (`bench_replay_shift.served_ends`: nothing ends before
   the gate step, a flagged request runs the strict action's lambda and never gives up, one
   above the give-up side's threshold never gives up; the gate alarm is not replayed);
3. serve the same prompts through a live `orca-serve` with greedy decoding and read `stop_step`
   (and `ended`, `give_up_step`).

Usage: python benchmarks/bench_parity.py [--reasoner toy|long] [--n 300] [--delta 0.1]
                                         [--give-up-delta D2] [--bundle BUNDLE]
(the bundle: the reasoner's demo bundle by default). Writes benchmarks/parity.json, or
parity-long.json for the long reasoner (every prompt: its steps, both stop steps, and the scores
around a mismatch).
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_replay_shift import gate_scores, served_ends  # noqa: E402

from orca_calibrate.collect import Collector, CollectSettings, read_prompts
from orca_demo.long import tasks as long_tasks
from orca_demo.toy import tasks as toy_tasks
from orca_demo.toy.demo_bundle import JOBS, demo_folder
from orca_method.bundle import load_bundle
from orca_method.outcomes import Ended
from orca_method.procedure import replay
from orca_method.thresholds import GIVE_UP_NEVER
from orca_method.trajectories import TrajectorySet
from orca_serve.settings.contract import DEFAULTS, safe_lam
from tests.serving import Server, orca_serve_cmd

# reasoner: its tasks module and max_tokens (the calibration job's); folder and name: demo_bundle
REASONERS = {"toy": (toy_tasks, 400), "long": (long_tasks, 5000)}


def offline_stops(bundle, data: Path, lam: float, mu: float = GIVE_UP_NEVER
                  ) -> dict[str, tuple[str, int | None, list[float], bool]]:
    """Per problem: how the pair ends it (`ended`), the 1-based step (None: ran to its end),
    the smoothed stop scores, and whether the gate flagged it (the server's defaults: module
    docstring)."""
    ts = TrajectorySet.open(data)
    embs = [ts.embeddings(i) for i in range(len(ts))]
    stop = [s.numpy() for _, s in replay(bundle.load_probe(), embs, window=bundle.window)]
    give_up = (stop if math.isinf(mu) else  # never gives up: any scores do
               [s.numpy() for _, s in replay(bundle.load_give_up_probe(), embs,
                                             window=bundle.give_up.window)])
    flagged = barred = np.zeros(len(ts), dtype=bool)
    steps, safe = 1, safe_lam(bundle, DEFAULTS.shift_action)
    gate = bundle.load_gate()
    if gate is not None:
        score = np.nan_to_num(gate_scores(gate, embs), nan=-np.inf)  # too short: not gated
        thr, thr_give_up = gate.thresholds()
        flagged, barred, steps = score > thr, score > thr_give_up, gate.steps
    end, how = served_ends(stop, give_up, lam, None if math.isinf(mu) else mu, flagged, steps,
                           safe, barred)
    return {p.id: (h, None if h == Ended.FULL else int(e) + 1, s.tolist(), bool(f))
            for p, e, h, s, f in zip(ts.problems, end, how, stop, flagged)}


async def online_stops(srv: Server, model: str, prompts: list[dict], delta: float,
                       max_tokens: int, concurrency: int,
                       give_up: float | None = None) -> dict[str, dict]:
    client = srv.aclient()
    sem = asyncio.Semaphore(concurrency)

    async def one(rec: dict) -> tuple[str, dict]:
        async with sem:
            r = await client.chat.completions.create(
                model=model, messages=rec["messages"], temperature=0, max_tokens=max_tokens,
                extra_body={"orca": {"delta": delta, "policy": "answer",
                                     **({} if give_up is None else
                                        {"give_up": {"delta": give_up}})}})
            return str(rec["id"]), r.model_extra["orca"]

    return dict(await asyncio.gather(*(one(r) for r in prompts)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reasoner", choices=sorted(REASONERS), default="toy")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--delta", type=float, default=0.1)
    ap.add_argument("--give-up-delta", type=float, default=None,
                    help="also give up with this risk (a two-sided bundle)")
    ap.add_argument("--bundle", default=None)
    ap.add_argument("--max-tokens", type=int, default=None, help="default: the reasoner's")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--work", default=None, help="default: .cache/parity[-long]")
    a = ap.parse_args()
    tasks, max_tokens = REASONERS[a.reasoner]
    folder, served_name = demo_folder(a.reasoner), JOBS[a.reasoner][1]
    model = folder / "model"
    a.max_tokens = a.max_tokens or max_tokens
    a.bundle = a.bundle or str(folder / "bundle.json")
    tail = "" if a.reasoner == "toy" else f"-{a.reasoner}"
    work = Path(a.work or ROOT / ".cache" / f"parity{tail}")
    work.mkdir(parents=True, exist_ok=True)
    bundle = load_bundle(a.bundle)
    lam = bundle.lam(a.delta)
    mu = GIVE_UP_NEVER if a.give_up_delta is None else bundle.mu(a.give_up_delta)
    prompts_file = work / "prompts.jsonl"
    tasks.write_prompts(prompts_file, "in-dist", a.n, seed=4242)
    prompts = read_prompts(prompts_file)
    # recordings are reused only for the same model weights and settings (a stale cache from an
    # earlier model once made every stop step disagree)
    key = hashlib.sha256(f"{(model / 'SHA256SUMS').read_text()}|{a.n}|{a.max_tokens}".encode())
    data = work / f"recorded-{key.hexdigest()[:12]}"
    t0 = time.perf_counter()
    if not (data / "problems.jsonl").exists():
        settings = CollectSettings(temperature=0.0, max_tokens=a.max_tokens, label_every=10**6,
                                   answer_tokens=4, batch=64,
                                   think=bundle.think.model_dump(),
                                   segmentation=bundle.segmentation.model_dump(),
                                   normalization=bundle.normalization)
        collector = Collector(str(model), settings)
        collector.run(prompts, data, progress=True)
        del collector
    offline = offline_stops(bundle, data, lam, mu)
    t1 = time.perf_counter()
    srv = Server(orca_serve_cmd("--model", str(model), "--calib", a.bundle), work / "serve.log",
                 ["--served-model-name", str(model), served_name,  # the bundle's name for it
                  "--host", "127.0.0.1", "--enforce-eager", "--dtype", "float32",
                  "--max-model-len", str(max(1024, a.max_tokens + 120)), "--seed", "0"])
    try:
        srv.wait()
        online = asyncio.run(online_stops(srv, str(model), prompts, a.delta, a.max_tokens, a.concurrency,
                                          a.give_up_delta))
    finally:
        srv.stop()
    rows, match = [], 0
    for rec in prompts:
        pid = str(rec["id"])
        off_how, off_step, scores, off_flagged = offline.get(pid, ("full", None, [], False))
        on = online[pid]
        on_how = on["ended"]
        on_step = {"early": on["stop_step"], "gave_up": on.get("give_up_step")}.get(on_how)
        ok = (off_how, off_step) == (on_how, on_step)
        match += ok
        on_flagged = bool((on.get("shift") or {}).get("flagged"))
        row = {"id": pid, "steps": len(scores), "offline": off_step, "online": on_step,
               "ended_offline": off_how, "ended_online": on_how,
               "flagged_offline": off_flagged, "flagged_online": on_flagged, "match": ok}
        if not ok:
            k = (off_step or on_step or 1) - 1
            row["offline_scores_near"] = scores[max(0, k - 2):k + 3]
            row["online_last_score"] = on["last_score"]
        rows.append(row)
    result = {"n": len(prompts), "delta": a.delta, "lambda": None if math.isinf(lam) else lam,
              "give_up_delta": a.give_up_delta, "mu": None if math.isinf(mu) else mu,
              "matches": match, "match_rate": match / len(prompts),
              "gave_up_offline": sum(r["ended_offline"] == Ended.GAVE_UP for r in rows),
              "gave_up_online": sum(r["ended_online"] == Ended.GAVE_UP for r in rows),
              "stopped_offline": sum(r["ended_offline"] == Ended.EARLY for r in rows),
              "stopped_online": sum(r["ended_online"] == Ended.EARLY for r in rows),
              "flagged_offline": sum(r["flagged_offline"] for r in rows),
              "flagged_online": sum(r["flagged_online"] for r in rows),
              "mean_steps": float(np.mean([r["steps"] for r in rows])),
              "mean_stop_step_online": float(np.mean([r["online"] or r["steps"] for r in rows])),
              "record_s": round(t1 - t0, 1), "prompts": rows}
    (ROOT / "benchmarks" / f"parity{tail}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "prompts"}))
    for r in [r for r in rows if not r["match"]][:20]:
        print(r)


if __name__ == "__main__":
    main()
