"""Resumable meta-training: the whole training state after every epoch, read back on a rerun.

A killed training stage (a pre-empted node, Ctrl-C) used to start again at epoch 1: the
per-epoch probe files were written but never read, and they hold only the slow weights, not
Adam's moments, the schedule's position or the shuffling generator, so training could not have
gone on from them anyway. `Checkpoints` keeps, next to those files, one `resume.pt` with all of
it; a rerun with the same key continues after the last finished epoch and ends with the very
probe an uninterrupted run gives (tested bit for bit).

The key covers everything the result depends on: the probe's spec, the label mode, every
training setting, the seed and the training data (the problems' ids, steps and labels, and the
bytes of their embeddings). Saved state under another key is from other settings or other data:
it is removed with its epoch files when training starts, so the folder never mixes two runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from orca_method.probe import Probe, ProbeSpec
from orca_method.trajectories import TrajectorySet

RESUME_FILE = "resume.pt"
EPOCH_GLOB = "epoch_*.safetensors"

# the best epoch so far under validation: (val savings, -val loss, epoch, the probe's state)
Best = tuple[float, float, int, dict[str, torch.Tensor]]


def training_key(ts: TrajectorySet, problems: Sequence[int], spec: ProbeSpec, mode: str,
                 settings: Mapping[str, Any]) -> str:
    """A digest of what meta-training's result depends on (see the module docstring).

    `problems`: the training problems in the order training draws them from (fit then
    validation); hashing their embeddings reads them once, as one epoch does.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps({"spec": spec.to_json(), "mode": mode, "settings": dict(settings)},
                        sort_keys=True, default=str).encode())
    for i in problems:
        h.update(ts.problems[i].id.encode() + b"\0")
        h.update(np.ascontiguousarray(ts.labels(i, mode)).tobytes())
        h.update(np.ascontiguousarray(ts.embeddings(i)).tobytes())
    return h.hexdigest()


@dataclass
class Resumed:
    """What a rerun continues from: `epoch` epochs done, their history and the best so far."""

    epoch: int
    history: list[dict]
    best: Best | None


class Checkpoints:
    """One training's folder of checkpoints: `epoch_NNN.safetensors` (the probe after each
    epoch, for inspection) and `resume.pt` (everything needed to go on)."""

    def __init__(self, folder: Path, key: str) -> None:
        self.folder, self.key = Path(folder), key
        self._file = self.folder / RESUME_FILE

    def resume(self, probe: Probe, opt: torch.optim.Optimizer,
               sched: torch.optim.lr_scheduler.LRScheduler,
               rng: np.random.Generator) -> Resumed | None:
        """Restore the saved state into the given objects when it is this training's; else clear
        the folder's checkpoints of other settings (said on stderr) and return None."""
        saved = self._read()
        if saved is not None and saved["key"] == self.key:
            probe.load_state_dict(saved["probe"])
            opt.load_state_dict(saved["opt"])
            sched.load_state_dict(saved["sched"])
            rng.bit_generator.state = saved["rng"]
            print(f"meta-train: resuming after epoch {saved['epoch']} from {self.folder}",
                  file=sys.stderr)
            return Resumed(saved["epoch"], saved["history"], saved["best"])
        stale = sorted(self.folder.glob(EPOCH_GLOB)) + ([self._file] if self._file.exists() else [])
        for f in stale:
            f.unlink()
        if stale:
            print(f"meta-train: removed {len(stale)} checkpoint file(s) of other settings or data "
                  f"from {self.folder}", file=sys.stderr)
        return None

    def save(self, epoch: int, probe: Probe, opt: torch.optim.Optimizer,
             sched: torch.optim.lr_scheduler.LRScheduler, rng: np.random.Generator,
             history: list[dict], best: Best | None) -> None:
        """The state after `epoch`, replacing the last one atomically (a kill while writing
        leaves the previous epoch's)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self._file.with_suffix(".tmp")
        torch.save({"key": self.key, "epoch": epoch, "probe": probe.state_dict(),
                    "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "rng": rng.bit_generator.state, "history": history, "best": best}, tmp)
        os.replace(tmp, self._file)

    def _read(self) -> dict[str, Any] | None:
        """The saved state, or None when there is none or it cannot be read (a file of another
        version: it is treated as stale)."""
        if not self._file.is_file():
            return None
        try:
            saved = torch.load(self._file, weights_only=True)
        except (OSError, EOFError, RuntimeError, pickle.UnpicklingError):
            return None
        return saved if isinstance(saved, dict) and "key" in saved else None
