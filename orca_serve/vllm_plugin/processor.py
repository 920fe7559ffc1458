"""The V1 adapter: vLLM's V1 custom logits processor interface, driving `OrcaCore`.

The only code that touches `vllm.v1.sample.logits_processor`. It turns `BatchUpdate`s (rows
removed, added, moved) into the core's join/leave, and each `apply(logits)` into one core step
with plain data (per tracked row: output length and its last two token ids). All decisions are
the core's (orca_serve/core).

Request identity. vLLM hands a processor no request id. The model runner that builds the
processor has them (`input_batch.req_ids`), and two facts need them: the child index of an n > 1
request (children are "<index>_<parent id>"), and whether a removed request ended or was only
preempted (a preempted one is still in the runner's `requests`). We find the runner once, on the
constructor's call stack; without it (another vLLM version) a request is known by its params
object (the same object comes back after a preemption), children are indexed by the seed vLLM
gives each (`seed + index`), and a removal counts as final when the last token is a stop token
or max_tokens is reached (else the state is kept up to the result TTL).

Rows vLLM discards (partial prefill chunks, the recompute after a preemption) are left out using
the runner's `discard_request_mask`. The output-length rule alone (pool a row only when the
length grew) is not exact: a token sampled just before a preemption has its hidden row only in
the last recompute chunk, and every earlier chunk shows the same grown length. Without the
runner the core gives that one token up (`rows_exact = False`) rather than pool a wrong row.
"""

from __future__ import annotations

import re
import sys
import threading
import weakref
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from orca_serve.contract import XARG_N, XARG_SEED, validate_xargs
from orca_serve.core.registry import Request
from orca_serve.vllm_plugin import capture
from orca_serve.vllm_plugin.engine_setup import build_core, log

_CHILD_RE = re.compile(r"^(\d+)_")

# every live processor of this process (the worker extension asks them)
PROCESSORS: weakref.WeakSet = weakref.WeakSet()


class OrcaLogitsProcessor(LogitsProcessor):
    """ORCA early stopping as a vLLM V1 logits processor (see module docstring)."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        validate_xargs(sampling_params.extra_args, int(getattr(sampling_params, "n", 1) or 1),
                       sampling_params.seed)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self._lock = threading.RLock()
        self._runner = _find_model_runner()
        self.core = build_core(vllm_config, torch.device(device), bool(is_pin_memory))
        self.core.rows_exact = self._runner is not None
        self._rows: dict[int, tuple[Request, list[int]]] = {}
        PROCESSORS.add(self)

    def is_argmax_invariant(self) -> bool:
        return False  # it forces tokens

    # -- batch bookkeeping ------------------------------------------------------------------
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        with self._lock:
            rows = self._rows
            for row in batch_update.removed:
                self._leave(rows.pop(row, None))
            new: dict[int, tuple] = {}
            for row, params, prompt, out in batch_update.added:
                self._leave(rows.pop(row, None))  # replaced without a removal (should not happen)
                new.pop(row, None)
                if self.core.wants(params.extra_args):
                    new[row] = (params, prompt, out)
            for a, b, kind in batch_update.moved:
                for table in (rows, new):
                    va, vb = table.pop(a, None), table.pop(b, None)
                    if kind == MoveDirectionality.SWAP:
                        if vb is not None:
                            table[a] = vb
                    elif table is rows:
                        self._leave(vb)
                    if va is not None:
                        table[b] = va
            for row, (params, prompt, out) in new.items():
                req = self._join(row, params, prompt, out)
                if req is not None:
                    rows[row] = (req, out)

    def _join(self, row: int, params, prompt, out: list[int]) -> Request | None:
        xa = params.extra_args or {}
        req_id = self._req_id(row, out)
        index = 0
        if int(xa.get(XARG_N, 1)) > 1:
            m = _CHILD_RE.match(req_id or "")
            if m:
                index = int(m.group(1))
            elif XARG_SEED in xa and params.seed is not None:
                index = int(params.seed) - int(xa[XARG_SEED])
        ident = req_id if req_id is not None else f"params-{id(params)}/{index}"
        eos = getattr(params, "eos_token_id", None)
        return self.core.join(ident, xa, prompt=prompt, n_out=len(out), index=index,
                              max_tokens=params.max_tokens,
                              eos=None if eos is None else int(eos),
                              ignore_eos=bool(params.ignore_eos),
                              structured=getattr(params, "structured_outputs", None) is not None,
                              handle=params, output=out)

    def _leave(self, tracked: tuple[Request, list[int]] | None) -> None:
        if tracked is None:
            return
        req, out = tracked
        if self._runner is not None:
            final = req.ident not in self._runner.requests
        else:
            params = req.handle
            stops = set(getattr(params, "all_stop_token_ids", ()) or ())
            if req.eos is not None:
                stops.add(req.eos)
            final = bool(out) and (out[-1] in stops or (
                params.max_tokens is not None and len(out) >= params.max_tokens))
        self.core.leave(req, final)

    def _req_id(self, row: int, out: list) -> str | None:
        r = self._runner
        if r is None:
            return None
        ib = r.input_batch
        try:
            if ib.req_output_token_ids[row] is out:
                return ib.req_ids[row]
        except (IndexError, AttributeError):
            pass
        for i, lst in enumerate(ib.req_output_token_ids):  # rows already rearranged
            if lst is out:
                return ib.req_ids[i]
        return None

    # -- the engine step --------------------------------------------------------------------
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        hidden = capture.take_rows()
        with self._lock:
            # rows whose sampled token vLLM throws away (partial prefill chunks): left out
            discard = None if self._runner is None else self._runner.discard_request_mask.np
            entries = []
            for row, (req, out) in self._rows.items():
                if discard is not None and discard[row]:
                    self.core.stats["recompute_chunks"] += 1
                    continue
                n = len(out)
                entries.append((req, row, n, out[n - 2] if n > 1 else -1,
                                out[n - 1] if n else -1))
            self.core.step(entries, hidden, logits)
        return logits

    # -- results (worker extension) ---------------------------------------------------------
    def pop_results(self, keys: list[str]) -> dict[str, dict[str, Any]]:
        with self._lock:
            return self.core.pop_results(keys)

    def get_stats(self) -> dict[str, Any]:
        with self._lock:
            return self.core.get_stats()

    # -- hot reload (worker extension) ------------------------------------------------------
    def load_bundle(self, path: str) -> str | None:
        with self._lock:
            return self.core.load_bundle(path).checksum

    def use_bundle(self, checksum: str) -> None:
        with self._lock:
            self.core.use_bundle(checksum)

    def retire_bundles(self, keep: list[str]) -> list[str | None]:
        with self._lock:
            return self.core.retire_bundles(keep)


def _find_model_runner():
    """The GPUModelRunner (CPUModelRunner subclasses it) constructing us, found on the stack.

    vLLM builds logits processors inside GPUModelRunner.__init__
    (vllm/v1/worker/gpu_model_runner.py, `build_logitsprocs(...)`). None if not found.
    """
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception:  # noqa: BLE001
        return None
    f = sys._getframe(1)
    for _ in range(30):
        if f is None:
            break
        obj = f.f_locals.get("self")
        if isinstance(obj, GPUModelRunner):
            return obj
        f = f.f_back
    log.warning("orca: model runner not found on the stack; requests are known by their params")
    return None
