"""Frontier: answer accuracy against completion tokens for every stopping rule a user could pick.

For each embedded reasoner (today the toy: ~5-step traces) and each task family (in-distribution
and shifted), on held-out prompts (a seed no
calibration saw), through one live `orca-serve --demo`, the real OpenAI client over HTTP, at
`--concurrency` requests in flight, sampled at the calibration's temperature:

- live arms, each timed (requests/s = prompts / wall time until the last response):
  - **full**: ORCA off, the reasoning runs to its end;
  - **ORCA** at every delta of the demo's bundle (TTT no-QK), policy `answer`; and, with
    `--other-bundle`, at every delta of another bundle of the same model served by a second
    server (a static-probe bundle; one `orca-calibrate recalibrate` made from live audits);
  - **two-sided ORCA** (a two-sided bundle): the same deltas with `give_up` at GIVE_UP_DELTA
    (a given-up request answers with its best guess, the server's default give-up policy);
  - **thinking budget**: ORCA off and vLLM's `thinking_token_budget` at each of `--budgets`;
- offline rules, computed from the full arm's responses (their token log-probabilities and an
  answer probe at every step boundary, read through the same server with ORCA off):
  - **oracle**: stop at the first step whose forced answer equals the final one;
  - **consistency** (Dynasor's certaindex idea): stop once k consecutive forced answers agree;
  - **confidence** (DeepConf's idea): stop once the mean token confidence of the last step
    (minus the mean log-probability of the 5 likeliest tokens, averaged over the step's tokens)
    reaches a threshold; thresholds are quantiles of the workload's step confidences.
  An offline rule's tokens are the full response's through its stop step plus the tokens the
  full response wrote after its reasoning (its answer), its answer the forced answer at that
  step. The answer probes themselves are not counted: a live consistency rule would pay them.

Every ORCA point, two-sided ones included, carries its realized stop error (the bundle's loss;
requests cut short continued from their stop or give-up step with ORCA off to label the run they
cut short, as bench_goodput does), with the count and a 95% interval; a two-sided point also its
realized give-up error (over every request, as the give-up block counts it); and beside its
accuracy the accuracy of the answer an answer probe forces at each stop (what the guarantee is
about; the served answer should equal it). Every live arm requests the same token
log-probabilities, so their requests/s compare on equal terms.

Usage: python benchmarks/bench_frontier.py [--reasoners toy long] [--n 96] [--concurrency 64]
Writes runs/bench-frontier/<reasoner>-<family>.json, benchmarks/frontier-<reasoner>-<family>.png
and prints the markdown tables of benchmarks/RESULTS.md ("Frontier").
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
from types import ModuleType
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_goodput import (PROBE, Workload, cut_step, give_up_loss, label, oracle, realized,
                          request_loss)

from orca_demo.long import tasks as long_tasks
from orca_demo.toy import tasks as toy_tasks
from orca_demo.toy.demo_bundle import demo_folder
from orca_method.answer_probes import step_ends
from orca_method.bundle import load_bundle
from orca_method.labels import labelled_steps
from orca_method.outcomes import Ended
from orca_method.steps import segment
from tests.serving import Server, orca_serve_cmd

# a server's start-up, compile warm-up included, on a loaded 2-core machine: 300 s was not enough
# for the long reasoner at load 25
SERVER_START_S = 1200
PROMPT_SEED = 31  # calibration: seeds 1-3; goodput: 18. These prompts are held out.
TOP_LOGPROBS = 5  # DeepConf's token confidence: minus the mean of the top-k log-probabilities
CONSISTENCY_K = (2, 3, 4, 6, 8)
CONFIDENCE_QUANTILES = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
GIVE_UP_DELTA = 0.05  # the give-up risk of the two-sided arms (when the bundle has it)
AUDIT_GRID = 10  # the coarser labelling grid timed beside every step (the paper labels every 10th)


@dataclass(frozen=True)
class Reasoner:
    """One embedded demo: its folder (model/ and bundle.json), tasks, families, max_tokens (the
    calibration's) and thinking budgets."""

    home: Path
    tasks: ModuleType
    families: tuple[str, ...]
    max_tokens: int
    budgets: tuple[int, ...]

    @property
    def model_dir(self) -> Path:
        return self.home / "model"

    @property
    def bundle(self) -> Path:
        return self.home / "bundle.json"


REASONERS = {
    "toy": Reasoner(demo_folder("toy"), toy_tasks, ("in-dist", "shifted"), 400,
                    (48, 80, 112, 144, 176, 208, 256)),
    "long": Reasoner(demo_folder("long"), long_tasks, ("in-dist", "shifted", "hard"), 5000,
                     (300, 600, 1000, 1500, 2500)),
}


# --------------------------------------------------------- pure parts (tests/test_long_reasoner.py)

def consistency_stop(step_answers: Sequence[str | None], k: int) -> int | None:
    """0-based step at which k consecutive forced answers (none missing) first agree, or None."""
    for t in range(k - 1, len(step_answers)):
        window = step_answers[t - k + 1:t + 1]
        if window[0] is not None and all(a == window[0] for a in window):
            return t
    return None


def threshold_stop(scores: Sequence[float], tau: float) -> int | None:
    """0-based first step whose score reaches tau, or None."""
    hits = np.flatnonzero(np.asarray(scores, dtype=float) >= tau)
    return int(hits[0]) if hits.size else None


def step_confidences(token_conf: Sequence[float], ends: Sequence[int]) -> list[float]:
    """Mean token confidence over each step's tokens (ends: exclusive, in generated tokens)."""
    out = []
    for s, e in zip([0, *ends[:-1]], ends):
        seg = token_conf[s:e]
        out.append(float(np.mean(seg)) if len(seg) else float("nan"))
    return out


@dataclass(frozen=True)
class Stop:
    """Where an offline rule ends one full response: tokens it would have spent, and whether the
    answer it delivers is right."""

    tokens: int
    correct: bool


def offline_stop(trace: dict[str, Any], ends: Sequence[int], completion_tokens: int,
                 step: int | None, truth: str, full_correct: bool) -> Stop:
    """An offline rule's outcome on one labelled full response: stopping after 0-based `step`
    delivers that step's forced answer and spends the tokens through it plus the response's own
    answer-writing tokens; no stop (None) is the full response."""
    if step is None or step >= len(ends) - 1:
        return Stop(completion_tokens, full_correct)
    answer_tokens = completion_tokens - ends[-1]
    return Stop(ends[step] + answer_tokens, trace["step_answers"][step] == truth)


def point(stops: Sequence[Stop]) -> dict[str, float]:
    return {"tokens": float(np.mean([s.tokens for s in stops])),
            "accuracy": float(np.mean([s.correct for s in stops]))}


def accuracy_at(curve: Sequence[dict[str, float]], tokens: float) -> float | None:
    """A curve's accuracy at a token count, linearly interpolated between its points (sorted by
    tokens); None outside its range."""
    pts = sorted((p["tokens"], p["accuracy"]) for p in curve)
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    if not xs or tokens < xs[0] or tokens > xs[-1]:
        return None
    return float(np.interp(tokens, xs, ys))


def tokens_for(curve: Sequence[dict[str, float]], accuracy: float) -> float | None:
    """The fewest tokens at which a curve (its upper envelope, by tokens) reaches an accuracy,
    interpolated between its points; None when it never does."""
    pts = sorted((p["tokens"], p["accuracy"]) for p in curve)
    best_t, best_a = None, -1.0
    for t, a in pts:
        if a >= accuracy:
            if best_t is None:
                return t
            # interpolate between the last point below and this one
            return float(best_t + (accuracy - best_a) * (t - best_t) / (a - best_a))
        if a > best_a:
            best_t, best_a = t, a
    return None


def versus(orca: Sequence[dict[str, float]], other: dict[str, float]) -> str:
    """Where ORCA's curve stands at another rule's point: "above" (an ORCA point with no more
    tokens and no less accuracy, or ORCA's interpolated accuracy there at least as high),
    "below", or "outside" (fewer tokens than ORCA's cheapest point: ORCA has no point there)."""
    if any(p["tokens"] <= other["tokens"] and p["accuracy"] >= other["accuracy"] for p in orca):
        return "above"
    if other["tokens"] < min(p["tokens"] for p in orca):
        return "outside"
    at = accuracy_at(orca, other["tokens"])
    return "above" if at is not None and at >= other["accuracy"] else "below"


# ------------------------------------------------------------------------------- live parts

async def run_arm(client: Any, model: str, prompts: list[dict], body: dict[str, Any],
                  concurrency: int, max_tokens: int, temperature: float) -> tuple[list[dict], float]:
    """All prompts with one arm's extra body, `concurrency` at a time: raw responses (ids, usage,
    orca report, token confidences) and the wall time until the last one."""
    sem = asyncio.Semaphore(concurrency)

    async def one(rec: dict) -> dict:
        async with sem:
            r = await client.chat.completions.create(
                model=model, messages=rec["messages"], temperature=temperature,
                max_tokens=max_tokens, logprobs=True, top_logprobs=TOP_LOGPROBS,
                extra_body={**body, "return_token_ids": True})
        content = r.choices[0].logprobs.content or []
        return {"id": rec["id"], "completion_tokens": r.usage.completion_tokens,
                "prompt_token_ids": r.model_extra["prompt_token_ids"],
                "token_ids": r.choices[0].model_extra["token_ids"],
                "orca": r.model_extra.get("orca") or {},
                "token_conf": [-float(np.mean([t.logprob for t in c.top_logprobs]))
                               if c.top_logprobs else 0.0 for c in content]}

    t0 = time.perf_counter()
    out = await asyncio.gather(*(one(rec) for rec in prompts))
    return list(out), time.perf_counter() - t0


def live_point(responses: list[dict], wall: float, work: Workload) -> dict[str, Any]:
    by_id = {str(p["id"]): p for p in work.prompts}
    for r in responses:
        r["correct"] = work.correct(by_id[str(r["id"])], work.text(r["token_ids"]))
    return {"tokens": float(np.mean([r["completion_tokens"] for r in responses])),
            "accuracy": float(np.mean([r["correct"] for r in responses])),
            "requests_per_s": len(responses) / wall, "n": len(responses)}


def probe_right(trace: dict[str, Any], orca: dict[str, Any]) -> bool:
    """Whether the answer an answer probe forces (greedily) where ORCA ended the reasoning (the
    last step when it did not) is right: the answer the guarantee is about. The served answer
    should be it (docs/SERVER.md, "The answer after a stop")."""
    sup = trace["labels"]["supervised"]
    step = cut_step(orca)
    return bool(sup[step - 1 if step is not None else len(sup) - 1])


def orca_error(responses: list[dict], excluded_never_correct: bool) -> dict[str, Any]:
    stop = realized([request_loss(r["trace"], r["orca"], excluded_never_correct)
                     for r in responses])
    return {"stop_error": stop["rate"], "stop_error_counted": stop["n"],
            "stop_error_ci95": stop["ci95"],
            "stopped_early": float(np.mean([bool(r["orca"].get("stopped_early")) for r in responses])),
            # the shift gate's share flagged (served the safe action: full reasoning)
            "shift_flagged": float(np.mean([bool((r["orca"].get("shift") or {}).get("flagged"))
                                            for r in responses])),
            "probe_accuracy": float(np.mean([probe_right(r["trace"], r["orca"]) for r in responses]))}


def offline_rules(full: list[dict], work: Workload) -> dict[str, Any]:
    """Oracle, consistency and confidence points from the labelled full responses."""
    by_id = {str(p["id"]): p for p in work.prompts}
    rows = []
    for r in full:
        steps = segment(work.table, r["token_ids"], r["prompt_token_ids"])
        ends = step_ends(r["token_ids"], steps)
        rows.append((r, ends, step_confidences(r["token_conf"], ends), str(by_id[str(r["id"])]["answer"])))
    out: dict[str, Any] = {}
    orc = [oracle(r["trace"], r["completion_tokens"]) for r, *_ in rows]
    out["oracle"] = {"tokens": float(np.mean([o.tokens for o in orc])),
                     "accuracy": float(np.mean([r["correct"] for r, *_ in rows]))}
    out["consistency"] = [
        {"k": k, **point([offline_stop(r["trace"], ends, r["completion_tokens"],
                                       consistency_stop(r["trace"]["step_answers"], k), truth,
                                       r["correct"]) for r, ends, _, truth in rows])}
        for k in CONSISTENCY_K]
    pooled = np.array([c for _, _, conf, _ in rows for c in conf if np.isfinite(c)])
    out["confidence"] = []
    for q in CONFIDENCE_QUANTILES:
        tau = float(np.quantile(pooled, q))
        out["confidence"].append(
            {"quantile": q, "tau": tau,
             **point([offline_stop(r["trace"], ends, r["completion_tokens"],
                                   threshold_stop(conf, tau), truth, r["correct"])
                      for r, ends, conf, truth in rows])})
    return out


async def labelling_cost(client: Any, model: str, work: Workload, full: dict[str, Any],
                         reasoner: Reasoner, a: argparse.Namespace) -> dict[str, Any]:
    """What labelling an audit costs (docs/AUDIT.md): the full arm's responses labelled as the live
    audit labels them, an answer probe at every step (kept: the offline rules need them), then
    timed again on the coarser grid of every AUDIT_GRID-th step; each beside the wall time the
    server took to serve those responses, at the same concurrency."""
    out: dict[str, Any] = {"serve_wall_s": full["wall_s"], "responses": full["n"],
                           "completion_tokens": full["tokens"]}
    probe_tokens = len(work.suffix_ids) + PROBE.answer_tokens  # new tokens per probe at most
    for every in (AUDIT_GRID, 1):  # every=1 last: its labels are the ones kept
        t0 = time.perf_counter()
        await label(client, model, work, full["responses"], a.concurrency, reasoner.max_tokens,
                    a.temperature, label_every=every)
        wall = time.perf_counter() - t0
        probes = float(np.mean([len(labelled_steps(len(r["trace"]["step_tokens"]), every))
                                for r in full["responses"]]))
        out[f"every_{every}"] = {"wall_s": wall, "relative_to_serving": wall / full["wall_s"],
                                 "probes_per_request": probes,
                                 "probe_tokens_per_request_max": probes * probe_tokens}
        print(f"  labelling every {every}: {wall:.0f} s ({wall / full['wall_s']:.2f}x serving), "
              f"{probes:.1f} probes per request", file=sys.stderr, flush=True)
    return out


async def live_arms(url: str, work: Workload, reasoner: Reasoner, a: argparse.Namespace,
                    with_full: bool) -> dict[str, Any]:
    """Every live arm of one server on one workload, then the labelling the figures need."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", timeout=3600, max_retries=3)
    model = (await client.models.list()).data[0].id
    run = {}
    arms: list[tuple[str, dict[str, Any]]] = []
    if with_full:
        arms.append(("full", {"orca": {"enabled": False}}))
    arms += [(f"orca@{d}", {"orca": {"enabled": True, "delta": d, "policy": "answer"}})
             for d in work.bundle.deltas()]
    if a.ungated and work.bundle.shift_gate is not None:  # the same ORCA arms without the gate
        arms += [(f"orca-ungated@{d}", {"orca": {"enabled": True, "delta": d, "policy": "answer",
                                                 "shift_alpha": 0}})
                 for d in work.bundle.deltas()]
    if with_full and GIVE_UP_DELTA in work.bundle.give_up_deltas():  # the demo's bundle only
        arms += [(f"two-sided@{d}", {"orca": {"enabled": True, "delta": d, "policy": "answer",
                                              "give_up": {"delta": GIVE_UP_DELTA}}})
                 for d in work.bundle.deltas()]
    if with_full:
        arms += [(f"budget@{b}", {"orca": {"enabled": False}, "thinking_token_budget": b})
                 for b in reasoner.budgets]
    for name, body in arms:
        resp, wall = await run_arm(client, model, work.prompts, body, a.concurrency,
                                   reasoner.max_tokens, a.temperature)
        run[name] = {"responses": resp, "wall_s": wall, **live_point(resp, wall, work),
                     "loadavg": os.getloadavg()[0]}
        print(f"  {name}: {run[name]['tokens']:.0f} tokens, accuracy {run[name]['accuracy']:.3f}, "
              f"{run[name]['requests_per_s']:.2f} req/s ({wall:.0f} s, load {run[name]['loadavg']:.1f})",
              file=sys.stderr, flush=True)
    if with_full:
        run["labelling"] = await labelling_cost(client, model, work, run["full"], reasoner, a)
    orca_arms = {name: arm for name, arm in run.items()
                 if name.startswith(("orca@", "orca-ungated@", "two-sided@"))}
    to_label = [r for arm in orca_arms.values() for r in arm["responses"]]
    t0 = time.perf_counter()
    await label(client, model, work, to_label, 64, reasoner.max_tokens, a.temperature)
    print(f"  labelled {len(to_label)} ORCA responses in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr, flush=True)
    for name, arm in orca_arms.items():
        arm.update(orca_error(arm["responses"], work.bundle.ltt.excluded_never_correct))
        if name.startswith("two-sided@"):  # only served when the bundle has a give-up block
            arm["give_up_error"] = realized([give_up_loss(r["trace"], r["orca"],
                                                          work.bundle.give_up.label_mode)
                                             for r in arm["responses"]])
    await client.close()
    return run


def summarize(run: dict[str, Any], others: dict[str, dict[str, Any]],
              work: Workload) -> dict[str, Any]:
    """One workload's figures; `others`: the runs of the other bundles, by label."""
    def strip(arm: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in arm.items() if k != "responses"}

    full = run["full"]
    orca = [{"delta": float(n.split("@")[1]), **strip(v)} for n, v in run.items()
            if n.startswith("orca@")]
    budgets = [{"budget": int(n.split("@")[1]), **strip(v)} for n, v in run.items()
               if n.startswith("budget@")]
    two_sided = [{"delta": float(n.split("@")[1]), **strip(v),
                  "gave_up": float(np.mean([r["orca"].get("ended") == Ended.GAVE_UP
                                            for r in v["responses"]]))}
                 for n, v in run.items() if n.startswith("two-sided@")]
    out = {"full": strip(full), "orca": orca, "orca_two_sided": two_sided, "budget": budgets,
           "labelling": run["labelling"], **offline_rules(full["responses"], work)}
    out["orca_ungated"] = [{"delta": float(n.split("@")[1]), **strip(v)} for n, v in run.items()
                           if n.startswith("orca-ungated@")]
    out["orca_other"] = {label: [{"delta": float(n.split("@")[1]), **strip(v)}
                                 for n, v in other.items() if n.startswith("orca@")]
                         for label, other in others.items()}
    out["orca_versus_budget"] = [versus(orca, b) for b in budgets]
    best = max(orca, key=lambda p: p["accuracy"])
    need = tokens_for(budgets, best["accuracy"])
    out["headline"] = {"orca_delta": best["delta"], "orca_tokens": best["tokens"],
                       "orca_accuracy": best["accuracy"], "budget_tokens_at_that_accuracy": need,
                       "oracle_tokens": out["oracle"]["tokens"], "full_accuracy": full["accuracy"]}
    return out


def plot(summary: dict[str, Any], title: str, path: Path) -> None:
    """Accuracy against completion tokens per request, one series per rule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))

    def series(points: list[dict], label: str, style: str, key: str | None = None) -> None:
        pts = sorted(points, key=lambda p: p["tokens"])
        ax.plot([p["tokens"] for p in pts], [p["accuracy"] for p in pts], style, label=label)
        if key:
            for p in pts:
                ax.annotate(f"{p[key]:g}", (p["tokens"], p["accuracy"]), fontsize=6,
                            textcoords="offset points", xytext=(3, -8))

    series(summary["orca"], "ORCA TTT no-QK (delta)", "o-", "delta")
    if summary["orca_two_sided"]:
        series(summary["orca_two_sided"], f"two-sided ORCA, give-up delta {GIVE_UP_DELTA}",
               "o--", "delta")
    for label, points in summary.get("orca_other", {}).items():
        series(points, f"ORCA, {label} bundle (delta)", "s--", "delta")
    series(summary["budget"], "vLLM thinking budget (tokens)", "^-", "budget")
    series(summary["consistency"], "answer consistency, offline (k)", "v:", "k")
    series(summary["confidence"], "token confidence, offline (quantile)", "d:", "quantile")
    ax.plot([summary["full"]["tokens"]], [summary["full"]["accuracy"]], "k*", ms=11, label="full reasoning")
    ax.plot([summary["oracle"]["tokens"]], [summary["oracle"]["accuracy"]], "rP", ms=10, label="oracle")
    ax.set_xlabel("completion tokens per request")
    ax.set_ylabel("answer accuracy")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(name: str, s: dict[str, Any], epsilon: float) -> str:
    """The RESULTS.md rows of one workload."""
    f = s["full"]
    lines = [f"**{name}** (n = {f['n']}; epsilon = {epsilon}; full reasoning {f['tokens']:.0f} "
             f"tokens, accuracy {f['accuracy']:.3f}, {f['requests_per_s']:.2f} req/s; oracle "
             f"{s['oracle']['tokens']:.0f} tokens)", "",
             "Labelling these responses as an audit (answer probe at every step / every "
             f"{AUDIT_GRID}th): " + " / ".join(
                 f"{s['labelling'][k]['probes_per_request']:.1f} probes per request, "
                 f"{s['labelling'][k]['relative_to_serving']:.2f}x the serving wall time"
                 for k in ("every_1", f"every_{AUDIT_GRID}")), "",
             "| rule | setting | tokens/request | accuracy (answer probe at the stop) | requests/s "
             "| stop error (counted; 95% interval) |",
             "|---|---|---|---|---|---|"]
    def errors(p: dict[str, Any]) -> str:
        ci = p["stop_error_ci95"]
        err = (f"{p['stop_error']:.3f} ({p['stop_error_counted']}; {ci[0]:.3f}-{ci[1]:.3f})"
               if ci else "n/a")
        if p.get("shift_flagged"):
            err += f"; shift gate flagged {p['shift_flagged']:.3f}"
        if "give_up_error" in p:
            g = p["give_up_error"]
            err += (f"; give-up error {g['rate']:.3f} ({g['n']}; {g['ci95'][0]:.3f}-"
                    f"{g['ci95'][1]:.3f})")
        return err

    arms = [("ORCA TTT no-QK", s["orca"]), ("ORCA, shift gate off", s.get("orca_ungated", [])),
            *((f"ORCA, {label} bundle", points)
              for label, points in s.get("orca_other", {}).items()),
            ("two-sided ORCA", s["orca_two_sided"])]
    for label, points in arms:
        for p in points:
            setting = f"delta {p['delta']:g}" + (f", give-up {GIVE_UP_DELTA:g} (gave up on "
                                                 f"{p['gave_up']:.3f})" if "gave_up" in p else "")
            lines.append(f"| {label} | {setting} | {p['tokens']:.0f} | {p['accuracy']:.3f} "
                         f"({p['probe_accuracy']:.3f}) | {p['requests_per_s']:.2f} | {errors(p)} |")
    note = {"above": "", "below": " (ORCA below it)", "outside": " (fewer tokens than any ORCA point)"}
    for p, where in zip(s["budget"], s["orca_versus_budget"]):
        lines.append(f"| thinking budget | {p['budget']} tokens{note[where]} "
                     f"| {p['tokens']:.0f} | {p['accuracy']:.3f} | {p['requests_per_s']:.2f} | |")
    for p in s["consistency"]:
        lines.append(f"| consistency (offline) | k = {p['k']} | {p['tokens']:.0f} | {p['accuracy']:.3f} | | |")
    for p in s["confidence"]:
        lines.append(f"| confidence (offline) | q = {p['quantile']:g} | {p['tokens']:.0f} "
                     f"| {p['accuracy']:.3f} | | |")
    return "\n".join(lines)


def serve(reasoner: Reasoner, bundle: Path | None, log: Path,
          extra: Sequence[str] = ()) -> Server:
    """orca-serve on the reasoner's model with its own bundle (what `--demo` serves), or another
    one (the static arm), under the name the bundle gives the model; the context is the longest
    prompt (~60 tokens) plus max_tokens, within the long reasoner's 5,120 positions. `extra`:
    more orca-serve options (bench_shift's live audit and shift action)."""
    bundle = bundle or reasoner.bundle
    return Server(orca_serve_cmd("--model", str(reasoner.model_dir), "--calib", str(bundle),
                                 *extra), log,
                  ["--host", "127.0.0.1", "--seed", "0", "--reasoning-parser", "deepseek_r1",
                   "--served-model-name", load_bundle(bundle).model.name,
                   "--max-model-len", str(reasoner.max_tokens + 120)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reasoners", nargs="+", choices=sorted(REASONERS), default=sorted(REASONERS))
    ap.add_argument("--families", nargs="+", default=None, help="default: every family of each reasoner")
    ap.add_argument("--n", type=int, default=96, help="held-out prompts per workload")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7, help="the calibration's")
    ap.add_argument("--other-bundle", nargs="*", default=[], metavar="REASONER=LABEL=BUNDLE",
                    help="another bundle of a reasoner's model, served by a second server: its "
                    "one-sided ORCA arms under LABEL (e.g. long=recalibrated=runs/x/bundle.json)")
    ap.add_argument("--ungated", action="store_true",
                    help="also the ORCA arms with the bundle's shift gate off (orca.shift_alpha 0)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-frontier")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    others: dict[str, dict[str, Path]] = {}  # reasoner -> label -> bundle
    for x in a.other_bundle:
        rname, label, bundle = (x.split("=", 2) + ["", ""])[:3]
        if rname not in REASONERS or not label or not bundle:
            ap.error(f"--other-bundle takes REASONER=LABEL=BUNDLE with REASONER in "
                     f"{sorted(REASONERS)}; got {x!r}")
        try:  # before the first server: a bad bundle should not cost a run's first hour
            load_bundle(bundle)
        except (OSError, ValueError) as e:
            ap.error(f"--other-bundle {x!r}: {e}")
        others.setdefault(rname, {})[label] = Path(bundle)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    tables = []
    for rname in a.reasoners:
        reasoner = REASONERS[rname]
        families = [f for f in reasoner.families if a.families is None or f in a.families]
        works = {}
        for family in families:
            path = a.out / f"{rname}-{family}-prompts.jsonl"
            reasoner.tasks.write_prompts(path, family, a.n, seed=PROMPT_SEED)
            works[family] = Workload(path, reasoner.model_dir, reasoner.bundle, reasoner.tasks)
        runs: dict[str, dict[str, Any]] = {}
        srv = serve(reasoner, None, a.out / f"{rname}-serve.log")
        try:
            srv.wait(SERVER_START_S)
            for family, work in works.items():
                print(f"{rname} / {family}", file=sys.stderr, flush=True)
                runs[family] = asyncio.run(live_arms(srv.url, work, reasoner, a, with_full=True))
        finally:
            srv.stop()
        other_runs: dict[str, dict[str, Any]] = {family: {} for family in works}
        for label, bundle in others.get(rname, {}).items():
            srv = serve(reasoner, bundle, a.out / f"{rname}-{label}-serve.log")
            try:
                srv.wait(SERVER_START_S)
                for family in works:
                    other = Workload(a.out / f"{rname}-{family}-prompts.jsonl",
                                     reasoner.model_dir, bundle, reasoner.tasks)
                    print(f"{rname} / {family} ({label} bundle)", file=sys.stderr, flush=True)
                    other_runs[family][label] = asyncio.run(live_arms(srv.url, other, reasoner, a,
                                                                      with_full=False))
            finally:
                srv.stop()
        for family, work in works.items():
            s = summarize(runs[family], other_runs[family], work)
            s.update({"date": started, "nproc": os.cpu_count(), "reasoner": rname, "family": family,
                      "n": a.n, "concurrency": a.concurrency, "temperature": a.temperature,
                      "epsilon": work.bundle.ltt.epsilon, "max_tokens": reasoner.max_tokens})
            (a.out / f"{rname}-{family}.json").write_text(json.dumps(s, indent=1))
            title = f"{rname} reasoner, {family} (n = {a.n}, {a.concurrency} concurrent)"
            plot(s, title, ROOT / "benchmarks" / f"frontier-{rname}-{family}.png")
            tables.append(table(f"{rname} reasoner, {family}", s, work.bundle.ltt.epsilon))
    print(f"{started}, nproc {os.cpu_count()}, n {a.n} per workload, {a.concurrency} concurrent, "
          f"temperature {a.temperature}")
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
