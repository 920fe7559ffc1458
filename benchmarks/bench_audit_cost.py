"""What live auditing costs: tokens/s of one workload through `orca-serve` at two audit rates.

The in-distribution static bundle of `bench_audit.py` (calibrated there, or here on first use) is
served at `--orca-audit-rate 0` and at `--rate` (default 0.05), alternately, `--rounds` times each
(one server at a time: r=0, r=R, r=0, r=R, ...), each time with the same fresh in-distribution
prompts sent through the real OpenAI client, `--concurrency` at a time. Per server: completion
tokens per second of wall time until the last response, and until the audits' labelling queue
has drained (what the audits cost includes their answer probes, run in the same engine), and per
CPU second of the server's processes (less sensitive to the machine's other load). The figure is
the ratio of the two rates' tokens/s, pooled over rounds, with each round's ratio.

Usage: python benchmarks/bench_audit_cost.py [--rate 0.05] [--n 200] [--rounds 2]
Writes runs/bench-audit/cost/result.json (result-audited-first.json with --audited-first).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_audit import MAX_TOKENS, MODEL, ROOT, audit_table, calibrate, serve

from orca_demo.toy.tasks import write_prompts


def session_cpu_s(sid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of one session: the server,
    its engine core and worker. Less sensitive than wall time to what else runs on the machine."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        if int(fields[3]) == sid:  # fields after the name: state ppid pgrp session ...
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def run_once(bundle: Path, out: Path, rate: float, prompts: list[dict], concurrency: int,
             delta: float) -> dict:
    """One server at this rate, the workload through it; tokens/s and the audit counts."""
    load = os.getloadavg()
    srv = serve(bundle, out, rate)
    try:
        # retries: a client starved of CPU on the loaded machine may reuse a keep-alive
        # connection the server has just closed ("disconnected without sending a response")
        client = srv.client().with_options(timeout=900, max_retries=3)

        def ask(rec: dict) -> tuple[int, bool]:
            r = client.chat.completions.create(model=str(MODEL), messages=rec["messages"],
                                               temperature=0.7, max_tokens=MAX_TOKENS,
                                               extra_body={"orca": {"delta": delta}})
            orca = r.model_extra["orca"]
            return r.usage.completion_tokens, bool(orca.get("audited"))

        t0, cpu0 = time.time(), session_cpu_s(srv.proc.pid)
        with ThreadPoolExecutor(concurrency) as pool:
            answers = list(pool.map(ask, prompts))
        stream_s = time.time() - t0
        counts = None
        if rate > 0:
            while True:
                t = audit_table(client)
                if t["labelled"] + t["failed"] + t["dropped"] >= t["picked"]:
                    counts = {k: t[k] for k in ("picked", "labelled", "dropped", "failed")}
                    break
                time.sleep(0.2)
        drained_s = time.time() - t0
        cpu_s = session_cpu_s(srv.proc.pid) - cpu0
    finally:
        srv.stop()
    tokens = sum(n for n, _ in answers)
    return {"rate": rate, "requests": len(answers), "audited": sum(a for _, a in answers),
            "completion_tokens": tokens, "stream_s": round(stream_s, 1),
            "drained_s": round(drained_s, 1), "tokens_per_s": round(tokens / stream_s, 2),
            "tokens_per_s_drained": round(tokens / drained_s, 2), "cpu_s": round(cpu_s, 1),
            "tokens_per_cpu_s": round(tokens / cpu_s, 2), "audit": counts,
            "loadavg_before": load, "loadavg_after": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-audit")
    ap.add_argument("--rate", type=float, default=0.05)
    ap.add_argument("--n", type=int, default=200, help="requests per server")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--delta", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=41, help="the workload's prompts' seed")
    ap.add_argument("--audited-first", action="store_true",
                    help="each round serves rate R before rate 0 (to see an order effect)")
    a = ap.parse_args()
    bundle = calibrate(a.out, "static", 1200, 300, 31)
    out = a.out / "cost"
    out.mkdir(parents=True, exist_ok=True)
    write_prompts(out / "workload.jsonl", "in-dist", a.n, seed=a.seed)
    prompts = [json.loads(x) for x in (out / "workload.jsonl").read_text().splitlines()]
    runs = []
    for i in range(a.rounds):
        for rate in ((a.rate, 0.0) if a.audited_first else (0.0, a.rate)):
            runs.append(run_once(bundle, out, rate, prompts, a.concurrency, a.delta))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)

    def pooled(rate: float, key: str) -> float:
        rs = [r for r in runs if r["rate"] == rate]
        return sum(r["completion_tokens"] for r in rs) / sum(r[key] for r in rs)

    def tps(pair: list[dict], rate: float) -> float:
        return next(r["tokens_per_s"] for r in pair if r["rate"] == rate)

    summary = {
        "nproc": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "n": a.n, "concurrency": a.concurrency, "rounds": a.rounds,
        "ratio_tokens_per_s": round(pooled(a.rate, "stream_s") / pooled(0.0, "stream_s"), 3),
        "ratio_tokens_per_s_drained": round(pooled(a.rate, "drained_s")
                                            / pooled(0.0, "stream_s"), 3),
        "ratio_tokens_per_cpu_s": round(pooled(a.rate, "cpu_s") / pooled(0.0, "cpu_s"), 3),
        "order": [r["rate"] for r in runs],
        "ratio_per_round": [round(tps(runs[2 * i:2 * i + 2], a.rate) / tps(runs[2 * i:2 * i + 2], 0.0),
                                  3) for i in range(a.rounds)],
        "runs": runs}
    name = "result-audited-first.json" if a.audited_first else "result.json"
    (out / name).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
