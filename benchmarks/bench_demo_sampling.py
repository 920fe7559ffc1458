"""What `orca-serve --demo` does with requests that set no temperature: before and after the demo
model's generation_config.json named its calibration's (0.7).

Two servers in turn, each `orca-serve --demo` as shipped: `before` with `--generation-config
vllm` (vLLM's neutral defaults, temperature 1.0: what a request without one got while the model's
generation config named none), `after` without it (vLLM takes the model's generation config,
temperature 0.7). To each, the same `--n` fresh in-distribution toy problems (a seed no
calibration used), through the real OpenAI client with no sampling parameters, three times: ORCA
off (`"orca": {"enabled": false}`: the model's own accuracy at that temperature), with the
server's defaults (the bundle's default delta, policy `answer`) and with `"give_up": {"delta":
--give-up-delta}` (what the soak that found it served). Per arm and kind: accuracy (the toy's
checker, orca_demo/toy/tasks.py `check_answer`, on the delivered answer; its Clopper-Pearson 95%
interval), well-formed reasoning (`trace_stats`, on requests that ran to their end), how each
ended (`ended`: early / gave_up / full; `off` with ORCA off) and completion tokens.

Usage: python benchmarks/bench_demo_sampling.py [--n 100] [--give-up-delta 0.1]
Writes runs/bench-demo-sampling/result.json (every request).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
from collections import Counter
from pathlib import Path
from statistics import mean
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orca_calibrate.evaluate import interval95
from orca_demo.toy.tasks import Problem, check_answer, make_problem, trace_stats
from tests.serving import Server, orca_serve_cmd

ARMS = {"before": ["--generation-config", "vllm"], "after": []}
SERVER_ARGS = ["--host", "127.0.0.1", "--enforce-eager", "--seed", "0",
               "--disable-uvicorn-access-log"]
MAX_TOKENS = 400  # the toy job's (orca_calibrate/jobs/toy.yaml `collect.max_tokens`)


def problems(n: int) -> list[Problem]:
    """Fresh in-distribution problems: a stream of its own, not the job's seeds (1, 2)."""
    rng = random.Random("bench-demo-sampling")
    return [make_problem(rng, "in-dist") for _ in range(n)]


async def ask_all(server: Server, probs: list[Problem], orca: dict, concurrency: int) -> list[dict]:
    """Every problem once, with no sampling parameter but max_tokens; what each delivered."""
    sem = asyncio.Semaphore(concurrency)

    async def one(client: Any, model: str, p: Problem) -> dict:
        async with sem:
            r = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": p.question}],
                max_tokens=MAX_TOKENS, extra_body={"orca": orca})
        m = r.choices[0].message
        reasoning = (m.model_extra or {}).get("reasoning") or (m.model_extra or {}).get(
            "reasoning_content") or ""
        text = "<think>" + reasoning + "</think>" + (m.content or "")  # as generated
        o = r.model_extra.get("orca") or {}
        return {"question": p.question, "x": p.x, "text": text, "ended": o.get("ended", "off"),
                "completion_tokens": r.usage.completion_tokens,
                "correct": check_answer(m.content or "", p),
                "well_formed": trace_stats(text, p).well_formed}

    async with server.aclient() as client:
        model = (await client.models.list()).data[0].id
        return list(await asyncio.gather(*(one(client, model, p) for p in probs)))


def summary(rows: list[dict]) -> dict[str, Any]:
    ended = Counter(r["ended"] for r in rows)
    full = [r for r in rows if r["ended"] in ("full", "off")]
    right = sum(r["correct"] for r in rows)
    return {"n": len(rows), "correct_pct": 100 * right / len(rows),
            "correct_ci95_pct": [round(100 * v, 1) for v in interval95(right, len(rows))],
            "ended": dict(sorted(ended.items())),
            "well_formed_full_pct": 100 * mean(r["well_formed"] for r in full) if full else None,
            "mean_completion_tokens": mean(r["completion_tokens"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=100, help="problems per arm and kind")
    ap.add_argument("--give-up-delta", type=float, default=0.1)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-demo-sampling")
    a = ap.parse_args()
    probs = problems(a.n)
    kinds = {"off": {"enabled": False}, "default": {},
             "give_up": {"give_up": {"delta": a.give_up_delta}}}
    result: dict[str, Any] = {"n": a.n, "give_up_delta": a.give_up_delta, "arms": {}}
    for arm, flags in ARMS.items():
        log = Path(tempfile.mkdtemp(prefix=f"bench-demo-sampling-{arm}-")) / "serve.log"
        server = Server(orca_serve_cmd("--demo"), log, [*SERVER_ARGS, *flags])
        try:
            server.wait()
            rows = {k: asyncio.run(ask_all(server, probs, orca, a.concurrency))
                    for k, orca in kinds.items()}
        finally:
            server.stop()
        result["arms"][arm] = {"flags": flags, **{
            k: {"summary": summary(v), "rows": v} for k, v in rows.items()}}
        for k, v in rows.items():
            print(arm, k, json.dumps(summary(v)), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
