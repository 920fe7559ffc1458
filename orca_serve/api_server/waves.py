"""The samples of `orca.samples` launched in waves (`--orca-vote-waves`; docs/SERVER.md "Waves";
the guarantee: docs/METHOD.md section 14, "Waves").

A bundle whose consensus block was certified for a wave schedule (say 1+1+2+4) is served in that
schedule: the first wave's samples at once, each next wave only once every sample launched before
has finished and the vote is still not settled. A sample not yet launched counts as running in the
vote (`orca_method.consensus.verdict`), as calibration counted it (`in_waves`), so a group that
agrees early never launches its later samples: fewer tokens, at the latency of the waves it ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

from orca_method.consensus import check_waves

T = TypeVar("T")


class Waves(Generic[T]):
    """A vote's k sample requests (`items`, in sample order), handed out wave by wave."""

    def __init__(self, items: Sequence[T], sizes: Sequence[int]) -> None:
        self.sizes = check_waves(sizes, len(items))
        self._items = list(items)
        self.launched = 0  # waves handed out so far

    @property
    def left(self) -> bool:
        """Whether a wave is still to be launched."""
        return self.launched < len(self.sizes)

    def next(self) -> list[T]:
        """The next wave's requests ([] once every wave is out)."""
        if not self.left:
            return []
        start = sum(self.sizes[:self.launched])
        self.launched += 1
        return self._items[start:start + self.sizes[self.launched - 1]]
