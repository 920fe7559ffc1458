"""Speculative decoding: an engine step in which a request owns several logits rows.

Under speculative decoding a request scheduled with k draft tokens owns k + 1 consecutive logits
rows in a step. At output length n (its output ids known up to position n - 1), row 0 is the
hidden state of its last output token (position n - 1) and samples position n; row i (1..k) is
the hidden state of draft token i (position n - 1 + i) and samples position n + i. Which drafts
the rejection sampler accepts is known only after the step: when the request comes back at length
n' = n + a + 1, drafts 1..a were accepted, the rest never existed.

So nothing is pooled, segmented or scored from a draft row in the step that computes it. Its
hidden row is parked (`DraftSteps`), and on the request's next step the rows of its accepted
drafts are replayed through `OrcaCore.step` in order, one token per call, before the row of its
newest token: every token the core sees is an accepted one, each fed with its own hidden state,
so step boundaries, scores and stop steps are those of the same tokens decoded without
speculation, and a boundary inside rejected drafts never counts.

Forcing. A replayed token's successor is decided already, so nothing can be forced there:
`Request.decided_until` (the position row 0 samples now) makes a stop decided while replaying
plan its forced text from that position instead (`plan_start`), and nothing is forced into a
decided position. In the step's last call a stop plan is forced on row 0 and on the draft rows
alike (`sampled_rows`, `stopping.forced_id`): a row that samples a position of the forced text gets that token, one
that samples a position of the greedy answer after it its own argmax. Row i samples position
n + i only if drafts 1..i were accepted, which under forced rows means they equal those tokens
(the rejection sampler rejects a draft that differs from a row's only finite logit and samples
that token in its place), so every forced token lands on an output position in order and every
answer token is its row's argmax, whatever the drafts. Both kinds of stop are forced so:
- a stop whose step ends on an accepted draft (decided while replaying) is known to the host
  by the step's last call: it is forced at the first position still open, at most k tokens
  after the one plain decoding forces;
- a stop whose step ends on row 0's token is decided on the device in the same step, as
  without speculation, and the host learns of it only after the step: for each request scored
  in the step the planner stages beforehand what a stop, and what a give-up, would force on
  each of its rows (`plan._plan_candidates`), and the device forces the plan of the flag it
  sets. A draft equal to the forced text (an n-gram drafter proposes `</think>` text it saw in
  the prompt) is accepted, and the answer rows after it are forced to their argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from orca_serve.core.registry import Entry, Request

UNKNOWN = -1  # a token id not known yet (async scheduling placeholder) or absent

# an accepted draft to replay: (request, output length after it, its hidden row [d], output ids)
Replay = tuple[Request, int, Tensor, Sequence[int]]


class DraftEntry(NamedTuple):
    """One tracked request in a speculative step, as the V1 adapter hands it over."""

    req: Request
    first: int  # its first logits row
    count: int  # the logits rows it owns (1 + its draft rows)
    out: Sequence[int]  # its output ids: the engine's live list, accepted tokens only


def plan_start(req: Request, pos: int) -> int:
    """Where a stop decided for output position `pos` starts forcing: `pos`, or the first position
    not decided yet when speculative decoding accepted tokens past it."""
    return max(pos, req.decided_until)


def sampled_rows(req: Request, row: int, n: int) -> list[tuple[int, int]]:
    """(output position, logits row) of the positions this step samples for a request at output
    length n whose row `row` samples position n (and whose draft rows, if any, sample n + 1,
    ...). Nothing while the core replays accepted drafts (position n is decided)."""
    if n < req.decided_until:
        return []
    return [(n + i, r) for i, r in enumerate((row, *req.draft_rows))]


class SteppedCore(Protocol):
    """What `DraftSteps` drives of the core (`orca_serve.core.engine.OrcaCore`), named here since
    the core's own modules import this one."""

    stats: dict[str, Any]

    @property
    def live(self) -> dict[str, Request]: ...

    def settle(self) -> None: ...

    def step(self, entries: list[Entry], hidden: Tensor | None, logits: Tensor, *,
             replay: bool = False) -> None: ...


class DraftSteps:
    """Parks the hidden rows of draft tokens until their fate is known, and replays the accepted
    ones through the core (see module docstring). One per core."""

    def __init__(self, core: SteppedCore) -> None:
        self.core = core
        # ident -> (request, position of its first draft, the drafts' hidden rows [k, d])
        self._parked: dict[str, tuple[Request, int, Tensor]] = {}

    def step(self, entries: Sequence[DraftEntry], hidden: Tensor | None, logits: Tensor) -> None:
        """One engine step. hidden: [rows, d] captured at the LM head, logits: [rows, vocab]
        (changed in place), both with every row of every request (draft rows included)."""
        core = self.core
        core.settle()  # the last step's stops plan from its own decided position
        self._forget_gone()
        if not entries:
            core.step([], hidden, logits)
            return
        replays: list[list[Replay]] = []
        final = []
        drafts: list[tuple[Request, int, int, int]] = []  # (req, n, first draft row, count)
        for req, first, count, out in entries:
            n = len(out)
            replays.append(self._accepted(req, out, n))
            req.decided_until = n
            final.append(Entry(req, first, n, out[n - 2] if n > 1 else UNKNOWN,
                               out[n - 1] if n else UNKNOWN))
            if count > 1:
                drafts.append((req, n, first + 1, count - 1))
        if drafts and (hidden is None or hidden.shape[0] != logits.shape[0]):
            got = None if hidden is None else hidden.shape[0]
            for req, *_ in drafts:  # never take the engine down (as OrcaCore.step)
                req.fail(f"captured {got} hidden rows for {logits.shape[0]} logits rows")
            drafts = []
        if drafts:
            # [sum k, d]: a copy (the step's tensor may go), gathered from each request's
            # contiguous draft rows by slicing: an index tensor would be a host-to-device copy
            # from pageable memory, which waits for the device
            rows = torch.cat([hidden[a:a + k] for _, _, a, k in drafts])
            off = 0
            for req, n, a, k in drafts:
                self._parked[req.ident] = (req, n, rows[off:off + k])
                off += k
                req.draft_rows = tuple(range(a, a + k))
        self._replay(replays)
        try:
            core.step(final, hidden, logits)
        finally:
            for req, *_ in drafts:
                req.draft_rows = ()

    def finish(self, req: Request, out: Sequence[int]) -> None:
        """`req` leaves the batch for good with output `out`: feed the drafts its last step
        accepted (plain decoding feeds every token but the last) before the core stores its
        result. A stop decided there forces nothing: the request has ended. The runner's list
        may go on past max_tokens or an EOS among the accepted drafts (vLLM's scheduler cuts its
        own copy there): the output ends there."""
        self.core.settle()  # the last step's stops plan from its own decided position
        n = len(out) if req.max_tokens is None else min(len(out), req.max_tokens)
        if req.eos is not None and not req.ignore_eos:
            n = next((i + 1 for i in range(max(0, req.n_seen - 1), n) if out[i] == req.eos), n)
        req.decided_until = n
        self._replay([self._accepted(req, out, n)])

    def _accepted(self, req: Request, out: Sequence[int], n: int) -> list[Replay]:
        """The parked drafts of `req` that are output tokens at output length n, as replay
        entries (request, output length after the token, its hidden row [d], output ids)."""
        parked = self._parked.pop(req.ident, None)
        if parked is None or parked[0] is not req:
            return []
        _, m, rows = parked  # rows [k, d]: the drafts at output positions m, m + 1, ...
        accepted = max(0, min(n - 1 - m, rows.shape[0]))
        self.core.stats["drafts_accepted"] += accepted
        return [(req, m + j + 1, rows[j], out) for j in range(accepted)]

    def _replay(self, replays: list[list[Replay]]) -> None:
        """Feed the accepted drafts, one token per request per core call, aligned so that every
        request's last replayed token comes right before its row-0 token."""
        depth = max((len(s) for s in replays), default=0)
        for d in range(depth):
            batch = [s[len(s) - depth + d] for s in replays if len(s) >= depth - d]
            h = torch.stack([row for _, _, row, _ in batch])  # [r, d]
            entries = [Entry(req, i, n, out[n - 2] if n > 1 else UNKNOWN, out[n - 1])
                       for i, (req, n, _, out) in enumerate(batch)]
            # nothing is forced into a decided position: the logits are a [r, 0] placeholder
            self.core.step(entries, h, h.new_empty((len(batch), 0)), replay=True)

    def _forget_gone(self) -> None:
        live = self.core.live
        for ident in [i for i, (req, _, _) in self._parked.items() if live.get(i) is not req]:
            del self._parked[ident]
