"""Goodput: what early stopping buys a server, ORCA off vs on through one live `orca-serve --demo`.

One server, the same held-out toy prompts (in-distribution, a seed the calibration never saw)
sent per request with ORCA off (`"orca": {"enabled": false}`) and on (the bundle, at `--delta`),
in interleaved rounds (off then on, on then off, ...) at each `--concurrency`, through the real
OpenAI client over HTTP, sampled at the calibration's temperature. Per round and arm: requests/s
(prompts / wall time until the last response), completion tokens per request, p50/p95 latency,
answer accuracy (the toy's checker on the delivered text) and, for ORCA on, the stop error.

After the timed rounds (untimed, the same server) every response is labelled as
`orca-calibrate collect` labels a trajectory: its token ids (`return_token_ids`) are cut into
steps by the plugin's segmenter, each step prefix gets the answer-forcing suffix and a few greedy
tokens (`/v1/completions`, ORCA off), and the forced answers give the step labels. Then:
- **stop error** (ORCA on): the bundle's loss, 1 when no step up to the stop step had the right
  answer yet. It is defined on the never-stopping trajectory (never-right ones excluded), so a
  stopped request is first continued from its stop step with ORCA off and the same sampling (a
  draw of the rest of the run it cut short), then labelled whole;
- **oracle** (on the ORCA-off responses): stop at the first step whose forced answer already
  equals the response's final answer; its tokens are the response's minus the steps after that
  one, its answer the response's (so its accuracy is the off arm's). The fewest tokens any
  stopping rule could spend on these traces without changing an answer.

Usage: python benchmarks/bench_goodput.py [--n 96] [--rounds 6] [--concurrency 16 64]
Writes runs/bench-goodput/result.json (every request) and benchmarks/goodput.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from calibration.toy import tasks as toy_tasks
from calibration.toy.tasks import write_prompts
from orca_method.answer_probes import (
    ProbeSettings,
    probe_prompts,
    reasoning_start,
    step_ends,
    trajectory_fields,
)
from orca_method.bundle import load_bundle
from orca_method.labels import extract_forced
from orca_method.risk import cumulative, is_counted, losses
from tests.serving import Server, orca_serve_cmd

ARMS = ("off", "on")
MODEL_DIR = ROOT / "orca_serve" / "demo" / "model"
BUNDLE = ROOT / "orca_serve" / "demo" / "bundle.json"
# labelled as the demo's calibration data was (the bundle's labelling block), as its audit labels
PROBE = ProbeSettings(**load_bundle(BUNDLE).labelling.model_dump(), label_every=1)
PROMPT_SEED = 18  # calibration used seeds 1 (in-dist) and 2 (shifted): these prompts are held out


# ------------------------------------------------------------------ pure parts (tests/test_goodput)

def first_index(labels: Sequence[int]) -> int:
    """0-based index of the first 1 in `labels`, or the last index when there is none."""
    hits = np.flatnonzero(np.asarray(labels) == 1)
    return int(hits[0]) if hits.size else len(labels) - 1


def stop_loss(supervised: Sequence[int], stop_index: int) -> int:
    """The bundle's 0/1 loss of stopping at 0-based step `stop_index`: 1 when no step up to it
    had the right answer (orca_method/risk.py `losses` on cumulative labels)."""
    return int(losses(np.array([stop_index]), [cumulative(supervised)])[0])


@dataclass(frozen=True)
class Oracle:
    """The best stop on one labelled response: the first step whose answer is the final one.
    It delivers the response's own answer, so its accuracy is the response's."""

    step: int  # 0-based
    tokens: int  # completion tokens had the response stopped there


def oracle(trace: dict[str, Any], completion_tokens: int) -> Oracle:
    """The oracle stop of one labelled response (`trajectory_fields` record): the first step
    whose consistent label is 1 (its forced answer equals the final answer; the last step when
    none does). Its tokens: the response's, less every step after that one."""
    j = first_index(trace["labels"]["consistent"])
    return Oracle(step=j, tokens=completion_tokens - sum(trace["step_tokens"][j + 1:]))


def spread(values: Sequence[float]) -> dict[str, float]:
    """min / median / max of per-round figures (the spread the tables report)."""
    v = np.asarray(values, dtype=float)
    return {"min": float(v.min()), "median": float(np.median(v)), "max": float(v.max())}


def round_ratios(rounds: Sequence[dict[str, dict[str, float]]], key: str) -> list[float]:
    """Per round, on / off of one figure (`rounds[i][arm][key]`)."""
    return [r["on"][key] / r["off"][key] for r in rounds]


def arm_figures(requests: Sequence[dict[str, Any]], wall_s: float) -> dict[str, float]:
    """The timed figures of one arm in one round: requests/s, tokens/request, p50/p95 latency
    (s) and accuracy."""
    lat = np.array([r["latency_s"] for r in requests])
    return {"requests_per_s": len(requests) / wall_s,
            "tokens_per_request": float(np.mean([r["completion_tokens"] for r in requests])),
            "p50_latency_s": float(np.percentile(lat, 50)),
            "p95_latency_s": float(np.percentile(lat, 95)),
            "accuracy": float(np.mean([r["correct"] for r in requests]))}


def stop_error(requests: Sequence[dict[str, Any]]) -> tuple[float, int]:
    """(realized stop error, requests counted) over labelled ORCA-on requests (module docstring)."""
    counted = [r["loss"] for r in requests if r["loss"] is not None]
    return (float(np.mean(counted)) if counted else float("nan")), len(counted)


def interval95(rate: float, n: int) -> tuple[float, float]:
    """Clopper-Pearson 95% interval of a realized rate over n counted requests."""
    from scipy.stats import binomtest

    ci = binomtest(round(rate * n), n).proportion_ci(0.95)
    return float(ci.low), float(ci.high)


def request_loss(trace: dict[str, Any], orca: dict[str, Any],
                 excluded_never_correct: bool) -> int | None:
    """The stop loss of one ORCA-on request, given the labelled never-stopping trajectory it
    belongs to; None when that trajectory is never right and the bundle's calibration excluded
    such trajectories (orca_method/risk.py `is_counted`)."""
    sup = trace["labels"]["supervised"]
    if not is_counted(sup, excluded_never_correct):
        return None
    return stop_loss(sup, int(orca["stop_step"]) - 1 if orca.get("stopped_early") else len(sup) - 1)


# ------------------------------------------------------------------------------- live parts

class Workload:
    """The held-out prompts and what checks and segments their responses: a demo's model and
    bundle, and its task module (`Problem`, `check_answer`)."""

    def __init__(self, path: Path, model_dir: Path = MODEL_DIR, bundle: Path = BUNDLE,
                 tasks: Any = toy_tasks) -> None:
        from transformers import AutoTokenizer

        from orca_method.bundle import load_bundle
        from orca_method.steps import TokenTable

        self.prompts = [json.loads(x) for x in path.read_text().splitlines()]
        self.tasks = tasks
        self.bundle = load_bundle(bundle)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.table = TokenTable.from_tokenizer(self.tokenizer, segmentation=self.bundle.segmentation,
                                               think=self.bundle.think)
        self.suffix_ids = self.tokenizer.encode(PROBE.suffix, add_special_tokens=False)

    def text(self, gen: Sequence[int]) -> str:
        return self.tokenizer.decode(gen, skip_special_tokens=True)

    def correct(self, prompt: dict, text: str) -> bool:
        """The task's checker on a delivered text."""
        return self.tasks.check_answer(text, self.tasks.Problem(**prompt["problem"]))


async def run_arm(client: Any, model: str, prompts: list[dict], arm: str, delta: float,
                  concurrency: int, max_tokens: int, temperature: float) -> tuple[list[dict], float]:
    """All prompts through the server with ORCA `arm`, `concurrency` at a time; the raw
    responses (ids, usage, orca report, latency) and the wall time until the last one."""
    sem = asyncio.Semaphore(concurrency)
    orca = {"enabled": False} if arm == "off" else {"enabled": True, "delta": delta}

    async def one(rec: dict) -> dict:
        async with sem:
            t0 = time.perf_counter()
            r = await client.chat.completions.create(
                model=model, messages=rec["messages"], temperature=temperature,
                max_tokens=max_tokens, extra_body={"orca": orca, "return_token_ids": True})
            latency = time.perf_counter() - t0
        return {"id": rec["id"], "latency_s": latency,
                "completion_tokens": r.usage.completion_tokens,
                "prompt_token_ids": r.model_extra["prompt_token_ids"],
                "token_ids": r.choices[0].model_extra["token_ids"],
                "orca": r.model_extra.get("orca") or {}}

    t0 = time.perf_counter()
    out = await asyncio.gather(*(one(rec) for rec in prompts))
    return list(out), time.perf_counter() - t0


async def label(client: Any, model: str, work: Workload, responses: list[dict],
                concurrency: int, max_tokens: int, temperature: float,
                label_every: int = PROBE.label_every) -> None:
    """Give every response its never-stopping trajectory's record (`trace`): a stopped one is
    continued from its stop step (ORCA off, the same sampling); then answer probes at each step
    boundary through the server (ORCA off), labelled as `orca-calibrate collect` labels."""
    from orca_method.steps import segment

    sem = asyncio.Semaphore(concurrency)
    by_id = {str(p["id"]): p for p in work.prompts}
    off = {"orca": {"enabled": False}}

    async def probe(ids: list[int]) -> str | None:
        async with sem:
            r = await client.completions.create(
                model=model, prompt=ids, temperature=0, max_tokens=PROBE.answer_tokens,
                extra_body=off)
        return extract_forced(r.choices[0].text)

    async def never_stopping(resp: dict) -> list[int]:
        """The generated ids of the run without the stop: the response's own when it did not
        stop; else its steps through the stop step and a continuation from there."""
        prompt_ids, gen = resp["prompt_token_ids"], resp["token_ids"]
        if not resp["orca"].get("stopped_early"):
            return gen
        steps = segment(work.table, gen, prompt_ids)
        end = step_ends([len(x) for x in steps], reasoning_start(gen, steps))[
            resp["orca"]["stop_step"] - 1]
        async with sem:
            r = await client.completions.create(
                model=model, prompt=prompt_ids + gen[:end], temperature=temperature,
                max_tokens=max_tokens - end, extra_body={**off, "return_token_ids": True})
        resp["continued_tokens"] = len(r.choices[0].model_extra["token_ids"])
        return gen[:end] + r.choices[0].model_extra["token_ids"]

    async def one(resp: dict) -> None:
        prompt_ids = resp["prompt_token_ids"]
        gen = await never_stopping(resp)
        steps = segment(work.table, gen, prompt_ids)
        record = {"step_tokens": [len(x) for x in steps], "step_token_ids": steps}
        points = probe_prompts(prompt_ids, gen, record, work.suffix_ids, label_every)
        answers = await asyncio.gather(*(probe(ids) for _, ids in points))
        resp["trace"] = trajectory_fields(
            str(resp["id"]), by_id[str(resp["id"])], text=work.text(gen), finish_reason=None,
            completion_tokens=len(gen), step_tokens=record["step_tokens"],
            probed={t: a for (t, _), a in zip(points, answers)})

    await asyncio.gather(*(one(r) for r in responses))


def check(work: Workload, responses: list[dict]) -> None:
    """Accuracy of each response by the toy's checker on its delivered text."""
    by_id = {str(p["id"]): p for p in work.prompts}
    for r in responses:
        r["correct"] = work.correct(by_id[str(r["id"])], work.text(r["token_ids"]))


async def bench(a: argparse.Namespace, url: str, work: Workload) -> dict[str, Any]:
    import openai

    # retries: a client starved of CPU on the loaded machine may reuse a keep-alive connection
    # the server has just closed (seen in bench_audit_cost)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", timeout=900, max_retries=3)
    model = (await client.models.list()).data[0].id
    await run_arm(client, model, work.prompts[:16], "on", a.delta, 16, a.max_tokens,
                  a.temperature)  # warm-up, not counted
    levels = []
    for c in a.concurrency:
        rounds = []
        for i in range(a.rounds):
            order = ARMS if i % 2 == 0 else ARMS[::-1]
            rnd: dict[str, Any] = {"order": list(order), "loadavg": os.getloadavg()}
            for arm in order:
                resp, wall = await run_arm(client, model, work.prompts, arm, a.delta, c,
                                           a.max_tokens, a.temperature)
                rnd[arm] = {"wall_s": wall, "requests": resp}
            rounds.append(rnd)
            print(f"c={c} round {i + 1}: off {rnd['off']['wall_s']:.1f} s, "
                  f"on {rnd['on']['wall_s']:.1f} s, load {rnd['loadavg'][0]:.1f}",
                  file=sys.stderr, flush=True)
        levels.append({"concurrency": c, "rounds": rounds})
    t0 = time.perf_counter()
    everything = [r for lv in levels for rnd in lv["rounds"] for arm in ARMS
                  for r in rnd[arm]["requests"]]
    check(work, everything)
    await label(client, model, work, everything, 64, a.max_tokens, a.temperature)
    print(f"labelled {len(everything)} responses in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr, flush=True)
    return {"levels": levels}


def summarize(levels: list[dict[str, Any]], excluded_never_correct: bool) -> list[dict[str, Any]]:
    """Per concurrency: per-round figures of both arms, on/off ratios with their spread, the
    pooled stop error and the oracle. `excluded_never_correct`: the bundle's LTT setting."""
    out = []
    for lv in levels:
        per_round = []
        for rnd in lv["rounds"]:
            figs = {arm: arm_figures(rnd[arm]["requests"], rnd[arm]["wall_s"]) for arm in ARMS}
            for r in rnd["on"]["requests"]:
                r["loss"] = request_loss(r["trace"], r["orca"], excluded_never_correct)
            figs["on"]["stop_error"], _ = stop_error(rnd["on"]["requests"])
            per_round.append(figs)
        on = [r for rnd in lv["rounds"] for r in rnd["on"]["requests"]]
        off = [r for rnd in lv["rounds"] for r in rnd["off"]["requests"]]
        orc = [oracle(r["trace"], r["completion_tokens"]) for r in off]
        err, counted = stop_error(on)
        keys = ("requests_per_s", "tokens_per_request", "p50_latency_s", "p95_latency_s",
                "accuracy")
        out.append({
            "concurrency": lv["concurrency"], "rounds": len(per_round), "n_per_arm": len(off),
            "per_round": per_round,
            "ratio": {k: spread(round_ratios(per_round, k)) for k in keys},
            "off": {k: spread([r["off"][k] for r in per_round]) for k in keys},
            "on": {k: spread([r["on"][k] for r in per_round]) for k in (*keys, "stop_error")},
            "pooled": {
                "tokens_per_request": {"off": float(np.mean([r["completion_tokens"] for r in off])),
                                       "on": float(np.mean([r["completion_tokens"] for r in on])),
                                       "oracle": float(np.mean([o.tokens for o in orc]))},
                # the oracle delivers each off response's own answer: the off accuracy
                "accuracy": {"off": float(np.mean([r["correct"] for r in off])),
                             "on": float(np.mean([r["correct"] for r in on])),
                             "oracle": float(np.mean([r["correct"] for r in off]))},
                "stop_error": err, "stop_error_counted": counted,
                "stop_error_ci95": interval95(err, counted),
                "stopped_early": float(np.mean([bool(r["orca"].get("stopped_early"))
                                                for r in on])),
                # 1-based step the reasoning ended at (a request that did not stop: its last)
                "mean_stop_step": {
                    "on": float(np.mean([r["orca"]["stop_step"] if r["orca"].get("stopped_early")
                                         else len(r["trace"]["step_tokens"]) for r in on])),
                    "oracle": float(np.mean([o.step + 1 for o in orc]))}}})
    return out


RATIO_HEADER = ("| c | rounds x n | requests/s on/off | tokens/request on/off "
                "| p50 latency on/off | p95 latency on/off |")
POOLED_HEADER = ("| c | tokens/request off / ORCA / oracle | accuracy off / ORCA / oracle "
                 "| stop error (counted; 95% interval) | stopped early | requests/s off / on (median) |")


def table(summary: list[dict[str, Any]]) -> str:
    """The markdown tables for benchmarks/RESULTS.md: the on/off ratios as median (min-max) over
    rounds, then the pooled figures beside the oracle's."""
    def cell(d: dict[str, float]) -> str:
        return f"{d['median']:.2f} ({d['min']:.2f}-{d['max']:.2f})"

    lines = [RATIO_HEADER, "|---" * 6 + "|"]
    for lv in summary:
        r = lv["ratio"]
        lines.append(f"| {lv['concurrency']} | {lv['rounds']} x {lv['n_per_arm'] // lv['rounds']} | "
                     + " | ".join(cell(r[k]) for k in ("requests_per_s", "tokens_per_request",
                                                       "p50_latency_s", "p95_latency_s")) + " |")
    lines += ["", POOLED_HEADER, "|---" * 6 + "|"]
    for lv in summary:
        p = lv["pooled"]
        t, acc = p["tokens_per_request"], p["accuracy"]
        lines.append(
            f"| {lv['concurrency']} | {t['off']:.1f} / {t['on']:.1f} / {t['oracle']:.1f} "
            f"| {acc['off']:.3f} / {acc['on']:.3f} / {acc['oracle']:.3f} "
            f"| {p['stop_error']:.3f} ({p['stop_error_counted']}; "
            f"{p['stop_error_ci95'][0]:.3f}-{p['stop_error_ci95'][1]:.3f}) "
            f"| {p['stopped_early']:.3f} "
            f"| {lv['off']['requests_per_s']['median']:.2f} / "
            f"{lv['on']['requests_per_s']['median']:.2f} |")
    return "\n".join(lines)


def plot(summary: list[dict[str, Any]], path: Path) -> None:
    """Tokens per request and accuracy for off / ORCA / oracle, one group per concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ("off", "on", "oracle")
    labels = ("ORCA off", "ORCA on", "oracle")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    x = np.arange(len(summary))
    for k, (name, lab) in enumerate(zip(names, labels)):
        for ax, key in zip(axes, ("tokens_per_request", "accuracy")):
            ax.bar(x + (k - 1) * 0.27, [lv["pooled"][key][name] for lv in summary], 0.27,
                   label=lab)
    for ax, title in zip(axes, ("completion tokens per request", "answer accuracy")):
        ax.set_xticks(x, [f"c = {lv['concurrency']}" for lv in summary])
        ax.set_title(title)
    axes[1].set_ylim(0.5, 1.0)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=96, help="held-out prompts per round and arm")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--delta", type=float, default=None, help="default: the bundle's")
    ap.add_argument("--temperature", type=float, default=0.7, help="the calibration's")
    ap.add_argument("--max-tokens", type=int, default=400, help="the calibration's")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-goodput")
    ap.add_argument("--plot", type=Path, default=ROOT / "benchmarks" / "goodput.png")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    write_prompts(a.out / "prompts.jsonl", "in-dist", a.n, seed=PROMPT_SEED)
    work = Workload(a.out / "prompts.jsonl")
    a.delta = work.bundle.default_delta if a.delta is None else a.delta
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    srv = Server(orca_serve_cmd("--demo"), a.out / "serve.log",
                 ["--host", "127.0.0.1", "--seed", "0"])
    try:
        srv.wait()
        raw = asyncio.run(bench(a, srv.url, work))
    finally:
        srv.stop()
    summary = summarize(raw["levels"], work.bundle.ltt.excluded_never_correct)
    result = {"date": started, "nproc": os.cpu_count(), "n": a.n, "rounds": a.rounds,
              "delta": a.delta, "epsilon": work.bundle.ltt.epsilon,
              "lambda": work.bundle.lam(a.delta), "temperature": a.temperature,
              "max_tokens": a.max_tokens, "summary": summary, "raw": raw}
    (a.out / "result.json").write_text(json.dumps(result, indent=1))
    plot(summary, a.plot)
    loads = [rnd["loadavg"][0] for lv in raw["levels"] for rnd in lv["rounds"]]
    print(f"{started}, nproc {result['nproc']}, 1-minute load at the rounds' starts "
          f"{min(loads):.1f}-{max(loads):.1f}; delta {a.delta}, epsilon {result['epsilon']}, "
          f"lambda* {result['lambda']}, n {a.n} per round and arm, temperature {a.temperature}; "
          "ratio cells: median (min-max) over rounds")
    print(table(summary))


if __name__ == "__main__":
    main()
