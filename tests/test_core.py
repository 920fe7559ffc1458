"""The engine-step core (orca_serve.core) driven by a simulated engine: no vLLM needed.

A small fake engine runs several requests through `OrcaCore` the way the adapters do: requests
join at different steps, rows are shuffled every step, some are preempted and resumed, some run
with async-scheduling placeholders, and each request's next token is the forced one when the
core forced it, else the next token of its own scripted stream. Every request is then checked
against an offline reference built from the same tokens and hidden rows: the segmentation, the
token-l2 mean per step and `procedure.replay` (the calibration replay).
"""

from __future__ import annotations

import json
import logging
import random
from typing import ClassVar

import pytest
import torch

from orca_method.bundle import BundleError, Segmentation
from orca_method.probe import Probe, ProbeSpec
from orca_method.procedure import replay
from orca_method.steps import CLOSE, MERGE, NONE, STEP, STEP_PREV, Segmenter
from orca_serve.contract import XARG_BUNDLE, XARG_KEY, XARG_LAM
from orca_serve.core.engine import OrcaCore
from orca_serve.core.registry import open_reasoning_tokens
from tests.bundles import tiny_bundle, write_bundle

DIM = 16
WINDOW = 2
TOKENS = ["a", "b", "c", "x", ".", "\n", "\n\n", ".\n\n", "<think>", "</think>", "<eos>"]
ID = {t: i for i, t in enumerate(TOKENS)}
EOS = ID["<eos>"]
PROMPT = [ID["a"], ID["<think>"]]
FORCE = [ID["\n"], ID["</think>"], ID["\n\n"]]  # "\n</think>\n\n"


class FakeTokenizer:
    """The few tokenizer calls the core makes (vocabulary, per-id text, the forced text)."""

    eos_token_id = EOS

    def get_vocab(self) -> dict[str, int]:
        return dict(ID)

    def __len__(self) -> int:
        return len(TOKENS)

    def decode(self, ids: list[int]) -> str:
        return "".join(TOKENS[i] for i in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out, i = [], 0
        while i < len(text):
            t = max((t for t in TOKENS if text.startswith(t, i)), key=len)
            out.append(ID[t])
            i += len(t)
        return out


def _probe(seed: int = 1) -> Probe:
    probe = Probe(ProbeSpec(dim=DIM), seed=0)
    g = torch.Generator().manual_seed(seed)
    probe.params["w"].data = torch.randn(DIM, generator=g) * 3
    return probe.requires_grad_(False)


def _bundle(tmp_path_factory, keywords=None, *, seed: int = 1, hidden: int = DIM,
            normalization: str = "token-l2"):
    b = tiny_bundle(_probe(seed), [(0.05, None), (0.1, 0.75)], vocab=ID, window=WINDOW,
                    default_delta=0.1, name="fake", hidden_size=hidden,
                    segmentation=Segmentation(keywords=keywords), normalization=normalization)
    return write_bundle(b, tmp_path_factory.mktemp("bundle") / "bundle.json")


@pytest.fixture(scope="module")
def bundle_path(tmp_path_factory):
    return _bundle(tmp_path_factory)


@pytest.fixture(scope="module")
def other_bundle_path(tmp_path_factory):
    """Another probe for the same model (hot reload): other scores, another checksum."""
    return _bundle(tmp_path_factory, seed=7)


@pytest.fixture(scope="module")
def keyword_bundle_path(tmp_path_factory):
    """Steps open at sections with the keyword "x" (sections merge, steps end one late)."""
    return _bundle(tmp_path_factory, keywords=["x"])


def make_core(bundle_path, max_num_seqs: int = 8, **cfg) -> OrcaCore:
    return OrcaCore({"bundle": str(bundle_path), **cfg}, FakeTokenizer(), hidden_size=DIM,
                    model_name="fake", eos_ids={EOS}, default_eos=EOS,
                    max_num_seqs=max_num_seqs, device=torch.device("cpu"))


class SimRequest:
    def __init__(self, name: str, rng: random.Random, *, xa: dict, max_tokens: int,
                 join_at: int, preempt_at: int | None = None, lag_from: int | None = None):
        self.name, self.xa, self.max_tokens, self.join_at = name, xa, max_tokens, join_at
        self.preempt_at, self.lag_from = preempt_at, lag_from
        body = ["a", "b", "c", "x", ".", "\n"] * 3 + ["\n\n", ".\n\n"] * 2
        self.stream = [ID[rng.choice(body)] for _ in range(max_tokens + 8)]
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        self.hidden = torch.randn(max_tokens + 8, DIM, generator=g)  # row of output position i
        self.out: list[int] = []
        self.req = None
        self.done = False
        self.back_at: int | None = None


def run(core: OrcaCore, sims: list[SimRequest], seed: int = 0, steps: int = 400,
        on_park=None, on_step=None) -> None:
    """The fake engine: joins, preemptions, shuffled rows, forced or scripted next tokens.
    `on_step(t)` runs before step t's joins (a hot reload, say)."""
    rng = random.Random(seed)
    batch: list[SimRequest] = []
    for t in range(steps):
        if on_step is not None:
            on_step(t)
        for s in sims:
            if s.req is None and not s.done and t == s.join_at:
                s.req = core.join(s.name, s.xa, prompt=PROMPT, n_out=0, index=0,
                                  max_tokens=s.max_tokens, eos=None, ignore_eos=False,
                                  structured=False)
                batch.append(s)
            if s.back_at == t:  # resumed: same identity, same output so far
                assert core.join(s.name, s.xa, prompt=PROMPT, n_out=len(s.out), index=0,
                                 max_tokens=s.max_tokens, eos=None, ignore_eos=False,
                                 structured=False) is s.req
                batch.append(s)
                s.back_at = None
        for s in list(batch):  # leave: finished for good, or preempted for two steps
            if s.out and (s.out[-1] == EOS or len(s.out) >= s.max_tokens):
                core.leave(s.req, True)
                batch.remove(s)
                s.done = True
            elif s.preempt_at is not None and len(s.out) == s.preempt_at:
                core.leave(s.req, False)
                batch.remove(s)
                s.preempt_at, s.back_at = None, t + 2
                if on_park is not None:
                    on_park()
        if not batch and all(s.done for s in sims):
            break
        rng.shuffle(batch)  # rows move every step
        entries, rows = [], []
        for row, s in enumerate(batch):
            n = len(s.out)
            last = s.out[-1] if n else -1
            if s.lag_from is not None and n >= s.lag_from:
                last = -1  # async scheduling: the id of the last token is not known yet
            entries.append((s.req, row, n, s.out[-2] if n > 1 else -1, last))
            rows.append(s.hidden[n - 1] if n else torch.randn(DIM))
        hidden = torch.stack(rows) if rows else torch.zeros(0, DIM)
        logits = torch.zeros(len(batch), len(TOKENS))
        core.step(entries, hidden, logits)
        for row, s in enumerate(batch):
            forced = torch.isfinite(logits[row])
            tok = int(forced.nonzero()[0]) if int(forced.sum()) == 1 else s.stream[len(s.out)]
            s.out.append(tok)
    core.settle()


def reference(table, sim: SimRequest, probe: Probe, n_fed: int):
    """Offline: segment the first n_fed output tokens, mean their token-l2 rows per step, replay."""
    seg = Segmenter(table, PROMPT)
    a: list[int] = []
    s: list[int] = []
    steps: list[list[int]] = []  # positions per completed (scored) step
    ends: list[int] = []
    for pos in range(n_fed):
        counted, op = seg.feed(sim.out[pos])
        if counted:
            s.append(pos)
        if op == MERGE:
            a, s = a + s, []
        elif op in (STEP, STEP_PREV):
            steps.append(a + s if op == STEP else a)
            ends.append(pos)
            a, s = ([], []) if op == STEP else (s, [])
        elif op == CLOSE:
            break
        assert op in (NONE, MERGE, STEP, STEP_PREV)
    rows = torch.nn.functional.normalize(sim.hidden, dim=-1)
    phis = torch.stack([rows[p].mean(0) for p in steps]) if steps else torch.zeros(0, DIM)
    (_, sm), = replay(probe, [phis], WINDOW) if steps else [(None, torch.zeros(0))]
    return sm.tolist(), ends


def _first_cross(sm: list[float], lam: float) -> int | None:
    return next((t + 1 for t, v in enumerate(sm) if v >= lam), None)


POLICY_XA = {"stop": {"orca_policy": "stop"}, "answer": {"orca_policy": "answer"},
             "shadow": {"orca_policy": "shadow"}}


@pytest.mark.parametrize(("seed", "keywords"), [(0, False), (1, False), (2, False), (3, True)])
def test_core_matches_offline_replay_with_moves_preemption_and_lag(bundle_path,
                                                                   keyword_bundle_path, seed,
                                                                   keywords):
    rng = random.Random(seed)
    core = make_core(keyword_bundle_path if keywords else bundle_path, max_num_seqs=4)
    sims = []
    for i in range(8):
        policy = ["stop", "answer", "shadow"][i % 3]
        xa = {XARG_KEY: f"r{i}", **POLICY_XA[policy]}
        if i == 7:
            xa[XARG_LAM] = "inf"  # the server's resolution wins: never stops early
        sims.append(SimRequest(f"r{i}", rng, xa=xa, max_tokens=rng.randrange(40, 90),
                               join_at=rng.randrange(0, 6),
                               preempt_at=rng.randrange(5, 30) if i % 2 else None,
                               lag_from={4: 3, 5: 12}.get(i)))
    run(core, sims, seed)
    res = core.pop_results([s.name for s in sims])
    table, probe = core.dep.table, _probe()
    stops = 0
    for s in sims:
        r = res[s.name]
        assert "error" not in r, r.get("error")
        policy = s.xa["orca_policy"]
        lagged = s.lag_from is not None and len(s.out) > s.lag_from
        sm, ends = reference(table, s, probe, len(s.out) - 1 - lagged)
        lam = float("inf") if s.name == "r7" else 0.75
        cross = _first_cross(sm, lam)
        n_scored = r["steps_scored"]
        assert r["scores"] == pytest.approx(sm[:n_scored], abs=1e-5), s.name
        if policy == "shadow":
            assert r["would_stop_step"] == cross and r["forced_tokens"] == []
            assert n_scored == len(sm)
            continue
        if r["stop_reason"] == "budget":
            assert cross is None or cross > n_scored
            continue
        if cross is None:
            assert not r["stopped_early"] and n_scored == len(sm)
            continue
        stops += 1
        assert r["stopped_early"] and r["stop_step"] == n_scored == cross, s.name
        # the token right after the stop step's last one (one later when that one was lagged)
        at = ends[cross - 1] + 1
        at += s.lag_from is not None and at >= s.lag_from
        want = [EOS] if policy == "stop" else FORCE
        assert s.out[at:at + len(want)] == want, s.name
        assert r["forced_tokens"][:len(want)] == want
    # (keyword steps are long and few: there the point is the merge path's scores)
    assert stops >= (0 if keywords else 2), "no probe stop happened: the test would prove little"
    assert sum(res[s.name]["steps_scored"] for s in sims) >= 5
    assert core.pool.free_count == core.capacity  # every slot came back
    st = core.get_stats()
    assert st["resumed"] >= 3 and st["lagged_tokens"] >= 2


def test_state_is_freed_when_a_request_leaves_for_good(bundle_path):
    core = make_core(bundle_path, max_num_seqs=2)
    keyed = core.join("k", {XARG_KEY: "k", "orca_record": 1}, prompt=PROMPT, n_out=0, index=0,
                      max_tokens=50, eos=None, ignore_eos=False, structured=False)
    unkeyed = core.join("u", {}, prompt=PROMPT, n_out=0, index=0, max_tokens=50, eos=None,
                        ignore_eos=False, structured=False)
    assert core.pool.free_count == core.capacity - 2
    core.leave(unkeyed, False)  # preempted: keeps its slot
    assert core.pool.free_count == core.capacity - 2 and "u" in core.live
    core.leave(keyed, True)
    core.leave(core.join("u", {}, prompt=PROMPT, n_out=0, index=0, max_tokens=50, eos=None,
                         ignore_eos=False, structured=False), True)
    assert core.pool.free_count == core.capacity and not core.live
    st = core.get_stats()
    assert st["stored_results"] == 1 and st["tracked_requests"] == 0
    assert core.pop_results(["k", "u"]).keys() == {"k"}
    assert core.get_stats()["stored_results"] == 0


def test_results_expire_and_are_bounded(bundle_path):
    core = make_core(bundle_path, max_results=2)
    for i in range(3):
        r = core.join(f"k{i}", {XARG_KEY: f"k{i}"}, prompt=PROMPT, n_out=0, index=0,
                      max_tokens=9, eos=None, ignore_eos=False, structured=False)
        core.leave(r, True)
    assert set(core.pop_results(["k0", "k1", "k2"])) == {"k1", "k2"}
    core = make_core(bundle_path, result_ttl_s=0.0)
    core.leave(core.join("k", {XARG_KEY: "k"}, prompt=PROMPT, n_out=0, index=0, max_tokens=9,
                         eos=None, ignore_eos=False, structured=False), True)
    assert core.pop_results(["k"]) == {}


def test_parked_requests_are_evicted_into_snapshots_when_slots_run_out(bundle_path):
    """max_num_seqs=1 gives 2 slots: a third request evicts the parked one, whose state comes
    back bit for bit when it resumes."""
    rng = random.Random(5)
    ref_core, core = make_core(bundle_path, max_num_seqs=1), make_core(bundle_path,
                                                                       max_num_seqs=1)
    a = SimRequest("a", rng, xa={XARG_KEY: "a", "orca_policy": "shadow"}, max_tokens=40,
                   join_at=0)
    run(ref_core, [a])
    ref = ref_core.pop_results(["a"])["a"]
    b = SimRequest("a", random.Random(5), xa=a.xa, max_tokens=40, join_at=0, preempt_at=15)

    def crowd() -> None:  # two new requests take both slots while "a" is parked, then end
        others = [core.join(f"c{i}", {}, prompt=PROMPT, n_out=0, index=0, max_tokens=9,
                            eos=None, ignore_eos=False, structured=False) for i in range(2)]
        assert core.pool.free_count == 0 and b.req.slot is None  # "a" was evicted
        for r in others:
            core.leave(r, True)

    run(core, [b], on_park=crowd)
    assert core.get_stats()["evictions"] == 1
    got = core.pop_results(["a"])["a"]
    assert got["scores"] == pytest.approx(ref["scores"], abs=1e-6)
    assert got["steps_scored"] == ref["steps_scored"] > 0


# -- no host-device synchronisation in the step -----------------------------------------------------
class DeviceTensor(torch.Tensor):
    """A CPU tensor that plays a device tensor: every way of reading it on the host, and every
    host tensor that flows into it, is counted in `DeviceTensor.log`."""

    log: ClassVar[list[str]] = []
    D2H: ClassVar[set] = {torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.item,
           torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
           torch.Tensor.__index__}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in cls.D2H:
            cls.log.append(f"d2h {func.__name__}")
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.Tensor.to and ("cpu" in args[1:] or kwargs.get("device") == "cpu"):
            cls.log.append("d2h to('cpu')")
        if func is torch.Tensor.copy_:
            dst, src = args[0], args[1]
            if not isinstance(dst, DeviceTensor) and isinstance(src, DeviceTensor):
                cls.log.append("d2h copy_")
            elif isinstance(dst, DeviceTensor) and not isinstance(src, DeviceTensor):
                cls.log.append("h2d copy_")
        elif any(type(a) is torch.Tensor and a.numel() > 1 for a in _flat(args, kwargs)):
            cls.log.append(f"h2d operand of {getattr(func, '__name__', func)}")
        return super().__torch_function__(func, types, args, kwargs)


def _flat(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


class FactoryWatch(torch.overrides.TorchFunctionMode):
    """Counts tensors built from host data straight onto a device (`torch.tensor(list,
    device=...)`), which copy synchronously from pageable memory. Tensors made on the device
    from nothing (`torch.zeros(n, device=...)`) are device tensors: no copy."""

    MADE_ON_DEVICE: ClassVar[set] = {torch.zeros, torch.ones, torch.full, torch.empty}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
            DeviceTensor.log.append(f"h2d {func.__name__}(..., device=)")
        out = func(*args, **kwargs)
        if func in self.MADE_ON_DEVICE and kwargs.get("device") is not None:
            out = out.as_subclass(DeviceTensor)
        return out


def _to_device(obj) -> None:
    """Turn the core's device tensors into DeviceTensors (host staging buffers stay host)."""
    def conv(t):
        return t.as_subclass(DeviceTensor) if type(t) is torch.Tensor else t

    pool = obj.pool
    pool.A, pool.S, pool.lag = conv(pool.A), conv(pool.S), conv(pool.lag)
    staging = obj.device_step.staging
    staging.copy = True  # a real device needs the staging copy (a CPU one skips it)
    staging._dev = conv(staging._dev)
    for dep in obj.deps.values():
        bank = dep.bank
        bank._fast = {k: conv(v) for k, v in bank._fast.items()}
        bank._buf = {k: conv(v) for k, v in bank._buf.items()}
        bank._scratch = conv(bank._scratch)
        # the probe's weights live on the device too (a plain dict: a ParameterDict keeps
        # Parameters)
        bank.probe.__dict__["params"] = {k: v.detach().as_subclass(DeviceTensor)
                                         for k, v in bank.probe.params.items()}


@pytest.mark.parametrize("two_deployments", [False, True])
def test_engine_step_makes_at_most_one_device_to_host_copy(bundle_path, other_bundle_path,
                                                            two_deployments):
    """Steps with joins, scoring, stops, forcing, lag and preemption: per step at most one
    device-to-host copy (the readback) and one host-to-device copy (the staging), never a
    `.item()`/`.tolist()`/`bool()` of a device value or a tensor built from a list on a device.
    With two deployments live (hot reload), half the requests score through each bank."""
    core = make_core(bundle_path, max_num_seqs=4)
    other = core.load_bundle(str(other_bundle_path)).checksum if two_deployments else None
    _to_device(core)
    rng = random.Random(3)
    sims = [SimRequest(f"r{i}", rng, xa={XARG_KEY: f"r{i}", "orca_policy": p,
                                         **({XARG_BUNDLE: other} if other and i % 2 else {})},
                       max_tokens=60, join_at=i, preempt_at=10 if i == 1 else None,
                       lag_from=20 if i == 2 else None)
            for i, p in enumerate(["stop", "answer", "shadow", "answer"])]
    per_step: list[list[str]] = []
    orig = core.step

    def counted_step(entries, hidden, logits):
        DeviceTensor.log = []
        with FactoryWatch():
            orig(entries, hidden.as_subclass(DeviceTensor), logits.as_subclass(DeviceTensor))
        per_step.append(DeviceTensor.log)
        DeviceTensor.log = []  # joins and leaves between steps are not the step's

    core.step = counted_step
    run(core, sims)
    res = core.pop_results([s.name for s in sims])
    assert any(r["stopped_early"] for r in res.values())  # the stop path ran
    assert sum(r["steps_scored"] for r in res.values()) > 10
    worst = max(per_step, key=len)
    for log in per_step:
        d2h = [e for e in log if e.startswith("d2h")]
        h2d = [e for e in log if e.startswith("h2d")]
        assert d2h in ([], ["d2h copy_"]) and h2d in ([], ["h2d copy_"]), worst
    assert sum("d2h copy_" in log for log in per_step) > 5  # the readback is seen
    if two_deployments:
        assert {r["bundle_checksum"] for r in res.values()} == {core.dep.checksum, other}


# -- hot reload: several deployments live at once ---------------------------------------------------
def test_hot_reload_mixes_deployments_in_one_step_and_frees_the_old_one(bundle_path,
                                                                       other_bundle_path):
    """Requests of the old bundle keep its probe to their end while new ones (named by checksum,
    or naming none once the new bundle is current) run the new probe in the same steps; each
    request's scores equal the offline replay of its own probe. The old deployment is dropped
    when its last request leaves, not before."""
    rng = random.Random(11)
    core = make_core(bundle_path, max_num_seqs=8)
    old = core.dep.checksum
    reload_at = 12
    sims = []
    for i in range(8):
        late = i >= 4  # joins after the reload
        xa = {XARG_KEY: f"r{i}", "orca_policy": ["stop", "answer", "shadow"][i % 3]}
        if i == 5:
            xa[XARG_BUNDLE] = "will-be-set"  # names the new bundle explicitly
        elif not late:
            xa[XARG_BUNDLE] = old
        sims.append(SimRequest(f"r{i}", rng, xa=xa, max_tokens=rng.randrange(50, 90),
                               join_at=reload_at + 1 + i if late else i,
                               preempt_at=8 if i in (1, 6) else None))
    seen: dict[str, list] = {}

    def reload(t: int) -> None:
        if t == reload_at:
            new = core.load_bundle(str(other_bundle_path)).checksum
            assert new != old and core.dep.checksum == old  # staged, not current yet
            sims[5].xa[XARG_BUNDLE] = new
            core.use_bundle(new)
            assert core.retire_bundles() == [old, new]  # old requests still run on it
        seen.setdefault("deps", []).append(len(core.deps))

    run(core, sims, seed=11, on_step=reload)
    new = core.dep.checksum
    assert seen["deps"][reload_at - 1] == 1 and 2 in seen["deps"][reload_at:]
    assert list(core.deps) == [new]  # the old one went with its last request
    res = core.pop_results([s.name for s in sims])
    probes = {old: _probe(1), new: _probe(7)}
    for i, s in enumerate(sims):
        r = res[s.name]
        assert "error" not in r, r.get("error")
        want = new if i >= 4 else old
        assert r["bundle_checksum"] == want, s.name
        sm, _ = reference(core.dep.table, s, probes[want], len(s.out) - 1)
        assert r["steps_scored"] > 0
        assert r["scores"] == pytest.approx(sm[:r["steps_scored"]], abs=1e-5), s.name
    # the two probes really differ on these requests (else the test proves nothing)
    s0 = sims[0]
    a, _ = reference(core.dep.table, s0, probes[old], len(s0.out) - 1)
    b, _ = reference(core.dep.table, s0, probes[new], len(s0.out) - 1)
    assert a != pytest.approx(b, abs=1e-3)


def test_refused_bundles_leave_the_running_deployment(bundle_path, tmp_path_factory):
    core = make_core(bundle_path)
    before = dict(core.deps)
    wrong_model = _bundle(tmp_path_factory, seed=3, hidden=DIM + 1)
    with pytest.raises(BundleError, match="hidden size"):
        core.load_bundle(str(wrong_model))
    edited = tmp_path_factory.mktemp("edited") / "bundle.json"
    data = json.loads(other := _bundle(tmp_path_factory, seed=4).read_text())
    data["window"] += 1
    edited.write_text(json.dumps(data))
    with pytest.raises(BundleError, match="checksum"):
        core.load_bundle(str(edited))
    with pytest.raises(BundleError, match="normalises"):
        core.load_bundle(str(_bundle(tmp_path_factory, seed=5, normalization="step-l2")))
    with pytest.raises(BundleError, match="not loaded"):
        core.use_bundle("0" * 64)
    assert core.deps == before and core.dep is before[core.dep.checksum]
    # the same bundle again is the same deployment, and unknown files are one-line errors
    assert core.load_bundle(str(bundle_path)) is core.dep
    with pytest.raises(BundleError):
        core.load_bundle(str(other) + ".missing")


def test_a_request_naming_an_unloaded_bundle_runs_without_early_stopping(bundle_path):
    """lambda* of one probe is never applied to another: a request whose bundle is gone gets
    an error in its result instead of the current probe."""
    core = make_core(bundle_path)
    req = core.join("g", {XARG_KEY: "g", XARG_BUNDLE: "f" * 64, XARG_LAM: 0.1}, prompt=PROMPT,
                    n_out=0, index=0, max_tokens=9, eos=None, ignore_eos=False, structured=False)
    assert req is not None and not req.enabled
    core.leave(req, True)
    r = core.pop_results(["g"])["g"]
    assert "not loaded" in r["error"] and r["bundle_checksum"] is None
    assert not r["enabled"] and r["steps_scored"] == 0


def test_a_delta_outside_the_table_is_logged_once_and_reported(bundle_path, caplog):
    """Without the server's orca_lam (a stock vLLM server) the engine cannot refuse the delta:
    it runs with the default delta, says so in the result's notes and, once per delta, in the
    log (the only place a stock server's operator sees it)."""
    core = make_core(bundle_path)
    with caplog.at_level(logging.WARNING, logger="orca_serve.core"):
        for name in ("a", "b"):
            req = core.join(name, {"orca_delta": 0.3}, prompt=PROMPT, n_out=0, index=0,
                            max_tokens=20, eos=None, ignore_eos=False, structured=False)
            assert req.spec.delta == 0.1 and "default delta" in req.result().notes[0]
    warned = [r for r in caplog.records if "0.3" in r.getMessage()]
    assert len(warned) == 1 and "available deltas: 0.05, 0.1" in warned[0].getMessage()



def test_open_reasoning_tokens_of_a_prompt(bundle_path):
    """What vLLM's thinking budget has counted before the output starts: tokens after an open
    <think> (the server tells vLLM's budget stop from the model's own end by it)."""
    table = make_core(bundle_path).dep.table
    t, e = ID["<think>"], ID["</think>"]
    assert open_reasoning_tokens(table, PROMPT) == 0
    assert open_reasoning_tokens(table, [ID["a"], t, ID["\n"], ID["b"]]) == 2
    assert open_reasoning_tokens(table, [t, ID["a"], e, ID["b"]]) == 0  # closed in the prompt
