"""The Model Runner V2 adapter: vLLM's MRV2 logits-processor interface, driving `OrcaCore`.

vLLM's MRV2 (0.31-0.33, `vllm/v1/worker/gpu/model_runner.py`) gives a custom processor three calls:
`add_request(slot, params)` when a request enters the batch (last pipeline rank only),
`apply_staged_writes()` once per step, and `apply(logits, ctx)` with the step's layout
(`ctx.idx_mapping_np`: batch position -> slot, `ctx.seq_lens_upper_bound_np`: tokens visible
to the token sampled now; both on the host, exact without speculative decoding). One logits
row per request, in batch order; the LM-head capture (`orca_serve/vllm_compat/capture.py`)
sees the same rows, because MRV2's `sample()` calls
`self.model.compute_logits(hidden_states[logits_indices])`.

What the interface does not give, and where it comes from:
- **Request id and prompt ids.** They come from the MRV2 runner that builds the processor,
  through `orca_serve.vllm_compat.runner` (the one place that reads vLLM's batch): on vLLM
  0.33+ the worker extension's hook hands it over before `load_model` builds this processor;
  on 0.31/0.32 the constructor finds it on its call stack.
  `add_request`'s slot names the request (the runner fills its slot-to-id map just before); the
  id is the identity in the core (it survives preemption; n > 1 children are
  "<index>_<parent id>"). The prompt ids (the segmenter needs them: is the prompt inside a
  think block?) come from the step's new requests, seen before the runner adds them.
  `orca_key` is the result key only: extra_args cannot tell n > 1 children apart (vLLM's
  children share one shallow-copied extra_args dict) nor an end from a preemption.
- **Ends and preemptions.** MRV2 has no removal call: `finish_requests` frees the slots of
  finished *and* preempted requests alike (`_remove_request`) and a slot is reused at once.
  Slot reuse cannot tell the two apart, yet the difference matters (a preempted request
  resumes with its pooled state; a finished one must store its result and free its slot). So
  the adapter hears each step's finished ids (leave for good) and preempted ids (park until it
  comes back through `add_request`, with a new slot in vLLM and its old state in ours) from
  the runner view, before the runner frees their slots. A slot reused without
  that (should not happen) parks its previous occupant, which the result TTL ends.
- **Token ids.** MRV2 keeps them on the device (`ctx.input_ids`, `req_states.all_token_ids`);
  reading them in `apply()` would wait for the device every step. Instead the fed ids of the
  step (`ctx.input_ids`: at a decode row, the token whose hidden state the row is) are copied
  non_blocking and read on the next step (`core.pooling.IdReadback`), and the core runs in its
  lag mode: every token is fed to the segmenter one engine step after its hidden row arrived
  (its row parked meanwhile). Scores and stop steps are unchanged; a stop is forced one token
  later than under the V1 adapter (the model writes one more token of its own before the
  forced text or EOS), and the last two tokens of a request are never pooled (one under V1).
- **Partial prefill chunks** (their sample is discarded): a row whose visible length is below
  the slot's `prefill_len` (host). The last chunk of a resumed request is the row of the token
  sampled just before its preemption, pooled exactly.

Record mode under MRV2 leaves `output_token_ids` out of results (the ids are never on the
host in full); take them from vLLM's output. Without the runner (another vLLM version) the
adapter tracks nothing and says so in the log.
"""

from __future__ import annotations

import torch
from vllm.v1.worker.gpu.sample.logits_processor.interface import (
    LogitsContext,
    LogitsProcessor,
    LogitsProcRequestState,
)

from orca_serve.core.pooling import IdReadback
from orca_serve.core.registry import Entry
from orca_serve.core.rows import RowMap, Tracked
from orca_serve.core.speculation import UNKNOWN
from orca_serve.vllm_compat import capture
from orca_serve.vllm_compat.runner import NewRequests, find_mrv2_runner, offered_mrv2_runner
from orca_serve.vllm_plugin.adapter import (
    CoreAdapter,
    child_index,
    hands_over_the_runner,
    log,
)
from orca_serve.vllm_plugin.config import MRV2_SPEC_REFUSAL


class OrcaMRV2LogitsProcessor(CoreAdapter, LogitsProcessor):
    """ORCA early stopping as an MRV2 custom logits processor (see module docstring). Built by
    `OrcaLogitsProcessor` when MRV2 constructs that FQCN."""

    def __init__(self, vllm_config, req_states: LogitsProcRequestState) -> None:
        if getattr(vllm_config, "speculative_config", None):
            raise RuntimeError(MRV2_SPEC_REFUSAL)
        device = torch.device(req_states.device)
        self._states = req_states
        self._start_core(vllm_config, device, device.type == "cuda")
        self._slots = RowMap(self._park)  # slot -> tracked request in the batch
        self._new: dict[str, tuple[list[int], int]] = {}  # during add_requests: id -> ids, P
        self._fed: dict[str, tuple[int, int]] = {}  # request id -> (output position, its id)
        self._in_flight: list[tuple[str, int, int]] = []  # (request id, position, row) copied
        self._ids = IdReadback(req_states.max_num_reqs, device, device.type == "cuda")
        # vLLM 0.33+: handed over by the worker extension's hook, which ran before load_model
        # built this processor; otherwise (0.31/0.32, no orca extension) on this call stack
        self._runner = offered_mrv2_runner() if hands_over_the_runner(vllm_config) else \
            find_mrv2_runner()
        if self._runner is not None:
            self._runner.observe(self._on_new_requests, self._on_done)
            log.warning("orca: serving through the Model Runner V2 adapter, which is tested at "
                        "vLLM's interface but has not yet run in a GPU engine "
                        "(VLLM_USE_V2_MODEL_RUNNER=1 opted in); unset it or set it to 0 for the "
                        "tested V1 adapter")

    # -- the runner's request bookkeeping (see module docstring) -----------------------------
    def _on_new_requests(self, new: NewRequests) -> None:
        self._new = new

    def _on_done(self, finished: set[str], preempted: set[str]) -> None:
        with self._lock:
            if finished and self._in_flight:  # their ids in flight are of no use any more
                self._in_flight = [e for e in self._in_flight if e[0] not in finished]
            for rid in finished | preempted:
                self._slots.pop(rid)
                req = self.core.live.get(rid)
                if req is None:
                    continue
                final = rid in finished
                if final:
                    self._fed.pop(rid, None)
                if final or req.attached:
                    self.core.leave(req, final)

    def _park(self, old: Tracked) -> None:
        """A slot reused without finish_requests naming its occupant (should not happen): park
        it, which the result TTL ends if it never comes back."""
        if old.req.attached:
            self.core.leave(old.req, False)

    # -- the MRV2 interface -----------------------------------------------------------------
    def add_request(self, req_idx: int, sampling_params) -> bool:
        with self._lock:
            return self._slots.add(req_idx, sampling_params, self._join_slot)

    def _join_slot(self, slot: int, sampling_params) -> Tracked | None:
        if self._runner is None:
            return None
        settings = self.core.settings(sampling_params.extra_args)
        if settings is None:
            return None
        req_id = self._runner.request_id(slot)
        new = self._new.get(req_id) if req_id is not None else None
        if new is None:
            log.error("orca: slot %d has no new request in this step; not tracked", slot)
            return None
        ids, prompt_len = new
        index = child_index(req_id, settings, sampling_params.seed)
        req = self._join(req_id, sampling_params, settings, ids[:prompt_len],
                         len(ids) - prompt_len, None, index)
        return None if req is None else Tracked(req, None)

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        """One engine step: [rows, vocab] float32 logits, changed in place."""
        hidden = capture.take_rows()
        with self._lock:
            self._read_fed_ids()
            prompt_len, prefill_len = self._states.prompt_len.np, self._states.prefill_len.np
            seq_lens = ctx.seq_lens_upper_bound_np
            one_row_each = logits.shape[0] == len(ctx.idx_mapping_np)
            entries = []
            for row, slot in enumerate(ctx.idx_mapping_np.tolist()):
                tracked = self._slots.get(slot)
                if tracked is None:
                    continue
                req = tracked.req
                if not one_row_each:  # refused at construction; should not happen
                    req.fail("more than one logits row per request (speculative decoding)")
                    continue
                seq = int(seq_lens[row])
                if seq < prefill_len[slot]:  # a partial prefill chunk: its sample is dropped
                    self.core.stats["recompute_chunks"] += 1
                    continue
                n = seq - int(prompt_len[slot])
                pos, tid = self._fed.get(req.ident, (-1, UNKNOWN))
                entries.append(Entry(req, row, n, tid if pos == n - 2 else UNKNOWN, UNKNOWN))
            self.core.step(entries, hidden, logits)
            if entries:  # this step's fed ids, read on the next step
                self._ids.start(ctx.input_ids)
                self._in_flight = [(e.req.ident, e.n - 1, e.row) for e in entries]
        return logits

    def _read_fed_ids(self) -> None:
        if not self._in_flight:
            return
        ids = self._ids.take()
        for ident, pos, row in self._in_flight:
            if pos >= 0 and ident in self.core.live:
                self._fed[ident] = (pos, ids[row])
        self._in_flight = []

