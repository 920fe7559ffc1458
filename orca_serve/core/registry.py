"""Tracked requests and their results.

A request is known by the adapter's identity string (vLLM's request id, read from the model
runner; without the runner, an id of its params object and its child index: `orca_key` names its
result only) from the moment it joins the batch until it leaves for good. Leaving for good
frees its slot and probe row at once; only the small result stays (keyed requests only) until it
is fetched, `ttl` seconds pass, or `max_results` newer results push it out. A request that leaves
for a while (preemption) is parked with its slot, and resumes with its state.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from orca_method.steps import Segmenter, TokenTable
from orca_serve.settings.contract import OrcaResult, OrcaSettings, Policy, StopReason
from orca_serve.core.deployment import Deployment

if TYPE_CHECKING:
    from torch import Tensor

# a parked request's state while evicted from its slot: its pool rows (`SlotPool.snapshot`) and
# its probe-bank row (`ProbeBank.snapshot`; None when its deployment scores nothing)
Parked = tuple[tuple["Tensor", "Tensor", "Tensor"], dict[str, "Tensor"] | None]


class Handle(Protocol):
    """What the adapter hands the core with a new request (vLLM's SamplingParams, kept alive
    while the request is tracked so that the id derived from it is not reused) and reads back
    when the request leaves its row: its token limit."""

    max_tokens: int | None

log = logging.getLogger("orca_serve.core")


def open_reasoning_tokens(table: TokenTable, prompt: Sequence[int] | None) -> int:
    """Tokens after the prompt's last start tag when the prompt leaves the reasoning open (a
    template that opens `<think>` in the generation prompt, e.g. `<think>` + newline): vLLM's
    `thinking_token_budget` counts them, so the server needs them to tell its stop from ours."""
    if not prompt or not table.think_enabled or not table.reasoning_at_start(prompt):
        return 0
    for i in range(len(prompt) - 1, -1, -1):
        if prompt[i] == table.start_id:
            return len(prompt) - 1 - i
    return 0


class Request:
    """Everything the core keeps about one engine request (a child of n > 1 is its own)."""

    __slots__ = ("active", "alarm_ticket", "answer_budget", "attached", "bundle_checksum",
                 "decided_until", "dep", "draft_rows", "eos", "error", "fetched", "forced",
                 "gate_seen", "give_up_ids", "give_up_step", "greedy", "guard_pos", "handle",
                 "ident", "ignore_eos", "index", "key", "lag", "last_give_up", "left_at",
                 "max_tokens", "n_seen", "notes", "output", "plan", "policy", "prompt",
                 "prompt_reasoning", "record", "scores", "seg", "settings", "shift_alarm",
                 "shift_barred", "shift_flagged", "shift_pvalue", "shift_thr", "shift_thr_give_up",
                 "slot", "snapshot", "step_counts", "step_embs", "steps_scored", "stop_reason",
                 "stop_step", "stopped", "would_stop_step")

    def __init__(self, ident: str, settings: OrcaSettings, dep: Deployment, seg: Segmenter, *,
                 index: int, key: str | None, policy: Policy, max_tokens: int | None,
                 eos: int | None, ignore_eos: bool, n_out: int) -> None:
        # what it runs with (its deployment's: `orca_serve.settings.xargs.on_deployment`)
        self.ident, self.settings, self.dep, self.seg = ident, settings, dep, seg
        self.index, self.key, self.policy = index, key, policy
        self.record = settings.record
        self.answer_budget = settings.answer_budget
        self.max_tokens, self.eos, self.ignore_eos = max_tokens, eos, ignore_eos
        self.n_seen = n_out  # tokens generated before we saw it are not pooled
        self.active = True  # segmentation and scoring run (ends with a stop or an error)
        self.attached = True
        self.fetched = False
        self.left_at = 0.0
        self.slot: int | None = None
        self.snapshot: Parked | None = None  # while parked without a slot
        self.lag: int | None = None  # position whose hidden row is parked in pool.lag
        self.scores: list[float] = []
        self.steps_scored = 0
        self.stopped = False
        self.stop_step: int | None = None
        self.stop_reason: StopReason | None = None
        self.would_stop_step: int | None = None
        self.give_up_step: int | None = None
        self.last_give_up: float | None = None  # the give-up probe's last smoothed score
        # tokens a give-up forces after the end-of-thinking text (policy "message"; None: the
        # request's own stop plan, i.e. its best current answer)
        self.give_up_ids: list[int] | None = None
        self.plan: dict[int, int] = {}  # output position -> token forced after a stop
        self.greedy = range(0)  # output positions of the answer after a stop: decoded greedily
        self.forced: dict[int, int] = {}  # output position -> forced token id
        self.guard_pos: int | None = None
        # speculative decoding (core/speculation.py): output positions below this one are
        # decided already (accepted drafts), so a stop plans its forced text from here
        self.decided_until = 0
        self.draft_rows: tuple[int, ...] = ()  # this step's logits rows for positions n+1, ...
        self.step_embs: list[Tensor] = []  # [d] each
        self.step_counts: list[int] = []
        self.notes: list[str] = []
        # record mode: the prompt's ids and the engine's live output list (read at the end)
        self.prompt: list[int] | None = None
        self.prompt_reasoning = 0  # reasoning tokens the prompt holds after its open start tag
        self.output: Sequence[int] | None = None
        self.error: str | None = None
        self.handle: Handle | None = None
        self.bundle_checksum = dep.checksum  # None when no deployment of its bundle was live
        # the shift gate: its score thresholds for this request (stop side, give-up side; inf:
        # not gated), its p-value once decided, whether it flagged the request (then the
        # deployment's safe lambda, no give-up) and whether it barred its give-up
        self.shift_thr, self.shift_thr_give_up = (
            dep.gate_thresholds(settings.shift_alpha, settings.shift_give_up_alpha)
            if settings.enabled
            else (math.inf, math.inf))
        self.shift_pvalue: float | None = None
        self.shift_flagged = False
        self.shift_barred = False
        self.gate_seen = 0  # steps planned into the gate so far (each scored step is one)
        # the gate alarm (core/gate_alarm.py): its place in the arrival order until its gate
        # decides (None: none, or fed already); served as a flagged one because it was raised
        self.alarm_ticket: int | None = None
        self.shift_alarm = False

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    @property
    def lam(self) -> float | None:
        return self.settings.lam

    @property
    def gated(self) -> bool:
        """The gate runs for it: on either side (the give-up side's threshold is the lower)."""
        return self.shift_thr_give_up != math.inf

    @property
    def shift_levels(self) -> tuple[float, float] | None:
        """The gate's levels this request ran with (stop side, give-up side; None: the gate did
        not run for it)."""
        if not self.gated:
            return None
        return self.dep.gate.levels(self.settings.shift_alpha, self.settings.shift_give_up_alpha)

    def _shift(self) -> dict[str, Any]:
        """The gate's fields of the result (none when it did not run for this request)."""
        levels = self.shift_levels
        if levels is None:
            return {}
        return {"shift_alpha": levels[0], "shift_give_up_alpha": levels[1],
                "shift_pvalue": self.shift_pvalue, "shift_flagged": self.shift_flagged,
                "shift_barred": self.shift_barred, "shift_alarm": self.shift_alarm}

    def fail(self, msg: str, *, log_it: bool = True) -> None:
        if self.error is None:
            self.error = msg
            if log_it:
                log.error("orca request %s (%s): %s", self.key, self.ident, msg)
        self.active = False
        self.plan = {}
        self.greedy = range(0)
        self.guard_pos = None

    def result(self, pending_step: Tensor | None = None) -> OrcaResult:
        """The result; `pending_step` (record mode): the embedding of the unfinished last step."""
        lam = self.lam
        r = OrcaResult(
            enabled=self.enabled, policy=self.policy, delta=self.settings.delta,
            lam=lam,
            steps_scored=self.steps_scored,
            stopped_early=self.stopped and self.stop_reason == StopReason.PROBE,
            stop_step=self.stop_step, would_stop_step=self.would_stop_step,
            last_score=self.scores[-1] if self.scores else None, scores=list(self.scores),
            reasoning_tokens=self.seg.counted_total,
            forced_tokens=[self.forced[p] for p in sorted(self.forced)],
            stop_reason=self.stop_reason, index=self.index, notes=list(self.notes),
            error=self.error, bundle_checksum=self.bundle_checksum,
            # closed by a stop of ours (forced end text or EOS), or in the output
            reasoning_closed=self.stopped or (self.seg.fed > 0 and not self.seg.reasoning),
            prompt_reasoning_tokens=self.prompt_reasoning,
            give_up_mu=self.settings.give_up_mu, give_up_step=self.give_up_step,
            last_give_up_score=self.last_give_up, **self._shift())
        if self.record:
            embs, counts = list(self.step_embs), list(self.step_counts)
            ids = [list(s) for s in self.seg.steps]
            if pending_step is not None:
                embs.append(pending_step)
                counts.append(self.seg.pending)
                ids.append(self.seg.finish() or [])
            r.step_embeddings, r.step_tokens, r.step_token_ids = embs, counts, ids
            r.prompt_token_ids = self.prompt
            r.output_token_ids = None if self.output is None else [int(t) for t in self.output]
        return r


class Entry(NamedTuple):
    """One tracked row of one engine step, as an adapter hands it to the core (`OrcaCore.step`;
    a tuple underneath: the step's loop unpacks it at tuple speed)."""

    req: Request
    row: int  # its logits (and hidden) row in this step
    n: int  # the request's output length
    prev_id: int  # the token id at n - 2 (-1: none, or not known yet under async scheduling)
    last_id: int  # the token id at n - 1 (likewise)


class Results:
    """Results of keyed requests that left the batch, until fetched, expired or pushed out."""

    def __init__(self, ttl: float, max_count: int) -> None:
        self.ttl, self.max_count = ttl, max_count
        self._items: OrderedDict[str, tuple[float, OrcaResult]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: str, result: OrcaResult) -> None:
        self._items.pop(key, None)
        self._items[key] = (time.monotonic(), result)
        self.prune()

    def pop(self, key: str) -> OrcaResult | None:
        item = self._items.pop(key, None)
        return None if item is None else item[1]

    def discard(self, key: str) -> None:
        self._items.pop(key, None)

    def prune(self) -> None:
        now = time.monotonic()
        while self._items:
            t, _ = next(iter(self._items.values()))
            if now - t > self.ttl or len(self._items) > self.max_count:
                self._items.popitem(last=False)
            else:
                break
