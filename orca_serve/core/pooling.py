"""Device memory of the engine step: per-slot step sums and parked rows, staging, readback, fence.

One slot id per tracked request names its row in every per-request device tensor: the pooled
sums here and the probe bank's row (`ProbeBank` rows are slot ids). Everything is allocated once,
for the engine's `max_num_seqs` (times two: preempted requests keep their slot while they wait),
so nothing grows while serving.

Host-to-device traffic of a step goes through `Staging`: every per-step index/flag/threshold
vector is written on the host into one (pinned, where the device has pinned memory) float64
buffer and copied with ONE non_blocking copy. float64 holds every index exactly, and every
threshold as the calibration chose it: the bank compares its float32 scores with the float64
thresholds, as the calibration compares the same scores (`orca_method.risk.stop_indices`), so
a threshold whose nearest float32 is a score below it does not stop there. Device-to-host
traffic is the `Readback` (one [8, m] block per step). Both are ordered by one `Fence`: a
reused event per step, waited on only when the host needs that step's device work finished and
does not know it to be.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch
from torch import Tensor


class SlotPool:
    """Slots and their step sums: A = completed sections of the current step, S = the current
    section, lag = a hidden row parked while its token id is still a placeholder ([cap, d] each).
    """

    def __init__(self, capacity: int, dim: int, device: torch.device) -> None:
        self.capacity = capacity
        self.A = torch.zeros(capacity, dim, device=device)  # [cap, d]
        self.S = torch.zeros(capacity, dim, device=device)  # [cap, d]
        self.lag = torch.zeros(capacity, dim, device=device)  # [cap, d]
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def free_count(self) -> int:
        return len(self._free)

    def take(self) -> int | None:
        """A zeroed slot, or None when all are held."""
        if not self._free:
            return None
        s = self._free.pop()
        self.A[s].zero_()
        self.S[s].zero_()
        return s

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def snapshot(self, slot: int) -> tuple[Tensor, Tensor, Tensor]:
        return self.A[slot].clone(), self.S[slot].clone(), self.lag[slot].clone()

    def restore(self, slot: int, snap: tuple[Tensor, Tensor, Tensor]) -> None:
        self.A[slot].copy_(snap[0])
        self.S[slot].copy_(snap[1])
        self.lag[slot].copy_(snap[2])


class Fence:
    """The end of each step's device work, as reused CUDA events (none on other devices).

    `mark()` after a step's last device op returns the step's number; `wait(k)` returns once
    step k's work is done. Steps finish in order, so one wait covers every earlier step, and a
    step known done is never waited on again: a step waits at most once (for the readback it
    reads), and the staging buffer it rewrites is, in practice, already known free.
    """

    DEPTH = 2  # steps that may be in flight: the staging buffers alternate over two steps

    def __init__(self, device: torch.device) -> None:
        self._events = ([torch.cuda.Event() for _ in range(self.DEPTH)]
                        if device.type == "cuda" else None)
        self.marked = 0  # steps marked
        self._done = 0  # steps known finished

    def mark(self) -> int:
        if self._events is not None:
            self._events[self.marked % self.DEPTH].record()
        self.marked += 1
        return self.marked

    def wait(self, step: int) -> None:
        if step <= self._done:
            return
        if step < self.marked - self.DEPTH + 1:
            raise RuntimeError(f"step {step}'s event was reused")  # a bug, never a wait
        if self._events is not None:
            self._events[(step - 1) % self.DEPTH].synchronize()
        self._done = step


class Staging:
    """Per-step host vectors -> device, one copy.

    `upload(vectors)` writes the vectors one after the other into one host buffer, copies it to
    the device once and returns their `Staged` device views. Two host buffers alternate; a
    buffer is rewritten only once the step that copied from it is known finished (`fence`), so
    a non_blocking copy never reads a buffer being rewritten. On a CPU device there is nothing
    to copy (`copy` False): the views come from the host buffer itself.
    """

    def __init__(self, size: int, device: torch.device, pin: bool, fence: Fence) -> None:
        self.device = device
        self.copy = device.type != "cpu"
        pin = pin and device.type == "cuda"
        self._host = [torch.zeros(size, dtype=torch.float64, pin_memory=pin) for _ in range(2)]
        self._np = [h.numpy() for h in self._host]
        self._used_by = [0, 0]  # the step that last copied from each host buffer
        self._dev = torch.zeros(size, dtype=torch.float64, device=device)  # [size]
        self._fence = fence

    def upload(self, vectors: Sequence[Sequence[float]]) -> Staged:
        cur = self._fence.marked % 2
        self._fence.wait(self._used_by[cur])
        self._used_by[cur] = self._fence.marked + 1  # the step being built
        bounds, n = [], 0
        for v in vectors:
            bounds.append((n, n + len(v)))
            n += len(v)
        if n > len(self._dev):
            self._grow(n)
        if n:
            self._np[cur][:n] = list(chain.from_iterable(vectors))
        src = self._host[cur][:n]
        if self.copy and n:
            self._dev[:n].copy_(src, non_blocking=True)
            src = self._dev[:n]
        return Staged(src, bounds)

    def _grow(self, n: int) -> None:
        """Room for at least `n` values (twice the old room). The buffers are sized for the
        usual step; under speculative decoding the forcing vectors hold 1 + k values per request
        that stops, so a step where many stop at once with many drafts may need more. Rare, so
        they grow then rather than being sized for the worst k. The old buffers may still be
        read by the last step's copy and kernels: torch's allocators keep a pinned block until
        its non_blocking copy is done and a device block until its stream's work is."""
        size = max(n, 2 * len(self._dev))
        pin = self._host[0].is_pinned()
        self._host = [torch.zeros(size, dtype=torch.float64, pin_memory=pin) for _ in range(2)]
        self._np = [h.numpy() for h in self._host]
        self._dev = torch.zeros(size, dtype=torch.float64, device=self.device)  # [size]


class Staged:
    """Device views of one step's staged vectors, by their position in `Staging.upload`: the
    buffer is converted to int64 once per step, not per vector (indexes, ids, counts); the
    thresholds are read as staged, float64."""

    __slots__ = ("_bounds", "_buf", "_long")

    def __init__(self, buf: Tensor, bounds: list[tuple[int, int]]) -> None:
        self._buf, self._long, self._bounds = buf, buf.long(), bounds

    def long(self, i: int) -> Tensor:
        a, b = self._bounds[i]
        return self._long[a:b]

    def exact(self, i: int) -> Tensor:
        """float64, as the host wrote it (on a CPU device: a view of the host buffer, which
        the step after next rewrites)."""
        a, b = self._bounds[i]
        return self._buf[a:b]


class Readback:
    """The step's one device-to-host copy: a [ROWS, m] float32 block (smoothed score, stop flag,
    steps scored, give-up score, give-up flag, shift gate score, gate flag, gate's give-up bar)
    copied non_blocking into pinned memory, read on the next step."""

    ROWS = 8

    def __init__(self, capacity: int, device: torch.device, pin: bool, fence: Fence) -> None:
        pin = pin and device.type == "cuda"
        self._host = torch.zeros(self.ROWS * capacity, dtype=torch.float32, pin_memory=pin)
        self._fence = fence
        self._m = 0
        self._step = 0

    def start(self, block: Tensor) -> None:
        """block: [ROWS, m] float32 on the device (copied into a contiguous [ROWS, m] host
        view); the step's `fence.mark()` follows."""
        self._m = block.shape[1]
        self._host[:self.ROWS * self._m].view(self.ROWS, self._m).copy_(block, non_blocking=True)
        self._step = self._fence.marked + 1

    def wait(self) -> list[list[float]]:
        self._fence.wait(self._step)
        return self._host[:self.ROWS * self._m].view(self.ROWS, self._m).tolist()


class IdReadback:
    """Token ids that exist only on the device (Model Runner V2 feeds them from the device),
    read one step later: `start(ids)` copies a [k] id vector non_blocking into pinned memory;
    `take()` on the next step returns them (after the copy's event, reused; long done)."""

    def __init__(self, capacity: int, device: torch.device, pin: bool) -> None:
        pin = pin and device.type == "cuda"
        self._host = torch.zeros(capacity, dtype=torch.int64, pin_memory=pin)  # [cap]
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._k = 0

    def start(self, ids: Tensor) -> None:
        """ids: [k] integer tensor on the device, k <= capacity."""
        self._k = ids.shape[0]
        self._host[:self._k].copy_(ids, non_blocking=True)
        if self._event is not None:
            self._event.record()

    def take(self) -> list[int]:
        """The ids of the last `start` (once; [] when none is pending)."""
        k, self._k = self._k, 0
        if k and self._event is not None:
            self._event.synchronize()
        return self._host[:k].tolist()
