"""The V1 custom logits processor: pool step embeddings, run the probe, stop requests.

Per engine step (`apply(logits)`), for each tracked request row:
1. the row's hidden state (captured at the LM head, same row order as `logits`) is the state of
   `output_ids[-1]`, the token sampled in the previous step. Rows vLLM discards (partial prefill
   chunks, including the recompute after a preemption) and rows whose output did not grow are
   skipped: every decision is keyed on the output length, never on the number of calls;
2. the token goes through the request's `Segmenter` (orca_serve.steps); if it is counted, its
   normalised state is added to the request's running section sum (one gather + one
   `index_add_` for the whole batch);
3. for requests whose step just completed, phi_t = finish_step(sum, count) and ProbeBank.step
   scores, smooths, decides and updates (one call for the batch; one device-to-host copy);
4. forced tokens (a stop's end-of-thinking text, EOS) are written as a -inf mask except one id.

State lives per vLLM request id, not per batch row, so row moves and preemption (remove, later
re-add of the same request) cannot mix requests; the probe row and the pooled sums are
snapshotted on removal and restored on re-add. Results stay until fetched (`pop_results`) or
expired. See docs/PLUGIN.md.
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
import threading
import time
import weakref
from collections import OrderedDict
from time import perf_counter_ns
from typing import Any

import numpy as np
import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from orca_serve.procedure import NEVER, ProbeBank, finish_step, normalize_tokens
from orca_serve.steps import CLOSE, MERGE, NONE, STEP, STEP_PREV, Segmenter, TokenTable
from orca_serve.vllm_plugin import capture
from orca_serve.vllm_plugin.config import DEFAULTS, ENV_BUNDLE, MAX_RESULTS, RESULT_TTL_S

log = logging.getLogger("orca_serve.vllm_plugin")

POLICIES = ("answer", "stop", "shadow")
DEFAULT_ANSWER_BUDGET = 64
MIN_ANSWER_TOKENS = 8  # answer tokens the end-of-max_tokens reserve keeps (policy answer)
_CHILD_RE = re.compile(r"^(\d+)_")

# every live processor of this process (the worker extension asks them)
PROCESSORS: weakref.WeakSet = weakref.WeakSet()

_INT_ARGS = ("orca_enabled", "orca_answer_budget", "orca_record", "orca_reserve")


def _as_int(name: str, v: Any) -> int:
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v)
    raise ValueError(f"{name} must be an integer, got {v!r}")


def _as_lam(v: Any) -> float:
    """`orca_lam`: a threshold in [0, 1], or "inf" (no early stop; JSON has no infinity)."""
    if v == "inf":
        return NEVER
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
        raise ValueError(f"orca_lam must be a number in [0, 1] or \"inf\", got {v!r}")
    return float(v)


class _Req:
    """Everything the plugin keeps about one vLLM request (a child of n>1 is its own request)."""

    __slots__ = (
        "active",
        "answer_budget",
        "attached",
        "bank_row",
        "delta",
        "detached_at",
        "enabled",
        "eos",
        "error",
        "fetched",
        "forced",
        "guard_pos",
        "ignore_eos",
        "index",
        "key",
        "lam",
        "max_tokens",
        "n_seen",
        "notes",
        "out",
        "params",
        "plan",
        "policy",
        "prompt_ids",
        "prompt_len",
        "record",
        "req_id",
        "reserve",
        "saved_bank",
        "saved_sums",
        "scores",
        "seg",
        "shadow_pending",
        "slot",
        "step_counts",
        "step_embs",
        "steps_scored",
        "stop_reason",
        "stop_step",
        "stopped",
        "would_stop_step",
    )

    def __init__(self) -> None:
        self.scores: list[float] = []
        self.steps_scored = 0
        self.stopped = False
        self.stop_step: int | None = None
        self.stop_reason: str | None = None
        self.would_stop_step: int | None = None
        self.plan: dict[int, int] = {}
        self.forced: dict[int, int] = {}  # output position -> forced token id
        self.step_embs: list[torch.Tensor] = []
        self.step_counts: list[int] = []
        self.attached = True
        self.fetched = False
        self.detached_at = 0.0
        self.error: str | None = None
        self.notes: list[str] = []
        self.slot: int | None = None
        self.bank_row: int | None = None
        self.saved_sums: tuple[torch.Tensor, torch.Tensor] | None = None
        self.saved_bank: dict | None = None
        self.n_seen = 0
        self.guard_pos: int | None = None
        self.shadow_pending = False

    def fail(self, msg: str) -> None:
        if self.error is None:
            self.error = msg
            log.error("orca request %s (%s): %s", self.key, self.req_id, msg)
        self.active = False
        self.plan = {}
        self.guard_pos = None


class OrcaLogitsProcessor(LogitsProcessor):
    """ORCA early stopping as a vLLM V1 logits processor (see module docstring)."""

    # -- front-end validation (HTTP 400 on bad per-request arguments) ----------------------
    @classmethod
    def validate_params(cls, sampling_params) -> None:
        xa = sampling_params.extra_args
        if not xa:
            return
        if "orca_key" in xa and not isinstance(xa["orca_key"], str):
            raise ValueError(f"orca_key must be a string, got {xa['orca_key']!r}")
        for name in _INT_ARGS:
            if name in xa:
                v = _as_int(name, xa[name])
                if name in ("orca_enabled", "orca_record") and v not in (0, 1):
                    raise ValueError(f"{name} must be 0 or 1, got {xa[name]!r}")
                if name in ("orca_answer_budget", "orca_reserve") and v < 0:
                    raise ValueError(f"{name} must be >= 0, got {xa[name]!r}")
        if "orca_delta" in xa:
            d = xa["orca_delta"]
            if isinstance(d, bool) or not isinstance(d, (int, float, str)):
                raise ValueError(f"orca_delta must be a number, got {d!r}")
            try:
                d = float(d)
            except ValueError:
                raise ValueError(f"orca_delta must be a number, got {d!r}") from None
            if not 0 < d < 1:
                raise ValueError(f"orca_delta must be in (0, 1), got {d!r}")
        if "orca_lam" in xa:
            _as_lam(xa["orca_lam"])
        if "orca_policy" in xa and xa["orca_policy"] not in POLICIES:
            raise ValueError(f"orca_policy must be one of {', '.join(POLICIES)}, "
                             f"got {xa['orca_policy']!r}")
        # n > 1: children get copies of these params; tell them they are children so that each
        # reads its index from its request id "<i>_<parent id>"
        # (vllm/v1/engine/parallel_sampling.py:94)
        if getattr(sampling_params, "n", 1) > 1 and "orca_key" in xa:
            xa["orca_n"] = int(sampling_params.n)

    # -- construction (in the worker, inside GPUModelRunner.__init__) ----------------------
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        self._lock = threading.RLock()
        self._runner = _find_model_runner()
        cfg = dict((getattr(vllm_config, "additional_config", None) or {}).get("orca") or {})
        if not cfg and os.environ.get(ENV_BUNDLE):
            cfg = {"bundle": os.environ[ENV_BUNDLE]}
        self.cfg = cfg
        self.record_default = bool(cfg.get("record", False))
        self.defaults = {**DEFAULTS, **(cfg.get("defaults") or {})}
        self.ttl = float(cfg.get("result_ttl_s", RESULT_TTL_S))
        self.max_results = int(cfg.get("max_results", MAX_RESULTS))
        mc = vllm_config.model_config
        self.hidden_size = int(mc.get_hidden_size())
        self.bundle = None
        bundle_path = cfg.get("bundle")
        tok = _load_tokenizer(mc)
        vocab = tok.get_vocab()
        if bundle_path:
            from orca_serve.bundle import check_model, load_bundle

            self.bundle = load_bundle(bundle_path)
            check_model(self.bundle, self.hidden_size, vocab, str(mc.model))
            seg_cfg, think = self.bundle.segmentation, self.bundle.think
            self.normalization = self.bundle.normalization
        else:
            from orca_serve.bundle import Segmentation, ThinkTags

            seg_cfg = Segmentation(**(cfg.get("segmentation") or {}))
            think = ThinkTags(**(cfg.get("think") or {}))
            self.normalization = cfg.get("normalization") or "token-l2"
        self.think = think
        eos_ids = set()
        if tok.eos_token_id is not None:
            eos_ids.add(int(tok.eos_token_id))
        try:
            gen = mc.try_get_generation_config() or {}
            ge = gen.get("eos_token_id")
            eos_ids |= set([ge] if isinstance(ge, int) else (ge or []))
        except Exception as e:  # noqa: BLE001 - generation config is optional
            log.debug("no generation config for EOS ids: %s", e)
        self.default_eos = int(tok.eos_token_id) if tok.eos_token_id is not None else None
        self.table = TokenTable.from_tokenizer(tok, segmentation=seg_cfg, think=think,
                                               eos_ids=eos_ids)
        self.force_ids = (tok.encode(think.force_text, add_special_tokens=False)
                          if think.force_text else [])
        self.bank: ProbeBank | None = None
        if self.bundle is not None:
            self.bank = ProbeBank(self.bundle.load_probe(), window=self.bundle.window,
                                  capacity=16, device=self.device)
        # pooled sums per slot: A = completed sections of the current step, S = current section
        self._cap = 0
        self._A = torch.zeros(0, self.hidden_size, device=self.device)
        self._S = torch.zeros(0, self.hidden_size, device=self.device)
        self._free_slots: list[int] = []
        self._grow(16)
        self._rows: dict[int, _Req] = {}  # batch row -> tracked request
        self._states: dict[str, _Req] = {}  # vLLM request id -> state (attached or not)
        self._by_key: dict[str, _Req] = {}  # result key -> state
        self._detached: OrderedDict[str, _Req] = OrderedDict()
        self.stats = {"probe_ns": 0, "engine_steps": 0, "active_steps": 0, "rows_captured": 0,
                      "steps_scored": 0, "max_step_ns": 0, "resumed": 0,
                      "recompute_chunks": 0}
        PROCESSORS.add(self)
        log.info("orca processor ready: bundle=%s record=%s think=%s runner=%s", bundle_path,
                 self.record_default, think.enabled, type(self._runner).__name__)

    def is_argmax_invariant(self) -> bool:
        return False  # it forces tokens

    # -- slots -----------------------------------------------------------------------------
    def _grow(self, cap: int) -> None:
        z = torch.zeros(cap - self._cap, self.hidden_size, device=self.device)
        self._A = torch.cat([self._A, z])
        self._S = torch.cat([self._S, z.clone()])
        self._free_slots.extend(range(cap - 1, self._cap - 1, -1))
        self._cap = cap

    def _take_slot(self) -> int:
        if not self._free_slots:
            self._grow(2 * self._cap)
        s = self._free_slots.pop()
        self._A[s].zero_()
        self._S[s].zero_()
        return s

    # -- batch bookkeeping ------------------------------------------------------------------
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        with self._lock:
            for row in batch_update.removed:
                st = self._rows.pop(row, None)
                if st is not None:
                    self._detach(st)
            new: dict[int, tuple] = {}
            for row, params, prompt, out in batch_update.added:
                old = self._rows.pop(row, None)
                if old is not None:  # replaced without a removal (should not happen)
                    self._detach(old)
                new.pop(row, None)
                if self._wants(params):
                    new[row] = (params, prompt, out)
            for a, b, kind in batch_update.moved:
                if kind == MoveDirectionality.SWAP:
                    sa, sb = self._rows.pop(a, None), self._rows.pop(b, None)
                    na, nb = new.pop(a, None), new.pop(b, None)
                    if sa is not None:
                        self._rows[b] = sa
                    if sb is not None:
                        self._rows[a] = sb
                    if na is not None:
                        new[b] = na
                    if nb is not None:
                        new[a] = nb
                else:
                    sa, na = self._rows.pop(a, None), new.pop(a, None)
                    gone = self._rows.pop(b, None)
                    if gone is not None:
                        self._detach(gone)
                    new.pop(b, None)
                    if sa is not None:
                        self._rows[b] = sa
                    if na is not None:
                        new[b] = na
            for row, (params, prompt, out) in new.items():
                self._attach(row, params, prompt, out)
            if batch_update.removed:
                self._prune()

    def _wants(self, params) -> bool:
        xa = params.extra_args or {}
        if int(xa.get("orca_record", self.record_default)):
            return True
        return self.bank is not None and bool(int(xa.get("orca_enabled",
                                                          self.defaults["enabled"])))

    def _req_id(self, row: int, out: list) -> str:
        r = self._runner
        if r is not None:
            ib = r.input_batch
            try:
                if ib.req_output_token_ids[row] is out:
                    return ib.req_ids[row]
            except (IndexError, AttributeError):
                pass
            for i, lst in enumerate(ib.req_output_token_ids):  # rows already rearranged
                if lst is out:
                    return ib.req_ids[i]
        return f"list-{id(out)}"

    def _attach(self, row: int, params, prompt, out: list) -> None:
        req_id = self._req_id(row, out)
        st = self._states.get(req_id)
        if st is not None and (st.out is out or not req_id.startswith("list-")):
            # resumed after preemption (same request id; under async scheduling vLLM gives the
            # resumed request a new output list, gpu_model_runner.py:1439)
            self.stats["resumed"] += 1
            st.out = out
            if len(out) < st.n_seen:
                st.fail(f"output shrank from {st.n_seen} to {len(out)} tokens while preempted")
            self._detached.pop(req_id, None)
            st.attached = True
            st.slot = self._take_slot()
            if st.saved_sums is not None:
                self._A[st.slot].copy_(st.saved_sums[0])
                self._S[st.slot].copy_(st.saved_sums[1])
                st.saved_sums = None
            if st.saved_bank is not None and self.bank is not None:
                st.bank_row = self.bank.add()
                self.bank.restore(st.bank_row, st.saved_bank)
                st.saved_bank = None
            self._rows[row] = st
            return
        st = _Req()
        st.req_id, st.params, st.out = req_id, params, out
        st.prompt_len = len(prompt) if prompt is not None else 0
        xa = params.extra_args or {}
        key = xa.get("orca_key")
        st.index = 0
        if key is not None and int(xa.get("orca_n", 1)) > 1:
            m = _CHILD_RE.match(req_id)
            if m:
                st.index = int(m.group(1))
            else:
                st.notes.append(f"n>1 but request id {req_id!r} has no child index")
        st.key = None if key is None else (key if st.index == 0 else f"{key}/{st.index}")
        st.record = bool(int(xa.get("orca_record", self.record_default)))
        st.enabled = self.bank is not None and bool(int(xa.get("orca_enabled",
                                                                self.defaults["enabled"])))
        st.policy = xa.get("orca_policy", self.defaults["policy"])
        if st.policy == "stop" and params.ignore_eos:
            st.notes.append("policy stop under ignore_eos: a forced EOS would not end the "
                            "request, so it runs as shadow")
            st.policy = "shadow"
        if st.policy != "shadow" and getattr(params, "structured_outputs", None) is not None:
            st.notes.append("structured output: forcing tokens would break the grammar, so it "
                            "runs as shadow")
            st.policy = "shadow"
        st.answer_budget = int(xa.get("orca_answer_budget", self.defaults["answer_budget"]))
        st.delta = st.lam = None
        if self.bundle is not None:
            d = xa.get("orca_delta", self.defaults["delta"])
            try:
                st.delta = float(d) if d is not None else self.bundle.default_delta
                st.lam = self.bundle.lam(st.delta)
            except Exception as e:  # noqa: BLE001 - not in the table: use the default
                st.notes.append(f"{e}; using the bundle default delta")
                st.delta = self.bundle.default_delta
                st.lam = self.bundle.lam(st.delta)
            if "orca_lam" in xa:  # the server resolved lambda (its audit guard may override it)
                st.lam = _as_lam(xa["orca_lam"])
        st.max_tokens = params.max_tokens
        st.ignore_eos = bool(params.ignore_eos)
        eos = getattr(params, "eos_token_id", None)
        st.eos = self.default_eos if eos is None else int(eos)
        st.seg = Segmenter(self.table, prompt, keep_ids=st.record)
        st.prompt_ids = list(prompt) if st.record and prompt is not None else None
        st.active = True
        st.n_seen = len(out)  # tokens already generated before we saw it are not pooled
        if st.n_seen:
            st.notes.append(f"joined with {st.n_seen} generated tokens; those are not pooled")
        st.slot = self._take_slot()
        if st.enabled:
            st.bank_row = self.bank.add()
            if st.policy == "answer" and st.max_tokens is not None:
                reserve = xa.get("orca_reserve")
                reserve = (len(self.force_ids) + min(st.answer_budget, MIN_ANSWER_TOKENS)
                           if reserve is None else int(reserve))
                if reserve > 0 and st.max_tokens >= 2 * reserve:
                    st.guard_pos = st.max_tokens - reserve
        self._states[req_id] = st
        if st.key is not None:
            if st.key in self._by_key and self._by_key[st.key] is not st:
                log.warning("orca_key %r reused before its result was fetched; the older "
                            "result is dropped", st.key)
                self._drop(self._by_key[st.key])
            self._by_key[st.key] = st
        self._rows[row] = st

    def _detach(self, st: _Req) -> None:
        st.attached = False
        st.detached_at = time.monotonic()
        if st.slot is not None:
            if st.seg.pending and st.active:
                st.saved_sums = (self._A[st.slot].clone(), self._S[st.slot].clone())
            self._free_slots.append(st.slot)
            st.slot = None
        if st.bank_row is not None:
            if st.active and not st.stopped:
                st.saved_bank = self.bank.snapshot(st.bank_row)
            self.bank.free(st.bank_row)
            st.bank_row = None
        finished = bool(st.out) and (st.out[-1] == st.eos or (
            st.max_tokens is not None and len(st.out) >= st.max_tokens))
        if st.fetched or (st.key is None and finished):
            self._drop(st)
        else:
            self._detached[st.req_id] = st

    def _drop(self, st: _Req) -> None:
        if st.attached:
            st.fetched = True  # dropped when it leaves the batch
            if st.key is not None and self._by_key.get(st.key) is st:
                del self._by_key[st.key]
            return
        self._states.pop(st.req_id, None)
        self._detached.pop(st.req_id, None)
        if st.key is not None and self._by_key.get(st.key) is st:
            del self._by_key[st.key]

    def _prune(self) -> None:
        now = time.monotonic()
        while self._detached:
            st = next(iter(self._detached.values()))
            if now - st.detached_at > self.ttl or len(self._detached) > self.max_results:
                self._drop(st)
            else:
                break

    # -- the engine step ----------------------------------------------------------------------
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self.stats["engine_steps"] += 1
        if not self._rows:
            capture.take_rows()
            return logits
        t0 = perf_counter_ns()
        with self._lock:
            try:
                self._apply(logits)
            except Exception as e:  # never take the engine down: fail the tracked requests
                log.exception("orca processor failed in apply(); disabling it for the requests "
                              "in this batch")
                for st in self._rows.values():
                    st.fail(f"internal error: {e!r}")
        dt = perf_counter_ns() - t0
        self.stats["probe_ns"] += dt
        self.stats["active_steps"] += 1
        self.stats["max_step_ns"] = max(self.stats["max_step_ns"], dt)
        return logits

    def _apply(self, logits: torch.Tensor) -> None:
        hidden = capture.take_rows()
        n_rows = logits.shape[0]
        discard = None
        if self._runner is not None:
            discard = self._runner.discard_request_mask.np
        cap_rows: list[int] = []
        cap_slots: list[int] = []
        ops: list[tuple[_Req, int, int]] = []  # (state, op, tokens in the emitted step)
        live: list[tuple[int, _Req, int]] = []
        for row, st in self._rows.items():
            if row >= n_rows:
                continue
            out = st.out
            n = len(out)
            if n == 0:
                continue
            if discard is not None and discard[row]:
                self.stats["recompute_chunks"] += 1  # partial prefill after a preemption
                continue
            if n > st.n_seen:
                if n != st.n_seen + 1 or out[n - 1] < 0:
                    st.fail(f"output grew from {st.n_seen} to {n} tokens between two steps "
                            f"(last id {out[n - 1]}; speculative decoding?): hidden states "
                            "missing")
                    st.n_seen = n
                    continue
                st.n_seen = n
                tid = out[n - 1]
                if st.plan and (n - 1) in st.plan and st.plan[n - 1] != tid:
                    st.notes.append(f"forced token at {n - 1} was overridden ({tid})")
                if st.active:
                    a_before, s_before = st.seg.a_count, st.seg.s_count
                    counted, op = st.seg.feed(tid)
                    if counted:
                        cap_rows.append(row)
                        cap_slots.append(st.slot)
                    if op != NONE:
                        if op == STEP_PREV:
                            size = a_before
                        else:
                            size = a_before + s_before + (1 if counted else 0)
                        ops.append((st, op, size))
            elif discard is None and n == st.n_seen and not st.plan:
                continue  # no runner: a row at an unchanged length is a recompute chunk
            live.append((row, st, n))
        if cap_rows:
            if hidden is None or hidden.shape[0] != n_rows:
                got = None if hidden is None else hidden.shape[0]
                for st, _, _ in ops:
                    st.fail(f"captured {got} hidden rows for {n_rows} logits rows")
                for row in cap_rows:
                    self._rows[row].fail(f"captured {got} hidden rows for {n_rows} logits rows")
                ops = []
            else:
                idx = torch.tensor(cap_rows, device=hidden.device)
                h = normalize_tokens(hidden.index_select(0, idx), self.normalization)
                # slots are distinct; index_put_ stays serial (index_add_ sometimes entered an
                # OpenMP region and spun for milliseconds on this oversubscribed CPU)
                self._S.index_put_((torch.tensor(cap_slots, device=self.device),),
                                   h.to(self.device), accumulate=True)
                self.stats["rows_captured"] += len(cap_rows)
        if ops:
            self._run_ops([o for o in ops if o[0].active])
        if live:
            self._force(logits, live)

    def _run_ops(self, ops: list[tuple[_Req, int, int]]) -> None:
        if not ops:
            return
        dev = self.device
        slots = torch.tensor([st.slot for st, _, _ in ops], device=dev)
        kinds = [op for _, op, _ in ops]
        if self.table.keyword_re is None:
            # every op is STEP or CLOSE and A stays empty: the step is the section sum
            num = self._S.index_select(0, slots)
            self._S.index_fill_(0, slots, 0.0)
            counts = torch.tensor([size for _, _, size in ops], device=dev)
            self._emit(ops, list(range(len(ops))),
                       finish_step(num, counts, self.normalization))
            return
        # phi numerator = cA*A + cS*S ; new A = aA*A + aS*S ; new S = 0
        c_s = torch.tensor([1.0 if k in (STEP, CLOSE) else 0.0 for k in kinds], device=dev)
        a_a = torch.tensor([1.0 if k == MERGE else 0.0 for k in kinds], device=dev)
        a_s = torch.tensor([1.0 if k in (MERGE, STEP_PREV) else 0.0 for k in kinds], device=dev)
        A = self._A.index_select(0, slots)
        S = self._S.index_select(0, slots)
        num = A + S * c_s[:, None]
        self._A.index_copy_(0, slots, A * a_a[:, None] + S * a_s[:, None])
        self._S.index_fill_(0, slots, 0.0)
        emit = [i for i, k in enumerate(kinds) if k != MERGE]
        if not emit:
            return
        ei = torch.tensor(emit, device=dev)
        counts = torch.tensor([ops[i][2] for i in emit], device=dev)
        self._emit(ops, emit, finish_step(num.index_select(0, ei), counts, self.normalization))

    def _emit(self, ops: list[tuple[_Req, int, int]], emit: list[int], phi: torch.Tensor) -> None:
        """Completed steps: keep them (record) and score them (probe on, not stopped)."""
        dev = self.device
        scored: list[int] = []  # positions in `emit` that go to the probe
        for j, i in enumerate(emit):
            st, op, size = ops[i]
            if st.record:
                st.step_embs.append(phi[j])
                st.step_counts.append(size)
            if op != CLOSE and st.enabled and not st.stopped:
                scored.append(j)
        if scored and self.bank is not None:
            if len(scored) < len(emit):
                phi = phi.index_select(0, torch.tensor(scored, device=dev))
            self._score([ops[emit[j]][0] for j in scored], phi)

    def _score(self, sts: list[_Req], phi: torch.Tensor) -> None:
        """One probe step for these rows. Shadow rows never stop inside the bank (their update
        happens as in a never-stopping replay); whether they would stop is the same comparison
        of the smoothed score with their lambda, made here."""
        bank = self.bank
        rows = torch.tensor([st.bank_row for st in sts])  # host-side, see ProbeBank.step
        lam = torch.tensor([NEVER if (st.policy == "shadow" and st.would_stop_step is not None)
                            else st.lam for st in sts], device=self.device)
        shadow = torch.tensor([st.policy == "shadow" for st in sts], device=self.device)
        res = bank.step(rows, phi, torch.where(shadow, NEVER, lam))
        hit = res.smoothed >= lam
        # the one device-to-host copy of the step
        host = torch.stack([res.smoothed.float(), hit.float(), res.steps.float()]).cpu()
        sm, stp, nsteps = host[0].tolist(), host[1].tolist(), host[2].tolist()
        self.stats["steps_scored"] += len(sts)
        for i, st in enumerate(sts):
            st.scores.append(sm[i])
            st.steps_scored = int(nsteps[i])
            if stp[i] < 0.5:
                continue
            if st.would_stop_step is None:
                st.would_stop_step = st.steps_scored
            if st.policy == "shadow":
                continue
            st.stopped = True
            st.stop_step = st.steps_scored
            st.stop_reason = "probe"
            self._plan_stop(st, st.n_seen)

    def _plan_stop(self, st: _Req, pos: int) -> None:
        """Forced tokens by output position, starting at `pos` (the token sampled now)."""
        st.active = False  # segmentation and scoring end with the stop
        st.guard_pos = None
        limit = st.max_tokens if st.max_tokens is not None else math.inf
        plan: dict[int, int] = {}
        if st.policy == "stop":
            if st.eos is not None:
                plan[pos] = st.eos
        else:  # answer
            p = pos
            for t in self.force_ids:
                if p >= limit:
                    break
                plan[p] = t
                p += 1
            eos_at = p + st.answer_budget
            if not st.ignore_eos and st.eos is not None and eos_at < limit:
                plan[eos_at] = st.eos
        st.plan = plan

    def _force(self, logits: torch.Tensor, live: list[tuple[int, _Req, int]]) -> None:
        f_rows: list[int] = []
        f_ids: list[int] = []
        for row, st, n in live:
            if st.guard_pos is not None and n >= st.guard_pos and not st.stopped and st.active \
                    and st.seg.reasoning:
                st.stopped = True
                st.stop_reason = "budget"
                self._plan_stop(st, n)
            if st.plan:
                t = st.plan.get(n)
                if t is not None:
                    f_rows.append(row)
                    f_ids.append(t)
                    st.forced[n] = t
        if f_rows:
            r = torch.tensor(f_rows, device=logits.device)
            logits.index_fill_(0, r, float("-inf"))
            logits[r, torch.tensor(f_ids, device=logits.device)] = 0.0

    # -- results --------------------------------------------------------------------------
    def pop_results(self, keys: list[str]) -> dict[str, dict]:
        with self._lock:
            out = {}
            for k in keys:
                st = self._by_key.get(k)
                if st is None:
                    continue
                out[k] = self._result(st)
                self._drop(st)
            return out

    def peek_result(self, key: str) -> dict | None:
        with self._lock:
            st = self._by_key.get(key)
            return None if st is None else self._result(st)

    def _result(self, st: _Req) -> dict[str, Any]:
        forced = [st.forced[p] for p in sorted(st.forced)]
        d: dict[str, Any] = {
            "enabled": st.enabled,
            "policy": st.policy,
            "delta": st.delta,
            "lam": None if st.lam is None or st.lam == NEVER else st.lam,
            "steps_scored": st.steps_scored,
            "stopped_early": st.stopped and st.stop_reason == "probe",
            "stop_step": st.stop_step,
            "would_stop_step": st.would_stop_step,
            "last_score": st.scores[-1] if st.scores else None,
            "scores": list(st.scores),
            "reasoning_tokens": st.seg.counted_total,
            "forced_tokens": forced,
            "stop_reason": st.stop_reason,
            "index": st.index,
        }
        if st.notes:
            d["notes"] = list(st.notes)
        if st.error:
            d["error"] = st.error
        if st.record:
            embs = list(st.step_embs)
            counts = list(st.step_counts)
            ids = [list(s) for s in st.seg.steps]
            pend = st.seg.pending if st.active else 0
            if pend:
                if st.slot is not None:
                    a, s = self._A[st.slot], self._S[st.slot]
                elif st.saved_sums is not None:
                    a, s = st.saved_sums
                else:
                    a = s = None
                if a is not None:
                    phi = finish_step((a + s)[None], torch.tensor([pend], device=a.device),
                                      self.normalization)[0]
                    embs.append(phi)
                    counts.append(pend)
                    ids.append(st.seg.finish() or [])
            if embs:
                arr = torch.stack(embs).float().cpu().numpy()
            else:
                arr = np.zeros((0, self.hidden_size), dtype=np.float32)
            d["step_embeddings"] = arr.astype(np.float32, copy=False)
            d["step_tokens"] = counts
            d["step_token_ids"] = ids
            # the token sequence the answer probes continue (calibration/probing.py)
            d["prompt_token_ids"] = st.prompt_ids
            d["output_token_ids"] = [int(t) for t in st.out]
        return d

    def get_stats(self) -> dict[str, Any]:
        with self._lock:
            s = dict(self.stats)
            s["tracked_requests"] = len(self._rows)
            s["stored_results"] = len(self._by_key)
            return s


def _find_model_runner():
    """The GPUModelRunner (CPUModelRunner subclasses it) constructing us, found on the stack.

    vLLM builds logits processors inside GPUModelRunner.__init__
    (vllm/v1/worker/gpu_model_runner.py, `build_logitsprocs(...)`). We need it for the request
    ids of the batch rows (`input_batch.req_ids`) and for `discard_request_mask` (rows whose
    sampled token vLLM throws away: partial prefill chunks). None if not found (other versions):
    then rows are keyed by output-list identity and recompute chunks are detected by length.
    """
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception:  # noqa: BLE001
        return None
    f = sys._getframe(1)
    for _ in range(30):
        if f is None:
            break
        obj = f.f_locals.get("self")
        if isinstance(obj, GPUModelRunner):
            return obj
        f = f.f_back
    log.warning("orca: model runner not found on the stack; falling back to length-keyed rows")
    return None


def _load_tokenizer(model_config):
    try:
        from vllm.tokenizers.registry import cached_tokenizer_from_config

        return cached_tokenizer_from_config(model_config)
    except Exception:  # noqa: BLE001 - fall back to transformers
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_config.tokenizer,
                                             revision=model_config.tokenizer_revision,
                                             trust_remote_code=model_config.trust_remote_code)
