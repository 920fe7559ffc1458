"""The model runner handed to orca's processors by vLLM 0.33's worker-extension hook, at vLLM's
interface (orca_serve/vllm_compat/runner.py, "How the runner is reached").

The vLLM installed here (0.32) has no hook, so `start_worker` / `init_device` below do what
0.33.0's `WorkerWrapperBase` does with a worker extension (vllm/v1/worker/worker_base.py):
`init_worker` checks the extension's names against the worker class and appends the extension
to its bases (lines 313-333), then builds the worker (352); `init_device` runs the worker's own
`init_device`, which builds the model runner (gpu_worker.py:565, cpu_worker.py:155-164), then
the extension's `init_worker_extension` with the worker as `self` (361-368); the executor calls
`load_model` after that (uniproc_executor.py:69-74). The runners are vLLM's classes: V1 builds
its processors with vLLM's own `build_logitsprocs` in its constructor (gpu_model_runner.py:728),
MRV2 with vLLM's MRV2 loader in `load_model` (gpu/model_runner.py:465; tests/test_mrv2.py's
runner). `vllm.__version__` reads 0.33.0 where the hook path is meant; the stack walk, the
fallback of 0.31/0.32, is made to fail there, so a runner found proves the hook handed it over.
"""

from __future__ import annotations

from types import MethodType, SimpleNamespace

import numpy as np
import pytest
import torch
import vllm
from vllm import SamplingParams
from vllm.v1.sample import logits_processor as v1_processors
from vllm.v1.sample.logits_processor import BatchUpdate
from vllm.v1.worker.gpu_input_batch import InputBatch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1ModelRunner
from vllm.v1.worker.worker_base import WorkerWrapperBase

from orca_serve.settings.contract import XARG_KEY
from orca_serve.vllm_compat import runner as compat_runner
from orca_serve.vllm_plugin.config import (
    PROCESSOR_FQCN,
    WORKER_EXTENSION,
    WORKER_HOOK_SINCE,
    calls_worker_extension_hook,
)
from orca_serve.vllm_plugin.adapter import hands_over_the_runner
from orca_serve.vllm_plugin.processor import OrcaLogitsProcessor
from orca_serve.vllm_plugin.worker import OrcaWorkerExtension
from tests.core_sim import PROMPT, sim_bundle
from tests.test_mrv2 import (
    FakeRunner,
    cpu_vllm,  # noqa: F401 - autouse fixture: CPU buffers, fake tokenizer
    make_sims,
    run_mrv2,
)
from tests.test_mrv2 import vllm_config as sim_config

STACK_WALK = compat_runner._on_stack


@pytest.fixture(scope="module")
def bundle_path(tmp_path_factory):
    return sim_bundle(tmp_path_factory)


@pytest.fixture
def vllm_033(monkeypatch):
    """vLLM reporting 0.33.0, whose workers call the hook; the stack walk fails the test."""
    monkeypatch.setattr(vllm, "__version__", "0.33.0")

    def no_stack_walk(*_args):
        raise AssertionError("the runner was looked up on the call stack")

    monkeypatch.setattr(compat_runner, "_on_stack", no_stack_walk)


def engine_config(bundle_path, *, extension: str = WORKER_EXTENSION, speculative=None):
    cfg = sim_config(bundle_path, 8)
    cfg.parallel_config = SimpleNamespace(worker_extension_cls=extension)
    cfg.speculative_config = speculative
    return cfg


class V1Runner(V1ModelRunner):
    """vLLM's V1 model runner as far as processors go (no GPU: no super().__init__): its
    constructor builds them with vLLM's `build_logitsprocs`, the persistent batch it keeps
    (`input_batch`: request ids and live output lists by row), the requests it still holds and
    the discard mask."""

    def __init__(self, cfg) -> None:
        self.requests: dict[str, object] = {}
        self.input_batch = SimpleNamespace(
            req_ids=[], req_output_token_ids=[],
            update_async_output_token_ids=lambda: None,  # no async scheduling here
            # the module's name, as the runner module's: orca wraps it for speculation
            logitsprocs=v1_processors.build_logitsprocs(cfg, torch.device("cpu"), False, False,
                                                        [PROCESSOR_FQCN]))
        self.discard_request_mask = SimpleNamespace(np=np.zeros(8, dtype=bool))
        self._sample = self.vllm_sample

    def vllm_sample(self, logits, spec_decode_metadata):
        return "sampled by vLLM"


class Worker:
    """A worker whose `init_device` builds its model runner, as vLLM's GPU and CPU workers do."""

    runner_cls: type = V1Runner

    def __init__(self, vllm_config) -> None:
        self.vllm_config = vllm_config
        self.model_runner = None

    def init_device(self) -> None:
        self.model_runner = self.runner_cls(self.vllm_config)

    def load_model(self) -> None:
        """The weights (none here); the V1 runner has built its processors already."""


class MRV2Worker(Worker):
    @staticmethod
    def runner_cls(cfg) -> FakeRunner:
        return FakeRunner(cfg, max_num_reqs=8, load=False)

    def load_model(self) -> None:
        self.model_runner.load_model()  # MRV2 builds its processors here


def start_worker(worker_cls: type, cfg, *, hook: bool = True) -> Worker:
    """0.33's `WorkerWrapperBase.init_worker` and `init_device` (see the module docstring), then
    `load_model`; `hook=False`: 0.32's, which never calls the hook."""
    ext = OrcaWorkerExtension
    cls = type(worker_cls.__name__, (worker_cls,), {})  # vLLM mutates the worker class itself
    for attr in dir(ext):
        if not attr.startswith("__"):
            assert not hasattr(cls, attr), attr  # vLLM refuses a name the worker has
    cls.__bases__ = (*cls.__bases__, ext)
    worker = cls(cfg)
    worker.init_device()
    call = getattr(ext, "init_worker_extension", None)
    if hook and callable(call):
        call(worker)
    worker.load_model()
    return worker


def test_the_hook_is_vllm_033s_and_absent_from_the_installed_release():
    """The version rule against vLLM's own code: the installed release's worker wrapper calls
    the hook exactly when the rule says it does (the constant the 0.33 wrapper looks up)."""
    calls = "init_worker_extension" in WorkerWrapperBase.init_device.__code__.co_consts
    assert calls == calls_worker_extension_hook()
    assert WORKER_HOOK_SINCE == "0.33"
    for version, want in (("0.31.2", False), ("0.32.0", False), ("0.32.1.dev3+g1234", False),
                          ("0.33.0", True), ("0.33.1.dev2+gabc", True), ("0.34.0", True),
                          ("not a version", False)):
        assert calls_worker_extension_hook(version) is want, version


def test_only_orcas_extension_hands_the_runner_over(bundle_path, monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    assert hands_over_the_runner(engine_config(bundle_path))

    class Mine(OrcaWorkerExtension):  # a user's extension adding RPCs to orca's
        pass

    monkeypatch.setitem(globals(), "Mine", Mine)  # where vLLM's resolution put it
    assert hands_over_the_runner(engine_config(bundle_path, extension=f"{__name__}.Mine"))
    assert not hands_over_the_runner(engine_config(bundle_path, extension=""))
    assert not hands_over_the_runner(engine_config(bundle_path, extension="x.Other"))
    assert not hands_over_the_runner(sim_config(bundle_path, 8))  # no parallel config
    monkeypatch.setattr(vllm, "__version__", "0.32.0")
    assert not hands_over_the_runner(engine_config(bundle_path))


def test_v1_processor_gets_the_runner_from_the_hook(bundle_path, vllm_033):
    """V1 builds the processor inside the runner's constructor, before the hook: it starts
    without a runner and gets it from the hook, once; then request ids and preemption come from
    the runner (an n = 2 child's index from its id, a preempted request kept, a finished one
    stored under its key)."""
    cfg = engine_config(bundle_path)
    worker = start_worker(Worker, cfg, hook=False)  # as far as init_device: the hook not yet run
    proc = worker._orca_processors()[0]
    assert isinstance(proc, OrcaLogitsProcessor)
    assert proc._runner is None and not proc.core.rows_exact
    OrcaWorkerExtension.init_worker_extension(worker)  # what 0.33's init_device does next
    runner = worker.model_runner
    assert proc._runner.runner is runner and proc.core.rows_exact
    params = SamplingParams(n=2, max_tokens=40, extra_args={XARG_KEY: "p",
                                                           "orca_policy": "shadow"})
    OrcaLogitsProcessor.validate_params(params)
    out: list[int] = []
    runner.input_batch.req_ids, runner.input_batch.req_output_token_ids = ["1_p"], [out]
    runner.requests["1_p"] = object()

    def batch(added=(), removed=()):
        proc.update_state(BatchUpdate(batch_size=1, removed=list(removed), added=list(added),
                                      moved=[]))

    batch(added=[(0, params, list(PROMPT), out)])
    req = proc._rows.get(0).req
    assert (req.ident, req.index) == ("1_p", 1)  # by the runner's request id, not the params
    batch(removed=[0])  # still the runner's: preempted
    assert "1_p" in proc.core.live and proc.get_stats()["parked_requests"] == 1
    batch(added=[(0, params, list(PROMPT), out)])
    assert proc._rows.get(0).req is req  # resumed with its state
    del runner.requests["1_p"]
    batch(removed=[0])  # gone from the runner: finished
    assert "1_p" not in proc.core.live and set(proc.pop_results(["p/1"])) == {"p/1"}


def test_v1_speculation_is_wired_when_the_runner_arrives(bundle_path, vllm_033):
    """Under a speculative config the draft-row hook is installed on the runner the hook hands
    over (its `_sample` wrapped); a processor that never got one refuses to step rather than
    read draft rows as requests."""
    cfg = engine_config(bundle_path, speculative=SimpleNamespace(method="ngram"))
    worker = start_worker(Worker, cfg)
    runner, proc = worker.model_runner, worker._orca_processors()[0]
    assert proc._runner.runner is runner
    assert runner._sample != runner.vllm_sample  # wrapped; vLLM's own still runs under it
    assert runner._sample(torch.zeros(1, 4), None) == "sampled by vLLM"
    orphan = start_worker(Worker, cfg, hook=False)._orca_processors()[0]
    with pytest.raises(RuntimeError, match="V1 model runner"):
        orphan.apply(torch.zeros(1, 4))


def test_the_draft_rows_see_the_async_placeholders_filled():
    """Under async scheduling (vLLM's default on a GPU with draft-model speculation) the V1
    runner leaves the last step's sampled ids as -1 placeholders in the output lists, with one
    more per draft of that step (optimistically accepted), and fills them in its own `_sample`
    (`InputBatch.update_async_output_token_ids`), which the draft-row hook runs before. Read
    unfilled, every draft would count as accepted and placeholders would be segmented."""
    out = [5, 6, -1, -1, -1]  # the last step: 2 drafts (placeholders) and its own sample
    batch = SimpleNamespace(req_ids=["a"], prev_req_id_to_index={"a": 0},
                            sampling_metadata=SimpleNamespace(output_token_ids=[out]),
                            sampled_token_ids_cpu=torch.tensor([[7, -1, -1]]),  # none accepted
                            async_copy_ready_event=SimpleNamespace(synchronize=lambda: None))
    batch.update_async_output_token_ids = MethodType(InputBatch.update_async_output_token_ids,
                                                     batch)
    runner = SimpleNamespace(input_batch=batch, use_async_scheduling=True,
                             _draft_token_req_ids=None,
                             _get_spec_decode_draft_probs=lambda metadata: None,
                             rejection_sampler=lambda *args: "sampled by vLLM")
    runner._sample = MethodType(V1ModelRunner._sample, runner)  # vLLM's own
    seen: list[list[int]] = []
    view = compat_runner.V1Runner(runner)
    view.intercept_draft_steps(lambda logits, rows: seen.append(list(out)), lambda on: None)
    metadata = SimpleNamespace(num_draft_tokens=[3])
    assert runner._sample(torch.zeros(4, 8), metadata) == "sampled by vLLM"
    assert seen == [[5, 6, 7]] and out == [5, 6, 7]


def test_mrv2_processor_takes_the_runner_the_hook_offered(bundle_path, vllm_033, monkeypatch):
    """MRV2 builds the processor in load_model, after the hook: it takes the runner the hook
    offered, and serves exactly as with the runner found on the stack (0.31/0.32's way)."""
    worker = start_worker(MRV2Worker, engine_config(bundle_path))
    runner = worker.model_runner
    proc = runner.sampler.logits_processors[0]
    assert proc._runner.runner is runner
    sims = make_sims(5, n=6)
    run_mrv2(runner, sims, 5)
    hooked = proc.pop_results([s.name for s in sims])
    # the fallback: stock vLLM 0.33 without orca's extension, the runner found on the stack
    monkeypatch.setattr(compat_runner, "_on_stack", STACK_WALK)
    fallback = FakeRunner(engine_config(bundle_path, extension=""), max_num_reqs=8)
    assert fallback.proc._runner.runner is fallback
    sims = make_sims(5, n=6)
    run_mrv2(fallback, sims, 5)
    found = fallback.proc.pop_results([s.name for s in sims])
    assert set(hooked) == set(found) == {s.name for s in sims}
    assert any(r["stopped_early"] for r in hooked.values())
    for name, r in hooked.items():
        for field in ("stop_step", "stop_reason", "would_stop_step", "forced_tokens"):
            assert r[field] == found[name][field], (name, field)
        assert r["scores"] == pytest.approx(found[name]["scores"], abs=1e-6)


def test_each_mrv2_worker_gets_its_own_runner(bundle_path, vllm_033):
    """Engines built one after another in one process (in-process engines, tests): the second
    MRV2 processor gets its own worker's runner, not the one offered before."""
    workers = [start_worker(MRV2Worker, engine_config(bundle_path)) for _ in range(2)]
    for w in workers:
        assert w.model_runner.sampler.logits_processors[0]._runner.runner is w.model_runner
