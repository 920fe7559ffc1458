"""The engine-step core: pool step embeddings, run the probe, force stop tokens.

It knows nothing of vLLM's model runner. An adapter tells it when requests join and leave the
batch (`join`, `leave`) and calls `step` once per engine step with plain data: for each tracked
request its logits row, its output length n and its last two output token ids (-1 = not known
yet), the hidden rows captured at the LM head ([rows, d], the row of a request is the state of
its token at position n - 1) and the logits ([rows, vocab], changed in place).

Per step, on the host: each request's new token goes through its `Segmenter`; the pooling,
step-completion, scoring and forcing indexes are staged in one buffer and copied to the device
once. On the device: the new token rows are added to the request's section sum, completed steps
are pooled and scored by the probe bank, and forced tokens are written as -inf masks. A request
whose step completes now and whose probe says "stop" gets its first forced token in this very
step, decided on the device (no wait). The step's one device-to-host copy (scores, stop flags)
is started non_blocking and read on the next step, where the host learns of the stop and plans
the rest of the forced text: stops land on exactly the token a synchronous design would force.

Hot reload: several deployments (bundles) can be live at once. A request joins the one whose
checksum its `orca_bundle` extra arg names (the server resolved its lambda* with that bundle), or
the current one (`use_bundle`) when it names none, and keeps it to the end. A step scores each
deployment's requests through that deployment's probe bank, still with one staging copy and one
readback. A deployment retired by `retire_bundles` is dropped when its last request leaves.

Async scheduling: a token id that is still a placeholder (-1) cannot be segmented yet; its hidden
row is parked and the request runs one token behind (the parked token is fed on the next step,
when its id is known) instead of failing. See docs/PLUGIN.md.

Speculative decoding: `core/speculation.py` feeds accepted draft tokens through `step(...,
replay=True)` calls before the engine step's own call; `Request.decided_until` and
`Request.draft_rows` tell this module where forcing may start and which rows sample the
positions after n.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from time import perf_counter_ns
from typing import Any

import torch
from torch import Tensor

from orca_method.procedure import finish_step, normalize_tokens
from orca_method.steps import CLOSE, MERGE, NONE, STEP, STEP_PREV, Segmenter
from orca_serve.contract import (
    DEFAULTS,
    MAX_RESULTS,
    NEVER,
    RESULT_TTL_S,
    XARG_BUNDLE,
    child_key,
    request_spec,
)
from orca_serve.core.deployment import Deployment
from orca_serve.core.pooling import Readback, SlotPool, Staging
from orca_serve.core.registry import Request, Results
from orca_serve.core.speculation import forced_rows, plan_start
from orca_serve.core.stopping import guard_position, stop_plan

log = logging.getLogger("orca_serve.core")

UNKNOWN = -1  # a token id not known yet (async scheduling placeholder) or absent


def open_reasoning_tokens(table: Any, prompt: Sequence[int] | None) -> int:
    """Tokens after the prompt's last start tag when the prompt leaves the reasoning open (a
    template that opens `<think>` in the generation prompt, e.g. `<think>` + newline): vLLM's
    `thinking_token_budget` counts them, so the server needs them to tell its stop from ours."""
    if not prompt or not table.think_enabled or not table.reasoning_at_start(prompt):
        return 0
    for i in range(len(prompt) - 1, -1, -1):
        if prompt[i] == table.start_id:
            return len(prompt) - 1 - i
    return 0


# one entry per tracked row and step: (request, logits row, output length, id at n-2, id at n-1)
Entry = tuple[Request, int, int, int, int]


class OrcaCore:
    """Requests, slots, pooling, probe and stops of one engine (see module docstring)."""

    MAX_LOGGED_NOTES = 64  # clients choose deltas: the set of logged notes stays bounded

    def __init__(self, cfg: Mapping[str, Any], tokenizer: Any, *, hidden_size: int,
                 model_name: str, eos_ids: set[int], default_eos: int | None,
                 max_num_seqs: int, device: torch.device, pin_memory: bool = False) -> None:
        self.device = torch.device(device)
        self.record_default = bool(cfg.get("record", False))
        self._logged_notes: set[str] = set()  # request notes the log has shown (a fallback delta)
        self.defaults = {**DEFAULTS, **(cfg.get("defaults") or {})}
        self.default_eos = default_eos
        self.capacity = 2 * max(1, int(max_num_seqs))  # preempted requests keep their slot
        self._dep_args = {"hidden_size": hidden_size, "model_name": model_name,
                          "eos_ids": set(eos_ids), "capacity": self.capacity,
                          "device": self.device}
        self._tokenizer = tokenizer
        self.dep = Deployment(cfg, tokenizer, **self._dep_args)  # the current deployment
        self.deps: dict[str | None, Deployment] = {self.dep.checksum: self.dep}  # by checksum
        self._retired: set[str | None] = set()  # dropped when no live request uses them
        self.normalization = self.dep.normalization
        self.pool = SlotPool(self.capacity, hidden_size, self.device)
        # 18 segments of at most max_num_seqs values each
        self.hidden_size = hidden_size
        self.staging = Staging(16 * self.capacity, self.device, pin_memory)
        self.readback = Readback(self.capacity, self.device, pin_memory)
        self._pending: list[tuple[Request, int, bool, int]] | None = None  # see _pool_steps
        self._leaving: list[tuple[Request, bool]] = []
        self.live: dict[str, Request] = {}  # by identity: in the batch or parked
        self._parked: dict[str, Request] = {}  # insertion order = age
        self._by_key: dict[str, Request] = {}
        self.results = Results(float(cfg.get("result_ttl_s", RESULT_TTL_S)),
                               int(cfg.get("max_results", MAX_RESULTS)))
        # the adapter leaves out the rows the engine discards (partial prefill chunks); False:
        # it cannot, so a resumed request skips the token sampled just before its preemption
        self.rows_exact = True
        self.stats = {"probe_ns": 0, "engine_steps": 0, "active_steps": 0, "rows_captured": 0,
                      "steps_scored": 0, "max_step_ns": 0, "resumed": 0, "recompute_chunks": 0,
                      "lagged_tokens": 0, "evictions": 0, "drafts_accepted": 0}

    # -- deployments (hot reload) ---------------------------------------------------------------
    def load_bundle(self, path: str) -> Deployment:
        """Stage a bundle, checked as at start (its checksum, `check_model` against this engine's
        model): requests naming its checksum join it from now on; `use_bundle` makes it the one
        for requests naming none. Raises BundleError; the live deployments are left untouched.
        Loading a bundle that is live already returns that deployment (and un-retires it)."""
        from orca_method.bundle import BundleError

        dep = Deployment({"bundle": str(path)}, self._tokenizer, **self._dep_args)
        if dep.normalization != self.normalization:
            # the token rows of one step are normalised together, for every deployment
            raise BundleError(f"bundle {path} normalises token states with "
                              f"{dep.normalization!r} but this engine runs "
                              f"{self.normalization!r}; restart the server to change it")
        known = self.deps.get(dep.checksum)
        if known is not None:
            self._retired.discard(dep.checksum)
            return known
        self.deps[dep.checksum] = dep
        return dep

    def use_bundle(self, checksum: str | None) -> Deployment:
        """Make a live deployment the current one (for requests that name no bundle)."""
        from orca_method.bundle import BundleError

        dep = self.deps.get(checksum)
        if dep is None:
            raise BundleError(f"bundle {checksum} is not loaded in this engine")
        self._retired.discard(checksum)
        self.dep = dep
        return dep

    def retire_bundles(self, keep: Sequence[str | None] = ()) -> list[str | None]:
        """Retire every deployment but the current one and those in `keep`: each is dropped (its
        probe bank freed) when its last request leaves. Returns the checksums still live."""
        for c, dep in self.deps.items():
            if dep is not self.dep and c not in keep:
                self._retired.add(c)
        self._drop_retired()
        return list(self.deps)

    def _drop_retired(self) -> None:
        used = {id(r.dep) for r in self.live.values()}
        for c in list(self._retired):
            dep = self.deps.get(c)
            if dep is None or (dep is not self.dep and id(dep) not in used):
                self.deps.pop(c, None)
                self._retired.discard(c)

    # -- joining and leaving --------------------------------------------------------------------
    def wants(self, xa: Mapping[str, Any] | None) -> bool:
        """Whether a request with these extra_args is tracked at all."""
        xa = xa or {}
        if int(xa.get("orca_record", self.record_default)):
            return True
        if not int(xa.get("orca_enabled", self.defaults["enabled"])):
            return False
        return XARG_BUNDLE in xa or self.dep.bank is not None

    def _log_fallback(self, notes: tuple[str, ...], ident: str) -> None:
        """A delta outside the bundle's table (a request without the server's orca_lam, e.g. on a
        stock vLLM server, which cannot refuse it) runs with the default delta: say so in the log,
        once per distinct note, since no response can carry it there."""
        for note in notes:
            if note not in self._logged_notes and len(self._logged_notes) < self.MAX_LOGGED_NOTES:
                self._logged_notes.add(note)
                log.warning("orca request %s: %s (logged once per delta)", ident, note)

    def join(self, ident: str, xa: Mapping[str, Any] | None, *, prompt: Sequence[int] | None,
             n_out: int, index: int, max_tokens: int | None, eos: int | None,
             ignore_eos: bool, structured: bool, handle: Any = None,
             output: Sequence[int] | None = None) -> Request | None:
        """A request enters the batch: a new one (tracked if it asks for it) or a parked one.

        `handle`: an object the adapter's identity is derived from (kept alive while tracked,
        so that its id is not reused). `output`: the engine's live list of the request's output
        ids, read when a record-mode result is built (a resumed request may bring a new one)."""
        req = self.live.get(ident)
        if req is not None and any(r is req and final for r, final in self._leaving):
            self.settle()  # its identity is reused by a new request: end the old one first
            req = self.live.get(ident)
        if req is not None:
            if output is not None:
                req.output = output
            return self._resume(req, n_out)
        if not self.wants(xa):
            return None
        want = (xa or {}).get(XARG_BUNDLE)
        dep = self.dep if want is None else self.deps.get(str(want))
        missing = dep is None
        if missing:  # its lambda* belongs to a probe this engine no longer has: no early stop
            dep = self.dep
        spec = request_spec(xa, self.defaults, record=self.record_default,
                            lam_of=None if missing else dep.lam_of,
                            default_delta=None if missing else dep.default_delta)
        self._log_fallback(spec.notes, ident)
        policy = spec.policy
        notes = []
        if policy == "stop" and ignore_eos:
            notes.append("policy stop under ignore_eos: a forced EOS would not end the request, "
                         "so it runs as shadow")
            policy = "shadow"
        if policy != "shadow" and structured:
            notes.append("structured output: forcing tokens would break the grammar, so it runs "
                         "as shadow")
            policy = "shadow"
        key = None if spec.key is None else child_key(spec.key, index, spec.n)
        req = Request(ident, spec, dep, Segmenter(dep.table, prompt, keep_ids=spec.record),
                      index=index, key=key, policy=policy, max_tokens=max_tokens,
                      eos=self.default_eos if eos is None else eos, ignore_eos=ignore_eos,
                      n_out=n_out)
        req.handle = handle
        req.prompt_reasoning = open_reasoning_tokens(dep.table, prompt)
        if missing:
            req.bundle_checksum = None
            req.fail(f"bundle {want} is not loaded in this engine (replaced before the request "
                     "started); it ran without early stopping")
        if spec.record:
            req.prompt = None if prompt is None else [int(t) for t in prompt]
            req.output = output
        req.notes += notes
        if n_out:
            req.notes.append(f"joined with {n_out} generated tokens; those are not pooled")
        req.slot = self._take_slot()
        if req.slot is None:
            log.error("orca: no free slot for %s; not tracked", ident)
            return None
        if spec.enabled:
            dep.bank.reset(req.slot)
            req.guard_pos = guard_position(policy, max_tokens=max_tokens, reserve=spec.reserve,
                                           force_len=len(dep.force_ids),
                                           answer_budget=spec.answer_budget)
        self.live[ident] = req
        if key is not None:
            old = self._by_key.get(key)
            if old is not None and old is not req:
                log.warning("orca_key %r reused before its result was fetched; the older "
                            "result is dropped", key)
                old.key = None
            self.results.discard(key)
            self._by_key[key] = req
        return req

    def _resume(self, req: Request, n_out: int) -> Request:
        queued = [i for i, (r, _) in enumerate(self._leaving) if r is req]
        if queued:  # removed and re-added before the removal was settled: nothing happened
            del self._leaving[queued[0]]
            return req
        if req.attached:  # re-added without a removal (should not happen)
            return req
        self.stats["resumed"] += 1
        self._parked.pop(req.ident, None)
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

    def leave(self, req: Request, final: bool) -> None:
        """A request left the batch: for good (`final`), or for a while (preempted)."""
        if self._pending is not None:  # settle after this step's readback is read
            self._leaving.append((req, final))
        else:
            self._leave_now(req, final)

    def _leave_now(self, req: Request, final: bool) -> None:
        if not final:
            req.attached = False
            req.left_at = time.monotonic()
            self._parked[req.ident] = req
            self._prune_parked()
            return
        self._parked.pop(req.ident, None)
        if self.live.get(req.ident) is req:
            del self.live[req.ident]
        if req.key is not None and self._by_key.get(req.key) is req:
            del self._by_key[req.key]
            if not req.fetched:
                self.results.put(req.key, self._result(req))
        self._free(req)
        if self._retired:
            self._drop_retired()

    def _free(self, req: Request) -> None:
        if req.slot is not None:
            self.pool.release(req.slot)
            req.slot = None
        req.snapshot = None
        req.step_embs = []
        req.handle = None

    def _take_slot(self) -> int | None:
        slot = self.pool.take()
        if slot is None and self._parked:  # evict the longest-parked request into a snapshot
            old = next(iter(self._parked.values()))
            if old.slot is not None:
                bank = old.dep.bank if old.enabled else None
                old.snapshot = (self.pool.snapshot(old.slot),
                                None if bank is None else bank.snapshot(old.slot))
                self.pool.release(old.slot)
                old.slot = None
                self.stats["evictions"] += 1
                slot = self.pool.take()
        return slot

    def _prune_parked(self) -> None:
        """Parked longer than the result TTL: it is not coming back (the adapter could not tell
        an end from a preemption)."""
        now = time.monotonic()
        for req in list(self._parked.values()):
            if now - req.left_at <= self.results.ttl:
                break
            self._leave_now(req, True)

    def settle(self) -> None:
        """Read the last step's decisions and finish the removals that waited for them."""
        if self._pending is not None:
            self._consume(self.readback.wait())
        leaving, self._leaving = self._leaving, []
        for req, final in leaving:
            self._leave_now(req, final)
        if self._parked:
            self._prune_parked()

    # -- results ----------------------------------------------------------------------------------
    def pop_results(self, keys: list[str]) -> dict[str, dict[str, Any]]:
        self.settle()
        out = {}
        for k in keys:
            req = self._by_key.get(k)
            if req is not None:  # finished but not removed from the batch yet
                r = self._result(req)
                req.fetched = True
                del self._by_key[k]
            else:
                r = self.results.pop(k)
                if r is None:
                    continue
            out[k] = _host_result(r, self.hidden_size).to_dict()
        self.results.prune()
        return out

    def _result(self, req: Request):
        pending = None
        if req.record and req.active and req.seg.pending:
            src = None
            if req.slot is not None:
                src = (self.pool.A[req.slot], self.pool.S[req.slot])
            elif req.snapshot is not None:
                src = req.snapshot[0][:2]
            if src is not None:
                count = torch.tensor([req.seg.pending], device=src[0].device)
                pending = finish_step((src[0] + src[1])[None], count, self.normalization)[0]
        return req.result(pending)

    def get_stats(self) -> dict[str, Any]:
        self.settle()
        s = dict(self.stats)
        s["tracked_requests"] = sum(1 for r in self.live.values() if r.attached)
        s["stored_results"] = len(self.results) + len(self._by_key)
        s["slots_in_use"] = self.capacity - self.pool.free_count
        s["parked_requests"] = len(self._parked)
        s["deployments"] = len(self.deps)
        return s

    # -- the engine step --------------------------------------------------------------------------
    def step(self, entries: list[Entry], hidden: Tensor | None, logits: Tensor, *,
             replay: bool = False) -> None:
        """One engine step (see module docstring). hidden: [rows, d], logits: [rows, vocab].
        `replay`: a call that feeds accepted draft tokens of this engine step (speculative
        decoding, core/speculation.py), not an engine step of its own."""
        if not replay:
            self.stats["engine_steps"] += 1
        self.settle()
        if not entries:
            return
        t0 = perf_counter_ns()
        try:
            self._step(entries, hidden, logits)
        except Exception as e:  # never take the engine down: fail the tracked requests
            log.exception("orca core failed in a step; disabling it for the requests in it")
            self._pending = None
            for req, *_ in entries:
                req.fail(f"internal error: {e!r}")
        dt = perf_counter_ns() - t0
        self.stats["probe_ns"] += dt
        self.stats["active_steps"] += 0 if replay else 1
        self.stats["max_step_ns"] = max(self.stats["max_step_ns"], dt)

    def _step(self, entries: list[Entry], hidden: Tensor | None, logits: Tensor) -> None:
        n_rows = logits.shape[0]
        h_rows: list[int] = []  # pooled tokens whose row is in `hidden`
        h_slots: list[int] = []
        l_slots: list[int] = []  # pooled tokens whose row was parked (lag)
        park_rows: list[int] = []
        park_slots: list[int] = []
        ops: list[tuple[Request, int, int, int, int]] = []  # (req, op, size, row, n)
        live: list[tuple[Request, int, int]] = []
        for req, row, n, prev_id, last_id in entries:
            if row >= n_rows or n == 0 or req.slot is None:
                continue
            if n > req.n_seen:
                if n != req.n_seen + 1:
                    req.fail(f"output grew from {req.n_seen} to {n} tokens between two steps "
                             "(speculative decoding?): hidden states missing")
                    req.n_seen = n
                    continue
                req.n_seen = n
                if last_id >= 0 and (n - 1) in req.plan and req.plan[n - 1] != last_id:
                    req.notes.append(f"forced token at {n - 1} was overridden ({last_id})")
                if req.active:
                    if req.lag is not None:  # one behind: feed the parked token, park this one
                        if prev_id < 0:
                            req.fail("two token ids in a row still unknown")
                            continue
                        tid, src = prev_id, None
                        park_rows.append(row)
                        park_slots.append(req.slot)
                        req.lag = n - 1
                    elif last_id < 0:
                        tid = None
                        park_rows.append(row)
                        park_slots.append(req.slot)
                        req.lag = n - 1
                        self.stats["lagged_tokens"] += 1
                    else:
                        tid, src = last_id, row
                    if tid is not None:
                        self._feed(req, tid, src, row, n, h_rows, h_slots, l_slots, ops)
            else:  # a row at an unchanged length: a recompute (prefill) chunk
                self.stats["recompute_chunks"] += 1
                if req.lag is not None and req.active and last_id >= 0:  # catch up
                    req.lag = None
                    self._feed(req, last_id, None, row, n, h_rows, h_slots, l_slots, ops)
            live.append((req, row, n))

        # host: guard stops, then every token forced by a plan known now
        scored_now = {id(o[0]) for o in ops if o[1] not in (MERGE, CLOSE)}
        guard_hit: set[int] = set()
        f_rows: list[int] = []
        f_ids: list[int] = []
        for req, row, n in live:
            if req.guard_pos is not None and n >= req.guard_pos and not req.stopped \
                    and req.active and req.seg.reasoning:
                req.stopped = True
                req.stop_reason = "budget"
                if id(req) in scored_now:
                    guard_hit.add(id(req))
                self._plan(req, n)
            if req.plan:
                for pos, r, t in forced_rows(req, row, n, req.plan):
                    f_rows.append(r)
                    f_ids.append(t)
                    req.forced[pos] = t

        emit = [i for i, o in enumerate(ops) if o[1] != MERGE]
        scored = [j for j, i in enumerate(emit) if ops[i][1] != CLOSE and ops[i][0].enabled
                  and (not ops[i][0].stopped or id(ops[i][0]) in guard_hit)]
        groups = _by_deployment(scored, lambda j: ops[emit[j]][0].dep)  # sorts `scored`
        st = self.staging
        st.begin()
        s_hr, s_hs, s_ls = st.add(h_rows), st.add(h_slots), st.add(l_slots)
        s_pr, s_ps = st.add(park_rows), st.add(park_slots)
        s_os = st.add([o[0].slot for o in ops])
        s_ok = st.add([o[1] for o in ops])
        s_ei = st.add(emit)
        s_ec = st.add([ops[i][2] for i in emit])
        s_fr, s_fi = st.add(f_rows), st.add(f_ids)
        sc_reqs = [ops[emit[j]] for j in scored]
        s_si = st.add(scored)
        s_bl = st.add([NEVER if r.policy == "shadow" else r.lam for r, *_ in sc_reqs])
        s_hl = st.add([NEVER if r.policy == "shadow" and r.would_stop_step is not None
                       else r.lam for r, *_ in sc_reqs])
        # scored rows whose stop would force tokens now: (position among scored, row, token)
        cands = [(j, fr, t) for j, (r, _, _, row, n) in enumerate(sc_reqs)
                 if id(r) not in guard_hit and r.policy != "shadow"
                 for _, fr, t in forced_rows(r, row, n, self._plan_preview(r, n))]
        s_cp = st.add([c[0] for c in cands])
        s_cr = st.add([c[1] for c in cands])
        s_ct = st.add([c[2] for c in cands])
        s_sl = st.add([r.slot for r, *_ in sc_reqs])
        st.upload()

        if h_rows or l_slots:
            if hidden is None or hidden.shape[0] != n_rows:
                got = None if hidden is None else hidden.shape[0]
                raise RuntimeError(f"captured {got} hidden rows for {n_rows} logits rows")
            parts = []
            if h_rows:
                parts.append(hidden.index_select(0, st.long(s_hr)))
            if l_slots:
                parts.append(self.pool.lag.index_select(0, st.long(s_ls)))
            rows = parts[0] if len(parts) == 1 else torch.cat(parts)  # [k, d]
            h = normalize_tokens(rows, self.normalization).to(self.pool.S.dtype)
            slots = st.long(s_hs) if not l_slots else torch.cat([st.long(s_hs), st.long(s_ls)])
            # slots are distinct within a step; index_put_ stays serial on CPU
            self.pool.S.index_put_((slots,), h, accumulate=True)
            self.stats["rows_captured"] += len(h_rows) + len(l_slots)
        if park_rows:
            if hidden is None or hidden.shape[0] != n_rows:
                raise RuntimeError("no hidden rows to park")
            self.pool.lag.index_copy_(0, st.long(s_ps),
                                      hidden.index_select(0, st.long(s_pr)).float())
        if ops:
            self._pool_steps(ops, emit, scored, st.long(s_os), st.long(s_ok), st.long(s_ei),
                             st.float(s_ec), st.long(s_si), st.float(s_bl), st.float(s_hl),
                             (st.long(s_cp), st.long(s_cr), st.long(s_ct)) if cands else None,
                             st.long(s_sl), sc_reqs, groups, logits, guard_hit)
        if f_rows:
            r = st.long(s_fr)
            logits.index_fill_(0, r, float("-inf"))
            logits.index_put_((r, st.long(s_fi)),
                              torch.zeros(len(f_rows), dtype=logits.dtype, device=logits.device))

    def _feed(self, req: Request, tid: int, src: int | None, row: int, n: int,
              h_rows: list[int], h_slots: list[int], l_slots: list[int],
              ops: list[tuple[Request, int, int, int, int]]) -> None:
        """Segment one token; `src`: its hidden row in this step (None: parked in pool.lag)."""
        seg = req.seg
        a_before, s_before = seg.a_count, seg.s_count
        counted, op = seg.feed(tid)
        if counted:
            if src is None:
                l_slots.append(req.slot)
            else:
                h_rows.append(src)
                h_slots.append(req.slot)
        if op != NONE:
            size = a_before if op == STEP_PREV else a_before + s_before + (1 if counted else 0)
            ops.append((req, op, size, row, n))

    def _pool_steps(self, ops, emit, scored, slots, kinds, emit_d, counts, scored_d, bank_lam,
                    hit_lam, cands, bank_rows, sc_reqs, groups, logits, guard_hit) -> None:
        """Apply the ops to A/S, finish the emitted steps, score them (each deployment's
        requests, a contiguous range of the scored ones, through its own bank), force stops on
        the device."""
        pool = self.pool
        if all(d.table.keyword_re is None for d in self.deps.values()):
            # no keywords: every op is STEP or CLOSE and A stays zero; the step is the section
            num = pool.S.index_select(0, slots)  # [k, d]
        else:
            # phi numerator = cA*A + cS*S ; new A = aA*A + aS*S ; new S = 0
            c_s = ((kinds == STEP) | (kinds == CLOSE)).to(pool.S.dtype)  # [k]
            a_a = (kinds == MERGE).to(pool.S.dtype)
            a_s = ((kinds == MERGE) | (kinds == STEP_PREV)).to(pool.S.dtype)
            A = pool.A.index_select(0, slots)  # [k, d]
            S = pool.S.index_select(0, slots)
            num = A + S * c_s[:, None]
            pool.A.index_copy_(0, slots, A * a_a[:, None] + S * a_s[:, None])
        pool.S.index_fill_(0, slots, 0.0)
        if not emit:
            return
        phi = finish_step(num.index_select(0, emit_d), counts, self.normalization)  # [e, d]
        for j, i in enumerate(emit):
            req, _, size, _, _ = ops[i]
            if req.record:
                req.step_embs.append(phi[j])
                req.step_counts.append(size)
        if not scored:
            return
        phi_s = phi.index_select(0, scored_d)  # [m, d], grouped by deployment
        res = [dep.bank.step(torch.tensor([r.slot for r, *_ in sc_reqs[a:b]]), phi_s[a:b],
                             bank_lam[a:b], rows_dev=bank_rows[a:b]) for dep, a, b in groups]
        # [m] each: slices of device tensors and their concatenation wait for nothing
        smoothed, stop, steps = ((res[0].smoothed, res[0].stop, res[0].steps) if len(res) == 1
                                 else (torch.cat([r.smoothed for r in res]),
                                       torch.cat([r.stop for r in res]),
                                       torch.cat([r.steps for r in res])))
        hit = smoothed >= hit_lam
        if cands is not None:  # a probe stop forces its first token now, decided on the device
            pos, rows, tok = cands
            flag = stop.index_select(0, pos)  # [c]
            cur = logits.index_select(0, rows)  # [c, vocab]
            forced = torch.full_like(cur, float("-inf"))
            forced.scatter_(1, tok[:, None], 0.0)
            logits.index_copy_(0, rows, torch.where(flag[:, None], forced, cur))
        self.readback.start(torch.stack([smoothed.float(), hit.float(), steps.float()]))
        # (request, position, guard-stopped, logits rows a stop forced on the device)
        self._pending = [(r, n, id(r) in guard_hit, 1 + len(r.draft_rows))
                         for r, _, _, _, n in sc_reqs]

    def _consume(self, host: list[list[float]]) -> None:
        """The previous step's decisions reach the host: scores, would-stop and stop steps, and
        the rest of each stop's forced text (its first token was forced on the device)."""
        pending, self._pending = self._pending, None
        sm, hit, steps = host
        self.stats["steps_scored"] += len(pending)
        for i, (req, pos, guard_stopped, rows) in enumerate(pending):
            req.scores.append(sm[i])
            req.steps_scored = int(steps[i])
            if hit[i] < 0.5:
                continue
            if req.would_stop_step is None:
                req.would_stop_step = req.steps_scored
            if req.policy == "shadow":
                continue
            req.stop_step = req.steps_scored
            req.stop_reason = "probe"
            if not guard_stopped:  # a guard stop at the same step already planned the same
                req.stopped = True
                self._plan(req, pos)
                if pos >= req.decided_until:  # else nothing was forced: see core/speculation.py
                    for p in range(pos, pos + rows):
                        t = req.plan.get(p)
                        if t is not None:
                            req.forced[p] = t

    def _plan_preview(self, req: Request, pos: int) -> dict[int, int]:
        return stop_plan(req.policy, pos, force_ids=req.dep.force_ids, eos=req.eos,
                         answer_budget=req.answer_budget, max_tokens=req.max_tokens,
                         ignore_eos=req.ignore_eos)

    def _plan(self, req: Request, pos: int) -> None:
        req.active = False  # segmentation and scoring end with the stop
        req.guard_pos = None
        req.plan = self._plan_preview(req, plan_start(req, pos))


def _by_deployment(scored: list[int], dep_of) -> list[tuple[Deployment, int, int]]:
    """Sort `scored` (in place, stable) so each deployment's entries are contiguous; returns
    (deployment, start, end) per range, in order of first appearance."""
    order: dict[int, int] = {}
    deps: list[Deployment] = []
    for j in scored:
        d = dep_of(j)
        if id(d) not in order:
            order[id(d)] = len(deps)
            deps.append(d)
    counts = [0] * len(deps)
    for j in scored:
        counts[order[id(dep_of(j))]] += 1
    if len(deps) > 1:
        scored.sort(key=lambda j: order[id(dep_of(j))])
    groups, start = [], 0
    for d, c in zip(deps, counts):
        groups.append((d, start, start + c))
        start += c
    return groups


def _host_result(r, dim: int):
    """Record-mode embeddings as one float32 numpy array (the only copy of them to the host)."""
    import numpy as np

    if r.step_embeddings is not None and not isinstance(r.step_embeddings, np.ndarray):
        embs = r.step_embeddings
        r.step_embeddings = (torch.stack(embs).float().cpu().numpy() if embs else
                             np.zeros((0, dim), dtype=np.float32))
    return r
