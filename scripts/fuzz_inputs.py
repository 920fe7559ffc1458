"""Fuzzing campaign on the input readers: thousands of inputs per target, one table.

    python scripts/fuzz_inputs.py [--examples 3000] [--atheris-runs 20000] [--seed S]

Targets and oracles are those of the bounded tests (tests/fuzzing.py): the bundle loader on bytes
and on mutated valid bundles, the segmenter, the trajectory directory reader and the research
pickle reader. Unlike the tests, a failing input does not stop a target: every failure is
recorded under a signature (the oracle's reason, or the exception type and the deepest frame of
project code) and the run goes on, so the table counts distinct failures. With atheris installed
(`pip install atheris`; not in the dev extra) the bundle loader is also fuzzed coverage-guided on
raw bytes, seeded with the valid bundles (in a subprocess: libFuzzer ends its process when done).
Run it under a memory limit (`ulimit -v 8000000`): a loader that allocates what an input declares
then fails with an error instead of calling the kernel's OOM killer.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests package's helpers


def signature(e: BaseException) -> str:
    """What makes two failures the same bug."""
    if isinstance(e, AssertionError) and str(e):
        head = str(e).splitlines()[0]
        return re.sub(r"(/[^\s:]+)+", "<path>", head.split(": bundle")[0])[:100]
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if any(f"/{d}/" in f.filename for d in ("orca_serve", "orca_calibrate", "orca_demo"))]
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{type(e).__name__}{where}"


def run_target(name: str, strategy, check, examples: int, seed: int | None) -> dict:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    failures: Counter[str] = Counter()
    examples_of: dict[str, str] = {}
    tried = 0

    @settings(max_examples=examples, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much, HealthCheck.large_base_example])
    @given(strategy)
    def probe(case) -> None:
        nonlocal tried
        tried += 1
        try:
            check(*case) if isinstance(case, tuple) else check(case)
        except Exception as e:  # noqa: BLE001 - every escape is a finding to record
            sig = signature(e)
            failures[sig] += 1
            examples_of.setdefault(sig, repr(case)[:300])

    if seed is not None:
        probe = hseed(seed)(probe)
    t0 = time.perf_counter()
    probe()
    return {"target": name, "tool": "hypothesis", "tried": tried, "failures": dict(failures),
            "examples": examples_of, "seconds": round(time.perf_counter() - t0, 1)}


def atheris_worker(runs: int, out: str) -> None:
    """libFuzzer loop on raw bytes through load_bundle; findings go to `out`, never a crash."""
    import atheris
    import numpy  # noqa: F401 - the libraries load uninstrumented: only project code is traced
    import pydantic  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401

    with atheris.instrument_imports(include=["orca_serve", "orca_calibrate", "orca_demo"]):
        from tests import fuzzing

    found: Counter[str] = Counter()

    def one_input(data: bytes) -> None:
        try:
            fuzzing.check_bundle_bytes(data)
        except Exception as e:  # noqa: BLE001
            found[signature(e)] += 1
            Path(out).write_text(json.dumps(found))

    seeds = Path(out).parent / "corpus"  # the caller's directory: libFuzzer's exit runs no cleanup
    seeds.mkdir()
    for i, text in enumerate(fuzzing.valid_bundles()):
        (seeds / f"valid-{i}").write_text(text)
    Path(out).write_text(json.dumps(found))
    atheris.Setup([sys.argv[0], f"-runs={runs}", "-max_len=8192", "-seed=1", str(seeds)],
                  one_input)
    atheris.Fuzz()


def run_atheris(runs: int) -> dict | None:
    try:
        import atheris  # noqa: F401
    except ImportError:
        return None
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="orca-fuzz-") as tmp:  # its findings and corpus
        out = Path(tmp) / "found.json"
        r = subprocess.run([sys.executable, __file__, "--atheris-worker", str(runs), str(out)],
                           capture_output=True, text=True, check=False)
        found = json.loads(out.read_text()) if out.exists() else {"worker failed": 1}
    done = re.findall(r"Done (\d+) runs", r.stderr)
    return {"target": "bundle loader (bytes, coverage-guided)", "tool": "atheris",
            "tried": int(done[-1]) if done else None, "failures": found,
            "examples": {}, "seconds": round(time.perf_counter() - t0, 1),
            "rc": r.returncode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=3000, help="inputs per hypothesis target")
    ap.add_argument("--atheris-runs", type=int, default=20000, help="0: skip atheris")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--atheris-worker", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.atheris_worker:
        atheris_worker(int(a.atheris_worker[0]), a.atheris_worker[1])
        return
    from tests import fuzzing

    targets = [
        ("bundle loader (bytes)", fuzzing.bundle_bytes(), fuzzing.check_bundle_bytes),
        ("bundle loader (mutated bundles)", fuzzing.mutated_bundle(), fuzzing.check_bundle_bytes),
        ("segmenter", fuzzing.segmenter_case(), fuzzing.check_segmenter),
        ("trajectory directory reader", fuzzing.corrupted_directory(), fuzzing.check_directory),
        ("research pickle reader + importer", fuzzing.corrupted_pickle(), fuzzing.check_pickle),
    ]
    results = []
    for name, strategy, check in targets:
        results.append(run_target(name, strategy, check, a.examples, a.seed))
        print(f"{name}: {results[-1]['tried']} inputs, {len(results[-1]['failures'])} distinct "
              f"failures, {results[-1]['seconds']} s", file=sys.stderr, flush=True)
    if a.atheris_runs:
        res = run_atheris(a.atheris_runs)
        if res is not None:
            results.append(res)
    load = os.getloadavg()
    print(f"# fuzz_inputs {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
          f"{platform.node()}, nproc {os.cpu_count()}, load {load[0]:.1f}")
    print("| target | tool | inputs tried | distinct failures | seconds |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['target']} | {r['tool']} | {r['tried']} | {len(r['failures'])} | "
              f"{r['seconds']} |")
    for r in results:
        for sig, n in sorted(r["failures"].items()):
            print(f"- {r['target']}: {sig} ({n}x) e.g. {r['examples'].get(sig, '')[:200]}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
