"""Two engine processes, a shard of the prompts each, against one engine on the same prompts
(real vLLM, the embedded toy reasoner, sampled at temperature 0.7). Each trace draws from its own
generator (`orca_calibrate.collect.trace_seed`), so sharding must not change it: same ids in the
job's order, same steps and labels, embeddings equal up to floating point between batch
shapes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from orca_calibrate import shards
from orca_calibrate.collect import Collector, CollectSettings, read_prompts
from orca_calibrate.shards import collect_shards
from orca_demo.toy.tasks import write_prompts
from orca_method.trajectories import TrajectorySet
from tests.serving import server_env, start

pytestmark = pytest.mark.vllm

MODEL = str(Path(__file__).parents[1] / "orca_serve" / "demo" / "model")


@pytest.fixture
def forked_shards(monkeypatch):
    """The shards' engine processes started as the suite starts its servers and cluster workers
    (tests/serving.py `start`): the same command, in the environment the job gives each shard
    with the variables read at exec or import as this worker had them before its engines ran
    (`server_env`), forked from the zygote its servers come from (tests/zygote.py), not a
    fresh interpreter importing vLLM again (~9 s of CPU each); exec'd under
    `ORCA_TEST_ZYGOTE=0`."""
    monkeypatch.setattr(shards, "start_shard",
                        lambda cmd, env, log: start(cmd, Path(log.name), server_env(env)))


def test_two_engines_collect_the_one_engine_traces(tmp_path, forked_shards):
    write_prompts(tmp_path / "p.jsonl", "in-dist", 12, seed=5)
    prompts = read_prompts(tmp_path / "p.jsonl")
    settings = CollectSettings(temperature=0.7, max_tokens=320, answer_tokens=6,
                               suffix="\n</think>\nThe answer is \\boxed{", batch=16,
                               engine={"max_model_len": 1024})
    with Collector(MODEL, settings) as one:
        one.run(prompts, tmp_path / "one", progress=False)
    two = CollectSettings(**{**settings.__dict__, "engines": 2})
    later = {str(prompts[1]["id"])}  # one trace collected unprobed, as selective labelling does
    stats = collect_shards(MODEL, two, [(prompts, tmp_path / "two", later)], tmp_path / "work")
    a, b = TrajectorySet.open(tmp_path / "one"), TrajectorySet.open(tmp_path / "two")
    assert [p.id for p in b.problems] == [p.id for p in a.problems] and len(a) >= 10
    assert stats.trajectories == len(b)
    # both shards marked complete; the job removes their folders once the merge is recorded
    assert all((tmp_path / "work" / f"shard-{i}.stats.json").exists() for i in range(2))
    for i, (p, q) in enumerate(zip(a.problems, b.problems)):
        assert q.step_tokens == p.step_tokens
        np.testing.assert_allclose(b.embeddings(i), a.embeddings(i), atol=1e-4)
        if q.id in later:
            assert q.extra["selective"] == {"probed": [], "resolved": None}
        else:
            assert q.labels == p.labels
