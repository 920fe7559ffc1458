"""The pipelined collection's schedule without an engine (orca_calibrate/pipeline.py): what it
starts, what it hands on to be written, and the bounds it keeps, on scripted and random runs."""

from __future__ import annotations

import random

import pytest

from orca_calibrate.collect import CollectSettings
from orca_calibrate.pipeline import Schedule


def test_starts_up_to_the_generating_bound_and_refills_as_traces_finish():
    s = Schedule(["a", "b", "c", "d"], generating=2, unwritten=4)
    assert s.start() == ["a", "b"]
    assert s.start() == []  # two generating
    s.generated("b", 3)
    assert s.start() == ["c"]  # b probes while c generates
    assert s.in_flight == 2


def test_hands_on_in_the_jobs_order_once_every_probe_is_back():
    s = Schedule(["a", "b", "c"], generating=3, unwritten=3)
    s.start()
    s.generated("b", 0)  # b finished first (no step to probe)
    s.generated("c", 1)
    assert s.ready() == []  # a is still generating
    s.generated("a", 2)
    s.probed("a")
    assert s.ready() == []
    s.probed("a")
    assert s.ready() == ["a", "b"]  # c waits for its probe
    s.probed("c")
    assert s.ready() == ["c"] and s.done


def test_a_slow_head_stops_new_starts_at_the_unwritten_bound():
    s = Schedule([f"t{i}" for i in range(6)], generating=2, unwritten=3)
    assert s.start() == ["t0", "t1"]
    s.generated("t1", 0)
    assert s.start() == ["t2"]  # started, not written: t0, t1, t2
    s.generated("t2", 0)
    assert s.start() == []  # t0 holds up three: no fourth starts, though one engine slot is free
    s.generated("t0", 0)
    assert s.ready() == ["t0", "t1", "t2"]
    assert s.start() == ["t3", "t4"]


@pytest.mark.parametrize("bad", [
    lambda s: s.generated("a", 1),  # not started
    lambda s: (s.start(), s.generated("a", 1), s.generated("a", 1)),  # twice
    lambda s: (s.start(), s.probed("a")),  # generating, no probe queued
    lambda s: (s.start(), s.generated("a", -1)),
])
def test_refuses_events_that_cannot_happen(bad):
    with pytest.raises(ValueError):
        bad(Schedule(["a", "b"], generating=1, unwritten=2))


def test_refuses_bounds_that_cannot_hold():
    with pytest.raises(ValueError):
        Schedule(["a"], generating=3, unwritten=2)
    with pytest.raises(ValueError):
        Schedule(["a"], generating=0, unwritten=2)


@pytest.mark.parametrize("seed", range(40))
def test_random_runs_write_every_trace_once_in_order_within_the_bounds(seed):
    """An engine that finishes a random one of its requests at each step: every trace is handed
    on once, in the job's order; the bounds hold at every step; nothing stalls."""
    rng = random.Random(seed)
    keys = [f"k{i}" for i in range(rng.randint(1, 60))]
    generating = rng.randint(1, 8)
    unwritten = generating + rng.randint(0, 8)
    s = Schedule(keys, generating, unwritten)
    engine: list[tuple[str, bool]] = []  # (trace, is a probe) queued or running
    started: list[str] = []
    written: list[str] = []
    while not s.done:
        new = s.start()
        started += new
        engine += [(k, False) for k in new]
        assert engine, "stalled: nothing in the engine and nothing ready"
        key, probe = engine.pop(rng.randrange(len(engine)))
        if probe:
            s.probed(key)
        else:
            n = rng.choice([0, 0, 1, rng.randint(1, 20)])
            s.generated(key, n)
            engine += [(key, True)] * n
        written += s.ready()
        assert s.in_flight == sum(not p for _, p in engine) <= generating
        assert len(started) - len(written) <= unwritten
    assert written == keys == started and not engine


def test_the_schedule_setting_is_checked():
    assert CollectSettings().schedule == "pipelined"
    assert CollectSettings(schedule="batches").schedule == "batches"
    with pytest.raises(ValueError, match="collect.schedule is one of pipelined, batches"):
        CollectSettings(schedule="overlap")
