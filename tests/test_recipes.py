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
