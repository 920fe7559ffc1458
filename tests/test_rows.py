"""The row map both adapters feed (orca_serve/core/rows.py), against vLLM's own bookkeeping.

vLLM's builtin logits processors keep position -> state with `process_dict_updates`
(vllm/v1/sample/logits_processor/builtin.py); the row map must place every request where it
does, over random batch updates of the kinds vLLM's persistent batch sends, and hand each
request that loses its position without moving to `displaced` exactly once.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from orca_serve.core.rows import Added, Moved, RowMap, Tracked
from orca_serve.settings.contract import XARG_KEY
from orca_serve.vllm_compat import capture
from orca_serve.vllm_plugin.processor import OrcaLogitsProcessor
from tests.core_sim import (
    DIM,
    EOS,
    PROMPT,
    DeviceTensor,
    SimRequest,
    logged,
    sim_bundle,
    to_device,
)
from tests.test_mrv2 import cpu_vllm, vllm_config  # noqa: F401 - cpu_vllm: autouse fixture


def _fake(ident: str) -> Tracked:
    return Tracked(SimpleNamespace(ident=ident), None)  # type: ignore[arg-type]


def _random_update(rng: random.Random, occupied: list[int], size: int,
                   fresh: Callable[[], tuple[Any, list[int] | None, list[int]]]) -> BatchUpdate:
    """What vLLM's persistent batch sends (`fresh()`: a new request's params, prompt, output):
    removals, additions into the lowest freed rows (then past the end; a freed row that is
    filled is not reported removed: BatchUpdateBuilder's `pop_removed`), unidirectional moves from the tail into holes, swaps, and now and then an
    addition or a move onto an occupied row ("Added or moved requests may replace existing
    requests with the same index", vLLM's BatchUpdate)."""
    removed = sorted(rng.sample(occupied, rng.randint(0, len(occupied))))
    added, holes = [], list(removed)
    for _ in range(rng.randint(0, 4)):
        row = holes.pop(0) if holes else size + len([a for a in added if a[0] >= size])
        if rng.random() < 0.1 and occupied:
            row = rng.choice(occupied)
        added.append((row, *fresh()))
    removed = [r for r in removed if r not in {a[0] for a in added}]
    rows = sorted(set(occupied) - set(removed) | {a[0] for a in added})
    moved = []
    for _ in range(rng.randint(0, 3)):
        if len(rows) < 2:
            break
        a, b = rng.sample(rows, 2)
        kind = MoveDirectionality.SWAP if rng.random() < 0.6 else MoveDirectionality.UNIDIRECTIONAL
        moved.append((a, b, kind))
    return BatchUpdate(batch_size=len(rows), removed=removed, added=added, moved=moved)


def test_row_map_places_every_request_where_vllms_own_bookkeeping_does():
    rng = random.Random(7)
    displaced: list[str] = []
    rows = RowMap(lambda t: displaced.append(t.req.ident))
    reference: dict[int, str] = {}
    names = iter(range(10**6))

    def fresh() -> tuple[str, None, list[int]]:
        return f"r{next(names)}", None, []

    tracked_ever = 0
    for _ in range(3000):
        update = _random_update(rng, sorted(reference), max(reference, default=-1) + 1, fresh)
        # one in three added requests is not tracked (the core does not want it)
        wanted = {params: rng.random() < 2 / 3 for _, params, _, _ in update.added}
        before = {t.req.ident for _, t in rows.items()}
        rows.update(update.removed, [Added(r, p) for r, p, _, _ in update.added],
                    [Moved(a, b, k == MoveDirectionality.SWAP) for a, b, k in update.moved],
                    lambda row, p: _fake(p) if wanted[p] else None)
        process_dict_updates(reference, update, lambda p, _prompt, _out: p if wanted[p] else None)
        assert {r: t.req.ident for r, t in rows.items()} == reference
        joined = {p for p, w in wanted.items() if w}
        tracked_ever += len(joined)
        # displaced this update: every tracked request that lost its place without moving
        gone = (before | joined) - set(reference.values())
        assert sorted(displaced) == sorted(gone)
        displaced.clear()
        assert len(rows) == len(reference)
    assert tracked_ever > 1000 and len(reference) >= 1  # it did real work


def test_a_slot_reused_or_a_request_resumed_elsewhere_keeps_one_position_each():
    """MRV2's use: add_request per slot, finished or preempted ids popped by identity."""
    displaced: list[str] = []
    rows = RowMap(lambda t: displaced.append(t.req.ident))
    a, b = _fake("a"), _fake("b")
    assert rows.add(0, a, lambda _row, t: t) and rows.add(1, b, lambda _row, t: t)
    assert not rows.add(0, None, lambda _row, t: t)  # slot 0 reused by an untracked request
    assert displaced == ["a"] and rows.get(0) is None
    assert rows.add(5, b, lambda _row, t: t)  # b resumed into a new slot: its old one let go
    assert displaced == ["a"] and rows.get(1) is None and rows.get(5) is b
    assert rows.pop("b") is b and rows.pop("b") is None and len(rows) == 0
    assert displaced == ["a"]  # popped by the caller: the caller tells the core


def test_the_v1_adapter_keeps_the_core_attached_to_exactly_the_rows_it_maps(tmp_path_factory):
    """The V1 adapter's glue (`update_state`: joins through the core, displaced rows left) on
    random batch updates: every row holds the request vLLM's bookkeeping puts there, and the
    core's attached requests are exactly the mapped ones (a displaced one parked: without the
    runner an unfinished output counts as a preemption)."""
    proc = OrcaLogitsProcessor(vllm_config(sim_bundle(tmp_path_factory), 64),
                               torch.device("cpu"), False)
    rng = random.Random(11)

    def fresh() -> tuple[SamplingParams, list[int], list[int]]:
        on = int(rng.random() < 2 / 3)  # one in three not tracked (orca off)
        return (SamplingParams(max_tokens=1000, extra_args={"orca_enabled": on,
                                                            "orca_policy": "shadow"}),
                list(PROMPT), [])

    def ident(params: SamplingParams) -> str | None:
        return f"params-{id(params)}/0" if params.extra_args["orca_enabled"] else None

    reference: dict[int, str] = {}
    kept: list[SamplingParams] = []  # alive: the identities are their ids
    for _ in range(300):
        update = _random_update(rng, sorted(reference), max(reference, default=-1) + 1, fresh)
        kept += [p for _, p, _, _ in update.added]
        proc.update_state(update)
        process_dict_updates(reference, update, lambda p, _prompt, _out: ident(p))
        rows = {r: t.req for r, t in proc._rows.items()}
        assert {r: q.ident for r, q in rows.items()} == reference
        attached = {id(q) for q in proc.core.live.values() if q.attached}
        assert attached == {id(q) for q in rows.values()}
    assert len(kept) > 300 and proc.get_stats()["parked_requests"] > 0  # it did real work


def test_the_v1_adapter_never_waits_for_the_device(tmp_path_factory):
    """The core's sync check (tests/core_sim.py) through the V1 adapter: batch updates as vLLM's
    persistent batch sends them (additions into freed rows, removals, the tail moved into holes,
    swaps, a preempted request re-added) and apply() on the step's captured rows. An update
    reads and copies nothing; an apply() makes at most the core's two copies (staging in,
    readback out)."""
    proc = OrcaLogitsProcessor(vllm_config(sim_bundle(tmp_path_factory), 4),
                               torch.device("cpu"), False)
    to_device(proc.core)
    rng = random.Random(5)
    sims = [SimRequest(f"r{i}", rng, xa={XARG_KEY: f"r{i}", "orca_policy": p}, max_tokens=50,
                       join_at=2 * i, preempt_at=12 if i == 1 else None)
            for i, p in enumerate(["stop", "answer", "shadow", "answer", "stop"])]
    params = {s.name: SamplingParams(max_tokens=s.max_tokens, extra_args=dict(s.xa))
              for s in sims}
    rows: dict[int, SimRequest] = {}
    updates: list[list[str]] = []
    applies: list[list[str]] = []

    for t in range(300):
        gone = sorted(r for r, s in rows.items() if s.out and (
            s.out[-1] == EOS or len(s.out) >= s.max_tokens or len(s.out) == s.preempt_at))
        for r in gone:
            s = rows.pop(r)
            s.done = s.preempt_at != len(s.out)
            if not s.done:  # preempted: back in two steps, with its params and output list
                s.preempt_at, s.back_at = None, t + 2
        holes, added = list(gone), []
        for s in sims:
            if (s.req is None and t == s.join_at) or s.back_at == t:
                r = holes.pop(0) if holes else max(rows, default=-1) + 1
                rows[r], s.req, s.back_at = s, True, None
                added.append((r, params[s.name], list(PROMPT), s.out))
        moved = []
        while holes and rows and max(rows) > holes[0]:  # condense: the tail into the holes
            a, b = max(rows), holes.pop(0)
            rows[b] = rows.pop(a)
            moved.append((a, b, MoveDirectionality.UNIDIRECTIONAL))
        if len(rows) > 1 and rng.random() < 0.5:
            a, b = rng.sample(sorted(rows), 2)
            rows[a], rows[b] = rows[b], rows[a]
            moved.append((a, b, MoveDirectionality.SWAP))
        removed = [r for r in gone if r not in {a[0] for a in added}]
        if removed or added or moved:
            logged(proc.update_state, updates)(BatchUpdate(batch_size=len(rows), removed=removed,
                                                           added=added, moved=moved))
        if not rows:
            if all(s.done for s in sims):
                break
            continue
        batch = [rows[r] for r in range(len(rows))]
        capture.STASH.rows = torch.stack([s.hidden[len(s.out) - 1] if s.out else torch.randn(DIM)
                                          for s in batch]).as_subclass(DeviceTensor)
        logits = torch.stack([s.logits[len(s.out)] for s in batch])
        logits = logged(proc.apply, applies)(logits.as_subclass(DeviceTensor))
        for row, s in enumerate(batch):
            forced = torch.isfinite(logits[row]).as_subclass(torch.Tensor)
            s.out.append(int(forced.nonzero()[0]) if int(forced.sum()) == 1
                         else s.stream[len(s.out)])
    res = proc.pop_results([s.name for s in sims])
    assert all(s.done for s in sims) and any(r["stopped_early"] for r in res.values())
    assert proc.get_stats()["resumed"] == 1 and len(updates) > 5
    assert all(log == [] for log in updates), updates
    for log in applies:
        assert set(log) <= {"h2d copy_", "d2h copy_"} and len(log) <= 2, log
    assert sum("d2h copy_" in log for log in applies) > 5  # the readback is seen
