"""The multi-machine path on a local cluster of two workers (issue 36, item 3; real vLLM, the
embedded toy reasoner, greedy). Two separate `orca-calibrate collect --config JOB` processes, each
told its shard only by its own JOB_COMPLETION_INDEX as the pods of a Kubernetes indexed Job are
(deploy/k8s/calibrate-job.yaml), collect into one job folder at once (started as the tests start
a server, tests/serving.py `start`: forked from a zygote that imported vLLM, each in its own
environment; the console script's start is not this test's subject); `orca-calibrate merge` then
checks both shards, merges them and runs the rest of the job. Greedy traces draw no random
numbers, so the merged sets must be the traces one engine collects (ids in the job's order, steps
and labels; embeddings up to floating point), and the job must end in a bundle that certifies."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from orca_calibrate.calibrate_cli import main
from orca_calibrate.collect import Collector, CollectSettings, read_prompts
from orca_calibrate.shards import device_env
from orca_demo.toy.tasks import write_prompts
from orca_method.bundle import load_bundle
from orca_method.trajectories import TrajectorySet
from tests.serving import server_env, start

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).parents[1]


def test_two_workers_and_a_merge_make_the_one_engine_traces_and_a_bundle(tmp_path, capsys):
    # 40: a calibration split of 16 (the split is exact), 2 over the 14 that can certify delta
    # 0.2 without a loss (0.8^14 < 0.05 < 0.8^13)
    write_prompts(tmp_path / "prompts.jsonl", "in-dist", 40, seed=5)
    write_prompts(tmp_path / "shifted.jsonl", "shifted", 8, seed=6)
    toy = yaml.safe_load((ROOT / "orca_calibrate" / "jobs" / "toy.yaml").read_text())
    collect = {**toy["collect"], "temperature": 0.0, "max_tokens": 320, "batch": 16,
               "engine": {"max_model_len": 1024}, "engines": 2}
    job = {**toy, "model": str(ROOT / "orca_serve" / "demo" / "model"),
           "prompts": "prompts.jsonl", "shifted_prompts": "shifted.jsonl", "out": "run",
           "collect": collect, "split": {"fractions": [0.4, 0.4, 0.2], "seed": 0},
           "train": {**toy["train"], "epochs": 3},
           "calibrate": {"deltas": [0.1, 0.2], "epsilon": 0.05, "window": 1}}
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    settings = CollectSettings(**collect)

    workers = []
    for i in range(2):  # a core each, as device_env gives the engines of one machine
        env = {**device_env(i, 2, settings, server_env()), "JOB_COMPLETION_INDEX": str(i)}
        workers.append(start([sys.executable, "-m", "orca_calibrate.calibrate_cli", "collect",
                              "--config", str(config), "--of", "2"],
                             tmp_path / f"worker-{i}.log", env))
    codes = [w.wait(600) for w in workers]
    logs = [(tmp_path / f"worker-{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], "\n".join(x[-2000:] for x in logs)
    shard_stats = [json.loads(log.strip().splitlines()[-1]) for log in logs]
    assert [s["shard"] for s in shard_stats] == [0, 1]

    assert main(["merge", "--config", str(config)]) == 0
    run = tmp_path / "run"
    assert not (run / "shards").exists()  # merged and recorded: the shard folders are gone
    stats = json.loads((run / "collect-stats.json").read_text())
    assert stats["trajectories"] == sum(s["trajectories"] for s in shard_stats)
    bundle = load_bundle(run / "bundle.json")
    merged = TrajectorySet.open(run / "trajectories")
    assert bundle.ltt.n_cal == len(merged.split("calibration")) >= 14
    assert any(r.lam is not None for r in bundle.ltt.rows)  # a lambda* certified
    # a worker rerun after the merge (a retried pod) has nothing left to do: the CLI's entry
    # function in this process (the workers above are the processes a cluster starts; a third
    # would only import the package again to print one line)
    capsys.readouterr()
    assert main(["collect", "--config", str(config), "--shard", "1"]) == 0
    assert "collected and merged already" in capsys.readouterr().out

    with Collector(job["model"], settings) as one:  # the reference: one engine, every prompt
        for name in ("prompts", "shifted"):
            one.run(read_prompts(tmp_path / f"{name}.jsonl"), tmp_path / f"one-{name}",
                    progress=False)
    for name, got in (("prompts", "trajectories"), ("shifted", "trajectories-shifted")):
        a, b = TrajectorySet.open(tmp_path / f"one-{name}"), TrajectorySet.open(run / got)
        assert [p.id for p in b.problems] == [p.id for p in a.problems] and len(a) >= 6
        for i, (p, q) in enumerate(zip(a.problems, b.problems)):
            assert (q.step_tokens, q.labels) == (p.step_tokens, p.labels)
            np.testing.assert_allclose(b.embeddings(i), a.embeddings(i), atol=1e-4)
