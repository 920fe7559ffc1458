"""Worker extension: hands per-request results and stats to the caller via `collective_rpc`.

vLLM appends this class to the worker's bases (`worker_extension_cls`,
vllm/v1/worker/worker_base.py), so its methods run in the worker process that owns the logits
processor. Names must not clash with Worker attributes (vLLM asserts this).

    per_worker = llm.collective_rpc("orca_results", args=(keys,))  # one dict per worker
    results = orca_serve.settings.contract.merge_results(per_worker)  # {key: OrcaResult}
    llm.collective_rpc("orca_stats")                   # -> [ {probe_ns, engine_steps, ...}, ... ]

Hot reload, in two phases (the server's `POST /v1/orca/bundle` and SIGHUP; see
docs/SERVER.md): `orca_load_bundle(path)` stages a bundle on every worker, checked as at start;
only when every worker answered with its checksum does `orca_use_bundle(checksum)` make it the
default, and `orca_retire_bundles([checksum, ...])` lets every other deployment go once its last
request leaves (also the roll-back when some worker refused). Every worker answers these (all of
them run the core), `{"error": reason}` when it cannot.

Several workers (tensor / pipeline parallelism): every worker builds the processor and sees the
batch updates, but only the last pipeline stage samples, so only its processors run `apply()`
and know where a request stopped (stage 0's copy of a request never scores a step). Under tensor
parallelism every rank of that stage runs the probe on the all-gathered logits and computes the
same result. So exactly one worker answers: the last pipeline rank with tensor rank 0; the others
drop the requested results (they must forget them too) and answer `{}`. The same worker alone
reports `orca_stats`, so engine steps and probe time are counted once.

The model runner (vLLM 0.33 and later): vLLM calls `init_worker_extension` on every worker once
its model runner exists, before the model is loaded, and this hands the runner to orca's
processors (`orca_serve/vllm_compat/runner.py` says what they read from it, and how 0.31/0.32
find it instead).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from orca_method.errors import first_line
from orca_serve.settings.contract import ReloadAnswer, to_wire
from orca_serve.vllm_compat.runner import (
    MRV2Runner,
    V1Runner,
    is_reporting_worker,
    offer_mrv2_runner,
    processors_in,
    runner_of,
)
from orca_serve.vllm_plugin import speculation
from orca_serve.vllm_plugin.adapter import CoreAdapter

log = logging.getLogger(__name__)

# the worker imports this module before it builds its model runner (vLLM's worker_extension_cls)
speculation.install()


def processor_stats(processors: Iterable[CoreAdapter]) -> dict[str, Any]:
    """The cumulative stats of a worker's orca processors, added up (`max_step_ns`: the most)."""
    total: dict[str, Any] = {}
    for p in processors:
        for k, v in p.get_stats().items():
            total[k] = max(total.get(k, 0), v) if k == "max_step_ns" else total.get(k, 0) + v
    return total


class OrcaWorkerExtension:
    def init_worker_extension(self) -> None:
        """vLLM 0.33+ calls this once per worker, `self` being the worker, right after the
        worker's `init_device` built the model runner and before `load_model`. Hands the runner
        to orca's processors: V1 built them in the runner's constructor, so they get it now
        (`attach_runner`); MRV2 builds them in `load_model`, later, and takes it then
        (`vllm_compat.runner.offered_mrv2_runner`). Nothing runs per step."""
        view = runner_of(self)
        if isinstance(view, V1Runner):
            for p in self._orca_processors():
                p.attach_runner(view)
        elif isinstance(view, MRV2Runner):
            offer_mrv2_runner(view)
        else:
            log.warning("orca: the worker's model runner (%s) is neither of vLLM's runners the "
                        "plugin reads; requests are known by what the processor interface gives",
                        type(getattr(self, "model_runner", None)).__name__)

    def _orca_processors(self) -> list[CoreAdapter]:
        """Our processors in this worker (either runner's; `vllm_compat.runner`)."""
        return [p for p in processors_in(self) if isinstance(p, CoreAdapter)]

    def _orca_reports(self) -> bool:
        """True on the one worker that answers for the engine: the last pipeline rank (it runs
        the sampler, hence the processor's apply()) with tensor-parallel rank 0."""
        return is_reporting_worker()

    def orca_results(self, keys: list[str]) -> dict[str, dict[str, Any]]:
        """Pop and return the results of these keys (keys without a result are left out).

        Every worker pops (and so forgets) them; only the reporting worker (`_orca_reports`)
        returns them, each marked `ran_sampler` (its processor ran apply() at least once), which
        `merge_results` prefers should two workers ever answer for one key.

        Numpy arrays are always sent as bytes: vLLM's transport would lose them across processes,
        and whether the caller shares this process cannot be told from here (an API server's
        engine core is a process of its own even with VLLM_ENABLE_V1_MULTIPROCESSING=0).
        `orca_serve.settings.contract.merge_results` restores them.
        Fetch after the request finished; a result is kept until fetched, for at most
        `result_ttl_s` after the request left the batch, and at most `max_results` of them.
        """
        reports = self._orca_reports()
        out: dict[str, dict[str, Any]] = {}
        for p in self._orca_processors():
            ran = p.get_stats()["engine_steps"] > 0
            for k, r in p.pop_results(list(keys)).items():
                if reports:
                    r["ran_sampler"] = ran
                    out[k] = to_wire(r)
        return out

    def orca_stats(self) -> dict[str, Any]:
        """Cumulative in-engine cost: probe_ns (time inside apply()), engine_steps (apply()
        calls), active_steps (calls with tracked requests), rows_captured, steps_scored,
        max_step_ns, tracked_requests, stored_results. `{}` from every worker but the reporting
        one (`_orca_reports`), so a sum over workers counts each engine step once."""
        return processor_stats(self._orca_processors()) if self._orca_reports() else {}

    # -- hot reload -------------------------------------------------------------------------------
    def _orca_each(self, what: str, fn: Callable[[CoreAdapter], Any],
                   answer: Callable[[Any], ReloadAnswer]) -> dict[str, Any]:
        """Run `fn(processor)` on every processor of this worker; the wire form of
        `answer(the last processor's result)`, or of a refusal in one line."""
        procs = self._orca_processors()
        if not procs:
            return ReloadAnswer(error="this engine runs no orca processor (start it with a "
                                "bundle)").to_wire()
        try:
            for p in procs:
                out = fn(p)
        except Exception as e:  # noqa: BLE001 - a refusal must reach the caller, not kill the RPC
            msg = first_line(e)
            return ReloadAnswer(error=f"{what}: {msg}" if not isinstance(e, ValueError)
                                else msg).to_wire()
        return answer(out).to_wire()

    def orca_load_bundle(self, path: str) -> dict[str, Any]:
        """Stage a bundle (checksum, model match: `OrcaCore.load_bundle`): a `ReloadAnswer` with
        its checksum or the refusal; the running deployments serve on either way."""
        return self._orca_each("loading the bundle failed", lambda p: p.load_bundle(path),
                               lambda c: ReloadAnswer(checksum=c))

    def orca_use_bundle(self, checksum: str) -> dict[str, Any]:
        """Make a staged bundle the default for requests that name none."""
        return self._orca_each("switching bundles failed", lambda p: p.use_bundle(checksum),
                               lambda _: ReloadAnswer(checksum=checksum))

    def orca_retire_bundles(self, keep: list[str]) -> dict[str, Any]:
        """Let every deployment but the current one and `keep` go when its last request leaves;
        a `ReloadAnswer` with the checksums still loaded (`live`)."""
        return self._orca_each("retiring bundles failed",
                               lambda p: p.retire_bundles(list(keep)),
                               lambda live: ReloadAnswer(live=tuple(live)))

