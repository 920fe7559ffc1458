"""Long fuzzing run of orca-serve's HTTP surface (the test suite runs a bounded one).

    python scripts/fuzz_http.py [--examples 60] [--minutes 20] [--url URL] [--json OUT]

Starts `orca-serve --demo` (unless --url names a running server), fuzzes every client route of
its /openapi.json with schemathesis (`tests/http_fuzz.py`: schema-valid and schema-violating
inputs; findings are 5xx answers, requests past their timeout, and the server going away),
prints the distinct findings with a curl command each, and the row for the "Fuzzing" table of
`benchmarks/RESULTS.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests package's helpers

from tests.http_fuzz import fuzz
from tests.serving import Server, orca_serve_cmd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=60,
                    help="cases per operation and generation mode (positive, negative)")
    ap.add_argument("--minutes", type=float, default=20.0, help="stop starting operations after")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a request may take")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--url", help="fuzz this running server instead of starting the demo")
    ap.add_argument("--json", type=Path, help="write the report here")
    a = ap.parse_args()

    server = None
    url = a.url
    if url is None:
        log = Path(tempfile.mkdtemp(prefix="fuzz_http_")) / "demo.log"
        server = Server(orca_serve_cmd("--demo"), log,
                        ["--host", "127.0.0.1", "--enforce-eager", "--reasoning-parser",
                         "deepseek_r1", "--disable-uvicorn-access-log"]).wait()
        url = server.url
        print(f"orca-serve --demo at {url} (log {log})", flush=True)
    try:
        report = fuzz(url, examples=a.examples, timeout=a.timeout, seed_value=a.seed,
                      deadline_s=a.minutes * 60)
    finally:
        if server is not None:
            server.stop()
    print(f"{report.operations} operations ({len(report.unusable)} unusable: "
          f"{report.unusable}); {report.cases} cases in {report.seconds:.0f} s; statuses "
          f"{dict(sorted(report.by_status.items()))}; server crashed: {report.crashed}")
    for f in report.findings.values():
        print(f"- {f.key}\n    {f.example}")
    print(f"| HTTP surface of `orca-serve --demo` (all client routes of /openapi.json) | "
          f"schemathesis (positive + negative) | {report.cases} | {len(report.findings)} | |")
    if a.json:
        a.json.write_text(json.dumps({
            "operations": report.operations, "unusable": report.unusable,
            "cases": report.cases, "seconds": report.seconds, "crashed": report.crashed,
            "statuses": dict(report.by_status), "nproc": os.cpu_count(),
            "findings": [{"key": f.key, "example": f.example} for f in report.findings.values()],
        }, indent=1))


if __name__ == "__main__":
    main()
