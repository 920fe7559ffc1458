"""scripts/cuda_sync_check.py, the core's sync check on a real GPU, checked without one: its dry
run (the same scenarios on the CPU stand-in of tests/core_sim.py, each host read it logs inside
a core call counted as a sync) finds nothing in this checkout and fails on a planted host read,
and its CUDA path's filing of torch's sync warnings is run on warnings raised by hand."""

from __future__ import annotations

import re
import warnings

import torch

from orca_serve.core import pooling
from scripts.cuda_sync_check import (
    SCENARIOS,
    SYNC_WARNING,
    Watch,
    check,
    main,
    recording_sync_warnings,
    report,
)


def test_the_dry_run_finds_no_sync_and_runs_every_scenario(capsys):
    tally = check(SCENARIOS, dry=True)
    assert report(tally, SCENARIOS, dry=True) == 0, capsys.readouterr().out
    assert tally.unexpected() == 0
    for s in SCENARIOS:  # each scenario called the core, scored steps and failed no request
        assert tally.calls[s] > 0 and tally.scored[s] > 0 and not tally.failed[s], s


def test_a_host_read_planted_in_the_step_fails_the_check(monkeypatch, capsys):
    """An `.item()` of a device value in every scoring step (a sync on a GPU; the stand-in logs
    it) is found, at the core's line that made it, and the check exits 1."""
    start = pooling.Readback.start

    def reading_start(self, block: torch.Tensor) -> None:
        block.sum().item()
        start(self, block)

    monkeypatch.setattr(pooling.Readback, "start", reading_start)
    assert main(["--dry-run", "--scenario", "plain"]) == 1
    found = re.findall(r"\[plain\] x(\d+)  device_step\.py:\d+ DeviceStep\._score: self\.readback",
                       capsys.readouterr().out)
    assert len(found) == 1 and int(found[0]) > 10, found


def test_torchs_sync_warnings_are_filed_at_our_frame_with_the_fence_wait_apart(monkeypatch):
    """The CUDA path's filing, on warnings raised by hand: a sync inside a core call is filed at
    the innermost frame of ours (`SlotPool.take`, though a `take` of pooling.py, is not a
    documented wait), the fence's wait is counted apart, the mode's notice that it is a
    prototype is no sync (once one, matched on "synchroniz"), nor is a sync outside a call."""
    class Event:  # a CUDA event: waiting on it synchronises
        def record(self) -> None:
            pass

        def synchronize(self) -> None:
            warnings.warn(f"{SYNC_WARNING} (Triggered internally at CUDAFunctions.cpp:1.)")

    fence = pooling.Fence(torch.device("cpu"))
    fence._events = [Event(), Event()]
    pool = pooling.SlotPool(2, 4, torch.device("cpu"))
    watch = Watch(dry=True)  # the stand-in's watch: CUDA's debug mode is left alone
    watch.scenario = "s"
    with recording_sync_warnings(watch):
        watch.watched(fence.wait)(fence.mark())
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "zero_", lambda t: warnings.warn(SYNC_WARNING))
            watch.watched(pool.take)()
            pool.take()  # outside a core call
        watch.watched(warnings.warn)("Synchronization debug mode is a prototype feature and "
                                     "does not yet detect all synchronizing operations")
    assert watch.tally.waits == {"s": 1}
    places = dict(watch.tally.syncs)
    assert sorted(places.values()) == [1, 1] and all(
        s == "s" and re.fullmatch(r"pooling\.py:\d+ SlotPool\.take: self\.[AS]\[s\]\.zero_\(\)", w)
        for s, w in places), places
