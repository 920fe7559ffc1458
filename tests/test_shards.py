"""Data-parallel collection's bookkeeping (orca_calibrate/shards.py) without engines: which
shard a prompt goes to, the devices each engine gets, and the merge of the shards' folders into
the job's one trajectory directory (tests/test_shards_engine.py runs real engines)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from orca_calibrate.collect import PENDING_FILE, CollectSettings
from orca_calibrate.shards import device_env, merge, shard_of
from orca_method.trajectories import TrajectorySet, TrajectoryWriter


def test_prompts_go_round_robin_with_all_their_samples():
    assert shard_of(["a", "b", "c", "d", "e"], 2) == {"a": 0, "b": 1, "c": 0, "d": 1, "e": 0}
    assert set(shard_of(["a"], 3).values()) == {0}


def test_each_cpu_engine_binds_cores_of_its_own(monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    binds = [device_env(i, 2, CollectSettings(), {})["VLLM_CPU_OMP_THREADS_BIND"]
             for i in range(2)]
    assert binds == ["0,1", "2,3,4"]
    with pytest.raises(ValueError, match="one engine needs a core"):
        device_env(0, 6, CollectSettings(), {})


def _shard(path, ids, steps, pending=()):
    with TrajectoryWriter(path, dim=3, dtype="float32", model="m") as w:
        for pid, n in zip(ids, steps):
            w.append({"id": pid, "labels": {"consistent": [0] * (n - 1) + [1]}},
                     np.full((n, 3), float(n), np.float32))
    if pending:
        (path / PENDING_FILE).write_text("".join(json.dumps({"id": p}) + "\n" for p in pending))


def test_merge_keeps_the_jobs_order_and_resumes(tmp_path):
    _shard(tmp_path / "s0", ["a", "c"], [2, 4], pending=["c"])
    _shard(tmp_path / "s1", ["b", "d"], [3, 5])
    into = tmp_path / "all"
    _shard(into, ["a"], [2])  # a merge killed after its first problem
    merge([tmp_path / "s0", tmp_path / "s1", tmp_path / "s2-never-ran"], into,
          ["a", "b", "c", "d", "e-had-no-steps"])
    ts = TrajectorySet.open(into)
    assert [p.id for p in ts.problems] == ["a", "b", "c", "d"]
    assert [float(ts.embeddings(i)[0, 0]) for i in range(4)] == [2.0, 3.0, 4.0, 5.0]
    assert [p.offset for p in ts.problems] == [0, 2, 5, 9]
    assert ts.problems[3].labels["consistent"] == [0, 0, 0, 0, 1]
    assert [json.loads(x)["id"] for x in (into / PENDING_FILE).read_text().splitlines()] == ["c"]
