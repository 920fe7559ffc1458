"""What labelling a live audit costs, at every step and selectively (docs/AUDIT.md, "What
labelling costs"), on recorded traces, through the server's classes.

A stream of requests drawn from recorded trajectories (their answers forced at every step stand
in for the engine's answer probes), a share `rate` of them audited; every audit goes through
`LiveAudit._process` and the server's `AuditLabeller` rounds twice, once with
`--orca-audit-label-steps every` and once `selective`, on two audits fed the same stream. The
scores are the bundle's probe replayed on the recorded step embeddings (what the server would
have computed). Prints per rate: audits, answer probes per audit and per served request for
both modes (and per audit the selective mode did not label in full: one no recalibration
window could take), and whether the guards' decisions (bounds, alarms, lambda served) were
equal after every audit.

    python benchmarks/bench_audit_labels.py --bundle runs/long/bundle.json \\
        --trajectories runs/long/trajectories --shifted runs/long/trajectories-shifted
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests package's helpers

from orca_method.bundle import load_bundle  # noqa: E402
from orca_method.procedure import replay  # noqa: E402
from orca_method.trajectories import TrajectorySet  # noqa: E402
from orca_serve.live_audit.live import LiveAudit, _Job  # noqa: E402
from orca_serve.live_audit.options import AuditConfig  # noqa: E402
from tests.audit_simulation import TableLabeller  # noqa: E402
from tests.servers import orca_result  # noqa: E402


def traces(path: str, bundle, split: str | None) -> list[dict]:
    """The trajectories of `path` (its `split` only, when given) as the audit would see them."""
    ts = TrajectorySet.open(path)
    idx = ts.split(split) if split else list(range(len(ts)))
    runs = replay(bundle.load_probe(), [ts.embeddings(i) for i in idx], window=bundle.window)
    out = []
    for i, (_, smooth) in zip(idx, runs):
        p = ts.problems[i]
        out.append({"scores": smooth.numpy().astype(float), "answers": list(p.step_answers),
                    "embeddings": np.asarray(ts.embeddings(i)),
                    "text": f"</think> \\boxed{{{p.final_answer}}}" if p.final_answer else "",
                    "reason": (p.extra or {}).get("finish_reason") or "stop"})
    return out


def _state(audit: LiveAudit) -> list:
    return [(g.cs.n, g.cs.lower, g.cs.upper, g.alarm, g.lam, g.source, g.recalibrations)
            for g in audit.state.guards.values()]


def stream(pool: list[dict], shifted: list[dict], bundle, *, rate: float, requests: int,
           shift_at: int | None, on_alarm: str, window: int, seed: int) -> dict:
    """One stream of `requests` (from `pool`, then from `shifted` after `shift_at`)."""
    rng = np.random.default_rng(seed)
    answers: dict[str, list[str]] = {}
    texts: dict[str, str] = {}
    audits, labellers = {}, {}
    for mode in ("every", "selective"):
        labellers[mode] = TableLabeller(answers, texts)
        audits[mode] = LiveAudit(bundle, AuditConfig(rate=rate, on_alarm=on_alarm, window=window,
                                                     label_steps=mode),
                                 labeller=labellers[mode])
    n_audits, equal, full, chosen = 0, True, 0, 0
    for r in range(requests):
        if rng.random() >= rate:
            continue
        src = shifted if shift_at is not None and r >= shift_at else pool
        t = src[int(rng.integers(len(src)))]
        key = f"a{r}"
        answers[key], texts[key] = t["answers"], t["text"]
        n = len(t["answers"])
        result = orca_result(policy="shadow", scores=[float(x) for x in t["scores"][:-1]],
                             step_tokens=[1] * n, step_token_ids=[[k] for k in range(n)],
                             prompt_token_ids=[100000], output_token_ids=list(range(n)),
                             step_embeddings=t["embeddings"])
        for mode, audit in audits.items():
            seq = audit.state.admit()
            before = labellers[mode].probes
            in_full = audit.state.label_needs(seq) is None
            asyncio.run(audit._process(_Job(key, {"prompt": "p"}, result, seq, t["reason"])))
            if mode == "selective":
                full += in_full
                if not in_full:
                    chosen += labellers[mode].probes - before
        n_audits += 1
        equal &= _state(audits["every"]) == _state(audits["selective"])
    probes = {m: lab.probes for m, lab in labellers.items()}
    return {"rate": rate, "requests": requests, "audits": n_audits, "labelled_in_full": full,
            "decisions_equal": bool(equal),
            "probes_per_audit_not_in_full": chosen / max(n_audits - full, 1),
            **{f"probes_per_audit_{m}": p / max(n_audits, 1) for m, p in probes.items()},
            **{f"probes_per_request_{m}": p / requests for m, p in probes.items()},
            "recalibrations": [g.recalibrations for g in audits["every"].state.guards.values()],
            "lambda_served": [g.lam for g in audits["every"].state.guards.values()]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--trajectories", required=True)
    ap.add_argument("--split", default="test", help="of --trajectories ('' for all)")
    ap.add_argument("--shifted", default=None, help="trajectories served after --shift-at")
    ap.add_argument("--shift-at", type=int, default=None)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.02, 0.1, 0.2])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--on-alarm", default="report")
    ap.add_argument("--window", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    bundle = load_bundle(a.bundle)
    pool = traces(a.trajectories, bundle, a.split or None)
    shifted = traces(a.shifted, bundle, None) if a.shifted else []
    rows = []
    for rate in a.rates:
        t0 = time.perf_counter()
        row = stream(pool, shifted, bundle, rate=rate, requests=a.requests,
                     shift_at=a.shift_at, on_alarm=a.on_alarm, window=a.window, seed=a.seed)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
