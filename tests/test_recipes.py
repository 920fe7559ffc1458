"""The job files (orca_calibrate/jobs/*.yaml, the recipes of docs/RECIPES.md among them) load
through the job's own loader and hold settings the collection, the plugin and vLLM accept, so
none of them rots unnoticed; the recipes name every job file and only reasoning parsers the
installed vLLM has."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from orca_calibrate.collect import CollectSettings
from orca_calibrate.job import STAGES, load_job, stage_settings
from orca_method.bundle import Segmentation, ThinkTags
from orca_method.normalizations import NORMALIZATIONS

ROOT = Path(__file__).parents[1]
JOBS = sorted((ROOT / "orca_calibrate" / "jobs").glob("*.yaml"))
RECIPES = (ROOT / "docs" / "RECIPES.md").read_text()


@pytest.mark.parametrize("path", JOBS, ids=[p.stem for p in JOBS])
def test_every_job_file_loads_with_settings_that_exist(path: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs  # deferred: vllm (no engine starts)

    job = load_job(path)
    settings = CollectSettings(**(job.get("collect") or {}))
    Segmentation(**settings.segmentation)  # the plugin's own models: unknown keys are errors
    think = ThinkTags(**settings.think)
    assert settings.normalization in NORMALIZATIONS
    assert set(settings.engine) <= {f.name for f in fields(EngineArgs)}
    assert think.end in settings.suffix  # the labelling suffix closes the reasoning
    assert len(stage_settings(job)) == len(STAGES)
    assert all(Path(f).is_file() for f in job.get("group_prompts") or [])  # shipped with it


def test_the_recipes_name_every_real_model_job_and_existing_parsers() -> None:
    from vllm.reasoning import ReasoningParserManager  # deferred: vllm (no engine starts)

    demo = {"toy.yaml", "long.yaml"}  # the embedded demo reasoners' jobs: docs/CALIBRATE.md
    for path in JOBS:
        if path.name not in demo:
            assert f"orca_calibrate/jobs/{path.name}" in RECIPES, path.name
            assert f"`{load_job(path)['model']}`" in RECIPES, path.name
    parsers = set(re.findall(r"--reasoning-parser (\w+)", RECIPES))
    assert parsers == {"deepseek_r1", "qwen3"}
    assert parsers <= set(ReasoningParserManager.list_registered())


# The sampling each real-model recipe's model names in its generation_config.json (its authors'
# advice, docs/RECIPES.md "Sampling"): what vLLM samples a request that sets none with. Written
# from the model cards and files as published; not re-read here (the hub cannot be reached), so
# a release that changes its file is the deployment's to check (RECIPES says how)
PUBLISHED = {"Qwen/QwQ-32B": {"temperature": 0.6, "top_p": 0.95, "top_k": 40,
                              "repetition_penalty": 1.0},
             "Qwen/Qwen3-8B": {"temperature": 0.6, "top_p": 0.95, "top_k": 20},
             **{f"deepseek-ai/DeepSeek-R1-Distill-{m}": {"temperature": 0.6, "top_p": 0.95}
                for m in ("Qwen-7B", "Llama-8B", "Qwen-32B")}}
REAL = [p for p in JOBS if p.name not in {"toy.yaml", "long.yaml"}]


@pytest.mark.parametrize("path", REAL, ids=[p.stem for p in REAL])
def test_a_recipe_samples_as_its_models_generation_config(path: Path, tmp_path: Path) -> None:
    """Served with the model's own generation config (vLLM's default), a request that sets no
    sampling is sampled as the recipe's calibration traces were: orca-serve warns of nothing
    (the model's config file stands in for the hub model's; the demo model's weights are not
    read)."""
    import json
    import shutil

    from orca_method.bundle import Generation
    from orca_serve.checks.bundle import serving_warnings
    from orca_serve.startup.preflight import add_orca_args, demo_paths
    from orca_serve.vllm_compat import launch
    from tests.bundles import small_bundle

    job = load_job(path)
    model = tmp_path / "model"
    shutil.copytree(demo_paths()[0], model, ignore=shutil.ignore_patterns("*.safetensors"))
    (model / "generation_config.json").write_text(json.dumps(PUBLISHED[job["model"]]))
    parser = add_orca_args(launch.serve_parser("orca-serve", "test"))
    served = launch.served_generation(parser.parse_args(["--model", str(model)]))
    s = CollectSettings(**job["collect"])
    under = Generation(dtype=served[0].dtype, temperature=s.temperature, top_p=s.top_p,
                       top_k=s.top_k, min_p=s.min_p)
    bundle = small_bundle().model_copy(update={"provenance": {"collected_under": under.record()}})
    assert serving_warnings(bundle, served) == []
