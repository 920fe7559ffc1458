"""The live audit's statistics: cost per request, and the guarantee's figures in the server's
production configuration (grid 501, a member every 50 audits kept at dyadic ages, epsilon 0.05).

    python benchmarks/bench_audit_stats.py                 # cost per request (markdown rows)
    python benchmarks/bench_audit_stats.py --false-alarms  # hardest null, grid 501
    python benchmarks/bench_audit_stats.py --delays        # 3 shift sizes after 1k / 10k clean
    python benchmarks/bench_audit_stats.py --recalibrate 400  # P(bad lambda ever served)
    python benchmarks/bench_audit_stats.py --censored      # cut audits: coverage, power, width
    python benchmarks/bench_audit_stats.py --joint         # four deltas: per-delta vs joint
    python benchmarks/bench_audit_stats.py --restarts      # restarts every 250 audits
    python benchmarks/bench_audit_stats.py --drift 10      # recalibrate under a gradual drift
    python benchmarks/bench_audit_stats.py --cut           # cut audits by rule: power, coverage
    python benchmarks/bench_audit_stats.py --clearing 20   # fallback with half the audits cut
    python benchmarks/bench_audit_stats.py --sequential 400  # the drift tests' false alarms, delays

The simulations are tests/audit_simulation.py's (the tests assert the same quantities on
smaller runs). Every mode prints markdown rows for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests package's helpers

from orca_method.audit.drift import DriftMonitor, build_reference
from orca_method.audit.sequence import ConfidenceSequence, RestartedAlarm
from tests.audit_simulation import (
    CUT_RULES,
    EPSILON,
    RISK_015_BIAS,
    bad_lambda_served,
    censored_streams,
    cut_streams,
    cut_truth,
    drift_alarms,
    drift_stream,
    fallback_clearing,
    give_up_recalibration,
    hardest_null,
    joint_null,
    restart_null,
    restarted_stream,
    recalibrate_stream,
    shift_delays,
)

N = 5000


def per_call_us(fn, args) -> float:
    start = time.perf_counter()
    for a in args:
        fn(a)
    return (time.perf_counter() - start) / len(args) * 1e6


def paths(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    out = []
    for _ in range(n):
        z = rng.normal(-1, 1) + np.cumsum(rng.normal(0.08, 0.3, int(rng.integers(20, 200))))
        out.append(1 / (1 + np.exp(-z)))
    return out


def cost() -> None:
    rng = np.random.default_rng(0)
    cs = ConfidenceSequence(alpha=0.05)
    losses = (rng.random(N) < 0.1).astype(float).tolist()
    cs_us = per_call_us(cs.update, losses)
    state = cs.to_dict()
    start = time.perf_counter()
    ConfidenceSequence.from_dict(state)
    restore_ms = (time.perf_counter() - start) * 1e3
    alarm = RestartedAlarm(EPSILON)
    for x in (rng.random(10_000) < 0.1).astype(float):
        alarm.update(float(x))
    alarm_us = per_call_us(alarm.update, losses[:1000])
    mon = DriftMonitor(build_reference(paths(rng, 2000), 10, [0.8, 0.9]))
    drift_us = per_call_us(mon.observe, paths(rng, N))
    print("| what | cost |\n| --- | --- |")
    print(f"| ConfidenceSequence.update (grid 501), per audit and delta | {cs_us:.1f} us |")
    print(f"| RestartedAlarm.update after 10,000 audits ({len(alarm.members)} members), per "
          f"audit and delta | {alarm_us:.0f} us |")
    print(f"| ConfidenceSequence state restore (from_dict) | {restore_ms:.2f} ms |")
    print(f"| DriftMonitor.observe, mean over {N} requests incl. a KS test every 500 | "
          f"{drift_us:.1f} us ({mon.tests} tests) |")


def false_alarms(streams: int, audits: int) -> None:
    share = hardest_null(EPSILON, streams=streams, audits=audits, seed=21)
    se = np.sqrt(share * (1 - share) / streams)
    print(f"| hardest null (risk = delta = 0.1), {streams} streams x {audits} audits, grid 501 "
          f"| {share:.2%} +- {se:.2%} (bound epsilon/2 = {EPSILON / 2:.1%}) |")


def delays(streams: int) -> None:
    print("| clean audits (risk 0.05) | shift to | alarm: median [p10, p90] | not within 3,000 "
          "| whole history alone: median | not within 3,000 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for clean in (1000, 10_000):
        res = shift_delays(EPSILON, clean, 0.05, [0.5, 0.25, 0.18], streams=streams,
                           seed=clean)
        for risk, (fam, whole) in res.items():
            q = [_audits(x) for x in np.quantile(fam, [0.5, 0.1, 0.9])]
            print(f"| {clean:,} | {risk:g} | {q[0]} [{q[1]}, {q[2]}] | "
                  f"{np.isinf(fam).mean():.1%} | {_audits(np.median(whole))} | "
                  f"{np.isinf(whole).mean():.1%} |", flush=True)


def _audits(x: float) -> str:
    return "> 3,000" if np.isinf(x) else f"{x:,.0f}"


def recalibrate(streams: int) -> None:
    runs = [recalibrate_stream(seed) for seed in range(streams)]
    bad = bad_lambda_served(runs)
    se = np.sqrt(bad.mean() * (1 - bad.mean()) / streams)
    alarm = np.array([r.alarm_at for r in runs], dtype=float)
    print(f"| recalibrate, {streams} streams (50 clean, 600 shifted audits, window 200) | "
          f"P(bad lambda ever served) {bad.mean():.1%} +- {se:.1%} (epsilon {EPSILON:.0%}); "
          f"alarm after a median {np.median(alarm):.0f} shifted audits; recalibrations per "
          f"stream {np.mean([r.recalibrations for r in runs]):.2f} |")


def censored(streams: int, audits: int) -> None:
    print("| true risk | cut share | interval ever missed the risk | alarm (delta 0.1) within "
          f"{audits:,} | median audit of the alarm | final width [lower, upper] | risk range "
          "width |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for risk in (0.1, 0.15):
        for share in (0.0, 0.05, 0.1, 0.15):
            r = censored_streams(risk, share=share, ratio=3, streams=streams, audits=audits,
                                 seed=51)
            fired = np.isfinite(r["first_alarm"])
            med = f"{np.median(r['first_alarm'][fired]):,.0f}" if fired.any() else "-"
            print(f"| {risk:g} | {share:.0%} | {r['missed'].mean():.1%} | {fired.mean():.1%} | "
                  f"{med} | {np.mean(r['upper'] - r['lower']):.3f} | "
                  f"{np.mean(r['range_high'] - r['range_low']):.3f} |", flush=True)


def joint(streams: int, audits: int) -> None:
    print("| split | any delta ever alarmed | per delta (0.05, 0.1, 0.15, 0.2) |")
    print("| --- | --- | --- |")
    for split in ("per-delta", "joint"):
        share, per = joint_null(split, streams=streams, audits=audits, seed=61)
        se = np.sqrt(share * (1 - share) / streams)
        print(f"| {split} | {share:.2%} +- {se:.2%} | "
              f"{', '.join(f'{x:.2%}' for x in per)} |", flush=True)


def restarts(streams: int, audits: int, exact: int) -> None:
    whole, fresh = restart_null(streams, audits, 250, seed=71)
    print(f"| hardest null (risk = delta = 0.1), {streams} streams x {audits:,} audits, a "
          f"restart every 250 | resumed from the journal (one sequence): {whole:.2%}; "
          f"every start empty (before): {fresh:.2%} | bound epsilon/2 = {EPSILON / 2:.1%} |")
    same = 0
    served = {"whole": [], "resumed": [], "empty": []}
    for seed in range(exact):  # the server's LiveAudit, a journal in a temporary directory
        risks = [0.1] * audits if seed % 2 == 0 else [0.05] * 1000 + [0.3] * 2000
        with tempfile.TemporaryDirectory() as d:
            runs = {"whole": restarted_stream(seed, risks=risks, restart_every=None),
                    "resumed": restarted_stream(seed, risks=risks, restart_every=250,
                                                journal_dir=d),
                    "empty": restarted_stream(seed, risks=risks, restart_every=250)}
        same += runs["resumed"].trace == runs["whole"].trace
        if seed % 2:
            for k, r in runs.items():
                served[k].append(r.bundle_lambda_served)
    print(f"| LiveAudit with its journal, restarted every 250 audits, {exact} streams of "
          f"{audits:,} (half at the hardest null, half 1,000 clean then 2,000 at risk 0.3; "
          f"fallback) | bounds, alarm and served lambda after every audit equal to one process "
          f"that never restarted in {same} of {exact} streams | shifted audits served the "
          f"alarmed lambda*: one process {np.mean(served['whole']):.0f}, resumed "
          f"{np.mean(served['resumed']):.0f}, every start empty {np.mean(served['empty']):.0f} "
          f"(means over {len(served['whole'])} streams) |", flush=True)


def drift(streams: int) -> None:
    tests = {"none": {"distrust": False, "recent_half": False},
             "window test (before)": {"sequential": False, "recent_half": False},
             "window and sequential tests": {"recent_half": False},
             "window and sequential tests, lambda of the window and its recent half (now)": {}}
    runs = {k: [drift_stream(seed, **kw) for seed in range(streams)] for k, kw in tests.items()}
    for k, rs in runs.items():
        bad = np.array([r["bad"] for r in rs])
        print(f"| gradual drift (bias 0 -> 3 over 2,000 audits after 50 clean; recalibrate, "
              f"window 200), {streams} streams, recalibrated lambda's drift tests: "
              f"{k} | audits served a recalibrated lambda bad for "
              f"the current traffic: mean {bad.mean():.0f} (streams with any: "
              f"{(bad > 0).sum()} of {streams}) | fallback audits: mean "
              f"{np.mean([r['fallback'] for r in rs]):.0f}; recalibrations: mean "
              f"{np.mean([r['recalibrations'] for r in rs]):.1f} |", flush=True)


def cut(streams: int, audits: int) -> None:
    """Issue 34 item 4: trajectories whose loss-dependent cuts enter by each rule (CUT_RULES)."""
    print("| true risk (certified) | cut share | rule | alarm (delta 0.1) within "
          f"{audits:,} | median audit of the alarm | interval ever missed the risk | ... the "
          "certified risk | censored share | final upper |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for bias in (RISK_015_BIAS, 0.0):
        for share in (0.1, 0.5):
            risk, certified = cut_truth(bias, share, 3.0)
            for rule in CUT_RULES:
                r = cut_streams(bias, share=share, ratio=3, rule=rule, streams=streams,
                                audits=audits, seed=81)
                fired = np.isfinite(r["first_alarm"])
                se = np.sqrt(fired.mean() * (1 - fired.mean()) / streams)
                med = f"{np.median(r['first_alarm'][fired]):,.0f}" if fired.any() else "-"
                print(f"| {risk:.3f} ({certified:.3f}) | {share:.0%} | {rule} | "
                      f"{fired.mean():.1%} +- {se:.1%} | {med} | {r['missed_risk'].mean():.1%} | "
                      f"{r['missed_certified'].mean():.1%} | {r['censored'].mean():.3f} | "
                      f"{r['upper'].mean():.3f} |", flush=True)


def clearing(streams: int) -> None:
    """Issue 34 item 4: does a fallback clear on clean traffic with half the audits cut?"""
    for share in (0.5, 0.0):
        for rule in CUT_RULES if share else CUT_RULES[-1:]:
            runs = [fallback_clearing(seed, rule=rule, share=share, clean=12_000)
                    for seed in range(streams)]
            after = np.array([r["cleared_after"] for r in runs])
            done = np.isfinite(after)
            print(f"| fallback: 150 shifted audits, then 12,000 clean, {share:.0%} cut | {rule} | "
                  f"cleared in {done.sum()} of {streams} streams, median "
                  f"{'never' if np.isinf(np.median(after)) else f'{np.median(after):,.0f}'} clean audits | final upper: mean "
                  f"{np.mean([r['upper'] for r in runs]):.3f} |", flush=True)


def sequential(streams: int) -> None:
    """Issue 34 item 4: requests until the bundle's drift tests alarm, sequential vs window."""
    clean = 200
    print("| stream (one request each) | test | alarmed | requests from the shift to the alarm: "
          "median [10 %, 90 %] |")
    print("| --- | --- | --- | --- |")
    null = drift_alarms([0.0] * 2000, streams=streams, seed=91)
    for name, at in zip(("sequential", "window (500)"), null):
        share = np.isfinite(at).mean()
        print(f"| unchanged, 2,000 requests | {name} | {share:.1%} +- "
              f"{np.sqrt(share * (1 - share) / streams):.1%} (false; level 5 %) | - |", flush=True)
    for label, after in (("abrupt, bias 1.5", [1.5] * 2000), ("abrupt, bias 0.5", [0.5] * 2000),
                         ("gradual, bias 0 -> 3 over 2,000", list(np.linspace(0, 3, 2000)))):
        res = drift_alarms([0.0] * clean + after, streams=streams, seed=92)
        for name, at in zip(("sequential", "window (500)"), res):
            d = at - clean
            fired = np.isfinite(d)
            q = np.quantile(d, [0.5, 0.1, 0.9])
            shown = ["never" if np.isinf(x) else f"{x:,.0f}" for x in q]
            early = (fired & (d <= 0)).mean()
            print(f"| {clean} unchanged, then {label} | {name} | {fired.mean():.1%} (before the "
                  f"shift: {early:.1%}) | {shown[0]} [{shown[1]}, {shown[2]}] |", flush=True)


def give_up_recalibrate(streams: int) -> None:
    """The give-up threshold recalibrated from consistency labels on a shifted family."""
    out = give_up_recalibration(streams, audits=400, window=150)
    print(f"| give-up recalibrate, {streams} streams (400 shifted audits, window 150) | "
          f"recalibrated {out['recalibrated']:.1%}, alarm after a median "
          f"{out['alarm_median']:.0f} audits; P(bad mu ever served) {out['bad']:.1%} "
          f"(epsilon_2 5%); bound missed {out['missed']:.1%}; served mu {out['served_mu']:.3f}: "
          f"risk {out['served_risk']:.3f}, gave up {out['served_rate']:.3f} (the bundle's mu*: "
          f"{out['bundle_risk']:.3f}, {out['bundle_rate']:.3f}) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--false-alarms", action="store_true")
    ap.add_argument("--delays", action="store_true")
    ap.add_argument("--recalibrate", type=int, metavar="STREAMS")
    ap.add_argument("--censored", action="store_true")
    ap.add_argument("--joint", action="store_true")
    ap.add_argument("--restarts", type=int, metavar="EXACT_STREAMS")
    ap.add_argument("--drift", type=int, metavar="STREAMS")
    ap.add_argument("--cut", action="store_true")
    ap.add_argument("--clearing", type=int, metavar="STREAMS")
    ap.add_argument("--sequential", type=int, metavar="STREAMS")
    ap.add_argument("--give-up-recalibrate", type=int, metavar="STREAMS")
    ap.add_argument("--streams", type=int, default=400,
                    help="--false-alarms, --delays, --censored, --joint")
    ap.add_argument("--audits", type=int, default=3000,
                    help="--false-alarms, --censored, --joint")
    a = ap.parse_args()
    if a.false_alarms:
        false_alarms(a.streams, a.audits)
    elif a.delays:
        delays(a.streams)
    elif a.recalibrate:
        recalibrate(a.recalibrate)
    elif a.censored:
        censored(a.streams, a.audits)
    elif a.joint:
        joint(a.streams, a.audits)
    elif a.restarts:
        restarts(a.streams, a.audits, a.restarts)
    elif a.drift:
        drift(a.drift)
    elif a.cut:
        cut(a.streams, a.audits)
    elif a.clearing:
        clearing(a.clearing)
    elif a.sequential:
        sequential(a.sequential)
    elif a.give_up_recalibrate:
        give_up_recalibrate(a.give_up_recalibrate)
    else:
        cost()


if __name__ == "__main__":
    main()
