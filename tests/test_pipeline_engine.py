"""The pipelined collector against the batch collector on one real vLLM engine (the embedded toy
reasoner, sampled at temperature 0.7): the same traces, probes and labels, written in the job's
order; and a pipelined collection killed part-way resumes to the same set, the engine left empty.
On the same engine, the collector samples with the job's top_k and min_p.

Each trace draws from its own generator (`orca_calibrate.collect.trace_seed`), so the schedule
must not change it (embeddings equal up to floating point between batch shapes)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from orca_calibrate.collect import Collector, CollectSettings, read_prompts, trace_keys
from orca_demo.toy.tasks import write_prompts
from orca_method.bundle import COLLECTED_UNDER
from orca_method.trajectories import TrajectorySet, TrajectoryWriter
from orca_serve.vllm_compat import offline

pytestmark = pytest.mark.vllm

MODEL = str(Path(__file__).parents[1] / "orca_serve" / "demo" / "model")


class Killed(Exception):
    """Stands in for a kill in the middle of a collection."""


def _same(a: TrajectorySet, b: TrajectorySet) -> None:
    """b holds a's traces (by id): steps, probed answers, labels, embeddings."""
    where = {p.id: i for i, p in enumerate(a.problems)}
    assert sorted(where) == sorted(p.id for p in b.problems)
    for j, q in enumerate(b.problems):
        i = where[q.id]
        p = a.problems[i]
        assert (q.step_tokens, q.step_answers, q.labels, q.extra) == \
            (p.step_tokens, p.step_answers, p.labels, p.extra), q.id
        np.testing.assert_allclose(b.embeddings(j), a.embeddings(i), atol=1e-4)


def test_pipelined_collects_the_batch_traces_and_resumes(tmp_path, monkeypatch):
    write_prompts(tmp_path / "p.jsonl", "in-dist", 14, seed=7)
    prompts = read_prompts(tmp_path / "p.jsonl")
    order = [k for k, _ in trace_keys(prompts, 1)]
    later = {order[2]}  # collected unprobed, as selective labelling does
    settings = CollectSettings(temperature=0.7, max_tokens=320, answer_tokens=6,
                               suffix="\n</think>\nThe answer is \\boxed{", batch=4,
                               schedule="batches", engine={"max_model_len": 1024})
    with Collector(MODEL, settings) as c:
        c.run(prompts, tmp_path / "batches", progress=False, defer=later.__contains__)
        batch_probes = c.stats.answer_probes
        settings.schedule = "pipelined"  # the same engine, the other schedule
        c.stats.answer_probes = 0
        c.run(prompts, tmp_path / "pipelined", progress=False, defer=later.__contains__)
        assert c.stats.answer_probes == batch_probes > 0
        assert c.stats.pipelined_s > 0 and c.stats.generated_tokens > 0

        # killed while writing the sixth trace
        append, calls = TrajectoryWriter.append, []

        def dies(self, *args, **kwargs):
            if len(calls) == 5:
                raise Killed
            calls.append(1)
            append(self, *args, **kwargs)

        monkeypatch.setattr(TrajectoryWriter, "append", dies)
        with pytest.raises(Killed):
            c.run(prompts, tmp_path / "resumed", progress=False)
        monkeypatch.setattr(TrajectoryWriter, "append", append)
        interrupted = [p.id for p in TrajectorySet.open(tmp_path / "resumed").problems]
        assert not offline.busy(c.llm)  # the requests in flight were aborted
        c.run(prompts, tmp_path / "resumed", progress=False)

        # top_k 1 and min_p 1 each leave the likeliest token alone: at temperature 2 the traces
        # are the greedy ones (that temperature alone draws others); the data records both
        drawn = {}
        for name, change in (("greedy", {"temperature": 0.0}), ("hot", {"temperature": 2.0}),
                             ("top_k", {"temperature": 2.0, "top_k": 1}),
                             ("min_p", {"temperature": 2.0, "min_p": 1.0})):
            c.settings = replace(settings, max_tokens=64, **change)
            drawn[name] = [r["output_token_ids"] for r in c.record(prompts[:4])]
        assert drawn["top_k"] == drawn["greedy"] == drawn["min_p"] != drawn["hot"]
        c.settings = replace(settings, temperature=0.6, top_p=0.95, top_k=20, min_p=0.05)
        assert c.info_fields()[COLLECTED_UNDER] == {"dtype": "float32", "temperature": 0.6,
                                                    "top_p": 0.95, "top_k": 20, "min_p": 0.05}

    batches, pipelined = (TrajectorySet.open(tmp_path / d) for d in ("batches", "pipelined"))
    assert len(batches) >= 12
    # the job's order (the batch collector writes a batch's unprobed traces after its others)
    assert [p.id for p in pipelined.problems] == [k for k in order if k in
                                                   {p.id for p in batches.problems}]
    _same(batches, pipelined)
    assert {p.id: p for p in pipelined.problems}[order[2]].extra["selective"] == \
        {"probed": [], "resolved": None}
    pending = (tmp_path / "pipelined" / "pending-probes.jsonl").read_text().splitlines()
    assert len(pending) == 1 and order[2] in pending[0]
    # killed: the job's first five traces on disk; resumed (no trace deferred this time): the
    # whole set, in the job's order, the same traces
    assert interrupted == [p.id for p in pipelined.problems[:5]]
    resumed = TrajectorySet.open(tmp_path / "resumed")
    assert [p.id for p in resumed.problems] == [p.id for p in pipelined.problems]
    for i, (p, q) in enumerate(zip(resumed.problems, pipelined.problems)):
        assert p.step_tokens == q.step_tokens
        np.testing.assert_allclose(resumed.embeddings(i), pipelined.embeddings(i), atol=1e-4)
        if p.id not in later:
            assert (p.step_answers, p.labels) == (q.step_answers, q.labels)
