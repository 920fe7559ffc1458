"""The guarantee on live traffic: how soon does the audit's alarm fire after a distribution shift?

1. calibrate on the toy model in distribution (`orca-calibrate run`: collect, split, train the
   probe, LTT with consistency labels: what the live audit measures), evaluating the bundle offline
   on the shifted family too;
2. serve that bundle with `--orca-audit-rate R` and send a stream that switches from the
   in-distribution family to the shifted one (concurrent requests, in order);
3. poll GET /v1/orca/audit and report when the alarm at `--delta` first fires: after how many
   audited requests (the ones in the risk), how many live requests had finished, how many of them
   were shifted.

Usage: python benchmarks/bench_audit.py [--probe static] [--n-in 100] [--n-shift 300] [--rate 1.0]
Writes OUT/result.json (the stream's timeline and the final table).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from serving import Server, orca_serve_cmd

from calibration.job import run_job
from calibration.toy.tasks import FORCE_SUFFIX, write_prompts

MODEL = ROOT / "orca_serve" / "demo" / "model"
ANSWER_TOKENS = 6  # calibration/jobs/toy.yaml
MAX_TOKENS = 400
SERVE = ["--host", "127.0.0.1", "--enforce-eager", "--dtype", "float32", "--max-model-len", "1024",
         "--reasoning-parser", "deepseek_r1", "--max-num-batched-tokens", "16384",
         "--disable-uvicorn-access-log"]


def calibrate(out: Path, probe: str, n_cal: int, seed: int) -> Path:
    """The in-distribution bundle (a resumable job: a rerun reuses finished stages)."""
    out.mkdir(parents=True, exist_ok=True)
    write_prompts(out / "prompts.jsonl", "in-dist", n_cal, seed=seed)
    write_prompts(out / "shifted.jsonl", "shifted", 200, seed=seed + 1)
    train = {"probe": probe, "label_mode": "consistent", "seed": 0, "batch_size": 1}
    if probe != "static":
        train["epochs"] = 20
    (out / "job.yaml").write_text(json.dumps({
        "model": str(MODEL), "prompts": "prompts.jsonl", "shifted_prompts": "shifted.jsonl",
        "out": "run",
        "collect": {"temperature": 0.7, "max_tokens": MAX_TOKENS, "suffix": FORCE_SUFFIX,
                    "answer_tokens": ANSWER_TOKENS, "batch": 128, "dtype": "float32",
                    "think": {"force_text": "\n</think>\n"}},
        "split": {"fractions": [0.45, 0.45, 0.1], "seed": 0},
        "train": train,
        "calibrate": {"deltas": [0.05, 0.1, 0.15, 0.2], "epsilon": 0.05, "window": 1},
    }, indent=1))
    for line in run_job(out / "job.yaml", progress=False):
        print(line, file=sys.stderr)
    return out / "run" / "bundle.json"


def stream(srv: Server, prompts: list[dict], concurrency: int, delta: float) -> dict:
    """Send the prompts in order, `concurrency` at a time; poll the audit table meanwhile."""
    finished: list[str] = []  # families, in completion order
    lock = threading.Lock()
    timeline: list[dict] = []
    done = threading.Event()
    first_alarm: dict | None = None
    first_drift: dict | None = None

    def ask(rec: dict) -> None:
        c = srv.client().with_options(timeout=900)
        c.chat.completions.create(model=str(MODEL), messages=rec["messages"], temperature=0.7,
                                  max_tokens=MAX_TOKENS, extra_body={"orca": {"delta": delta}})
        with lock:
            finished.append(rec["family"])

    def poll() -> None:
        nonlocal first_alarm, first_drift
        while not done.is_set():
            t = httpx.get(srv.url + "/v1/orca/audit", timeout=10).json()
            row = next(r for r in t["deltas"] if abs(r["delta"] - delta) < 1e-9)
            with lock:
                live, shifted = len(finished), finished.count("shifted")
            point = {"t": time.time(), "live": live, "live_shifted": shifted,
                     "labelled": t["labelled"], "n": row["n"], "risk": row["risk"],
                     "lower": row["lower"], "upper": row["upper"], "alarm": row["alarm"],
                     "drift": t.get("drift")}
            timeline.append(point)
            if row["alarm"] and first_alarm is None:
                first_alarm = point
            if (t.get("drift") or {}).get("alarm") and first_drift is None:
                first_drift = point
            time.sleep(0.5)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    t0 = time.time()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(ask, prompts))
    while True:  # let the labelling queue drain
        t = httpx.get(srv.url + "/v1/orca/audit", timeout=10).json()
        if t["labelled"] + t["failed"] + t["dropped"] >= t["picked"]:
            break
        time.sleep(1)
    time.sleep(1)
    done.set()
    poller.join()
    return {"first_alarm": first_alarm, "first_drift_alarm": first_drift, "final": t, "stream_s": round(time.time() - t0, 1),
            "timeline": timeline}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-audit")
    ap.add_argument("--probe", default="static")
    ap.add_argument("--n-cal", type=int, default=400, help="in-distribution calibration prompts")
    ap.add_argument("--n-in", type=int, default=100, help="in-distribution requests first")
    ap.add_argument("--n-shift", type=int, default=300, help="then shifted requests")
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--delta", type=float, default=0.1)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=31)
    a = ap.parse_args()
    out = a.out / a.probe
    bundle = calibrate(out, a.probe, a.n_cal, a.seed)
    write_prompts(out / "stream-in.jsonl", "in-dist", a.n_in, seed=a.seed + 2)
    write_prompts(out / "stream-shift.jsonl", "shifted", a.n_shift, seed=a.seed + 3)
    prompts = [json.loads(x) for f in ("stream-in.jsonl", "stream-shift.jsonl")
               for x in (out / f).read_text().splitlines()]
    srv = Server(orca_serve_cmd("--model", str(MODEL), "--calib", str(bundle),
                                "--orca-audit-rate", str(a.rate), "--orca-audit-seed", "0",
                                "--orca-audit-suffix", FORCE_SUFFIX,
                                "--orca-audit-answer-tokens", str(ANSWER_TOKENS),
                                "--orca-audit-queue", "10000",
                                "--orca-audit-dir", str(out / "audits")),
                 out / "server.log", SERVE)
    try:
        srv.wait()
        res = stream(srv, prompts, a.concurrency, a.delta)
    finally:
        srv.stop()
    offline = json.loads((out / "run" / "evaluation.json").read_text())
    res.update({"probe": a.probe, "rate": a.rate, "delta": a.delta, "n_in": a.n_in,
                "n_shift": a.n_shift, "concurrency": a.concurrency, "offline": offline})
    (out / "result.json").write_text(json.dumps(res, indent=1))
    f, row = res["first_alarm"], next(r for r in res["final"]["deltas"]
                                      if abs(r["delta"] - a.delta) < 1e-9)
    print(json.dumps({"probe": a.probe, "first_alarm": f,
                      "first_drift_alarm": res["first_drift_alarm"], "final_row": row,
                      "drift": res["final"].get("drift"),
                      "final_counts": {k: res["final"][k] for k in
                                       ("picked", "labelled", "dropped", "failed",
                                        "unsolvable", "unaligned")},
                      "stream_s": res["stream_s"]}, indent=1))


if __name__ == "__main__":
    main()
