"""The engine-step core: pool step embeddings, run the probe, force stop tokens.

It knows nothing of vLLM's model runner. An adapter tells it when requests join and leave the
batch (`join`, `leave`) and calls `step` once per engine step with plain data: for each tracked
request its logits row, its output length n and its last two output token ids (-1 = not known
yet), the hidden rows captured at the LM head ([rows, d], the row of a request is the state of
its token at position n - 1) and the logits ([rows, vocab], changed in place).

`OrcaCore` composes the parts, each in its module:
- `table.RequestTable`: join, park, evict, leave, stored results;
- `plan.plan_step`: the host half of a step, one pass over the rows (segmentation, budget guard,
  forced tokens) into one typed `StepPlan`; `plan.apply_readback`: decisions back to requests;
- `device_step.DeviceStep`: the device half, on preallocated memory (one staging copy in, one
  readback out, reused events);
- `deployment.Deployments`: the live bundles (hot reload);
- `admission.Admission`: which requests are tracked and the `Request` a new one becomes.

A request whose step completes now and whose probe says "stop" gets this step's forced tokens
in this very step, decided on the device (its first one; under speculative decoding its draft
rows' too, the argmax of those that sample its greedy answer). The step's readback (scores,
stop flags) is read on the next step (`settle`), where the host learns of the stop and plans
the rest: stops land on exactly the token a synchronous design would force.

Async scheduling: a token id that is still a placeholder (-1) cannot be segmented yet; its hidden
row is parked and the request runs one token behind (the parked token is fed on the next step,
when its id is known) instead of failing. See docs/PLUGIN.md.

Speculative decoding: `core/speculation.py` feeds accepted draft tokens through `step(...,
replay=True)` calls before the engine step's own call; `Request.decided_until` and
`Request.draft_rows` tell the planner where forcing may start and which rows sample the
positions after n.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from time import perf_counter_ns
from typing import Any

import torch
from torch import Tensor

from orca_method.outcomes import GiveUpPolicy
from orca_serve.settings.contract import GIVE_UP_MESSAGE, OrcaSettings, RequestDefaults
from orca_serve.settings.engine_config import EngineConfig
from orca_serve.core.admission import Admission
from orca_serve.core.deployment import Deployment, Deployments
from orca_serve.core.gate_alarm import take_ticket
from orca_serve.core.device_step import DeviceStep
from orca_serve.core.plan import StepPlan, apply_readback, plan_step
from orca_serve.core.pooling import SlotPool
from orca_serve.core.registry import Entry, Handle, Request, Results
from orca_serve.core.table import RequestTable

log = logging.getLogger("orca_serve.core")


def give_up_message_ids(tokenizer: Any, defaults: RequestDefaults) -> list[int] | None:
    """The ids of the message a give-up answers with under the MESSAGE give-up policy (None: a
    given-up request answers with its best current guess)."""
    if defaults.give_up_policy != GiveUpPolicy.MESSAGE:
        return None
    text = defaults.give_up_message or GIVE_UP_MESSAGE
    return list(tokenizer.encode(text, add_special_tokens=False))


class OrcaCore:
    """Requests, slots, pooling, probe and stops of one engine (see module docstring)."""

    def __init__(self, cfg: EngineConfig, tokenizer: Any, *, hidden_size: int,
                 model_name: str, eos_ids: set[int], default_eos: int | None,
                 max_num_seqs: int, device: torch.device, pin_memory: bool = False) -> None:
        device = torch.device(device)
        self.capacity = 2 * max(1, int(max_num_seqs))  # preempted requests keep their slot
        defaults = cfg.defaults
        self.deployments = Deployments(cfg, tokenizer, hidden_size=hidden_size,
                                       model_name=model_name, eos_ids=set(eos_ids),
                                       capacity=self.capacity, device=device,
                                       shift_action=defaults.shift_action,
                                       shift_alpha=defaults.shift_alpha,
                                       gate_alarm=defaults.gate_alarm)
        self.admission = Admission(self.deployments, defaults,
                                   record_default=cfg.record,
                                   default_eos=default_eos,
                                   give_up_ids=give_up_message_ids(tokenizer, defaults))
        self.normalization = self.dep.normalization
        self.device_step = DeviceStep(self.capacity, hidden_size, device, pin_memory,
                                      self.normalization)
        self.stats = {"probe_ns": 0, "engine_steps": 0, "active_steps": 0, "rows_captured": 0,
                      "steps_scored": 0, "max_step_ns": 0, "resumed": 0, "recompute_chunks": 0,
                      "lagged_tokens": 0, "evictions": 0, "drafts_accepted": 0,
                      "alarm_raised": 0, "alarm_cleared": 0}
        results = Results(cfg.result_ttl_s, cfg.max_results)
        self.table = RequestTable(self.pool, results, self.normalization, self.stats)
        self._pending: StepPlan | None = None  # the step whose readback is unread

    # the parts' state, under the names adapters and tests use
    @property
    def dep(self) -> Deployment:
        """The current deployment (for requests that name no bundle)."""
        return self.deployments.current

    @property
    def deps(self) -> dict[str | None, Deployment]:
        return self.deployments.live

    @property
    def record_default(self) -> bool:
        return self.admission.record_default

    @property
    def live(self) -> dict[str, Request]:
        return self.table.live

    @property
    def pool(self) -> SlotPool:
        return self.device_step.pool

    @property
    def rows_exact(self) -> bool:
        return self.table.rows_exact

    @rows_exact.setter
    def rows_exact(self, exact: bool) -> None:
        self.table.rows_exact = exact

    # -- deployments (hot reload, see `Deployments`) ----------------------------------------------
    def load_bundle(self, path: str) -> Deployment:
        return self.deployments.load(path)

    def use_bundle(self, checksum: str | None) -> Deployment:
        return self.deployments.use(checksum)

    def retire_bundles(self, keep: Sequence[str | None] = ()) -> list[str | None]:
        return self.deployments.retire(keep, (r.dep for r in self.live.values()))

    # -- joining and leaving --------------------------------------------------------------------
    def settings(self, xa: Mapping[str, Any] | None) -> OrcaSettings | None:
        """A request's settings, read once from its extra_args; None: the core does not track
        it (`Admission.settings`)."""
        return self.admission.settings(xa)

    def join(self, ident: str, settings: OrcaSettings | None, *, prompt: Sequence[int] | None,
             n_out: int, index: int, max_tokens: int | None, eos: int | None,
             ignore_eos: bool, structured: bool, handle: Handle | None = None,
             output: Sequence[int] | None = None) -> Request | None:
        """A request enters the batch: a new one with its `settings` (None: one the core does
        not track) or a parked one. Returns the tracked request, or None.

        `handle`: an object the adapter's identity is derived from (kept alive while tracked,
        so that its id is not reused). `output`: the engine's live list of the request's output
        ids, read when a record-mode result is built (a resumed request may bring a new one)."""
        req = self.live.get(ident)
        if req is not None and any(r is req and final for r, final in self.table.leaving):
            self.settle()  # its identity is reused by a new request: end the old one first
            req = self.live.get(ident)
        if req is not None:
            if output is not None:
                req.output = output
            return self.table.resume(req, n_out)
        if settings is None:
            return None
        req = self.admission.new_request(ident, settings, prompt=prompt, n_out=n_out,
                                         index=index, max_tokens=max_tokens, eos=eos,
                                         ignore_eos=ignore_eos, structured=structured)
        req.handle = handle
        if req.record:
            req.prompt = None if prompt is None else [int(t) for t in prompt]
            req.output = output
        if not self.table.add(req):
            log.error("orca: no free slot for %s; not tracked", ident)
            return None
        take_ticket(req)
        return req

    def leave(self, req: Request, final: bool) -> None:
        """A request left the batch: for good (`final`), or for a while (preempted)."""
        self.table.leave(req, final, defer=self._pending is not None)
        if final and self._pending is None:
            self.deployments.drop_unused(r.dep for r in self.live.values())

    def settle(self) -> None:
        """Read the last step's decisions and finish the removals that waited for them."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            apply_readback(pending.pending, self.device_step.readback.wait(), self.stats)
        if self.table.leaving or self.table.parked:
            self.table.settle()
            self.deployments.drop_unused(r.dep for r in self.live.values())

    # -- results ----------------------------------------------------------------------------------
    def pop_results(self, keys: list[str]) -> dict[str, dict[str, Any]]:
        self.settle()
        return self.table.pop_results(keys)

    def get_stats(self) -> dict[str, Any]:
        self.settle()
        s = dict(self.stats)
        s["tracked_requests"] = sum(1 for r in self.live.values() if r.attached)
        s["stored_results"] = len(self.table.results) + len(self.table.by_key)
        s["slots_in_use"] = self.capacity - self.pool.free_count
        s["parked_requests"] = len(self.table.parked)
        s["deployments"] = len(self.deps)
        s["alarms_raised"] = sum(1 for d in self.deps.values()
                                 if d.alarm is not None and d.alarm.alarmed)
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
            plan = plan_step(entries, logits.shape[0], self.stats)
            self.stats["rows_captured"] += len(plan.pool_rows) + len(plan.lag_slots)
            self.device_step.run(plan, hidden, logits)
            if plan.pending:
                self._pending = plan
        except Exception as e:  # never take the engine down: fail the tracked requests
            log.exception("orca core failed in a step; disabling it for the requests in it")
            self._pending = None
            for entry in entries:
                entry.req.fail(f"internal error: {e!r}")
        dt = perf_counter_ns() - t0
        self.stats["probe_ns"] += dt
        self.stats["active_steps"] += 0 if replay else 1
        self.stats["max_step_ns"] = max(self.stats["max_step_ns"], dt)

