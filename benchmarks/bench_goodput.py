"""Goodput: what early stopping buys a server: ORCA off, on and two-sided through one server.

One live `orca-serve --demo`, the same held-out toy prompts per task family (in-distribution and
shifted, a seed the calibration never saw) sent per request with ORCA off (`"orca": {"enabled":
false}`), on (the bundle, at `--delta`) and two-sided (on, and `"give_up": {"delta":
--give-up-delta}`), in interleaved rounds (the arms' order rotates from round to round) at each
`--concurrency`, through the real OpenAI client over HTTP, sampled at the calibration's
temperature. Per round and arm: requests/s (prompts / wall time until the last response),
goodput (right answers / the same wall time), completion tokens per request, p50/p95 latency,
answer accuracy (the toy's checker on the delivered text; a given-up request delivers its best
guess, the server's default give-up policy), and per outcome (`ended`: early / gave_up / full)
its count, tokens and accuracy.

After the timed rounds (untimed, the same server) every response is labelled as
`orca-calibrate collect` labels a trajectory: its token ids (`return_token_ids`) are cut into
steps by the plugin's segmenter, each step prefix gets the answer-forcing suffix and a few greedy
tokens (`/v1/completions`, ORCA off), and the forced answers give the step labels. The labels are
those of the never-stopping trajectory: a request ORCA cut short (stopped or gave up) is first
continued from that step with ORCA off and the same sampling (a draw of the rest of the run it
cut short), then labelled whole. Then:
- **stop error** (both ORCA arms): the bundle's loss, 1 when no step up to the stop step had the
  right answer yet (never-right trajectories excluded when the calibration excluded them; a
  request that gave up or ran to its end did not stop: loss 0);
- **give-up error** (two-sided): 1 when the request gave up while a right answer still lay
  ahead (a step at or after its give-up step is right in the continued trajectory, under the
  give-up block's reference labels), over every request: the risk mu* is certified for
  (orca_method/give_up.py);
- **oracles** (on the ORCA-off responses): `oracle` stops at the first step whose forced answer
  already equals the response's final answer (its tokens: the response's minus the steps after
  that one, its answer the response's, so its accuracy is the off arm's: the fewest tokens any
  stopping rule could spend without changing an answer); `oracle stop` at the first step whose
  forced answer is right, and `oracle two-sided` that, and gives up after the first step on a
  response never right at any step (issue 24's oracles, as `orca_calibrate.evaluate` computes them
  offline).

Usage: python benchmarks/bench_goodput.py [--n 96] [--rounds 6] [--concurrency 16 64]
       [--families in-dist shifted]
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

from orca_calibrate.evaluate import interval95 as clopper_pearson
from orca_calibrate.progress import progress_bar
from orca_demo.toy import tasks as toy_tasks
from orca_demo.toy.tasks import write_prompts
from orca_method.answer_probes import (
    ProbeSettings,
    probe_prompts,
    step_ends,
    trajectory_fields,
)
from orca_method.bundle import load_bundle
from orca_method.give_up import last_right
from orca_method.labels import extract_forced
from orca_method.outcomes import Ended
from orca_method.risk import cumulative, is_counted, losses
from orca_method.thresholds import lam_to_json
from tests.serving import Server, orca_serve_cmd

ARMS = ("off", "on", "two_sided")  # ORCA off, one-sided ORCA, ORCA with give-up
MODEL_DIR = ROOT / "orca_serve" / "demo" / "model"
BUNDLE = ROOT / "orca_serve" / "demo" / "bundle.json"
# labelled as the demo's calibration data was (the bundle's labelling block), as its audit labels
PROBE = ProbeSettings(**load_bundle(BUNDLE).labelling.model_dump(), label_every=1)
PROMPT_SEED = 18  # calibration used seeds 1 (in-dist) and 2 (shifted): these prompts are held out
FIGURES = ("requests_per_s", "goodput", "tokens_per_request", "p50_latency_s", "p95_latency_s",
           "accuracy")


# --------------------------------------------------------------- pure parts (tests/test_goodput.py)

def orca_body(arm: str, delta: float, give_up_delta: float) -> dict[str, Any]:
    """The request's `orca` object for one arm."""
    if arm == "off":
        return {"enabled": False}
    body: dict[str, Any] = {"enabled": True, "delta": delta}
    if arm == "two_sided":
        body["give_up"] = {"delta": give_up_delta}
    return body


def arm_order(round_index: int, arms: Sequence[str] = ARMS) -> list[str]:
    """The arms' order in one round: rotated by one per round, so each arm runs first, in the
    middle and last equally often (with two arms: off then on, on then off, ...)."""
    k = round_index % len(arms)
    return [*arms[k:], *arms[:k]]


def first_index(labels: Sequence[int]) -> int:
    """0-based index of the first 1 in `labels`, or the last index when there is none."""
    hits = np.flatnonzero(np.asarray(labels) == 1)
    return int(hits[0]) if hits.size else len(labels) - 1


def cut_step(orca: dict[str, Any]) -> int | None:
    """The 1-based step at which ORCA ended a response's reasoning (its stop or give-up step),
    None when it ran to its own end."""
    if orca.get("stopped_early"):
        return int(orca["stop_step"])
    if orca.get("ended") == Ended.GAVE_UP:
        return int(orca["give_up_step"])
    return None


def stop_loss(supervised: Sequence[int], stop_index: int) -> int:
    """The bundle's 0/1 loss of stopping at 0-based step `stop_index`: 1 when no step up to it
    had the right answer (orca_method/risk.py `losses` on cumulative labels)."""
    return int(losses(np.array([stop_index]), [cumulative(supervised)])[0])


def tokens_through(trace: dict[str, Any], completion_tokens: int, step: int) -> int:
    """A response's completion tokens had its reasoning ended after 0-based `step`: less every
    later step (the answer written after the reasoning stays)."""
    return completion_tokens - sum(trace["step_tokens"][step + 1:])


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
    return Oracle(step=j, tokens=tokens_through(trace, completion_tokens, j))


@dataclass(frozen=True)
class OracleEnd:
    """Where one of issue 24's oracles ends a labelled response, and what it delivers."""

    tokens: int
    correct: bool
    gave_up: bool


def right_step_oracle(trace: dict[str, Any], completion_tokens: int, correct: bool,
                      give_up: bool) -> OracleEnd:
    """Issue 24's oracles on one labelled full response (supervised labels): stop at the first
    step whose forced answer is right and deliver it (right). A response right at no step runs
    to its end and delivers its own answer (`correct`, the checker's verdict), or, with
    `give_up`, gives up after its first step (no step after it is right: its guess is wrong),
    as `orca_calibrate.evaluate.evaluate_two_sided` computes them offline."""
    sup = trace["labels"]["supervised"]
    if any(sup):
        return OracleEnd(tokens_through(trace, completion_tokens, first_index(sup)), True, False)
    if give_up and len(sup) > 1:
        return OracleEnd(tokens_through(trace, completion_tokens, 0), False, True)
    return OracleEnd(completion_tokens, bool(correct), False)


def spread(values: Sequence[float]) -> dict[str, float]:
    """min / median / max of per-round figures (the spread the tables report)."""
    v = np.asarray(values, dtype=float)
    return {"min": float(v.min()), "median": float(np.median(v)), "max": float(v.max())}


def round_ratios(rounds: Sequence[dict[str, dict[str, float]]], key: str,
                 arm: str = "on") -> list[float]:
    """Per round, `arm` / off of one figure (`rounds[i][arm][key]`)."""
    return [r[arm][key] / r["off"][key] for r in rounds]


def arm_figures(requests: Sequence[dict[str, Any]], wall_s: float) -> dict[str, float]:
    """The timed figures of one arm in one round: requests/s, goodput (right answers/s),
    tokens/request, p50/p95 latency (s) and accuracy."""
    lat = np.array([r["latency_s"] for r in requests])
    return {"requests_per_s": len(requests) / wall_s,
            "goodput": sum(bool(r["correct"]) for r in requests) / wall_s,
            "tokens_per_request": float(np.mean([r["completion_tokens"] for r in requests])),
            "p50_latency_s": float(np.percentile(lat, 50)),
            "p95_latency_s": float(np.percentile(lat, 95)),
            "accuracy": float(np.mean([r["correct"] for r in requests]))}


def outcomes(requests: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per way the reasoning ended (the response's `ended`, orca_method/outcomes.py; a request
    without ORCA: `full`): how many, their share, mean completion tokens and accuracy. Outcomes
    no request had are left out."""
    out = {}
    for name in Ended:
        group = [r for r in requests if (r["orca"].get("ended") or Ended.FULL) == name]
        if group:
            out[name] = {"n": len(group), "share": len(group) / len(requests),
                         "tokens_per_request": float(np.mean([r["completion_tokens"]
                                                              for r in group])),
                         "accuracy": float(np.mean([r["correct"] for r in group]))}
    return out


def interval95(rate: float, n: int) -> tuple[float, float]:
    """Clopper-Pearson 95% interval of a realized rate over n counted requests (the project's,
    `orca_calibrate.evaluate.interval95`, from a rate instead of a count)."""
    return clopper_pearson(round(rate * n), n)


def realized(losses_: Sequence[int | None]) -> dict[str, Any]:
    """A realized risk over the requests it counts (None: not counted): rate, k, n and the 95%
    Clopper-Pearson interval (nan and no interval when none counts)."""
    counted = [x for x in losses_ if x is not None]
    k, n = int(sum(counted)), len(counted)
    return {"rate": k / n if n else float("nan"), "k": k, "n": n,
            "ci95": list(clopper_pearson(k, n)) if n else None}


def request_loss(trace: dict[str, Any], orca: dict[str, Any],
                 excluded_never_correct: bool) -> int | None:
    """The stop loss of one ORCA-on request, given the labelled never-stopping trajectory it
    belongs to; None when that trajectory is never right and the bundle's calibration excluded
    such trajectories (orca_method/risk.py `is_counted`). A request that did not stop early
    (it gave up, or ran to its end) is scored at its last step."""
    sup = trace["labels"]["supervised"]
    if not is_counted(sup, excluded_never_correct):
        return None
    return stop_loss(sup, int(orca["stop_step"]) - 1 if orca.get("stopped_early") else len(sup) - 1)


def give_up_loss(trace: dict[str, Any], orca: dict[str, Any], reference: str) -> int:
    """The give-up loss of one request (orca_method/give_up.py): it gave up, and a step at or
    after its give-up step is right in its labelled never-stopping trajectory (`reference`
    labels, raw per step): continuing could still have reached a right answer. Every request
    counts."""
    return int(orca.get("ended") == Ended.GAVE_UP
               and last_right(trace["labels"][reference]) >= int(orca["give_up_step"]) - 1)


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


async def run_arm(client: Any, model: str, prompts: list[dict], orca: dict[str, Any],
                  concurrency: int, max_tokens: int, temperature: float) -> tuple[list[dict], float]:
    """All prompts through the server with the `orca` object `orca`, `concurrency` at a time;
    the raw responses (ids, usage, orca report, latency) and the wall time until the last one."""
    sem = asyncio.Semaphore(concurrency)

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
    """Give every response its never-stopping trajectory's record (`trace`): one ORCA cut short
    (stopped or gave up) is continued from that step (ORCA off, the same sampling); then answer
    probes at each step boundary through the server (ORCA off), labelled as
    `orca-calibrate collect` labels. A progress bar on stderr: a long reasoner's hundreds of
    responses take an hour (~75 probes each)."""
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
        """The generated ids of the run without the stop or give-up: the response's own when
        ORCA did not cut it; else its steps through that step and a continuation from there."""
        prompt_ids, gen = resp["prompt_token_ids"], resp["token_ids"]
        step = cut_step(resp["orca"])
        if step is None:
            return gen
        steps = segment(work.table, gen, prompt_ids)
        end = step_ends(gen, steps)[step - 1]
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
        bar.update(1)

    with progress_bar(total=len(responses), desc="label", unit="response") as bar:
        await asyncio.gather(*(one(r) for r in responses))


def check(work: Workload, responses: list[dict]) -> None:
    """Accuracy of each response by the toy's checker on its delivered text."""
    by_id = {str(p["id"]): p for p in work.prompts}
    for r in responses:
        r["correct"] = work.correct(by_id[str(r["id"])], work.text(r["token_ids"]))


async def bench(a: argparse.Namespace, url: str, works: dict[str, Workload]) -> dict[str, Any]:
    """The timed rounds of every family and concurrency, then the labelling (untimed)."""
    import openai

    # retries: a client starved of CPU on the loaded machine may reuse a keep-alive connection
    # the server has just closed (seen in bench_audit_cost)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", timeout=900, max_retries=3)
    model = (await client.models.list()).data[0].id
    bodies = {arm: orca_body(arm, a.delta, a.give_up_delta) for arm in ARMS}
    first = next(iter(works.values()))
    await run_arm(client, model, first.prompts[:16], bodies["two_sided"], 16, a.max_tokens,
                  a.temperature)  # warm-up, not counted
    levels = []
    for family, work in works.items():
        for c in a.concurrency:
            rounds = []
            for i in range(a.rounds):
                order = arm_order(i)
                rnd: dict[str, Any] = {"order": order, "loadavg": os.getloadavg()}
                for arm in order:
                    resp, wall = await run_arm(client, model, work.prompts, bodies[arm], c,
                                               a.max_tokens, a.temperature)
                    rnd[arm] = {"wall_s": wall, "requests": resp}
                rounds.append(rnd)
                print(f"{family} c={c} round {i + 1}: "
                      + ", ".join(f"{arm} {rnd[arm]['wall_s']:.1f} s" for arm in ARMS)
                      + f", load {rnd['loadavg'][0]:.1f}", file=sys.stderr, flush=True)
            levels.append({"family": family, "concurrency": c, "rounds": rounds})
    t0 = time.perf_counter()
    for lv in levels:
        work = works[lv["family"]]
        everything = [r for rnd in lv["rounds"] for arm in ARMS for r in rnd[arm]["requests"]]
        check(work, everything)
        await label(client, model, work, everything, 64, a.max_tokens, a.temperature)
    print(f"labelled every response in {time.perf_counter() - t0:.0f} s", file=sys.stderr,
          flush=True)
    return {"levels": levels}


def summarize(levels: list[dict[str, Any]], excluded_never_correct: bool,
              give_up_reference: str = "supervised") -> list[dict[str, Any]]:
    """Per family and concurrency: per-round figures of every arm, arm/off ratios with their
    spread, and pooled per arm: tokens, accuracy, the realized stop and give-up errors, the
    outcomes; the oracles beside them. The arms are those the rounds hold.
    `excluded_never_correct`: the bundle's LTT setting; `give_up_reference`: the give-up
    block's label mode."""
    out = []
    for lv in levels:
        arms = [arm for arm in ARMS if arm in lv["rounds"][0]]
        per_round = []
        for rnd in lv["rounds"]:
            figs = {arm: arm_figures(rnd[arm]["requests"], rnd[arm]["wall_s"]) for arm in arms}
            for arm in arms:
                for r in rnd[arm]["requests"]:
                    if arm != "off":
                        r["loss"] = request_loss(r["trace"], r["orca"], excluded_never_correct)
                    if arm == "two_sided":
                        r["give_up_loss"] = give_up_loss(r["trace"], r["orca"], give_up_reference)
            per_round.append(figs)
        pooled: dict[str, dict[str, Any]] = {}
        for arm in arms:
            reqs = [r for rnd in lv["rounds"] for r in rnd[arm]["requests"]]
            wall = sum(rnd[arm]["wall_s"] for rnd in lv["rounds"])
            p = {"tokens_per_request": float(np.mean([r["completion_tokens"] for r in reqs])),
                 "accuracy": float(np.mean([r["correct"] for r in reqs])),
                 "requests_per_s": len(reqs) / wall,
                 "goodput": sum(bool(r["correct"]) for r in reqs) / wall,
                 "outcomes": outcomes(reqs)}
            if arm != "off":
                p["stop_error"] = realized([r["loss"] for r in reqs])
                # 1-based step the reasoning ended at (a request ORCA did not cut: its last)
                p["mean_end_step"] = float(np.mean([
                    cut_step(r["orca"]) or len(r["trace"]["step_tokens"]) for r in reqs]))
            if arm == "two_sided":
                p["give_up_error"] = realized([r["give_up_loss"] for r in reqs])
            pooled[arm] = p
        off = [r for rnd in lv["rounds"] for r in rnd["off"]["requests"]]
        orc = [oracle(r["trace"], r["completion_tokens"]) for r in off]
        # the consistent oracle delivers each off response's own answer: the off accuracy
        pooled["oracle"] = {"tokens_per_request": float(np.mean([o.tokens for o in orc])),
                            "accuracy": pooled["off"]["accuracy"],
                            "mean_end_step": float(np.mean([o.step + 1 for o in orc]))}
        for name, give_up in (("oracle_stop", False), ("oracle_two_sided", True)):
            ends = [right_step_oracle(r["trace"], r["completion_tokens"], r["correct"], give_up)
                    for r in off]
            pooled[name] = {"tokens_per_request": float(np.mean([e.tokens for e in ends])),
                            "accuracy": float(np.mean([e.correct for e in ends])),
                            "gave_up": float(np.mean([e.gave_up for e in ends]))}
        out.append({
            "family": lv["family"], "concurrency": lv["concurrency"],
            "rounds": len(per_round), "n_per_arm": len(off), "arms": arms,
            "per_round": per_round,
            "ratio": {arm: {k: spread(round_ratios(per_round, k, arm)) for k in FIGURES}
                      for arm in arms if arm != "off"},
            "median": {arm: {k: spread([r[arm][k] for r in per_round]) for k in FIGURES}
                       for arm in arms},
            "pooled": pooled})
    return out


ARM_NAMES = {"off": "ORCA off", "on": "ORCA", "two_sided": "two-sided ORCA", "oracle": "oracle",
             "oracle_stop": "oracle stop", "oracle_two_sided": "oracle two-sided"}
RATIO_HEADER = ("| family | c | rounds x n | arm | requests/s | goodput | tokens/request "
                "| p50 latency | p95 latency |")
POOLED_HEADER = ("| family | c | arm | tokens/request | accuracy | goodput (correct/s) "
                 "| requests/s | stop error (k/n; 95%) | give-up error (k/n; 95%) |")
OUTCOME_HEADER = "| family | c | arm | ended | n (share) | tokens/request | accuracy |"


def risk_cell(r: dict[str, Any] | None) -> str:
    """A realized risk as `rate (k/n; low-high)`; empty for an arm without that risk."""
    if r is None:
        return ""
    if not r["n"]:
        return "n/a (0 counted)"
    return f"{r['rate']:.3f} ({r['k']}/{r['n']}; {r['ci95'][0]:.3f}-{r['ci95'][1]:.3f})"


def table(summary: list[dict[str, Any]]) -> str:
    """The markdown tables for benchmarks/RESULTS.md: each ORCA arm's ratios to off as median
    (min-max) over rounds; the pooled figures per arm beside the oracles' (goodput and
    requests/s: the median over rounds); the outcomes per arm."""
    def cell(d: dict[str, float]) -> str:
        return f"{d['median']:.2f} ({d['min']:.2f}-{d['max']:.2f})"

    lines = [RATIO_HEADER, "|---" * 9 + "|"]
    for lv in summary:
        for arm, r in lv["ratio"].items():
            lines.append(
                f"| {lv['family']} | {lv['concurrency']} "
                f"| {lv['rounds']} x {lv['n_per_arm'] // lv['rounds']} | {ARM_NAMES[arm]} / off | "
                + " | ".join(cell(r[k]) for k in ("requests_per_s", "goodput",
                                                  "tokens_per_request", "p50_latency_s",
                                                  "p95_latency_s")) + " |")
    lines += ["", POOLED_HEADER, "|---" * 9 + "|"]
    for lv in summary:
        for arm, p in lv["pooled"].items():
            timed = lv["median"].get(arm)
            rates = (f"{timed['goodput']['median']:.2f} | {timed['requests_per_s']['median']:.2f}"
                     if timed else " | ")
            lines.append(f"| {lv['family']} | {lv['concurrency']} | {ARM_NAMES[arm]} "
                         f"| {p['tokens_per_request']:.1f} | {p['accuracy']:.3f} | {rates} "
                         f"| {risk_cell(p.get('stop_error'))} "
                         f"| {risk_cell(p.get('give_up_error'))} |")
    lines += ["", OUTCOME_HEADER, "|---" * 7 + "|"]
    for lv in summary:
        for arm in lv["arms"]:
            for ended, o in lv["pooled"][arm]["outcomes"].items():
                lines.append(f"| {lv['family']} | {lv['concurrency']} | {ARM_NAMES[arm]} | {ended} "
                             f"| {o['n']} ({o['share']:.3f}) | {o['tokens_per_request']:.1f} "
                             f"| {o['accuracy']:.3f} |")
    return "\n".join(lines)


def plot(summary: list[dict[str, Any]], path: Path) -> None:
    """Tokens per request and accuracy per arm and oracle, one group per family and
    concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [*summary[0]["arms"], "oracle", "oracle_two_sided"]
    width = 0.8 / len(names)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    x = np.arange(len(summary))
    for k, name in enumerate(names):
        for ax, key in zip(axes, ("tokens_per_request", "accuracy")):
            ax.bar(x + (k - (len(names) - 1) / 2) * width,
                   [lv["pooled"][name][key] for lv in summary], width, label=ARM_NAMES[name])
    for ax, title in zip(axes, ("completion tokens per request", "answer accuracy")):
        ax.set_xticks(x, [f"{lv['family']}, c = {lv['concurrency']}" for lv in summary])
        ax.set_title(title)
    axes[1].set_ylim(0.0, 1.0)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=96, help="held-out prompts per family, round and arm")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--families", nargs="+", choices=toy_tasks.FAMILIES,
                    default=list(toy_tasks.FAMILIES))
    ap.add_argument("--delta", type=float, default=None, help="default: the bundle's")
    ap.add_argument("--give-up-delta", type=float, default=None,
                    help="the two-sided arm's give-up delta; default: the bundle's")
    ap.add_argument("--temperature", type=float, default=0.7, help="the calibration's")
    ap.add_argument("--max-tokens", type=int, default=400, help="the calibration's")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-goodput")
    ap.add_argument("--plot", type=Path, default=ROOT / "benchmarks" / "goodput.png")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    works = {}
    for family in a.families:
        path = a.out / f"prompts-{family}.jsonl"
        write_prompts(path, family, a.n, seed=PROMPT_SEED)
        works[family] = Workload(path)
    bundle = next(iter(works.values())).bundle
    if bundle.give_up is None:
        ap.error(f"{BUNDLE} is one-sided (no give-up threshold): the two-sided arm needs one")
    a.delta = bundle.default_delta if a.delta is None else a.delta
    a.give_up_delta = (bundle.give_up.default_delta if a.give_up_delta is None
                       else a.give_up_delta)
    lam, mu = bundle.lam(a.delta), bundle.mu(a.give_up_delta)  # refuses an uncalibrated delta
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    srv = Server(orca_serve_cmd("--demo"), a.out / "serve.log",
                 ["--host", "127.0.0.1", "--seed", "0"])
    try:
        srv.wait()
        raw = asyncio.run(bench(a, srv.url, works))
    finally:
        srv.stop()
    summary = summarize(raw["levels"], bundle.ltt.excluded_never_correct,
                        bundle.give_up.label_mode)
    result = {"date": started, "nproc": os.cpu_count(), "n": a.n, "rounds": a.rounds,
              "families": a.families, "delta": a.delta, "epsilon": bundle.ltt.epsilon,
              "lambda": lam_to_json(lam), "give_up_delta": a.give_up_delta,
              "give_up_epsilon": bundle.give_up.ltt.epsilon, "mu": lam_to_json(mu),
              "give_up_reference": bundle.give_up.label_mode, "temperature": a.temperature,
              "max_tokens": a.max_tokens, "summary": summary, "raw": raw}
    (a.out / "result.json").write_text(json.dumps(result, indent=1))
    plot(summary, a.plot)
    loads = [rnd["loadavg"][0] for lv in raw["levels"] for rnd in lv["rounds"]]
    print(f"{started}, nproc {result['nproc']}, 1-minute load at the rounds' starts "
          f"{min(loads):.1f}-{max(loads):.1f}; delta {a.delta}, epsilon {result['epsilon']}, "
          f"lambda* {result['lambda']}; give-up delta_2 {a.give_up_delta}, epsilon_2 "
          f"{result['give_up_epsilon']}, mu* {result['mu']} ({result['give_up_reference']} "
          f"labels); n {a.n} per family, round and arm, temperature {a.temperature}; "
          "ratio cells: median (min-max) over rounds")
    print(table(summary))


if __name__ == "__main__":
    main()
