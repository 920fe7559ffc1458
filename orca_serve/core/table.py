"""The request table: who is tracked, in which slot, parked or not, and what is left of them.

A request is known by the adapter's identity string from the moment it joins the batch until it
leaves for good. Leaving for good frees its slot at once; only the small result stays (keyed
requests only, `Results`) until fetched. A request that leaves for a while (preemption) is
parked with its slot; when slots run out, the longest-parked one still holding a slot is
evicted into a snapshot and restored into a new slot when it comes back. Removals that arrive
while a step's readback is still unread wait for it (`leave(..., defer=True)`, then `settle`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from orca_method.procedure import Normalization, finish_step
from orca_serve.settings.contract import OrcaResult
from orca_serve.core import gate_alarm
from orca_serve.core.pooling import SlotPool
from orca_serve.core.registry import Request, Results

log = logging.getLogger("orca_serve.core")


class RequestTable:
    """Tracked requests by identity, their slots, parked requests and stored results."""

    def __init__(self, pool: SlotPool, results: Results, normalization: Normalization,
                 stats: dict[str, Any]) -> None:
        self.pool = pool
        self.results = results
        self.normalization = normalization
        self.stats = stats
        self.live: dict[str, Request] = {}  # by identity: in the batch or parked
        self.parked: dict[str, Request] = {}  # insertion order = age
        self.by_key: dict[str, Request] = {}
        self.leaving: list[tuple[Request, bool]] = []  # waiting for the readback
        # the adapter leaves out the rows the engine discards (partial prefill chunks); False:
        # it cannot, so a resumed request skips the token sampled just before its preemption
        self.rows_exact = True

    def add(self, req: Request) -> bool:
        """Track a new request: give it a slot (False: none free) and its result key."""
        req.slot = self._take_slot()
        if req.slot is None:
            return False
        if req.enabled:
            req.dep.bank.reset(req.slot)
        self.live[req.ident] = req
        key = req.key
        if key is not None:
            old = self.by_key.get(key)
            if old is not None and old is not req:
                log.warning("orca_key %r reused before its result was fetched; the older "
                            "result is dropped", key)
                old.key = None
            self.results.discard(key)
            self.by_key[key] = req
        return True

    def resume(self, req: Request, n_out: int) -> Request:
        """A tracked request re-enters the batch (after a preemption) with n_out tokens."""
        queued = [i for i, (r, _) in enumerate(self.leaving) if r is req]
        if queued:  # removed and re-added before the removal was settled: nothing happened
            del self.leaving[queued[0]]
            return req
        if req.attached:  # re-added without a removal (should not happen)
            return req
        self.stats["resumed"] += 1
        self.parked.pop(req.ident, None)
        req.attached = True
        if n_out < req.n_seen:
            req.fail(f"output shrank from {req.n_seen} to {n_out} tokens while preempted")
        elif n_out > req.n_seen and not self.rows_exact:
            # its row comes in the last recompute chunk, which cannot be told from the others
            req.notes.append(f"token {n_out - 1}, sampled before a preemption, is not pooled")
            req.n_seen = n_out
            req.lag = None
        if req.slot is None:  # evicted while parked: restore into a new slot
            req.slot = self._take_slot()
            if req.slot is None:
                req.fail("no free slot to resume into")
                return req
            pool_snap, bank_snap = req.snapshot
            self.pool.restore(req.slot, pool_snap)
            if bank_snap is not None:
                req.dep.bank.restore(req.slot, bank_snap)
            req.snapshot = None
        return req

    def leave(self, req: Request, final: bool, defer: bool) -> None:
        """A request left the batch: for good (`final`), or for a while (preempted); `defer`:
        after the pending readback is read (`settle`)."""
        if defer:
            self.leaving.append((req, final))
            return
        if not final:
            req.attached = False
            req.left_at = time.monotonic()
            self.parked[req.ident] = req
            self.prune_parked()
            return
        self.parked.pop(req.ident, None)
        gate_alarm.feed(req, None, self.stats)  # left before its gate decided: its place goes
        if self.live.get(req.ident) is req:
            del self.live[req.ident]
        if req.key is not None and self.by_key.get(req.key) is req:
            del self.by_key[req.key]
            if not req.fetched:
                self.results.put(req.key, self.result(req))
        if req.slot is not None:
            self.pool.release(req.slot)
            req.slot = None
        req.snapshot = None
        req.step_embs = []
        req.handle = None

    def settle(self) -> None:
        """Finish the removals that waited for the readback; end long-parked requests."""
        leaving, self.leaving = self.leaving, []
        for req, final in leaving:
            self.leave(req, final, defer=False)
        if self.parked:
            self.prune_parked()

    def prune_parked(self) -> None:
        """Parked longer than the result TTL: it is not coming back (the adapter could not tell
        an end from a preemption)."""
        now = time.monotonic()
        for req in list(self.parked.values()):
            if now - req.left_at <= self.results.ttl:
                break
            self.leave(req, True, defer=False)

    def _take_slot(self) -> int | None:
        slot = self.pool.take()
        if slot is None and self.parked:  # evict the longest-parked request into a snapshot
            # that still holds a slot (an evicted one stays parked, without a slot, until it
            # comes back or its TTL ends it)
            old = next((r for r in self.parked.values() if r.slot is not None), None)
            if old is not None:
                bank = old.dep.bank if old.enabled else None
                old.snapshot = (self.pool.snapshot(old.slot),
                                None if bank is None else bank.snapshot(old.slot))
                self.pool.release(old.slot)
                old.slot = None
                self.stats["evictions"] += 1
                slot = self.pool.take()
        return slot

    # -- results ----------------------------------------------------------------------------------
    def pop_results(self, keys: list[str]) -> dict[str, dict[str, Any]]:
        """The results of these keys that exist (a finished request still in the batch too), in
        wire form (`OrcaResult.to_dict`)."""
        out = {}
        for k in keys:
            req = self.by_key.get(k)
            if req is not None:  # finished but not removed from the batch yet
                r = self.result(req)
                req.fetched = True
                del self.by_key[k]
            else:
                r = self.results.pop(k)
                if r is None:
                    continue
            out[k] = _embeddings_to_host(r, self.pool.S.shape[1]).to_dict()
        self.results.prune()
        return out

    def result(self, req: Request) -> OrcaResult:
        """The request's result; in record mode with the unfinished last step's embedding."""
        pending = None
        if req.record and req.active and req.seg.pending:
            src = None
            if req.slot is not None:
                src = (self.pool.A[req.slot], self.pool.S[req.slot])
            elif req.snapshot is not None:
                src = req.snapshot[0][:2]
            if src is not None:  # built in the step's path (a leave): filled on the device,
                # not copied from a host list (a pageable copy waits for the device)
                count = torch.full((1,), req.seg.pending, device=src[0].device)
                pending = finish_step((src[0] + src[1])[None], count, self.normalization)[0]
        return req.result(pending)


def _embeddings_to_host(r: OrcaResult, dim: int) -> OrcaResult:
    """Record-mode embeddings as one float32 numpy array (the only copy of them to the host)."""
    if r.step_embeddings is not None and not isinstance(r.step_embeddings, np.ndarray):
        embs = r.step_embeddings
        r.step_embeddings = (torch.stack(embs).float().cpu().numpy() if embs else
                             np.zeros((0, dim), dtype=np.float32))
    return r
