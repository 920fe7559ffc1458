"""The mixed stream: one live server, the shipped bundle, traffic that moves away from its
calibration set (issue 34, item 5).

One `orca-serve` with an embedded demo's shipped bundle (the model and bundle `--demo` serves)
gets one stream of held-out prompts in order: in distribution, then shifted, then hard (the long
reasoner only; the toy has two families), then a mixture of all of them, shuffled. Every arm
sends the whole stream in that order, `--concurrency` requests in flight, through the real
OpenAI client, sampled at the calibration's temperature:

- **full**: ORCA off; **budget@B**: ORCA off and vLLM's `thinking_token_budget` B;
- **gated@d**: ORCA at delta d with the server's defaults (the bundle's shift gate on);
- **ungated@d**: the same with `orca.shift_alpha` 0 (no gate);
- **two-sided@d** / **two-sided-ungated@d**: the same two with `give_up` at GIVE_UP_DELTA.

The live audit is a server option, so it is a run of its own: `--audit-rate R` serves with
`--orca-audit-rate R --orca-on-alarm fallback` (an alarm at a delta stops early there no more),
and `--shift-action off` turns the gate off for the whole server (`--orca-shift-action off`).
The gate alarm (docs/SERVER.md, "The gate alarm") is on by default, as the server's; `--gate-alarm
0` serves without it (`--orca-gate-alarm 0`). Its state is the engine's, so with it on every arm
the gate runs for (gated, two-sided) gets a server of its own, started afresh: an arm never
inherits the alarm the arm before it raised.
Each run writes OUT/REASONER/CONFIG.json; `--report` reads them all and prints the tables of
benchmarks/RESULTS.md ("Mixed stream, served") and draws benchmarks/shift-REASONER.png.

Per segment and arm: tokens per request, accuracy (the task's checker on the delivered text),
the realized stop error and give-up error with exact 95% intervals (labelled as
bench_goodput labels: a request cut short is continued with ORCA off, then answer-probed at every
step), the shares the gate flagged, gave up and were audited, accuracy against the thinking
budget's at matched tokens (its curve on the same segment, interpolated), and the requests
**served a bad lambda**: a request ran with a lambda that could stop it (ORCA on, not flagged,
not audited, a finite lambda) and that lambda's realized stop error on the requests of its family
it was served to in this arm is above delta. Served after a reaction (the gate flagged it, the
audit's alarm turned its delta to the fallback), a request runs no such lambda, so the count is
the requests served a bad lambda before anything reacted to them; each arm also says where in
the stream the first reaction came (the first flagged request, the first served as a flagged one
by the gate alarm and the first served the fallback, counted from the first request of the
shift).

Usage (one server configuration per run; runs on the same stream add their arms to its file):
  python benchmarks/bench_shift.py --reasoner toy --n 100 \\
      --arms full budget gated ungated two-sided two-sided-ungated
  python benchmarks/bench_shift.py --reasoner toy --n 100 --arms gated --deltas 0.1 \\
      --audit-rate 0.2
  python benchmarks/bench_shift.py --reasoner toy --n 100 --arms gated --gate-alarm 0
  python benchmarks/bench_shift.py --reasoner toy --report
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_frontier import (GIVE_UP_DELTA, PROMPT_SEED, REASONERS, SERVER_START_S, Reasoner,
                            accuracy_at, probe_right, run_arm, serve)
from bench_goodput import Workload, give_up_loss, label, realized, request_loss

from orca_method.outcomes import Ended, Source

MIXTURE = "mixture"
ARM_KINDS = ("full", "budget", "gated", "ungated", "two-sided", "two-sided-ungated")
LABEL_CONCURRENCY = 64
SUMMARY = "summary.json"  # the report's, beside the runs' CONFIG.json files


# ------------------------------------------------------- pure parts (tests/test_bench_shift.py)

def build_stream(by_family: Mapping[str, Sequence[dict]], sizes: Mapping[str, int],
                 n_mix: int, seed: int) -> list[dict]:
    """The stream in order: each family's segment (its first `sizes[family]` prompts, families
    in `by_family`'s order), then a mixture of `n_mix` prompts drawn in turn from each family's
    remaining ones (so no prompt appears twice) and shuffled with `seed`. Every prompt gets its
    `segment` and its place `i` in the stream."""
    out: list[dict] = []
    for family, prompts in by_family.items():
        out += [{**p, "segment": family} for p in prompts[:sizes[family]]]
    rest = {f: list(p[sizes[f]:]) for f, p in by_family.items()}
    mix: list[dict] = []
    families = list(by_family)
    for k in range(n_mix):
        family = families[k % len(families)]
        if not rest[family]:
            raise ValueError(f"the mixture needs more {family} prompts than were written")
        mix.append({**rest[family].pop(0), "segment": MIXTURE})
    random.Random(seed).shuffle(mix)
    return [{**p, "i": i} for i, p in enumerate(out + mix)]


def prompts_needed(families: Sequence[str], sizes: Mapping[str, int], n_mix: int) -> dict[str, int]:
    """How many prompts of each family the stream takes (its segment and its mixture share)."""
    return {f: sizes[f] + sum(1 for k in range(n_mix) if families[k % len(families)] == f)
            for f in families}


def arm_body(arm: str) -> dict[str, Any]:
    """The request's extra body of an arm named KIND or KIND@VALUE (ARM_KINDS)."""
    kind, _, value = arm.partition("@")
    if kind == "full":
        return {"orca": {"enabled": False}}
    if kind == "budget":
        return {"orca": {"enabled": False}, "thinking_token_budget": int(value)}
    if kind not in ARM_KINDS:
        raise ValueError(f"unknown arm {arm!r}")
    orca: dict[str, Any] = {"enabled": True, "delta": float(value), "policy": "answer"}
    if kind.endswith("ungated"):
        orca["shift_alpha"] = 0
    if kind.startswith("two-sided"):
        orca["give_up"] = {"delta": GIVE_UP_DELTA}
    return {"orca": orca}


def arm_names(kinds: Sequence[str], deltas: Sequence[float], budgets: Sequence[int]) -> list[str]:
    """The arms of a run, in the order they are sent."""
    out = []
    for kind in kinds:
        if kind == "full":
            out.append("full")
        elif kind == "budget":
            out += [f"budget@{b}" for b in budgets]
        else:
            out += [f"{kind}@{d:g}" for d in deltas]
    return out


def arm_batches(arms: Sequence[str], fresh: bool) -> list[list[str]]:
    """The arms in the order they are sent, in batches that each get a server of their own:
    with `fresh` (the gate alarm on), at most one arm the gate runs for per batch, so that no
    such arm starts with the alarm another arm raised; other arms (ORCA off, ungated) neither
    feed nor read the alarm and join the batch before them."""
    def alarmed(arm: str) -> bool:
        return arm.partition("@")[0] in ("gated", "two-sided")

    out: list[list[str]] = []
    for arm in arms:
        if not out or (fresh and alarmed(arm) and any(map(alarmed, out[-1]))):
            out.append([])
        out[-1].append(arm)
    return out


def acting(orca: Mapping[str, Any]) -> bool:
    """Whether a response ran with a lambda that could stop it: ORCA on, not audited (shadow),
    not flagged by the gate nor served as flagged by the gate alarm (`shift_alarm`: the engine
    ran the safe action, whatever `lambda` it was resolved with), and a finite lambda (null:
    never stops, the fallback's)."""
    return (bool(orca.get("enabled")) and not orca.get("audited")
            and not (orca.get("shift") or {}).get("flagged") and not orca.get("shift_alarm")
            and isinstance(orca.get("lambda"), (int, float)))


def mark_bad(records: list[dict], delta: float) -> None:
    """Set each record's `bad`: it was acting and its lambda's realized stop error over the
    acting records of its family served that lambda (in this arm) is above delta. Records: the
    `record` dicts of one arm."""
    groups: dict[tuple[str, float], list[dict]] = defaultdict(list)
    for r in records:
        r["bad"] = False
        if r["acting"]:
            groups[(r["family"], r["lambda"])].append(r)
    for group in groups.values():
        err = realized([r["loss"] for r in group])
        if err["n"] and err["rate"] > delta:
            for r in group:
                r["bad"] = True


def first_reactions(records: Sequence[dict], shift_start: int) -> dict[str, int | None]:
    """Where the first reactions came, in requests from the first request of the shift (its
    place `shift_start` in the stream; 0: that first request): the first request the gate
    flagged, the first the gate alarm served as a flagged one, and the first served the audit's
    fallback; None when there was none."""
    def first(pred: Any) -> int | None:
        hits = [r["i"] - shift_start for r in records if r["i"] >= shift_start and pred(r)]
        return min(hits) if hits else None

    return {"gate": first(lambda r: r["flagged"]), "alarm": first(lambda r: r.get("alarm")),
            "audit": first(lambda r: r["lambda_source"] == Source.FALLBACK
                           and not r.get("alarm"))}


def share(records: Sequence[dict], key: str) -> float:
    """The share of records whose `key` is true, over those that have it (None: not labelled)."""
    known = [bool(r[key]) for r in records if r[key] is not None]
    return float(np.mean(known)) if known else math.nan


def segment_figures(records: Sequence[dict]) -> dict[str, Any]:
    """One arm's figures on one segment's records."""
    out: dict[str, Any] = {"n": len(records),
                           "tokens": float(np.mean([r["tokens"] for r in records])),
                           "accuracy": share(records, "correct")}
    if records and records[0]["orca"]:
        out.update(stop_error=realized([r["loss"] for r in records]),
                   give_up_error=realized([r["give_up_loss"] for r in records]),
                   flagged=share(records, "flagged"), audited=share(records, "audited"),
                   alarm=share(records, "alarm") if "alarm" in records[0] else math.nan,
                   gave_up=share(records, "gave_up"), acting=share(records, "acting"),
                   probe_accuracy=share(records, "probe_right"),
                   bad_served=sum(r["bad"] for r in records))
    return out


def segments_of(records: Sequence[dict]) -> list[str]:
    """The segments of a stream's records, in stream order."""
    seen: dict[str, None] = {}
    for r in sorted(records, key=lambda r: r["i"]):
        seen.setdefault(r["segment"], None)
    return list(seen)


def by_segment(records: Sequence[dict]) -> dict[str, dict[str, Any]]:
    return {s: segment_figures([r for r in records if r["segment"] == s])
            for s in segments_of(records)}


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's score interval of a proportion p over n."""
    if n == 0:
        return (math.nan, math.nan)
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (c - h, c + h)


def gap_interval(p1: float, n1: int, p2: float, n2: int) -> tuple[float, float]:
    """Newcombe's hybrid score interval (95%) of p1 - p2 for two independent proportions."""
    l1, u1 = wilson(p1, n1)
    l2, u2 = wilson(p2, n2)
    d = p1 - p2
    return (d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2),
            d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2))


def against_budget(point: Mapping[str, Any],
                   budgets: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """An ORCA point against the thinking budget's curve on the same segment at its tokens:
    the budget's interpolated accuracy there, the gap (ORCA - budget) and its 95% interval
    (both treated as proportions over their segment's n); where the budget has no point at
    those tokens, which side it lies on."""
    curve = [{"tokens": b["tokens"], "accuracy": b["accuracy"]} for b in budgets]
    if not curve:
        return {"where": "no budget"}
    at = accuracy_at(curve, point["tokens"])
    if at is None:
        lo, hi = min(c["tokens"] for c in curve), max(c["tokens"] for c in curve)
        if point["tokens"] > hi:  # ORCA spends more than the largest budget: compare with it
            top = max(budgets, key=lambda b: b["tokens"])
            at, where = top["accuracy"], "above the largest budget's tokens"
        else:
            return {"where": f"below the smallest budget's tokens ({lo:.0f})"}
    else:
        where = "interpolated"
    n_budget = min(b["n"] for b in budgets)
    return {"where": where, "budget_accuracy": at, "gap": point["accuracy"] - at,
            "gap_ci95": list(gap_interval(point["accuracy"], point["n"], at, n_budget))}


# ------------------------------------------------------------------------------- live parts

def record(resp: dict, prompt: dict, orca_arm: bool, excluded_never_correct: bool,
           give_up_reference: str) -> dict[str, Any]:
    """What a summary needs of one response (its token ids are dropped); its errors are None
    until it is labelled (its `trace`)."""
    o, trace = resp["orca"], resp.get("trace")
    r = {"i": prompt["i"], "id": prompt["id"], "segment": prompt["segment"],
         "family": prompt["family"], "tokens": resp["completion_tokens"],
         "correct": bool(resp["correct"]), "orca": orca_arm}
    if orca_arm:
        r.update({"flagged": bool((o.get("shift") or {}).get("flagged")),
                  "alarm": bool(o.get("shift_alarm")),
                  "audited": bool(o.get("audited")), "acting": acting(o),
                  "lambda": o.get("lambda"), "lambda_source": o.get("lambda_source"),
                  "gave_up": o.get("ended") == Ended.GAVE_UP,
                  "stopped_early": bool(o.get("stopped_early")),
                  "loss": None, "give_up_loss": None, "probe_right": None})
        if trace is not None:
            r.update({"loss": request_loss(trace, o, excluded_never_correct),
                      "give_up_loss": give_up_loss(trace, o, give_up_reference),
                      "probe_right": probe_right(trace, o)})
    return r


async def run_stream(url: str, work: Workload, stream: list[dict], arms: list[str],
                     reasoner: Reasoner, a: argparse.Namespace,
                     save: Callable[[dict[str, Any]], None], started: float) -> None:
    """Every arm over the whole stream in order, then the labelling of the ORCA arms; per arm
    its records, and the server's audit table at its end (when auditing), handed to `save`
    arm by arm (a run cut short keeps the arms it finished); no arm starts past `--deadline-s`
    after `started` (time.monotonic)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", timeout=3600, max_retries=3)
    model = (await client.models.list()).data[0].id
    by_id = {p["id"]: p for p in stream}
    bundle = work.bundle
    for arm in arms:
        if time.monotonic() - started > a.deadline_s:
            print(f"  past --deadline-s {a.deadline_s:.0f}: not starting {arm}", file=sys.stderr,
                  flush=True)
            continue
        resp, wall = await run_arm(client, model, stream, arm_body(arm), a.concurrency,
                                   reasoner.max_tokens, a.temperature)
        orca_arm = arm_body(arm)["orca"].get("enabled", True)
        for r in resp:
            r["correct"] = work.correct(by_id[r["id"]], work.text(r["token_ids"]))

        def records() -> list[dict[str, Any]]:
            return [record(r, by_id[r["id"]], orca_arm, bundle.ltt.excluded_never_correct,
                           bundle.give_up.label_mode if bundle.give_up else "supervised")
                    for r in resp]

        done = {"records": records(), "wall_s": wall, "label_s": None,
                "loadavg": os.getloadavg()[0]}
        if a.audit_rate > 0:
            done["audit_table"] = await client.get("/orca/audit", cast_to=object)
        save({arm: done})  # the served figures, kept should the labelling be cut short
        if orca_arm:
            t0 = time.perf_counter()
            await label(client, model, work, resp, LABEL_CONCURRENCY, reasoner.max_tokens,
                        a.temperature)
            done.update(records=records(), label_s=time.perf_counter() - t0)
            save({arm: done})
        recs = done["records"]
        print(f"  {arm}: {np.mean([r['tokens'] for r in recs]):.0f} tokens, accuracy "
              f"{np.mean([r['correct'] for r in recs]):.3f} ({wall:.0f} s serving, "
              f"{done['label_s'] or 0:.0f} s labelling, load {done['loadavg']:.1f})",
              file=sys.stderr, flush=True)
    await client.close()


def write_stream(out: Path, reasoner: Reasoner, sizes: dict[str, int], n_mix: int) -> Path:
    """The stream's prompts (held out: bench_frontier's seed), written to OUT/stream.jsonl."""
    by_family = {}
    for family, n in prompts_needed(reasoner.families, sizes, n_mix).items():
        path = out / f"prompts-{family}.jsonl"
        reasoner.tasks.write_prompts(path, family, n, seed=PROMPT_SEED)
        by_family[family] = [json.loads(x) for x in path.read_text().splitlines()]
    stream = build_stream(by_family, sizes, n_mix, seed=PROMPT_SEED)
    path = out / "stream.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in stream))
    return path


def config_name(a: argparse.Namespace) -> str:
    """The run's server configuration, its file's name: plain, audit-R, and -gate-off or
    -no-alarm."""
    name = f"audit-{a.audit_rate:g}" if a.audit_rate > 0 else "plain"
    return (name + ("-gate-off" if a.shift_action == "off" else "")
            + ("-no-alarm" if a.gate_alarm == 0 else ""))


def server_options(a: argparse.Namespace, out: Path) -> list[str]:
    """The run's orca-serve options: eager (a start in well under a minute, as the demo and the
    served tests start; the long reasoner's compile takes many minutes on this machine), then
    the live audit, the shift action and the gate alarm of its configuration."""
    opts = ["--enforce-eager"]
    if a.audit_rate > 0:
        audits = out / f"audits-{config_name(a)}"
        if audits.exists():  # the store resumes: each run starts anew
            import shutil

            shutil.rmtree(audits)
        opts += ["--orca-audit-rate", str(a.audit_rate), "--orca-audit-seed", "0",
                 "--orca-audit-queue", "10000", "--orca-audit-dir", str(audits),
                 "--orca-on-alarm", "fallback"]
    if a.shift_action:
        opts += ["--orca-shift-action", a.shift_action]
    if a.gate_alarm is not None:
        opts += ["--orca-gate-alarm", str(a.gate_alarm)]
    return opts


def live(a: argparse.Namespace) -> None:
    reasoner = REASONERS[a.reasoner]
    out = a.out / a.reasoner
    out.mkdir(parents=True, exist_ok=True)
    sizes = {f: a.n for f in reasoner.families}
    for x in a.n_for:
        family, n = x.split("=")
        sizes[family] = int(n)
    n_mix = a.n if a.n_mix is None else a.n_mix
    work = Workload(write_stream(out, reasoner, sizes, n_mix), reasoner.model_dir,
                    reasoner.bundle, reasoner.tasks)
    stream = work.prompts
    deltas = a.deltas or work.bundle.deltas()
    arms = arm_names(a.arms, deltas, a.budgets or reasoner.budgets)
    config, options = config_name(a), server_options(a, out)
    path = out / f"{config}.json"
    res = json.loads(path.read_text()) if path.exists() else None
    if res is None or (res["sizes"], res["n_mix"]) != (sizes, n_mix):  # another stream
        res = {"arms": {}, "runs": []}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    res.update({"nproc": os.cpu_count(), "reasoner": a.reasoner, "config": config,
                "server_options": options, "sizes": sizes, "n_mix": n_mix,
                "concurrency": a.concurrency, "temperature": a.temperature,
                "epsilon": work.bundle.ltt.epsilon, "give_up_delta": GIVE_UP_DELTA})
    res["runs"].append({"started": started})

    def save(arm: dict[str, Any]) -> None:
        res["arms"].update(arm)
        res["runs"][-1].update(ended=time.strftime("%H:%M UTC", time.gmtime()),
                               loadavg=os.getloadavg())
        path.write_text(json.dumps(res, indent=1))

    started = time.monotonic()
    for k, batch in enumerate(arm_batches(arms, fresh=a.gate_alarm != 0)):
        if time.monotonic() - started > a.deadline_s:
            print(f"  past --deadline-s {a.deadline_s:.0f}: not starting {batch}",
                  file=sys.stderr, flush=True)
            break
        t0 = time.time()
        srv = serve(reasoner, None, out / f"{config}-serve-{k}.log", options)
        try:
            srv.wait(SERVER_START_S)
            res["runs"][-1].setdefault("server_start_s", []).append(time.time() - t0)
            print(f"{a.reasoner} / {config}: server up in {time.time() - t0:.0f} s for {batch}",
                  file=sys.stderr, flush=True)
            asyncio.run(run_stream(srv.url, work, stream, batch, reasoner, a, save, started))
        finally:
            srv.stop()
    print(f"wrote {path}", file=sys.stderr)


# ------------------------------------------------------------------------------- the report

def arm_delta(arm: str) -> float | None:
    kind, _, value = arm.partition("@")
    return float(value) if kind not in ("full", "budget") else None


def summarize(runs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Every run of one reasoner (config -> its file): per config and arm, the figures per
    segment, the first reactions, and each ORCA point against the thinking budget on its
    segment (the budget arms of any run on the same stream)."""
    out: dict[str, Any] = {}
    budgets: dict[str, list[dict]] = defaultdict(list)
    for config, run in runs.items():
        for arm, body in run["arms"].items():
            recs = body["records"]
            delta = arm_delta(arm)
            if delta is not None:
                mark_bad(recs, delta)
            segs = by_segment(recs)
            shift_start = min((r["i"] for r in recs if r["family"] != "in-dist"), default=0)
            entry = {"config": config, "arm": arm, "delta": delta, "segments": segs,
                     "wall_s": body["wall_s"]}
            if delta is not None:
                entry["first_reaction"] = first_reactions(recs, shift_start)
                entry["bad_served"] = sum(r["bad"] for r in recs)
            if "audit_table" in body:
                entry["audit"] = {k: body["audit_table"].get(k)
                                  for k in ("picked", "labelled", "dropped", "failed", "drift")}
                entry["audit"]["rows"] = [{k: row.get(k) for k in ("delta", "n", "risk", "lower",
                                                                   "upper", "alarm", "lambda",
                                                                   "lambda_source")}
                                          for row in body["audit_table"].get("deltas", [])]
            out[f"{config}/{arm}"] = entry
            if arm.startswith("budget@"):
                for seg, fig in segs.items():
                    budgets[seg].append({"budget": int(arm.split("@")[1]), **fig})
    for entry in out.values():
        if entry["delta"] is not None:
            for seg, fig in entry["segments"].items():
                fig["versus_budget"] = against_budget(fig, budgets.get(seg, []))
    return {"arms": out, "budgets": dict(budgets)}


def risk_cell(r: Mapping[str, Any] | None) -> str:
    if not r or not r["n"]:
        return "n/a"
    return f"{r['rate']:.3f} ({r['k']}/{r['n']}; {r['ci95'][0]:.3f}-{r['ci95'][1]:.3f})"


def versus_cell(v: Mapping[str, Any] | None) -> str:
    if not v or "gap" not in v:
        return (v or {}).get("where", "")
    note = "" if v["where"] == "interpolated" else f" ({v['where']})"
    return (f"{v['budget_accuracy']:.3f}; {v['gap']:+.3f} ({v['gap_ci95'][0]:+.3f} to "
            f"{v['gap_ci95'][1]:+.3f}){note}")


def table(summary: Mapping[str, Any]) -> str:
    """The markdown table of RESULTS.md: one row per run, arm and segment."""
    lines = ["| run | arm | segment | n | tokens | accuracy (probe at stop) | budget at these "
             "tokens; gap (95%) | stop error (k/n; 95%) | give-up error (k/n; 95%) | flagged "
             "| alarm-served | gave up | audited | served a bad lambda |", "|---" * 14 + "|"]
    for entry in summary["arms"].values():
        for seg, f in entry["segments"].items():
            if entry["delta"] is None:
                lines.append(f"| {entry['config']} | {entry['arm']} | {seg} | {f['n']} "
                             f"| {f['tokens']:.0f} | {f['accuracy']:.3f} | | | | | | | | |")
                continue
            two = entry["arm"].startswith("two-sided")
            lines.append(
                f"| {entry['config']} | {entry['arm']} | {seg} | {f['n']} | {f['tokens']:.0f} "
                f"| {f['accuracy']:.3f} ({f['probe_accuracy']:.3f}) "
                f"| {versus_cell(f.get('versus_budget'))} | {risk_cell(f['stop_error'])} "
                f"| {risk_cell(f['give_up_error']) if two else ''} | {f['flagged']:.3f} "
                f"| {f.get('alarm', math.nan):.3f} | {f['gave_up']:.3f} | {f['audited']:.3f} "
                f"| {f['bad_served']} |")
    reactions = [f"- {e['config']} / {e['arm']}: {e['bad_served']} requests served a bad "
                 f"lambda; first gate flag at request {e['first_reaction']['gate']} of the shift, "
                 f"first served by the gate alarm at {e['first_reaction'].get('alarm')}, "
                 f"first fallback at {e['first_reaction']['audit']}"
                 + (f"; audit: {e['audit']['labelled']} of {e['audit']['picked']} labelled, "
                    + ", ".join(f"delta {r['delta']:g} alarm {r['alarm']} (n {r['n']}, lower "
                                f"{r['lower']:.3f})" for r in e["audit"]["rows"]
                                if r["lower"] is not None)
                    if "audit" in e else "")
                 for e in summary["arms"].values() if e["delta"] is not None]
    return "\n".join(lines + [""] + reactions)


def done_means(summary: Mapping[str, Any], config: str = "plain") -> str:
    """Issue 34's checks on one run's arms, per segment and delta: the gated stop error against
    delta (its upper 95% bound too), the two-sided give-up error against GIVE_UP_DELTA, and
    two-sided minus one-sided accuracy with its 95% interval (the issue asks >= -0.02)."""
    arms = summary["arms"]
    lines = ["| segment | delta | stop error, gated (95%) | <= delta | give-up error, two-sided "
             "(95%) | two-sided - one-sided accuracy (95%) |", "|---" * 6 + "|"]
    for key, e in arms.items():
        if not key.startswith(f"{config}/gated@"):
            continue
        two = arms.get(f"{config}/two-sided@{e['delta']:g}")
        for seg, f in e["segments"].items():
            err = f["stop_error"]
            ok = ("yes" if err["ci95"] and err["ci95"][1] <= e["delta"] else
                  "point only" if err["n"] and err["rate"] <= e["delta"] else "no")
            g = diff = ""
            if two is not None and seg in two["segments"]:
                t = two["segments"][seg]
                g = risk_cell(t["give_up_error"])
                lo, hi = gap_interval(t["accuracy"], t["n"], f["accuracy"], f["n"])
                diff = f"{t['accuracy'] - f['accuracy']:+.3f} ({lo:+.3f} to {hi:+.3f})"
            lines.append(f"| {seg} | {e['delta']:g} | {risk_cell(err)} | {ok} | {g} | {diff} |")
    return "\n".join(lines)


def plot(summary: Mapping[str, Any], title: str, path: Path) -> None:
    """Accuracy against tokens per request, one panel per segment: the thinking budget's
    curve, full reasoning, and every ORCA arm (labelled by delta)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = list(summary["arms"].values())
    segments = list(entries[0]["segments"])
    fig, axes = plt.subplots(1, len(segments), figsize=(4.2 * len(segments), 4.0), squeeze=False)
    styles = {"gated": "o", "ungated": "x", "two-sided": "s", "two-sided-ungated": "d"}  # points
    for ax, seg in zip(axes[0], segments):
        pts = sorted(summary["budgets"].get(seg, []), key=lambda p: p["tokens"])
        if pts:
            ax.plot([p["tokens"] for p in pts], [p["accuracy"] for p in pts], "^-", color="grey",
                    label="thinking budget")
        series: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
        for e in entries:
            f = e["segments"].get(seg)
            if f is None:
                continue
            if e["arm"] == "full":
                ax.plot([f["tokens"]], [f["accuracy"]], "k*", ms=11, label="full reasoning")
            elif e["delta"] is not None:
                kind = e["arm"].split("@")[0]
                name = kind if e["config"] == "plain" else f"{kind}, {e['config']}"
                series[name].append((f["tokens"], f["accuracy"], e["delta"]))
        for name, xs in series.items():
            xs.sort()
            ax.plot([x[0] for x in xs], [x[1] for x in xs], styles.get(name, "P"), label=name)
            for t, acc, d in xs:
                ax.annotate(f"{d:g}", (t, acc), fontsize=6, textcoords="offset points",
                            xytext=(3, -8))
        ax.set_title(seg, fontsize=10)
        ax.set_xlabel("completion tokens per request")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("answer accuracy")
    axes[0][-1].legend(fontsize=6, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(a: argparse.Namespace) -> None:
    out = a.out / a.reasoner
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))
            if p.name != SUMMARY}
    if not runs:
        raise SystemExit(f"no runs under {out}")
    summary = summarize(runs)
    (out / SUMMARY).write_text(json.dumps(summary, indent=1))
    first = next(iter(runs.values()))
    n = {**first["sizes"], MIXTURE: first["n_mix"]}
    plot(summary, f"{a.reasoner} reasoner, the mixed stream (n per segment {n})",
         ROOT / "benchmarks" / f"shift-{a.reasoner}.png")
    for config, run in runs.items():
        print(f"{config}: runs {run['runs']}, "
              f"options {' '.join(run['server_options']) or '(defaults)'}, epsilon "
              f"{run['epsilon']}, give-up delta {run['give_up_delta']}, concurrency "
              f"{run['concurrency']}, temperature {run['temperature']}")
    print(table(summary))
    print()
    print(done_means(summary))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reasoner", choices=sorted(REASONERS), required=True)
    ap.add_argument("--n", type=int, default=100, help="prompts per family segment")
    ap.add_argument("--n-for", action="append", default=[], metavar="FAMILY=N",
                    help="another segment size for one family")
    ap.add_argument("--n-mix", type=int, default=None, help="the mixture's size (default: --n)")
    ap.add_argument("--arms", nargs="+", choices=ARM_KINDS, default=list(ARM_KINDS))
    ap.add_argument("--deltas", nargs="+", type=float, default=None,
                    help="default: the bundle's")
    ap.add_argument("--budgets", nargs="+", type=int, default=None,
                    help="default: bench_frontier's for the reasoner")
    ap.add_argument("--audit-rate", type=float, default=0.0,
                    help="serve with the live audit at this rate, on-alarm fallback (0: off)")
    ap.add_argument("--shift-action", choices=["off"], default=None,
                    help="off: serve with --orca-shift-action off (no gate for any request)")
    ap.add_argument("--gate-alarm", type=float, default=None, metavar="LEVEL",
                    help="serve with --orca-gate-alarm LEVEL (0: no gate alarm; default: the "
                    "server's, on)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--deadline-s", type=float, default=1080,
                    help="start no arm after this many seconds of serving (the shared machine's "
                    "runs are kept short; the arms a run skips can be run again with --arms)")
    ap.add_argument("--temperature", type=float, default=0.7, help="the calibration's")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-shift")
    ap.add_argument("--report", action="store_true",
                    help="serve nothing: the tables and plot of the runs under OUT/REASONER")
    a = ap.parse_args(argv)
    if a.report:
        report(a)
    else:
        live(a)


if __name__ == "__main__":
    main()
