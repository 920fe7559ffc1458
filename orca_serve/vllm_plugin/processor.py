"""The V1 adapter: vLLM's V1 custom logits processor interface, driving `OrcaCore`.

The only code that touches `vllm.v1.sample.logits_processor`. It feeds `BatchUpdate`s (rows
removed, added, moved) to the row map (`orca_serve.core.rows.RowMap`, shared with the MRV2
adapter), whose joins and displacements are the core's join/leave, and turns each
`apply(logits)` into one core step with plain data (per tracked row: output length and its
last two token ids). All decisions are the core's (orca_serve/core); what both adapters share
is in `adapter.py`.

`OrcaLogitsProcessor` is also the FQCN for Model Runner V2: constructed the MRV2 way it returns
the MRV2 adapter (`mrv2.py`), so one engine argument serves whichever runner vLLM picks.

Request identity. `BatchUpdate` hands each added row its params, prompt ids and live output
list (a preempted request comes back with the same params object and list), but no request id
and no reason for a removal. Two facts need them: the child index of an n > 1 request (children
are "<index>_<parent id>"), and whether a removed request ended or was only preempted. They come
from the V1 runner (`orca_serve.vllm_compat.runner`, the one place that reads vLLM's batch).
vLLM builds this processor inside the runner's constructor, so on vLLM 0.33+ the runner arrives
after it, once, from the worker extension's hook (`attach_runner`, before the first step); on
0.31/0.32 the constructor finds it on its call stack. Without it (another vLLM version) a
request is known by its params object, children are
indexed by the seed vLLM gives each (`seed + index`), and a removal counts as final when the
last token is a stop token or max_tokens is reached (else the state is kept up to the result
TTL).

Rows vLLM discards (partial prefill chunks, the recompute after a preemption) are left out using
the runner's discard mask. The output-length rule alone (pool a row only when the length grew)
is not exact: a token sampled just before a preemption has its hidden row only in the last
recompute chunk, and every earlier chunk shows the same grown length. Without the runner the
core gives that one token up (`rows_exact = False`) rather than pool a wrong row.
"""

from __future__ import annotations

from orca_serve.vllm_plugin.config import check_vllm_version

# every vLLM process that loads the plugin imports this module first: refuse an unsupported
# release before the imports below, which it may lack
check_vllm_version()

import itertools

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
from vllm.v1.worker.gpu.sample.logits_processor.interface import (
    LogitsProcessor as MRV2LogitsProcessor,
)
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcRequestState

from orca_serve.core.registry import Entry
from orca_serve.core.rows import Added, Moved, RowMap, Tracked
from orca_serve.core.speculation import UNKNOWN, DraftEntry, DraftSteps
from orca_serve.vllm_compat import capture
from orca_serve.vllm_compat.runner import V1Runner, find_v1_runner
from orca_serve.vllm_plugin import speculation
from orca_serve.vllm_plugin.adapter import (
    CoreAdapter,
    child_index,
    hands_over_the_runner,
    log,
)
from orca_serve.vllm_plugin.mrv2 import OrcaMRV2LogitsProcessor

NO_RUNNER_UNDER_SPECULATION = ("orca: speculative decoding needs vLLM's V1 model runner, which "
                               "was not found")


class OrcaLogitsProcessor(CoreAdapter, LogitsProcessor, MRV2LogitsProcessor):
    """ORCA early stopping as a vLLM V1 logits processor (see module docstring).

    The one FQCN for both model runners: the class subclasses both interfaces, so the loaders
    of both accept it (they check `issubclass` only), and the constructor dispatches on how
    it is called. V1 builds processors as `cls(vllm_config, device, is_pin_memory)`; Model
    Runner V2 as `cls(vllm_config, req_states)`, which gets the MRV2 adapter
    (`orca_serve.vllm_plugin.mrv2.OrcaMRV2LogitsProcessor`) instead.
    """

    def __new__(cls, vllm_config, *args, **kwargs):
        req_states = kwargs.get("req_states", args[0] if len(args) == 1 else None)
        if isinstance(req_states, LogitsProcRequestState):
            # not an instance of cls, so Python does not call cls.__init__ on it
            return OrcaMRV2LogitsProcessor(vllm_config, req_states)
        return super().__new__(cls)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self._runner: V1Runner | None = None
        self._start_core(vllm_config, device, is_pin_memory)
        self.core.rows_exact = False  # until the runner is attached
        self._rows = RowMap(self._leave)
        # speculative decoding: every step goes through the draft-row driver (speculation.py)
        self._drafts: DraftSteps | None = None
        self.sampling_drafts = False  # vLLM's rejection sampler is running (rows handled)
        if getattr(vllm_config, "speculative_config", None):
            self._drafts = DraftSteps(self.core)
        # the worker extension's hook hands the runner over after this constructor (vLLM 0.33+)
        self._awaiting_runner = hands_over_the_runner(vllm_config)
        if not self._awaiting_runner:
            runner = find_v1_runner()
            if runner is not None:
                self.attach_runner(runner)
            elif self._drafts is not None:
                raise RuntimeError(NO_RUNNER_UNDER_SPECULATION)

    def attach_runner(self, runner: V1Runner) -> None:
        """Read vLLM's batch through `runner` from now on. Called once, before the first step:
        by the constructor (the runner found on its call stack) or by the worker extension's
        `init_worker_extension` (vLLM 0.33+, once the runner that built this processor exists)."""
        self._runner = runner
        self._awaiting_runner = False
        self.core.rows_exact = True
        if self._drafts is not None:
            speculation.attach(self, runner)

    def is_argmax_invariant(self) -> bool:
        return False  # it forces tokens

    # -- batch bookkeeping ------------------------------------------------------------------
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        with self._lock:
            self._rows.update(
                batch_update.removed,
                [Added(row, (params, prompt, out))
                 for row, params, prompt, out in batch_update.added],
                [Moved(a, b, kind == MoveDirectionality.SWAP)
                 for a, b, kind in batch_update.moved],
                self._join_row)

    def _join_row(self, row: int, added: tuple[SamplingParams, list[int] | None, list[int]],
                  ) -> Tracked | None:
        params, prompt, out = added
        settings = self.core.settings(params.extra_args)
        if settings is None:
            return None
        req_id = self._req_id(row, out)
        index = child_index(req_id, settings, params.seed)
        ident = req_id if req_id is not None else f"params-{id(params)}/{index}"
        req = self._join(ident, params, settings, prompt, len(out), out, index)
        return None if req is None else Tracked(req, out)

    def _leave(self, tracked: Tracked) -> None:
        """A tracked request lost its row (the row map's `displaced`): ended, or preempted."""
        req, out = tracked
        assert out is not None
        if self._runner is not None:
            final = not self._runner.is_preempted(req.ident)
        else:
            params = req.handle
            stops = set(getattr(params, "all_stop_token_ids", ()) or ())
            if req.eos is not None:
                stops.add(req.eos)
            final = bool(out) and (out[-1] in stops or (
                params.max_tokens is not None and len(out) >= params.max_tokens))
        if final and self._drafts is not None:
            self._drafts.finish(req, out)
        self.core.leave(req, final)

    def _req_id(self, row: int, out: list) -> str | None:
        if self._runner is not None:
            return self._runner.request_id(row, out)
        if self._awaiting_runner:  # said once: the hook never ran (another kind of worker wrapper)
            self._awaiting_runner = False
            log.warning("orca: the worker extension never handed over the V1 model runner; "
                        "requests are known by their params")
        return None

    # -- the engine step --------------------------------------------------------------------
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.sampling_drafts:  # the bonus rows of a step whose rows were all seen already
            return logits
        if self._drafts is not None:  # a step without drafts under a speculative config
            if self._runner is None:  # steps with drafts would reach here unseen
                raise RuntimeError(NO_RUNNER_UNDER_SPECULATION)
            self.apply_rows(logits, None)
            return logits
        hidden = capture.take_rows()
        with self._lock:
            entries = []
            for row, (req, out) in self._scheduled():
                n = len(out)
                entries.append(Entry(req, row, n, out[n - 2] if n > 1 else UNKNOWN,
                                     out[n - 1] if n else UNKNOWN))
            self.core.step(entries, hidden, logits)
        return logits

    def apply_rows(self, logits: torch.Tensor, rows_per_request: list[int] | None) -> None:
        """A step under speculative decoding: batch row b owns rows_per_request[b] consecutive
        logits rows (1 + its draft tokens; None: one each). See core/speculation.py."""
        hidden = capture.take_rows()
        with self._lock:
            first = list(range(logits.shape[0])) if rows_per_request is None else \
                [0, *itertools.accumulate(rows_per_request)]
            entries = [DraftEntry(req, first[b],
                                  1 if rows_per_request is None else rows_per_request[b], out)
                       for b, (req, out) in self._scheduled()]
            self._drafts.step(entries, hidden, logits)

    def _scheduled(self) -> list[tuple[int, Tracked]]:
        """The tracked batch rows of this step, without those whose sampled token vLLM throws
        away (partial prefill chunks)."""
        discard = None if self._runner is None else self._runner.discarded_rows()
        rows = []
        for row, tracked in self._rows.items():
            if discard is not None and discard[row]:
                self.core.stats["recompute_chunks"] += 1
                continue
            rows.append((row, tracked))
        return rows

