"""The fleet's audit journal: what an event costs on Redis against the file journal, and what one
shared sequence buys a fleet over separate ones.

    python benchmarks/bench_audit_store.py                # append / read latency per event
    python benchmarks/bench_audit_store.py --fleet        # 4 replicas: shared vs separate

Latency: the server's own journals (orca_serve/live_audit/journal.py, redis_journal.py), an
audit = its admission (not fsynced in the file) and its outcome (10 steps' scores and labels,
fsynced in the file), on a real redis-server on loopback (tests/redis_server.py), without
persistence and with `appendonly yes, appendfsync always` (the file journal's durability).
Fleet: the alarm of the server's configuration (RestartedAlarm, grid 501, epsilon 0.05, delta
0.1), one sequence fed every audit of the fleet (what the shared journal folds: the replicas'
states equal it after every audit, tests/test_audit_fleet.py) against 4 sequences each fed every
fourth audit (replicas that audit alone). Prints markdown rows for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from orca_serve.live_audit.journal import Journal, journal_path
from orca_serve.live_audit.redis_journal import RedisJournal
from orca_method.audit.sequence import RestartedAlarm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests package's helpers
from tests.redis_server import RedisServer

CHECKSUM = "f" * 64
EPSILON, DELTA, REPLICAS = 0.05, 0.1, 4


def _time_journal(journal, audits: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {"admission": [], "outcome": [], "read (nothing new)": []}
    for i in range(audits):
        t0 = time.perf_counter()
        journal.append({"a": journal.owner}, durable=False)
        t1 = time.perf_counter()
        journal.append({"r": i + 1, "o": "risk", "s": rng.random(10).tolist(),
                        "l": [0] * 4 + [1] * 6})
        t2 = time.perf_counter()
        journal.read()
        t3 = time.perf_counter()
        out["admission"].append(t1 - t0)
        out["outcome"].append(t2 - t1)
        out["read (nothing new)"].append(t3 - t2)
    journal.close()
    return {k: np.asarray(v) * 1e6 for k, v in out.items()}


def latency(audits: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        runs = {"file journal (outcome fsynced)": lambda: Journal(
            journal_path(root / "file", CHECKSUM), CHECKSUM)}
        (root / "plain").mkdir()
        (root / "aof").mkdir()
        servers = {"Redis, no persistence": RedisServer(root / "plain"),
                   "Redis, appendonly + appendfsync always": RedisServer(
                       root / "aof", "--appendonly", "yes", "--appendfsync", "always")}
        for name, server in servers.items():
            runs[name] = lambda s=server: RedisJournal(s.url, CHECKSUM)
        try:
            print("| journal | event | median us | p99 us |\n| --- | --- | --- | --- |")
            for name, make in runs.items():
                for event, us in _time_journal(make(), audits).items():
                    print(f"| {name} | {event} | {np.median(us):.0f} | "
                          f"{np.percentile(us, 99):.0f} |")
        finally:
            for s in servers.values():
                s.stop()


def _feed(fams: list[RestartedAlarm], x: np.ndarray, i: int) -> np.ndarray:
    """Audit i of the fleet: to the one shared sequence, or to replica i % 4's own."""
    fam = fams[0] if len(fams) == 1 else fams[i % len(fams)]
    fam.update(x)
    return np.stack([f.alarm(DELTA) for f in fams])  # [sequences, streams]


def fleet(streams: int, audits: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    print(f"| 4 replicas, {streams} streams, seed {seed} | false alarms: some replica ever "
          f"alarmed in {audits} audits at risk = delta | shift 0.05 -> 0.25 after 1,000: "
          "audits until the first replica falls back, median [p90] | until all do |")
    print("| --- | --- | --- | --- |")
    for name, n_seq in (("one shared sequence (--orca-audit-store)", 1),
                        ("each replica its own (before)", REPLICAS)):
        fams = [RestartedAlarm(EPSILON, shape=(streams,)) for _ in range(n_seq)]
        ever = np.zeros(streams, bool)
        for i in range(audits):
            ever |= _feed(fams, (rng.random(streams) < DELTA).astype(float), i).any(axis=0)
        fams = [RestartedAlarm(EPSILON, shape=(streams,)) for _ in range(n_seq)]
        for i in range(1000):
            _feed(fams, (rng.random(streams) < 0.05).astype(float), i)
        first = np.full(streams, np.inf)
        every = np.full((n_seq, streams), np.inf)
        for i in range(1, 3001):
            alarms = _feed(fams, (rng.random(streams) < 0.25).astype(float), 1000 + i - 1)
            first[np.isinf(first) & alarms.any(axis=0)] = i
            every[np.isinf(every) & alarms] = i
            if np.isfinite(every).all():
                break
        last = every.max(axis=0)
        print(f"| {name} | {ever.mean():.1%} | {np.median(first):.0f} "
              f"[{np.percentile(first, 90):.0f}] | {np.median(last):.0f} "
              f"[{np.percentile(last, 90):.0f}] |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fleet", action="store_true", help="4 replicas: shared vs separate")
    p.add_argument("--audits", type=int, default=2000)
    p.add_argument("--streams", type=int, default=400)
    p.add_argument("--seed", type=int, default=81)
    a = p.parse_args()
    if a.fleet:
        fleet(a.streams, a.audits, a.seed)
    else:
        latency(a.audits)


if __name__ == "__main__":
    main()
