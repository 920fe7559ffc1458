"""Device memory of the engine step: per-slot step sums and parked rows, and the staging buffers.

One slot id per tracked request names its row in every per-request device tensor: the pooled
sums here and the probe bank's row (`ProbeBank` rows are slot ids). Everything is allocated once,
for the engine's `max_num_seqs` (times two: preempted requests keep their slot while they wait),
so nothing grows while serving.

Host-to-device traffic of a step goes through `Staging`: every per-step index/flag/threshold
vector is written on the host into one (pinned, where the device has pinned memory) float64
buffer and copied with ONE non_blocking copy. float64 holds every index and every float32
threshold exactly.
"""

from __future__ import annotations

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


class Staging:
    """Per-step host vectors -> device, one copy.

    `add(values)` appends a segment on the host and returns its index; after `upload()`,
    `long(i)` / `float(i)` are device views of segment i (the buffer is converted once per step,
    not per segment). Two host buffers alternate, and a buffer is rewritten only after the copy
    that read it completed (its event), so a non_blocking copy never reads a buffer being
    rewritten. On a CPU device there is nothing to copy (`copy` False): the views come from the
    host buffer itself.
    """

    def __init__(self, size: int, device: torch.device, pin: bool) -> None:
        self.device = device
        self.copy = device.type != "cpu"
        pin = pin and device.type == "cuda"
        self._host = [torch.zeros(size, dtype=torch.float64, pin_memory=pin) for _ in range(2)]
        self._np = [h.numpy() for h in self._host]
        self._events: list = [None, None]
        self._dev = torch.zeros(size, dtype=torch.float64, device=device)  # [size]
        self._cur = 0
        self._off = 0
        self._segs: list[tuple[int, int]] = []
        self._long = self._float = self._dev[:0]

    def begin(self) -> None:
        self._cur ^= 1
        ev = self._events[self._cur]
        if ev is not None:
            ev.synchronize()  # the copy of two steps ago; long done in practice
        self._off = 0
        self._segs = []

    def add(self, values: list) -> int:
        k = len(values)
        if k:
            self._np[self._cur][self._off:self._off + k] = values
        self._segs.append((self._off, self._off + k))
        self._off += k
        return len(self._segs) - 1

    def upload(self) -> None:
        n = self._off
        src = self._host[self._cur][:n]
        if self.copy and n:
            self._dev[:n].copy_(src, non_blocking=True)
            src = self._dev[:n]
            if self.device.type == "cuda":
                ev = torch.cuda.Event()
                ev.record()
                self._events[self._cur] = ev
        self._long, self._float = src.long(), src.float()

    def float(self, i: int) -> Tensor:
        a, b = self._segs[i]
        return self._float[a:b]

    def long(self, i: int) -> Tensor:
        a, b = self._segs[i]
        return self._long[a:b]


class Readback:
    """The step's one device-to-host copy: a [3, m] float32 block (smoothed score, stop flag,
    steps scored) copied non_blocking into pinned memory, read on the next step after its event."""

    def __init__(self, capacity: int, device: torch.device, pin: bool) -> None:
        pin = pin and device.type == "cuda"
        self._host = torch.zeros(3 * capacity, dtype=torch.float32, pin_memory=pin)
        self._event = None
        self._m = 0

    def start(self, block: Tensor) -> None:
        """block: [3, m] float32 on the device (copied into a contiguous [3, m] host view)."""
        self._m = block.shape[1]
        self._view().copy_(block, non_blocking=True)
        if block.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> list[list[float]]:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._view().tolist()

    def _view(self) -> Tensor:
        return self._host[:3 * self._m].view(3, self._m)


class IdReadback:
    """Token ids that exist only on the device (Model Runner V2 feeds them from the device),
    read one step later without waiting: `start(ids)` copies a [k] id vector non_blocking into
    pinned memory; `take()` on the next step returns them (after the copy's event, long done)."""

    def __init__(self, capacity: int, device: torch.device, pin: bool) -> None:
        pin = pin and device.type == "cuda"
        self._host = torch.zeros(capacity, dtype=torch.int64, pin_memory=pin)  # [cap]
        self._event = None
        self._k = 0

    def start(self, ids: Tensor) -> None:
        """ids: [k] integer tensor on the device, k <= capacity."""
        self._k = ids.shape[0]
        self._host[:self._k].copy_(ids, non_blocking=True)
        if ids.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()

    def take(self) -> list[int]:
        """The ids of the last `start` (once; [] when none is pending)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        k, self._k = self._k, 0
        return self._host[:k].tolist()
