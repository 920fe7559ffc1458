"""`make demo`, the README's first command: the embedded model and bundle, served for real.

Runs `python -m orca_serve.startup.demo` as a user would (it starts `orca-serve --demo`, asks through the
OpenAI client, stops the server) and checks what it prints: the shipped bundle stops the
shipped model's greedy trace early, the answer after the stop is still right, and the step counts
it prints are the paragraphs it printed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from orca_method.bundle import load_bundle
from orca_serve.startup.demo import paragraphs

DEMO = Path(__file__).parents[1] / "orca_serve" / "demo"


def test_demo_bundle_names_the_model_portably() -> None:
    """The bundle's model name shows in user-facing errors: no machine path in it."""
    name = load_bundle(DEMO / "bundle.json").model.name  # loads: the checksum is valid
    assert name and "/" not in name and "\\" not in name and not Path(name).is_absolute()


def section(out: str, title: str, part: str) -> str:
    text = out.split(f"=== {title}")[1]
    return text.split(f"--- {part} ---\n")[1].split("\n---")[0]


@pytest.mark.vllm
def test_demo_stops_early_and_still_answers() -> None:
    r = subprocess.run([sys.executable, "-m", "orca_serve.startup.demo"], capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert out.count("--- answer ---") == 2, out
    early = out.split("=== with ORCA early stopping ===")[1]
    assert "\\boxed{7}" in early.split("--- orca:")[0], early  # 7*x + 3 = 52
    m = re.search(r"stopped after reasoning step (\d+) of the (\d+) the full reasoning has "
                  r"\(delta=([\d.]+), lambda\*=([\d.]+)\); "
                  r"reasoning tokens (\d+) instead of (\d+): (\d+) saved", out)
    assert m, out
    step, total, _, _, used, full, saved = (float(g) for g in m.groups())
    assert 1 <= step < total and used < full and saved == full - used
    # the counts are of what was printed: paragraphs of the full and of the stopped reasoning
    assert total == paragraphs(section(out, "without early stopping", "reasoning"))
    assert step == paragraphs(section(out, "with ORCA early stopping", "reasoning"))
