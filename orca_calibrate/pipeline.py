"""Pipelined collection's schedule: which traces to start generating, and which finished ones to
write, so that answer probes of a finished trace run while later traces still generate.

The batch collector (`collect.schedule: batches`) generates `batch` traces, waits for the
longest, then probes them all: the engine runs one phase at a time, and during the tail of each
phase few requests fill its batches. The pipelined collector keeps `batch` traces generating at
all times: when one finishes its answer probes join the engine's queue (its prefix still in the
KV cache) and the next trace starts, so the engine's batches mix the decode steps of traces with
the short probes of earlier ones. This module is that bookkeeping alone (no engine): the
collector (orca_calibrate/collect.py) tells it what finished and asks it what to start and what
to write.

Traces are written in the job's order, as the batch collector writes them, so the set on disk is
the same whichever way it was collected (the merge of shards keeps that order too): a trace that
finished before an earlier one waits. To bound what a killed job loses (the traces started but
not written) and the memory that waiting takes, at most `unwritten` traces are started and not
yet written; with `unwritten` = 2 x `batch` a long trace at the head holds up the start of new
ones only once `batch` later traces have finished behind it.
"""

from __future__ import annotations

from collections.abc import Sequence


class Schedule:
    """The state of a pipelined collection of `keys` (trace ids, in the job's order)."""

    def __init__(self, keys: Sequence[str], generating: int, unwritten: int) -> None:
        if not 1 <= generating <= unwritten:
            raise ValueError(f"need 1 <= generating ({generating}) <= unwritten ({unwritten})")
        self.keys = list(keys)
        self.generating = generating
        self.unwritten = unwritten
        self._started = 0  # keys[:_started] were started
        self._written = 0  # keys[:_written] were handed to `ready`
        self._probes: dict[str, int | None] = {}  # started, not written: probes left (None: generating)

    @property
    def done(self) -> bool:
        """Whether every trace was handed to `ready`."""
        return self._written == len(self.keys)

    @property
    def in_flight(self) -> int:
        """Traces generating now."""
        return sum(n is None for n in self._probes.values())

    def start(self) -> list[str]:
        """The traces to start generating now (none while `generating` are, or while
        `unwritten` are started and not written)."""
        out: list[str] = []
        running = self.in_flight
        while self._started < len(self.keys) and running < self.generating and \
                self._started - self._written < self.unwritten:
            key = self.keys[self._started]
            self._probes[key] = None
            out.append(key)
            self._started += 1
            running += 1
        return out

    def generated(self, key: str, probes: int) -> None:
        """Trace `key` finished generating; `probes` answer probes of it were queued."""
        if self._probes.get(key, 0) is not None:
            raise ValueError(f"{key!r} is not generating")
        if probes < 0:
            raise ValueError(f"probes is a count, not {probes}")
        self._probes[key] = probes

    def probed(self, key: str) -> None:
        """One answer probe of trace `key` came back."""
        left = self._probes.get(key)
        if not left:
            raise ValueError(f"{key!r} has no answer probe outstanding")
        self._probes[key] = left - 1

    def ready(self) -> list[str]:
        """The traces to write now, in the job's order: the finished ones (generated, every
        probe back) up to the first that is not."""
        out: list[str] = []
        while self._written < self._started and self._probes[self.keys[self._written]] == 0:
            key = self.keys[self._written]
            del self._probes[key]
            out.append(key)
            self._written += 1
        return out
