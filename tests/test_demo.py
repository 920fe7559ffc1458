"""`make demo`, the README's first command: the embedded model and bundle, served for real.

Runs `python -m orca_serve.demo` as a user would (it starts `orca-serve --demo`, asks through the
OpenAI client, stops the server) and checks what it prints: the shipped bundle stops the
shipped model's greedy trace early, and the answer after the stop is still right.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm


def test_demo_stops_early_and_still_answers() -> None:
    r = subprocess.run([sys.executable, "-m", "orca_serve.demo"], capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert out.count("--- answer ---") == 2, out
    early = out.split("=== with ORCA early stopping ===")[1]
    assert "\\boxed{7}" in early.split("--- orca:")[0], early  # 7*x + 3 = 52
    m = re.search(r"stopped at reasoning step (\d+) of (\d+) \(delta=([\d.]+), lambda\*=([\d.]+)\); "
                  r"reasoning tokens (\d+) instead of (\d+): (\d+) saved", out)
    assert m, out
    step, total, _, _, used, full, saved = (float(g) for g in m.groups())
    assert 1 <= step < total and used < full and saved == full - used
