"""The Model Runner V2 adapter (orca_serve/vllm_plugin/mrv2.py) at vLLM's own MRV2 interface.

MRV2 needs Triton's GPU backend, so no MRV2 engine runs here. These tests drive the adapter the
way MRV2's model runner does, with vLLM's own pieces wherever they run on a CPU: the processor
is built by vLLM's MRV2 loader (`build_custom_logits_processors`) inside an instance of vLLM's
MRV2 `GPUModelRunner` whose real `add_requests` / `finish_requests` run on a real
`RequestState` (vLLM's CPU stand-in for UVA buffers, as vLLM's CPU worker installs it; only
the Triton write kernel of `apply_staged_writes` is skipped, whose device copy the adapter
never reads). Components the adapter does not involve (KV blocks, LoRA, model state) are
no-ops, and the sampler is reduced to its custom-processor loop. Each step hands `apply` a real
`LogitsContext`: rows in a new order every step, requests joining, finishing, preempted and
resumed through `add_request` with a new slot and a prefill recomputed in two chunks, n > 1
children. Results are checked against the offline replay and against the core driven the V1
way (exact token ids, no lag) on the same token streams.
"""

from __future__ import annotations

import random
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.config.vllm import VllmConfig
from vllm.exceptions import VLLMValidationError
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.sample.logits_processor import _load_logitsprocs_by_fqcns
from vllm.v1.worker.cpu import buffer_utils as cpu_buffer_utils
from vllm.v1.worker.gpu import buffer_utils
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.worker.gpu.sample.logits_processor import (
    LogitsContext,
    build_custom_logits_processors,
    build_custom_logits_processors_params_validator,
)
from vllm.v1.worker.gpu.states import RequestState

from orca_serve.settings.contract import DEFAULTS, XARG_KEY, XARG_LAM, XARG_N
from orca_serve.settings.xargs import decode_settings
from orca_serve.vllm_compat import capture
from orca_serve.vllm_plugin import adapter
from orca_serve.vllm_plugin.config import PROCESSOR_FQCN
from orca_serve.vllm_plugin.mrv2 import OrcaMRV2LogitsProcessor
from orca_serve.vllm_plugin.processor import OrcaLogitsProcessor
from orca_serve.vllm_plugin.worker import OrcaWorkerExtension
from tests.core_sim import (
    DIM,
    EOS,
    FORCE,
    PROMPT,
    TOKENS,
    DeviceTensor,
    FactoryWatch,
    FakeTokenizer,
    SimRequest,
    first_cross,
    make_core,
    reference,
    run,
    sim_bundle,
    sim_probe,
    to_device,
)

P = len(PROMPT)


@pytest.fixture(scope="module")
def bundle_path(tmp_path_factory):
    return sim_bundle(tmp_path_factory)


@pytest.fixture(autouse=True)
def cpu_vllm(monkeypatch):
    """vLLM's CPU UVA buffer (what its CPU worker installs) and our fake tokenizer."""
    monkeypatch.setattr(buffer_utils, "UvaBuffer", cpu_buffer_utils.UvaBuffer)
    monkeypatch.setattr(adapter, "load_tokenizer", lambda mc: FakeTokenizer())


def vllm_config(bundle_path, max_num_seqs: int):
    mc = SimpleNamespace(model="fake", get_hidden_size=lambda: DIM,
                         try_get_generation_config=dict)
    return SimpleNamespace(model_config=mc,
                           scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
                           additional_config={"orca": {"bundle": str(bundle_path)}})


class _Noop:
    """Runner components the adapter does not involve (KV blocks, LoRA, model state)."""

    def __getattr__(self, name):
        return lambda *a, **k: None


class _Sampler:
    """vLLM's MRV2 Sampler as far as custom processors go (sample/sampler.py): add_request and
    apply_staged_writes loop over them; apply() runs only if a request in the batch needs it."""

    def __init__(self, procs) -> None:
        self.logits_processors = list(procs)
        self.needs: dict[int, bool] = {}

    def add_request(self, req_idx: int, params) -> None:
        needs = False
        for p in self.logits_processors:  # every processor hears of every request
            needs |= p.add_request(req_idx, params)
        self.needs[req_idx] = needs

    def apply_staged_writes(self) -> None:
        for p in self.logits_processors:
            p.apply_staged_writes()


class FakeRunner(GPUModelRunner):
    """vLLM's MRV2 model runner: its own add_requests/finish_requests on a real RequestState;
    the processor is built by vLLM's MRV2 loader inside its `load_model` (as vLLM's is,
    gpu/model_runner.py; `load=False` leaves that to the caller, as a worker does)."""

    def __init__(self, cfg, max_num_reqs: int, load: bool = True) -> None:  # no GPU: no super
        self.cfg = cfg
        self.req_states = RequestState(max_num_reqs, 512, 512, 0, len(TOKENS),
                                       torch.device("cpu"))
        self.req_states.apply_staged_writes = lambda: None  # a Triton kernel; device side only
        self.model_state = self.block_tables = self.lora_state = _Noop()
        self.prompt_logprobs_worker = _Noop()
        self.pooling_runner = self.pp_handler = self.encoder_cache = None
        self.adaptive_verification = None
        self.is_last_pp_rank = True
        if load:
            self.load_model()

    def load_model(self) -> None:
        self.sampler = _Sampler(build_custom_logits_processors(
            self.cfg, self.req_states, False, [PROCESSOR_FQCN]))

    @property
    def proc(self) -> OrcaMRV2LogitsProcessor:
        return self.sampler.logits_processors[0]


def _new_req(name: str, params, out: list[int]) -> NewRequestData:
    return NewRequestData(req_id=name, prompt_token_ids=list(PROMPT), mm_features=[],
                          sampling_params=params, pooling_params=None, block_ids=([],),
                          num_computed_tokens=0, lora_request=None,
                          prefill_token_ids=list(PROMPT) + list(out))


def run_mrv2(runner: FakeRunner, sims: list[SimRequest], seed: int = 0, steps: int = 400,
             device_like: bool = False, per_step: list | None = None) -> None:
    """The fake MRV2 engine (cf. test_core.run): scheduler outputs with new, finished and
    preempted ids; rows shuffled every step; a resumed request recomputes its prefill in two
    chunks (the first one's sample is discarded, and its hidden row is garbage)."""
    rng = random.Random(seed)
    batch: list[SimRequest] = []
    finished: set[str] = set()
    for t in range(steps):
        so = SchedulerOutput.make_empty()
        so.finished_req_ids, finished = finished, set()
        so.preempted_req_ids = set()
        for s in list(batch):
            if s.preempt_at is not None and len(s.out) == s.preempt_at:
                so.preempted_req_ids.add(s.name)
                batch.remove(s)
                s.preempt_at, s.back_at = None, t + 2
        for s in sims:
            new = s.req is None and not s.done and t == s.join_at
            if new or s.back_at == t:
                so.scheduled_new_reqs.append(_new_req(s.name, s.params, s.out))
                n_ids = P + len(s.out)
                s.chunks = [n_ids - 2, n_ids] if s.back_at == t else [n_ids]
                s.req, s.back_at = True, None
                batch.append(s)
        runner.finish_requests(so)  # execute_model's order
        runner.add_requests(so)
        if not batch:
            if all(s.done for s in sims):
                break
            continue
        rng.shuffle(batch)
        slots = [runner.req_states.req_id_to_index[s.name] for s in batch]
        seqs, ids, rows = [], [], []
        for s in batch:
            seq = s.chunks.pop(0) if s.chunks else P + len(s.out)
            full = list(PROMPT) + s.out
            n = seq - P
            seqs.append(seq)
            ids.append(full[seq - 1])
            complete = seq == len(full)
            rows.append(s.hidden[n - 1] if complete and n > 0 else torch.randn(DIM) * 9)
        logits = torch.stack([s.logits[len(s.out)] for s in batch])
        hidden = torch.stack(rows)
        idx = np.array(slots, dtype=np.intp)
        ctx = LogitsContext(
            expanded_idx_mapping=torch.from_numpy(idx).long(), idx_mapping=torch.from_numpy(idx),
            idx_mapping_np=idx, expanded_local_pos=torch.zeros(len(batch), dtype=torch.int32),
            input_ids=torch.tensor(ids, dtype=torch.int32),
            pos=torch.tensor(seqs, dtype=torch.int64) - 1,
            seq_lens_upper_bound_np=np.array(seqs, dtype=np.int32))
        if any(runner.sampler.needs.get(s) for s in slots):
            if device_like:
                DeviceTensor.log = []
                hidden, logits = hidden.as_subclass(DeviceTensor), logits.as_subclass(DeviceTensor)
                ctx = LogitsContext(**{**ctx.__dict__,
                                       "input_ids": ctx.input_ids.as_subclass(DeviceTensor)})
            capture.STASH.rows = hidden  # what the LM-head capture layer keeps
            with FactoryWatch():
                for p in runner.sampler.logits_processors:
                    logits = p.apply(logits, ctx)
            if per_step is not None:
                per_step.append(DeviceTensor.log)
                DeviceTensor.log = []
            logits = logits.as_subclass(torch.Tensor)
        for row, s in enumerate(batch):
            if seqs[row] < P + len(s.out):
                continue  # partial prefill chunk: vLLM drops its sample
            forced = torch.isfinite(logits[row])
            tok = int(forced.nonzero()[0]) if int(forced.sum()) == 1 else s.stream[len(s.out)]
            s.out.append(tok)
            if tok == EOS or len(s.out) >= s.max_tokens:
                finished.add(s.name)
        for s in [s for s in batch if s.name in finished]:
            batch.remove(s)
            s.done = True
    so = SchedulerOutput.make_empty()
    so.finished_req_ids = finished
    runner.finish_requests(so)


def make_sims(seed: int, n: int = 8) -> list[SimRequest]:
    rng = random.Random(seed)
    sims = []
    for i in range(n):
        policy = ["stop", "answer", "shadow"][i % 3]
        xa = {XARG_KEY: f"r{i}", "orca_policy": policy}
        if i == 7:
            xa[XARG_LAM] = "inf"
        s = SimRequest(f"r{i}", rng, xa=xa, max_tokens=rng.randrange(40, 90),
                       join_at=rng.randrange(0, 6),
                       preempt_at=rng.randrange(5, 30) if i % 2 else None)
        s.params = SamplingParams(max_tokens=s.max_tokens, extra_args=dict(xa))
        sims.append(s)
    return sims


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mrv2_matches_replay_and_the_v1_way_with_joins_reorders_and_preemption(bundle_path,
                                                                              seed):
    runner = FakeRunner(vllm_config(bundle_path, 8), max_num_reqs=8)
    proc = runner.proc
    assert isinstance(proc, OrcaMRV2LogitsProcessor)
    sims = make_sims(seed)
    run_mrv2(runner, sims, seed)
    res = proc.pop_results([s.name for s in sims])
    # the same scripted streams through the core, the V1 adapter's way (exact ids, no lag)
    v1_sims = make_sims(seed)
    core = make_core(bundle_path, max_num_seqs=4)
    run(core, v1_sims, seed)
    v1 = core.pop_results([s.name for s in v1_sims])
    table, probe = core.dep.table, sim_probe()
    stops = 0
    for s, s1 in zip(sims, v1_sims, strict=True):
        r, r1 = res[s.name], v1[s.name]
        assert "error" not in r, r.get("error")
        policy = s.xa["orca_policy"]
        sm, ends = reference(table, s, probe, len(s.out) - 2)  # the last two are never pooled
        n_scored = r["steps_scored"]
        assert r["scores"] == pytest.approx(sm[:n_scored], abs=1e-5), s.name
        # same stop decisions as the V1 way; scores agree as far as both scored
        assert r["stop_step"] == r1["stop_step"] and r["stop_reason"] == r1["stop_reason"]
        assert r["would_stop_step"] == r1["would_stop_step"]
        k = min(n_scored, r1["steps_scored"])
        assert r["scores"][:k] == pytest.approx(r1["scores"][:k], abs=1e-5)
        assert r["forced_tokens"] == r1["forced_tokens"]
        cross = first_cross(sm, float("inf") if s.name == "r7" else 0.75)
        if policy == "shadow":
            assert r["would_stop_step"] == cross and r["forced_tokens"] == []
            continue
        if r["stop_reason"] != "probe":
            continue
        stops += 1
        assert r["stopped_early"] and r["stop_step"] == n_scored == cross
        at = ends[cross - 1] + 2  # one token later than the V1 way (the documented lag)
        want = [EOS] if policy == "stop" else FORCE
        assert s.out[at:at + len(want)] == want, s.name
        assert s1.out[at - 1:at - 1 + len(want)] == want, s.name
    assert stops >= 2, "no probe stop happened: the test would prove little"
    # every state is freed; every result was retrievable by key
    st = proc.get_stats()
    assert proc.core.pool.free_count == proc.core.capacity and not proc.core.live
    assert not proc._slots and not proc._fed
    assert st["tracked_requests"] == 0 and st["parked_requests"] == 0
    assert st["stored_results"] == 0 and st["resumed"] >= 3
    assert st["recompute_chunks"] >= 3  # the discarded first chunks of resumed prefills


def test_n_children_get_their_own_results(bundle_path):
    """n = 2: vLLM's two children share one params object (unseeded); their request ids
    "<index>_<parent>" give the index; results under the key and key/1."""
    runner = FakeRunner(vllm_config(bundle_path, 8), max_num_reqs=8)
    params = SamplingParams(n=2, max_tokens=60, extra_args={XARG_KEY: "p",
                                                           "orca_policy": "shadow"})
    OrcaLogitsProcessor.validate_params(params)  # the front end, before the fan-out
    assert params.extra_args[XARG_N] == 2
    rng = random.Random(7)
    sims = [SimRequest(f"{i}_parent", rng, xa=params.extra_args, max_tokens=60, join_at=i,
                       preempt_at=12 if i else None) for i in range(2)]
    for s in sims:
        s.params = params
    run_mrv2(runner, sims, 7)
    res = runner.proc.pop_results(["p", "p/1"])
    table, probe = runner.proc.core.dep.table, sim_probe()
    for s, key, index in zip(sims, ["p", "p/1"], [0, 1], strict=True):
        sm, _ = reference(table, s, probe, len(s.out) - 2)
        assert res[key]["index"] == index
        assert res[key]["scores"] == pytest.approx(sm, abs=1e-5) and len(sm) > 3
    assert runner.proc.core.pool.free_count == runner.proc.core.capacity


def test_child_index_from_the_id_or_the_seed():
    """A child's index from vLLM's "<index>_<parent>" id, else from its seed minus the parent's
    as the codec carries it (`OrcaSettings.seed`); 0 for a request that is no child."""
    params = SamplingParams(n=3, seed=40, extra_args={XARG_KEY: "p"})
    OrcaLogitsProcessor.validate_params(params)
    settings = decode_settings(params.extra_args, DEFAULTS, record=False)
    assert (settings.n, settings.seed) == (3, 40)
    assert adapter.child_index("2_parent", settings, 40) == 2  # the id wins
    assert adapter.child_index(None, settings, 41) == 1  # vLLM seeded child 1 with 40 + 1
    assert adapter.child_index(None, settings, None) == 0
    single = decode_settings({XARG_KEY: "q"}, DEFAULTS, record=False)
    assert single.seed is None and adapter.child_index("1_parent", single, 41) == 0


def test_mrv2_apply_never_waits_for_the_device(bundle_path):
    """As the core's sync test, through the adapter: per apply() no .item()/.tolist()/bool()
    of a device value, one host-to-device copy at most (the core's staging) and at most two
    non_blocking device-to-host copies (the core's readback and the fed token ids)."""
    runner = FakeRunner(vllm_config(bundle_path, 8), max_num_reqs=8)
    to_device(runner.proc.core)
    sims = make_sims(3, n=4)
    per_step: list[list[str]] = []
    run_mrv2(runner, sims, 3, device_like=True, per_step=per_step)
    res = runner.proc.pop_results([s.name for s in sims])
    assert any(r["stopped_early"] for r in res.values())
    worst = max(per_step, key=len)
    for log in per_step:
        d2h = [e for e in log if e.startswith("d2h")]
        h2d = [e for e in log if e.startswith("h2d")]
        assert set(d2h) <= {"d2h copy_"} and len(d2h) <= 2, worst
        assert h2d in ([], ["h2d copy_"]), worst
    assert sum(log.count("d2h copy_") == 2 for log in per_step) > 5  # both copies are seen


def test_one_fqcn_for_both_runners_and_admission_checks(bundle_path):
    """Both loaders accept the one FQCN; each constructor signature gets its adapter; the MRV2
    front-end validator refuses a malformed orca xarg."""
    assert _load_logitsprocs_by_fqcns([PROCESSOR_FQCN]) == [OrcaLogitsProcessor]
    runner = FakeRunner(vllm_config(bundle_path, 2), max_num_reqs=2)
    assert type(runner.proc) is OrcaMRV2LogitsProcessor and runner.proc._runner.runner is runner
    v1 = OrcaLogitsProcessor(vllm_config(bundle_path, 2), torch.device("cpu"), False)
    assert type(v1) is OrcaLogitsProcessor
    validate = build_custom_logits_processors_params_validator([PROCESSOR_FQCN])
    validate(SamplingParams(extra_args={"orca_policy": "stop", "orca_delta": 0.1}))
    for bad in ({"orca_policy": "never"}, {"orca_delta": 2}, {XARG_KEY: 5},
                {"orca_enabled": "yes"}):
        with pytest.raises(VLLMValidationError, match="orca_"):
            validate(SamplingParams(extra_args=bad))


def test_worker_extension_finds_the_mrv2_processor(bundle_path):
    runner = FakeRunner(vllm_config(bundle_path, 8), max_num_reqs=8)
    sims = make_sims(4, n=3)
    run_mrv2(runner, sims, 4)
    ext = OrcaWorkerExtension()
    ext.model_runner = runner
    assert ext._orca_processors() == [runner.proc]
    got = ext.orca_results(["r0", "r1", "r2"])
    assert set(got) == {"r0", "r1", "r2"} and all(r["ran_sampler"] for r in got.values())
    assert ext.orca_stats()["engine_steps"] > 0


def test_speculative_decoding_is_refused_under_mrv2(bundle_path):
    """Under MRV2 a request owns one logits row per draft token, which this adapter does not
    read: building it under a speculative config fails the engine start with one line."""
    cfg = vllm_config(bundle_path, 2)
    cfg.speculative_config = SimpleNamespace(method="ngram")
    with pytest.raises(RuntimeError, match="V1 model runner only"):
        FakeRunner(cfg, max_num_reqs=2)


# -- the default runner -----------------------------------------------------------------------
def test_orca_keeps_vllm_on_v1_where_mrv2_would_be_picked(monkeypatch) -> None:
    """vLLM picks Model Runner V2 when VLLM_USE_V2_MODEL_RUNNER is unset, Triton is present and
    no listed feature is unsupported (`VllmConfig.use_v2_model_runner`, vLLM's own selection,
    run here on a config in that state: a GPU machine). prepare_environment(), which orca-serve
    and the collect job call and the plugin's users are told to call, turns that into V1 and
    says how to opt in; VLLM_USE_V2_MODEL_RUNNER=1 opts in and is left alone."""
    from orca_serve.vllm_plugin.config import ENV_V2_RUNNER, V1_DEFAULT_NOTE, prepare_environment

    monkeypatch.setattr(sys.modules[VllmConfig.__module__], "HAS_TRITON", True)
    gpu = SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None),
                          watermark_config=None,
                          model_config=None,  # 0.31 reads it for its ROCm default (V1 by model)
                          _get_v2_model_runner_unsupported_features=lambda: [])

    def picks_mrv2() -> bool:
        return VllmConfig.use_v2_model_runner.fget(gpu)

    monkeypatch.delenv(ENV_V2_RUNNER, raising=False)
    assert picks_mrv2()  # what vLLM does on its own
    note = prepare_environment()
    assert note == V1_DEFAULT_NOTE and f"{ENV_V2_RUNNER}=1" in note
    assert not picks_mrv2()
    assert prepare_environment() is None  # said once: the environment has chosen now
    monkeypatch.setenv(ENV_V2_RUNNER, "1")
    assert prepare_environment() is None and picks_mrv2()
