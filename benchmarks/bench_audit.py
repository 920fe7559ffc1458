"""The guarantee on live traffic: how soon does the audit's alarm fire after a distribution shift?

1. calibrate on the toy model in distribution (`orca-calibrate run`: collect, split, train the
   probe, LTT with consistency labels: what the live audit measures), evaluating the bundle offline
   on the shifted family too (OUT/PROBE/run/evaluation.md); once per probe, cached under OUT.
   `--reasoner long` serves the long reasoner's shipped bundle instead (consistency labels, TTT
   no-QK; calibrated on walks up, while its shifted family walks down);
2. serve that bundle with `orca-serve --orca-audit-rate R [--orca-on-alarm P]` and send, through
   the real OpenAI client, a stream of fresh problems that switches from the in-distribution
   family to the shifted one (`--concurrency` requests at a time, in order);
3. poll GET /v1/orca/audit meanwhile: per delta, the first poll that shows the alarm, with the
   live requests finished by then; after the stream, replay the audit directory
   (`orca-calibrate audit-report`'s code) for the exact audit at which each alarm fired, and every
   audit's loss, steps and tokens under the lambda it was served and under the bundle's lambda*,
   and whether the answer probed at that stop (the answer served after a stop) is right.

The figures of benchmarks/RESULTS-archive.md ("Live audit on the toy model, end to end"):
  python benchmarks/bench_audit.py --probe static --rate 1.0 --n-in 100 --n-shift 200 --name switch-r1
  python benchmarks/bench_audit.py --probe static --rate 0.1 --n-in 100 --n-shift 500 --name switch-r01
  python benchmarks/bench_audit.py --probe ttt-noqk --rate 1.0 --n-in 100 --n-shift 200 --name switch-r1
  python benchmarks/bench_audit.py --probe static --rate 1.0 --n-in 1000 --n-shift 0 \
      --concurrency 8 --stream-seed 35 --name in-dist-1000
  python benchmarks/bench_audit.py --probe static --rate 1.0 --on-alarm recalibrate \
      --n-in 30 --n-shift 560 --stream-seed 37 --name recalibrate
  python benchmarks/bench_audit.py --delays runs/bench-audit/static/in-dist-1000/result.json \
      runs/bench-audit/static/switch-r1/result.json
and on the long reasoner ("The long reasoner's shifted family, recalibrated live"):
  python benchmarks/bench_audit.py --reasoner long --rate 1.0 --on-alarm recalibrate --window 150 \
      --n-in 30 --n-shift 400 --concurrency 32 --stream-seed 37 --name recalibrate
and the cost of auditing: benchmarks/bench_audit_cost.py.
Writes OUT/PROBE/NAME/result.json (OUT/long/NAME for the long reasoner: summary, every audit, the
polled timeline), server.log, audits/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests package's helpers

from bench_frontier import REASONERS, Reasoner
from orca_calibrate.job import run_job
from orca_demo.toy.tasks import FORCE_SUFFIX
from orca_method.audit.sequence import RESTART_EVERY, RESTART_SPAN
from orca_method.bundle import load_bundle
from orca_method.labels import equivalent, step_labels
from orca_method.outcomes import ON_ALARM, OnAlarm, Source
from tests.serving import Server, orca_serve_cmd

TOY = REASONERS["toy"]
MODEL = TOY.model_dir
ANSWER_TOKENS = 6  # orca_calibrate/jobs/toy.yaml
MAX_TOKENS = TOY.max_tokens
SERVE = ["--host", "127.0.0.1", "--enforce-eager", "--dtype", "float32",
         "--reasoning-parser", "deepseek_r1", "--max-num-batched-tokens", "16384",
         "--disable-uvicorn-access-log"]


def calibrate(root: Path, probe: str, n_cal: int, n_shifted: int, seed: int) -> Path:
    """The in-distribution bundle of one probe (a resumable job: a rerun reuses finished stages).

    The settings are orca_calibrate/jobs/toy.yaml's (1,200 in-distribution prompts, split 0.5 / 0.25
    / 0.25: 600 training problems, batch 1, window 1; TTT 20 epochs, epoch picked on validation)
    but with **consistency** labels, what the live audit measures. Both probes' jobs read one
    prompt set; the second job copies the first one's trajectories (same collect and split
    settings, so its collect and split stages count as done) instead of collecting them again.
    """
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    if not (data / "prompts.jsonl").exists():
        TOY.tasks.write_prompts(data / "prompts.jsonl", "in-dist", n_cal, seed=seed)
        TOY.tasks.write_prompts(data / "shifted.jsonl", "shifted", n_shifted, seed=seed + 1)
    out = root / probe
    out.mkdir(parents=True, exist_ok=True)
    train = {"probe": probe, "label_mode": "consistent", "seed": 0, "batch_size": 1}
    if probe != "static":
        train.update(epochs=20, epoch_select="validation")
    (out / "job.yaml").write_text(json.dumps({
        "model": str(MODEL), "prompts": str(data / "prompts.jsonl"),
        "shifted_prompts": str(data / "shifted.jsonl"), "out": "run",
        "collect": {"temperature": 0.7, "max_tokens": MAX_TOKENS, "suffix": FORCE_SUFFIX,
                    "answer_tokens": ANSWER_TOKENS, "batch": 128, "dtype": "float32",
                    "think": {"force_text": "\n</think>\n"}},
        "split": {"fractions": [0.5, 0.25, 0.25], "seed": 0},
        "train": train,
        "calibrate": {"deltas": [0.05, 0.1, 0.15, 0.2], "epsilon": 0.05, "window": 1},
    }, indent=1))
    run = out / "run"
    if not (run / ".done-split").exists():
        for sibling in root.glob("*/run/.done-split"):
            src = sibling.parent
            run.mkdir(exist_ok=True)
            for name in ("trajectories", "trajectories-shifted"):
                shutil.copytree(src / name, run / name, dirs_exist_ok=True)
            for name in (".done-collect", ".done-split", "collect-stats.json"):
                shutil.copy2(src / name, run / name)
            break
    for line in run_job(out / "job.yaml", progress=False):
        print(f"{probe}: {line}", file=sys.stderr)
    return run / "bundle.json"


def stream_prompts(out: Path, reasoner: Reasoner, n_in: int, n_shift: int,
                   seed: int) -> list[dict]:
    """Newly drawn problems (another seed than the calibration set's): n_in in distribution,
    then n_shift shifted."""
    out.mkdir(parents=True, exist_ok=True)
    reasoner.tasks.write_prompts(out / "stream-in.jsonl", "in-dist", n_in, seed=seed)
    reasoner.tasks.write_prompts(out / "stream-shift.jsonl", "shifted", n_shift, seed=seed + 1)
    return [json.loads(x) for f in ("stream-in.jsonl", "stream-shift.jsonl")
            for x in (out / f).read_text().splitlines()]


def serve(bundle: Path, out: Path, rate: float, *, on_alarm: OnAlarm = OnAlarm.REPORT,
          window: int = 200, reasoner: Reasoner = TOY) -> Server:
    """`orca-serve` with this bundle and audit rate (audits appended to OUT/audits; the answer
    probes take the bundle's labelling: its collection's suffix and answer length)."""
    audit = ["--orca-audit-rate", str(rate)]
    if rate > 0:
        audit += ["--orca-audit-seed", "0", "--orca-audit-queue", "10000",
                  "--orca-audit-dir", str(out / "audits"), "--orca-on-alarm", on_alarm,
                  "--orca-recalibrate-window", str(window)]
    shutil.rmtree(out / "audits", ignore_errors=True)  # the store resumes; each run starts anew
    srv = Server(orca_serve_cmd("--model", str(reasoner.model_dir), "--calib", str(bundle),
                                *audit),
                 out / "server.log", [*SERVE, "--max-model-len", str(reasoner.max_tokens + 120),
                                      "--served-model-name", load_bundle(bundle).model.name])
    try:
        return srv.wait()
    except BaseException:
        srv.stop()
        raise


def audit_table(client: openai.OpenAI) -> dict:
    """GET /v1/orca/audit through the OpenAI client (its raw GET on the same base URL)."""
    return client.get("/orca/audit", cast_to=object)


def stream(srv: Server, prompts: list[dict], concurrency: int, delta: float,
           reasoner: Reasoner = TOY) -> dict:
    """Send the prompts in order, `concurrency` at a time, with the real OpenAI client; poll the
    audit table meanwhile and note, per delta, the first poll that shows its alarm."""
    finished: list[str] = []  # families, in completion order
    usage = {"completion_tokens": 0, "requests": 0}
    lock = threading.Lock()
    timeline: list[dict] = []
    done = threading.Event()
    first_alarm: dict[float, dict] = {}
    # retries: a client starved of CPU on the loaded machine may reuse a keep-alive
    # connection the server has just closed ("disconnected without sending a response")
    client = srv.client().with_options(timeout=900, max_retries=3)
    model = client.models.list().data[0].id  # the bundle's name for it

    def ask(rec: dict) -> None:
        r = client.chat.completions.create(model=model,
                                           messages=rec["messages"], temperature=0.7,
                                           max_tokens=reasoner.max_tokens,
                                           extra_body={"orca": {"delta": delta}})
        with lock:
            finished.append(rec["family"])
            usage["completion_tokens"] += r.usage.completion_tokens
            usage["requests"] += 1

    def poll() -> None:
        while not done.is_set():
            t = audit_table(client)
            with lock:
                live, shifted = len(finished), finished.count("shifted")
            point = {"t": round(time.time() - t0, 2), "live": live, "live_shifted": shifted,
                     "picked": t["picked"], "labelled": t["labelled"],
                     "rows": {r["delta"]: {k: r[k] for k in ("n", "risk", "lower", "upper",
                                                               "alarm", "lambda", "lambda_source")}
                              for r in t["deltas"]},
                     "drift": t.get("drift")}
            timeline.append(point)
            for d, row in point["rows"].items():
                if row["alarm"] and d not in first_alarm:
                    first_alarm[d] = {k: point[k] for k in ("t", "live", "live_shifted", "picked",
                                                            "labelled")} | {"n": row["n"]}
            time.sleep(0.5)

    t0 = time.time()
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(ask, prompts))
    stream_s = time.time() - t0
    while True:  # let the labelling queue drain, the last record written
        t = audit_table(client)
        resolved = sum(t[k] for k in ("labelled", "failed", "dropped", "aborted", "length"))
        if resolved >= t["picked"] and t["labelling"] == 0:
            break
        time.sleep(1)
    time.sleep(1)
    done.set()
    poller.join()
    return {"first_alarm_poll": first_alarm, "final": t, "stream_s": round(stream_s, 1),
            "completion_tokens": usage["completion_tokens"],
            "tokens_per_s": round(usage["completion_tokens"] / stream_s, 2),
            "timeline": timeline}


def by_question(prompts: list[dict]) -> dict[str, dict]:
    """Each stream prompt (its family and right answer), keyed by its user message (what an audit
    records)."""
    return {rec["messages"][-1]["content"]: rec for rec in prompts}


def replay(audit_dir: Path, bundle_file: Path, prompts: dict[str, dict], delta: float) -> dict:
    """What the audits measured, from the audit directory, in labelling order.

    `audit_report` (`orca-calibrate audit-report`: the probe rescored offline, the server's
    confidence sequence) gives the exact audit at which each delta's alarm first fired. Then, at
    `delta`, every counted audit's loss under the lambda it was SERVED with (recorded in the audit:
    the guard's lambda when the request was admitted; None = fallback, never stops) and under the
    bundle's lambda*, with the steps and tokens each would save: the figures of `recalibrate`;
    and whether the answer probed at each stop, and the final answer, equal the prompt's right
    answer (`right_*`: the accuracy a served stop would have had).
    """
    from orca_calibrate.audit_report import audit_report, open_audits
    from orca_method.audit.guards import aligned_scores
    from orca_method.risk import is_counted

    bundle = load_bundle(bundle_file)
    ts = open_audits(audit_dir)
    report = audit_report(bundle, ts, mode="consistent")
    bundle_lam = bundle.lam(delta)
    rows = []
    for p in ts.problems:
        msgs = json.loads(p.prompt)
        c = np.maximum.accumulate(np.asarray(p.labels["consistent"]))
        if not is_counted(c, bundle.ltt.excluded_never_correct):
            continue
        s = aligned_scores(p.extra["audit"]["scores"], len(c))
        if s is None:
            continue
        served = p.extra["audit"]["lambda"]
        rec = prompts.get(msgs[-1]["content"], {})
        right = step_labels(p.step_answers, rec.get("answer"))  # per step: the probe is right
        row = {"family": rec.get("family", "?"), "served_lambda": served,
               "source": p.extra["audit"].get("lambda_source"),
               "steps": len(c), "tokens": int(sum(p.step_tokens)),
               "right_full": equivalent(p.final_answer, rec.get("answer"))}
        for name, lam in (("served", np.inf if served is None else served),
                          ("bundle", bundle_lam)):
            row.update({f"{k}_{name}": v
                        for k, v in at_lambda(s, c, p.step_tokens, right, lam).items()})
        rows.append(row)
    return {"report": {k: v for k, v in report.items() if k != "history"}, "audits": rows}


def at_lambda(scores: Sequence[float], labels: Sequence[int], step_tokens: Sequence[int],
              right: Sequence[int], lam: float) -> dict:
    """One audit replayed at one lambda (inf: never stops): its loss (the server's
    `request_loss`), the steps and reasoning tokens through the step it stops at, and whether the
    answer probed there is right (`right`: per step, against the prompt's answer)."""
    from orca_method.risk import request_loss, stop_indices

    stop = int(stop_indices([np.asarray(scores, dtype=float)], np.array([lam]))[0, 0])
    return {"loss": request_loss(scores, labels, lam), "steps": stop + 1,
            "tokens": int(sum(step_tokens[:stop + 1])), "right": bool(right[stop])}


def summarize(rows: list[dict], which: str) -> dict:
    """Realized error and savings (total steps and tokens, 1 - stopped / full) of some audits,
    with the reasoning tokens per request and the accuracy at their stops and at their ends."""
    def mean(key: str) -> float:
        return round(float(np.mean([r[key] for r in rows])), 4)

    if not rows:
        return {"n": 0}
    return {"n": len(rows), "error": mean(f"loss_{which}"),
            "savings_total_steps": round(1 - sum(r[f"steps_{which}"] for r in rows)
                                         / sum(r["steps"] for r in rows), 4),
            "token_savings_total": round(1 - sum(r[f"tokens_{which}"] for r in rows)
                                         / sum(r["tokens"] for r in rows), 4),
            "tokens": mean(f"tokens_{which}"), "accuracy": mean(f"right_{which}"),
            "tokens_full": mean("tokens"), "accuracy_full": mean("right_full")}


def recalibration_figures(rows: list[dict], delta: float) -> dict:
    """What `recalibrate` served the shifted requests, by audit (every request is audited).

    Each recalibrated lambda (`lambda_source` audit) came from audits admitted after the alarm
    and before it took effect, so the audits served with it are fresh for it: their realized
    error is its error on new shifted traffic. A request was served a bad lambda when it got
    the bundle's lambda* after the shift (its realized error on the shifted audits is above
    delta) or a recalibrated lambda whose realized error on its fresh audits is above delta
    (point estimates).
    """
    shifted = [r for r in rows if r["family"] == "shifted"]
    fresh = [r for r in shifted if r["source"] == Source.AUDIT]
    per_lambda = []
    for lam in sorted({r["served_lambda"] for r in fresh}, key=lambda x: np.inf if x is None else x):
        served = [r for r in fresh if r["served_lambda"] == lam]
        per_lambda.append({"lambda": lam, **summarize(served, "served")})
    bundle_bad = bool(shifted) and summarize(shifted, "bundle")["error"] > delta
    bad = sum(r["source"] == Source.BUNDLE for r in shifted) if bundle_bad else 0
    bad += sum(p["n"] for p in per_lambda if p["error"] > delta)
    return {"delta": delta, "fresh_shifted": len(fresh), "per_lambda": per_lambda,
            "recalibrated": summarize(fresh, "served"), "bundle": summarize(fresh, "bundle"),
            "shifted_requests": len(shifted),
            "served_bad_lambda": round(bad / len(shifted), 4) if shifted else None,
            "sources_shifted": {str(src): sum(r["source"] == src for r in shifted)
                                for src in Source}}


def alarm_delays(clean: list[float], shifted: list[float], prefixes: list[int], delta: float,
                 epsilon: float, every: int, span: int, draws: int = 200, limit: int = 5000,
                 seed: int = 0) -> dict:
    """How long the server's alarm takes to fire after a shift that follows a clean history of
    K audits: the first K measured in-distribution losses, then shifted losses drawn with
    replacement from the measured ones (`draws` orders), fed to the alarm as the server does
    (RestartedAlarm restarted every `every` audits, members kept at dyadic ages; every = 0: the single
    whole-history ConfidenceSequence the server used before). Per K: quantiles of the shifted
    audits until the alarm."""
    from orca_method.audit.sequence import ConfidenceSequence, RestartedAlarm

    rng = np.random.default_rng(seed)
    out = {}
    for k in prefixes:
        if k > len(clean):
            continue
        cs = (RestartedAlarm(epsilon, every, span, shape=(draws,)) if every else
              ConfidenceSequence(alpha=epsilon, shape=(draws,)))
        for x in clean[:k]:
            cs.update(np.full(draws, x))
        when = np.full(draws, np.inf)
        for i in range(1, limit + 1):
            cs.update(rng.choice(shifted, size=draws))
            when[np.isinf(when) & cs.alarm(delta)] = i
            if np.isfinite(when).all():
                break
        q = np.quantile(when, [0.1, 0.5, 0.9])
        out[k] = {"p10": q[0], "median": q[1], "p90": q[2], "never_within": int(np.isinf(when).sum())}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=lambda p: Path(p).absolute(), default=ROOT / "runs" / "bench-audit")
    ap.add_argument("--name", default="switch", help="this run's directory under OUT/PROBE")
    ap.add_argument("--reasoner", default="toy", choices=sorted(REASONERS),
                    help="toy: calibrate a bundle per --probe here; long: its shipped bundle")
    ap.add_argument("--probe", default="static", choices=["static", "ttt-noqk", "ttt-qk"],
                    help="the toy bundle's probe")
    ap.add_argument("--n-cal", type=int, default=1200, help="in-distribution calibration prompts")
    ap.add_argument("--n-in", type=int, default=100, help="in-distribution requests first")
    ap.add_argument("--n-shift", type=int, default=200, help="then shifted requests")
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--on-alarm", default=str(OnAlarm.REPORT), choices=ON_ALARM)
    ap.add_argument("--window", type=int, default=200, help="--orca-recalibrate-window")
    ap.add_argument("--delta", type=float, default=0.1)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=31, help="calibration prompts' seed")
    ap.add_argument("--stream-seed", type=int, default=33, help="the stream's prompts' seed")
    ap.add_argument("--delays", nargs=2, type=Path, metavar=("CLEAN", "SWITCH"),
                    help="serve nothing: alarm delays after K clean audits, from the measured "
                    "losses of two runs' result.json (in-distribution audits of CLEAN, shifted "
                    "audits of SWITCH)")
    ap.add_argument("--restart-every", type=int, default=RESTART_EVERY,
                    help="--delays: the alarm's restart period (0: one whole-history sequence, "
                    "the alarm before restarts)")
    ap.add_argument("--restart-span", type=int, default=RESTART_SPAN,
                    help="--delays: member j lives span * 2^v(j) restarts (dyadic ages)")
    a = ap.parse_args()
    if a.delays:
        clean, switch = (json.loads(f.read_text()) for f in a.delays)
        losses = [[r["loss_bundle"] for r in run["audits"] if r["family"] == fam]
                  for run, fam in ((clean, "in-dist"), (switch, "shifted"))]
        res = {"clean": str(a.delays[0]), "switch": str(a.delays[1]), "delta": a.delta,
               "clean_risk": float(np.mean(losses[0])), "shifted_risk": float(np.mean(losses[1])),
               "delays": alarm_delays(losses[0], losses[1], [0, 10, 30, 100, 140, 300, 975, len(losses[0])],
                                      a.delta, epsilon=0.05, every=a.restart_every,
                                      span=a.restart_span)}
        res.update(restart_every=a.restart_every, restart_span=a.restart_span)
        (a.out / f"delays-{a.delta:g}-w{a.restart_every}-s{a.restart_span}.json").write_text(
            json.dumps(res, indent=1))
        print(json.dumps(res, indent=1))
        return
    reasoner = REASONERS[a.reasoner]
    probe = a.probe if a.reasoner == "toy" else "shipped"
    if a.reasoner == "toy":
        bundle, out = calibrate(a.out, a.probe, a.n_cal, 300, a.seed), a.out / a.probe / a.name
    else:
        bundle, out = reasoner.bundle, a.out / a.reasoner / a.name
    prompts = stream_prompts(out, reasoner, a.n_in, a.n_shift, a.stream_seed)
    load = {"nproc": os.cpu_count(), "loadavg_before": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    srv = serve(bundle, out, a.rate, on_alarm=a.on_alarm, window=a.window, reasoner=reasoner)
    try:
        res = stream(srv, prompts, a.concurrency, a.delta, reasoner)
    finally:
        srv.stop()
    load["loadavg_after"] = os.getloadavg()
    rep = replay(out / "audits", bundle, by_question(prompts), a.delta)
    rows = rep.pop("audits")
    bundle_lam = next(r["lambda"] for r in rep["report"]["deltas"]
                      if abs(r["delta"] - a.delta) < 1e-9)
    by_family = {f: {"served": summarize([r for r in rows if r["family"] == f], "served"),
                     "bundle": summarize([r for r in rows if r["family"] == f], "bundle")}
                 for f in ("in-dist", "shifted")}
    shifted_rank = [i for i, r in enumerate(rows) if r["family"] == "shifted"]
    offline = bundle.parent / "evaluation.json"  # the job's (a shipped bundle has none beside it)
    summary = {
        "reasoner": a.reasoner, "probe": probe, "rate": a.rate, "on_alarm": a.on_alarm,
        "delta": a.delta,
        "n_in": a.n_in, "n_shift": a.n_shift, "concurrency": a.concurrency, **load,
        "bundle_lambda": bundle_lam,
        "offline": json.loads(offline.read_text()) if offline.exists() else None,
        "first_alarm_audit": {r["delta"]: r["first_alarm_at"] for r in rep["report"]["deltas"]},
        "first_shifted_audit": shifted_rank[0] + 1 if shifted_rank else None,
        "first_alarm_poll": res["first_alarm_poll"],
        "final": {r["delta"]: {k: r[k] for k in ("n", "risk", "lower", "upper", "alarm")}
                  for r in rep["report"]["deltas"]},
        "counts": {k: res["final"].get(k) for k in ("picked", "labelled", "dropped", "failed",
                                                    "aborted", "length", "unsolvable",
                                                    "unaligned")},
        "drift": rep["report"].get("drift"), "by_family": by_family,
        "stream_s": res["stream_s"], "tokens_per_s": res["tokens_per_s"]}
    if a.on_alarm == OnAlarm.RECALIBRATE:
        summary["recalibrate"] = recalibration_figures(rows, a.delta)
    (out / "result.json").write_text(json.dumps({**summary, "audits": rows,
                                                 "timeline": res["timeline"]}, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "offline"}, indent=1))


if __name__ == "__main__":
    main()
