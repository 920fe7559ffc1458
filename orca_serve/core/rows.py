"""Which tracked request sits at which engine position: the one row map both adapters feed.

vLLM names a request in a step by a position: the V1 runner by its row in the persistent batch
(rows are added, removed and moved between steps: `BatchUpdate`), Model Runner V2 by its slot
(given in `add_request`, freed when the request finishes or is preempted). Both adapters keep
the same thing, position -> tracked request, and update it the way vLLM's own builtin logits
processors do (`process_dict_updates` in vllm/v1/sample/logits_processor/builtin.py): one pass
over named records, in vLLM's order (removed, added, moved). What differs between the adapters
is only what becomes of a request that loses its position without moving (`displaced`: the V1
adapter asks the runner whether it ended; MRV2 parks it) and how a new one joins (`join`).

A request holds one position at most: added at another, it leaves the old one (MRV2 gives a
resumed request a new slot). The map is the adapters' only bookkeeping of positions; the core's
`RequestTable` keeps requests by identity (parked ones too, which hold no position).
"""

from __future__ import annotations

from collections.abc import Callable, ItemsView, Iterable
from typing import Generic, NamedTuple, TypeVar

from orca_serve.core.registry import Request

P = TypeVar("P")  # what an added record carries for `join` (the adapter's request data)


class Tracked(NamedTuple):
    """A tracked request at its position."""

    req: Request
    out: list[int] | None  # the engine's live output ids (V1); None where they stay on device


class Added(NamedTuple, Generic[P]):
    """A request entering the batch at `row` (vLLM's `AddedRequest`): `join(row, data)` says
    whether it is tracked."""

    row: int
    data: P


class Moved(NamedTuple):
    """vLLM's `MovedRequest`: the request at `src` moves to `dst` (`swap`: and the one at `dst`
    to `src`; else whatever was at `dst` is replaced)."""

    src: int
    dst: int
    swap: bool


class RowMap:
    """Engine position -> tracked request (see the module docstring)."""

    def __init__(self, displaced: Callable[[Tracked], None]) -> None:
        """`displaced`: a tracked request lost its position without moving (removed, or
        replaced by another); the adapter tells the core whether it ended."""
        self._at: dict[int, Tracked] = {}
        self._row_of: dict[str, int] = {}  # request identity -> its position
        self._displaced = displaced

    def update(self, removed: Iterable[int], added: Iterable[Added[P]], moved: Iterable[Moved],
               join: Callable[[int, P], Tracked | None]) -> None:
        """One batch update in vLLM's order: removed, added, moved. `join(row, data)`: the
        tracked request an added record brings (None: not tracked; the row's previous
        occupant is displaced either way)."""
        for row in removed:
            self._drop(row)
        for a in added:
            self._drop(a.row)
            tracked = join(a.row, a.data)
            if tracked is not None:
                self._put(a.row, tracked)
        for m in moved:
            src, dst = self._at.pop(m.src, None), self._at.pop(m.dst, None)
            if dst is not None:
                if m.swap:
                    self._set(m.src, dst)
                else:
                    self._row_of.pop(dst.req.ident, None)
                    self._displaced(dst)
            if src is not None:
                self._set(m.dst, src)

    def add(self, row: int, data: P, join: Callable[[int, P], Tracked | None]) -> bool:
        """One request entering at `row` (MRV2's `add_request`); whether it is tracked."""
        self.update((), (Added(row, data),), (), join)
        return row in self._at

    def pop(self, ident: str) -> Tracked | None:
        """The request `ident` left its position (MRV2: finished or preempted, told by the
        runner); the caller tells the core. None: it held none."""
        row = self._row_of.pop(ident, None)
        return None if row is None else self._at.pop(row)

    def get(self, row: int) -> Tracked | None:
        return self._at.get(row)

    def items(self) -> ItemsView[int, Tracked]:
        """(position, tracked request), in the order they were placed."""
        return self._at.items()

    def __len__(self) -> int:
        return len(self._at)

    def _drop(self, row: int) -> None:
        old = self._at.pop(row, None)
        if old is not None:
            self._row_of.pop(old.req.ident, None)
            self._displaced(old)

    def _put(self, row: int, tracked: Tracked) -> None:
        """Place a joined request. Its identity at another position is stale (the core keeps
        one live request per identity: a request resumed into a new slot), let go unasked."""
        before = self._row_of.get(tracked.req.ident)
        if before is not None and before != row:
            del self._at[before]
        self._set(row, tracked)

    def _set(self, row: int, tracked: Tracked) -> None:
        self._at[row] = tracked
        self._row_of[tracked.req.ident] = row
