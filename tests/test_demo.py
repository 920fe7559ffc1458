"""`make demo`, the README's first command: the embedded model and bundle, served for real.

Runs `python -m orca_serve.startup.demo` as a user would (it starts `orca-serve --demo`, asks through the
OpenAI client, stops the server) and checks what it prints: the shipped bundle stops the
shipped model's greedy trace early, the answer after the stop is still right, and the step counts
it prints are the paragraphs it printed. Beside it, what both demos sample a request at that sets
no sampling parameters: their calibration's.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orca_calibrate.collect import CollectSettings
from orca_calibrate.job import load_job
from orca_method.bundle import load_bundle
from orca_serve.startup.demo import paragraphs
from orca_serve.startup.preflight import DEMOS, demo_paths

ROOT = Path(__file__).parents[1]
DEMO = ROOT / "orca_serve" / "demo"
# The sampling parameters vLLM takes from a model's generation_config.json as the defaults of a
# request that sets none (`--generation-config auto`, its default; docs/RECIPES.md, "Sampling"),
# each with the value it uses when the file names none: SamplingParams' own, which the
# calibration's collector leaves to every parameter but temperature, top_p, top_k and min_p.
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
           "presence_penalty": 0.0, "frequency_penalty": 0.0}


def test_demo_bundle_names_the_model_portably() -> None:
    """The bundle's model name shows in user-facing errors: no machine path in it."""
    name = load_bundle(DEMO / "bundle.json").model.name  # loads: the checksum is valid
    assert name and "/" not in name and "\\" not in name and not Path(name).is_absolute()


@pytest.mark.parametrize("demo", sorted(DEMOS))
def test_a_request_without_sampling_parameters_is_sampled_as_the_calibration_was(demo) -> None:
    """A client that sends no temperature gets the model's generation_config.json's, as a real
    model advises its own (QwQ 0.6): for a demo, its calibration job's. Without one the demo
    sampled such requests at vLLM's 1.0, traffic unlike its calibration set (a soak's give-up
    alarm after ~229 audits)."""
    model, bundle = demo_paths(demo)
    job = load_job(ROOT / load_bundle(bundle).provenance["job"])
    collected = CollectSettings(**job["collect"])
    gen = json.loads((model / "generation_config.json").read_text())
    assert {k: gen.get(k, v) for k, v in NEUTRAL.items()} == {
        **NEUTRAL, "temperature": collected.temperature, "top_p": collected.top_p,
        "top_k": collected.top_k, "min_p": collected.min_p}
    assert gen.get("max_new_tokens") is None  # vLLM would cap such requests at it
    assert gen.get("do_sample") is True  # transformers' save refuses a temperature without it


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
