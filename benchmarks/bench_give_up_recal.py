"""The give-up threshold recalibrated live from consistency-labelled audits, replayed on a
recorded shifted family (issue 34 item 4; docs/AUDIT.md, "The give-up risk").

The traces are recorded once in full (`bench_samples.py collect --family shifted --k 1`, the
job's collector: every step's answer probed, temperature 0.7, prompts no calibration saw) and
scored as the server scores them (`bench_replay_shift.replay_family`: the bundle's stop and
give-up probes replayed on the recorded step embeddings). Per random order of the family, the
first `--stream` requests are audited (every one, `--orca-on-alarm recalibrate`, window
`--window`) through the server's `LiveAudit`, with their consistency labels, as the labeller
would give them; then the thresholds the guards serve are measured on the other requests of the
family (the traffic after): per give-up delta the give-up rate, the give-up error under
consistency labels (giving up changed the answer from the final one: what a recalibrated mu is
certified for), the give-up error under the reference labels (gave up with a right answer
ahead, `guess`: the issue's figure), and the accuracy of two-sided against one-sided ORCA at
the lambda the stop guard serves at `--delta`, without the shift gate (what the give-up side
does where the gate lets requests through); beside them, the bundle's mu* on the same requests.

    python benchmarks/bench_give_up_recal.py --reasoner toy --family shifted
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_replay_shift import arm_figures, rate, replay_family, served_ends  # noqa: E402
from bench_samples import run_dir  # noqa: E402

from orca_method.bundle import load_bundle  # noqa: E402
from orca_method.give_up import consistency_give_up_losses  # noqa: E402
from orca_method.outcomes import Ended  # noqa: E402
from orca_method.trajectories import TrajectorySet  # noqa: E402
from orca_serve.live_audit.live import LiveAudit  # noqa: E402
from orca_serve.live_audit.options import AuditConfig  # noqa: E402

DEMO = {"toy": ROOT / "orca_serve" / "demo" / "bundle.json",
        "long": ROOT / "orca_serve" / "demo" / "long" / "bundle.json"}


def measure(bundle, rep, cons: list[np.ndarray], idx: np.ndarray, lam: float,
            mu: float) -> dict[str, Any]:
    """One (lambda, mu) pair on the requests `idx`: two-sided figures, the one-sided accuracy
    at the same lambda, and the give-up error under consistency labels."""
    sub = rep.subset(list(idx))
    none = np.zeros(len(idx), dtype=bool)
    steps = bundle.load_gate().steps
    policy, excl = bundle.give_up.policy, bundle.ltt.excluded_never_correct
    end, ended = served_ends(sub.stop, sub.give_up, lam, mu, none, steps)
    two = arm_figures(sub, end, ended, none, policy, excl)
    one = arm_figures(sub, *served_ends(sub.stop, sub.give_up, lam, None, none, steps), none,
                      policy, excl)
    gave = np.array([h == Ended.GAVE_UP for h in ended])
    changed = consistency_give_up_losses(np.asarray(end)[None], [cons[i] for i in idx],
                                         policy)[0].astype(bool) & gave
    return {"mu": None if not np.isfinite(mu) else mu, "gave_up": two["gave_up"],
            "give_up_error_consistency": rate(list(changed)),
            "give_up_error_reference": two["give_up_error"],
            "accuracy_two_sided": two["accuracy"], "accuracy_one_sided": one["accuracy"],
            "tokens_two_sided": two["tokens"], "tokens_one_sided": one["tokens"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reasoner", choices=sorted(DEMO), default="toy")
    ap.add_argument("--family", default="shifted")
    ap.add_argument("--bundle", default=None, help="default: the reasoner's shipped bundle")
    ap.add_argument("--stream", type=int, default=300, help="audited requests per order")
    ap.add_argument("--window", type=int, default=150)
    ap.add_argument("--delta", type=float, default=0.1, help="the stop side's delta")
    ap.add_argument("--orders", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    bundle = load_bundle(a.bundle or DEMO[a.reasoner])
    ts = TrajectorySet.open(run_dir(a.reasoner, 1, a.family) / "trajectories")
    rep = replay_family(bundle, ts)
    cons = [ts.raw_labels(i, "consistent") for i in range(len(ts))]
    rng = np.random.default_rng(a.seed)
    rows = []
    for o in range(a.orders):
        perm = rng.permutation(len(ts))
        stream, held = perm[:a.stream], perm[a.stream:]
        audit = LiveAudit(bundle, AuditConfig(rate=1.0, on_alarm="recalibrate",
                                              window=a.window))
        for i in stream:
            audit.observe(list(rep.stop[i]), [int(x) for x in cons[i]],
                          give_up=list(rep.give_up[i]))
        lam = audit.state.guard(a.delta).lam
        for d, g in audit.state.give_up_guards.items():
            row = {"order": o, "give_up_delta": d, "stream": len(stream), "held_out": len(held),
                   "lambda": None if not np.isfinite(lam) else lam, "mu_source": str(g.source),
                   "recalibrations": g.recalibrations,
                   "served": measure(bundle, rep, cons, held, lam, g.mu),
                   "bundle": measure(bundle, rep, cons, held, lam, bundle.mu(d))}
            rows.append(row)
            s, b = row["served"], row["bundle"]
            print(f"order {o} delta_2 {d}: mu {s['mu']} ({row['mu_source']}) gave up "
                  f"{s['gave_up']:.3f}, errors cons {s['give_up_error_consistency']['rate']:.3f} "
                  f"ref {s['give_up_error_reference']['rate']:.3f}, acc two/one "
                  f"{s['accuracy_two_sided']:.3f}/{s['accuracy_one_sided']:.3f} | bundle mu* "
                  f"{b['mu']}: gave up {b['gave_up']:.3f}, errors cons "
                  f"{b['give_up_error_consistency']['rate']:.3f} ref "
                  f"{b['give_up_error_reference']['rate']:.3f}, acc two "
                  f"{b['accuracy_two_sided']:.3f}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
