"""A simulated engine for the engine-step core (orca_serve.core), shared by the core, MRV2,
speculation and reload tests: a fake tokenizer and bundle, scripted requests run through
`OrcaCore` the way the adapters drive it, the offline reference they are checked against, and
the fake device that counts host-device copies (the sync tests).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from orca_method.bundle import Segmentation
from orca_method.probe import Probe, ProbeSpec
from orca_method.procedure import replay
from orca_method.steps import CLOSE, MERGE, NONE, STEP, STEP_PREV, Segmenter
from orca_serve.core.engine import OrcaCore
from orca_serve.core.registry import Entry
from orca_serve.settings.contract import DEFAULTS, XARG_KEY, OrcaSettings, RequestDefaults
from orca_serve.settings.engine_config import EngineConfig
from orca_serve.settings.xargs import decode_settings, on_deployment
from tests.bundles import tiny_bundle, with_give_up, write_bundle

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


def sim_probe(seed: int = 1) -> Probe:
    probe = Probe(ProbeSpec(dim=DIM), seed=0)
    g = torch.Generator().manual_seed(seed)
    probe.params["w"].data = torch.randn(DIM, generator=g) * 3
    return probe.requires_grad_(False)


def sim_bundle(tmp_path_factory, keywords=None, *, seed: int = 1, hidden: int = DIM,
            normalization: str = "token-l2", **fields: Any):
    """The simulation's bundle (`fields`: other Bundle fields, as `tiny_bundle` takes them)."""
    b = tiny_bundle(sim_probe(seed), [(0.05, None), (0.1, 0.75)], vocab=ID, window=WINDOW,
                    default_delta=0.1, name="fake", hidden_size=hidden,
                    segmentation=Segmentation(keywords=keywords), normalization=normalization,
                    **fields)
    return write_bundle(b, tmp_path_factory.mktemp("bundle") / "bundle.json")


def gated_sim_bundle(path, gate):
    """The sim bundle made two-sided (`with_give_up`: a static give-up score of sigmoid(-2) =
    0.12, mu* 0.1 / 0.2) with this shift gate, written at `path`."""
    b = with_give_up(tiny_bundle(sim_probe(), [(0.05, None), (0.1, 0.75)], vocab=ID,
                                 window=WINDOW, default_delta=0.1, name="fake", hidden_size=DIM),
                     [(0.05, 0.1), (0.1, 0.2)], bias=-2.0)
    return write_bundle(b.model_copy(update={"shift_gate": gate}), path)


def engine_settings(xa: dict, defaults: RequestDefaults = DEFAULTS, *, record: bool = False,
                    lam_of, default_delta: float | None, groups=()) -> OrcaSettings:
    """What the engine's admission makes of the extra_args `xa` on a deployment whose bundle
    resolves lambda* with `lam_of` (`decode_settings`, then `on_deployment`)."""
    return on_deployment(decode_settings(xa, defaults, record=record), defaults, lam_of=lam_of,
                         default_delta=default_delta, groups=groups)


def make_core(bundle_path, max_num_seqs: int = 8, *, device: str | torch.device = "cpu",
              **cfg) -> OrcaCore:
    """A core of the bundle at `bundle_path` (`cfg`: its config) on `device`, with pinned host
    buffers where that is CUDA, as the adapters build it (scripts/cuda_sync_check.py runs the
    sync checks' scenarios on a GPU so)."""
    device = torch.device(device)
    return OrcaCore(EngineConfig.from_dict({"bundle": str(bundle_path), **cfg}), FakeTokenizer(),
                    hidden_size=DIM,
                    model_name="fake", eos_ids={EOS}, default_eos=EOS,
                    max_num_seqs=max_num_seqs, device=device,
                    pin_memory=device.type == "cuda")


class SimRequest:
    def __init__(self, name: str, rng: random.Random, *, xa: dict, max_tokens: int,
                 join_at: int, preempt_at: int | None = None, lag_from: int | None = None):
        self.name, self.xa, self.max_tokens, self.join_at = name, xa, max_tokens, join_at
        self.preempt_at, self.lag_from = preempt_at, lag_from
        body = ["a", "b", "c", "x", ".", "\n"] * 3 + ["\n\n", ".\n\n"] * 2
        self.stream = [ID[rng.choice(body)] for _ in range(max_tokens + 8)]
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        self.hidden = torch.randn(max_tokens + 8, DIM, generator=g)  # row of output position i
        # the model's logits for output position i: the stream is a sample of them, the argmax
        # is what a greedy (forced-argmax) row takes
        self.logits = torch.randn(max_tokens + 8, len(TOKENS), generator=g)
        self.logits[:, EOS] = -30.0  # like its stream, the model never ends on its own
        self.out: list[int] = []
        self.req = None
        self.done = False
        self.back_at: int | None = None


def sync_sims(max_tokens: int, xa: Callable[[int], dict] = lambda i: {}) -> list[SimRequest]:
    """The requests of the sync checks (tests/test_core.py, scripts/cuda_sync_check.py), every
    path of the step that moves data between host and device: one per policy (stop, answer,
    shadow, answer) joining a step apart, the second preempted at 10 tokens and resumed, the
    third lagging from 20 (async scheduling's placeholder ids). `xa(i)`: request i's extra_args
    besides its key and policy."""
    rng = random.Random(3)
    return [SimRequest(f"r{i}", rng, xa={XARG_KEY: f"r{i}", "orca_policy": p, **xa(i)},
                       max_tokens=max_tokens, join_at=i, preempt_at=10 if i == 1 else None,
                       lag_from=20 if i == 2 else None)
            for i, p in enumerate(["stop", "answer", "shadow", "answer"])]


def run_requests(path, requests: dict[str, dict], **cfg) -> tuple[dict, dict]:
    """Requests by name (their extra_args besides the key) run together from step 0 through a
    4-slot core of the bundle at `path` (`cfg`: the core's config): (sims, raw results) by
    name; every slot is free again afterwards."""
    core = make_core(path, max_num_seqs=4, **cfg)
    rng = random.Random(0)
    sims = [SimRequest(name, rng, xa={"orca_key": name, **xa}, max_tokens=60, join_at=0)
            for name, xa in requests.items()]
    run(core, sims)
    res = core.pop_results(list(requests))
    assert core.pool.free_count == core.capacity
    return {s.name: s for s in sims}, res


def join_due(core: OrcaCore, sims: list[SimRequest], batch: list[SimRequest], t: int) -> None:
    """The requests whose turn it is at step t enter `batch`: new ones join, preempted ones come
    back (same identity, same output so far: `join` must return the request it had)."""
    for s in sims:
        if s.req is None and not s.done and t == s.join_at:
            s.req = core.join(s.name, core.settings(s.xa), prompt=PROMPT, n_out=0, index=0,
                              max_tokens=s.max_tokens, eos=None, ignore_eos=False,
                              structured=False)
            batch.append(s)
        if s.back_at == t:
            assert core.join(s.name, core.settings(s.xa), prompt=PROMPT, n_out=len(s.out), index=0,
                             max_tokens=s.max_tokens, eos=None, ignore_eos=False,
                             structured=False) is s.req
            batch.append(s)
            s.back_at = None


def run(core: OrcaCore, sims: list[SimRequest], seed: int = 0, steps: int = 400,
        on_park=None, on_step=None) -> None:
    """The fake engine: joins, preemptions, shuffled rows, forced or scripted next tokens (a row
    left with one finite logit is forced; else the request samples its stream's token).
    `on_step(t)` runs before step t's joins (a hot reload, say)."""
    rng = random.Random(seed)
    batch: list[SimRequest] = []
    for t in range(steps):
        if on_step is not None:
            on_step(t)
        join_due(core, sims, batch, t)
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
            entries.append(Entry(s.req, row, n, s.out[-2] if n > 1 else -1, last))
            rows.append(s.hidden[n - 1] if n else torch.randn(DIM))
        hidden = torch.stack(rows) if rows else torch.zeros(0, DIM)
        logits = torch.stack([s.logits[len(s.out)] for s in batch]) if batch else \
            torch.zeros(0, len(TOKENS))
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


def first_cross(sm: list[float], lam: float) -> int | None:
    return next((t + 1 for t, v in enumerate(sm) if v >= lam), None)


POLICY_XA = {"stop": {"orca_policy": "stop"}, "answer": {"orca_policy": "answer"},
             "shadow": {"orca_policy": "shadow"}}


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
        if func is torch.Tensor.__setitem__ and isinstance(args[2], (bool, int, float)):
            # a Python number written into one element copies it from the host (a lifted
            # scalar, `aten.copy_`: a pageable copy on CUDA, seen there); into a slice it is a
            # fill on the device
            with torch._C.DisableTorchFunctionSubclass():
                if args[0][args[1]].dim() == 0:
                    cls.log.append("h2d number into one element")
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


def to_device(obj) -> None:
    """Turn the core's device tensors into DeviceTensors (host staging buffers stay host)."""
    def conv(t):
        return t.as_subclass(DeviceTensor) if type(t) is torch.Tensor else t

    pool = obj.pool
    pool.A, pool.S, pool.lag = conv(pool.A), conv(pool.S), conv(pool.lag)
    staging = obj.device_step.staging
    staging.copy = True  # a real device needs the staging copy (a CPU one skips it)
    staging._dev = conv(staging._dev)
    def conv_bank(bank) -> None:
        bank._fast = {k: conv(v) for k, v in bank._fast.items()}
        bank._buf = {k: conv(v) for k, v in bank._buf.items()}
        bank._scratch = conv(bank._scratch)
        # the probe's weights live on the device too (a plain dict: a ParameterDict keeps
        # Parameters)
        bank.probe.__dict__["params"] = {k: v.detach().as_subclass(DeviceTensor)
                                         for k, v in bank.probe.params.items()}
        if bank.gate is not None:  # the shift gate's reference lives on the device too
            g = bank.gate
            g.mean, g.basis, g.var = conv(g.mean), conv(g.basis), conv(g.var)
        if bank.give_up is not None:  # the give-up probe's bank (a two-sided bundle)
            conv_bank(bank.give_up)

    for dep in obj.deps.values():
        conv_bank(dep.bank)


def logged(fn: Callable[..., Any], logs: list[list[str]]) -> Callable[..., Any]:
    """`fn`, with the DeviceTensor log of each call alone appended to `logs` (one list a
    call): what that call moved between host and device, or read of a device value."""
    def call(*args: Any, **kwargs: Any) -> Any:
        DeviceTensor.log = []
        try:
            with FactoryWatch():
                return fn(*args, **kwargs)
        finally:
            logs.append(DeviceTensor.log)
            DeviceTensor.log = []
    return call


def count_copies(core: OrcaCore) -> list[list[str]]:
    """Wrap `core.step` so that each engine step's host-device traffic is logged (the
    DeviceTensor log of that step alone, joins and leaves between steps left out); the list it
    returns fills with one log per step. Call after `to_device(core)`."""
    per_step: list[list[str]] = []
    step = logged(core.step, per_step)
    core.step = lambda entries, hidden, logits: step(
        entries, hidden.as_subclass(DeviceTensor), logits.as_subclass(DeviceTensor))
    return per_step


def count_join_copies(core: OrcaCore) -> list[list[str]]:
    """Wrap `core.join` likewise: a request joins in the engine step's path (vLLM's batch
    update), where a wait for the device stalls the step as one inside it would. One log per
    join. Call after `to_device(core)`."""
    per_join: list[list[str]] = []
    core.join = logged(core.join, per_join)
    return per_join
