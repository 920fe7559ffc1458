"""The request contract between the server and the engine-side plugin, defined once.

Plain Python (no vLLM, no torch): the server (`orca_serve.settings.resolve`, `orca_serve.api_server.server`), the
plugin's adapters and its core all import these names, so a policy, a default, an xarg name or the
result-key rule cannot drift between them. A request goes in as one `OrcaSettings`, the same frozen
type on both sides, through the one codec of its wire form (`vllm_xargs`:
`orca_serve.settings.xargs`); results come back as `OrcaResult`, through the one codec of its wire
form here (`to_wire`, `OrcaResult.from_wire`, `merge_results`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from orca_method.gate_alarm import DEFAULT_ALARM_LEVEL
from orca_method.outcomes import Ended, GiveUpPolicy, Source, Weighting
from orca_method.thresholds import NEVER, lam_from_json, lam_to_json

if TYPE_CHECKING:  # types only: this module loads without numpy and torch
    import numpy as np
    from torch import Tensor


@dataclass(frozen=True)
class PolicyRule:
    """What a policy does when a request stops (docs/SERVER.md, "Policies")."""

    acts: bool  # a stop changes the output (False: shadow only reports where it would stop)
    answers: bool  # a stop closes the thinking and lets the model answer (else: EOS at once)


class Policy(StrEnum):
    """What a stop does: `answer` forces the end-of-thinking text and lets the model answer for
    its answer budget; `stop` ends the request (EOS); `shadow` never stops (it reports where it
    would have). Each has one `PolicyRule`; code asks the rule, never compares names."""

    ANSWER = "answer"
    STOP = "stop"
    SHADOW = "shadow"

    @property
    def rule(self) -> PolicyRule:
        return _RULES[self]


_RULES = {Policy.ANSWER: PolicyRule(acts=True, answers=True),
          Policy.STOP: PolicyRule(acts=True, answers=False),
          Policy.SHADOW: PolicyRule(acts=False, answers=False)}
POLICIES: tuple[str, ...] = tuple(str(p) for p in Policy)  # names: what argparse lists in errors


class StopReason(StrEnum):
    """Why the engine stopped a request's reasoning (`OrcaResult.stop_reason`; None: it did
    not): the probe's score crossed lambda*; the give-up score crossed mu*; or the budget guard
    closed the reasoning to keep the answer's reserve before max_tokens (or a thinking budget).
    """

    PROBE = "probe"
    GIVE_UP = "give_up"
    BUDGET = "budget"


class ShiftAction(StrEnum):
    """What a request the shift gate flags runs with (the operator's choice,
    `--orca-shift-action`; docs/METHOD.md section 11): STRICT (the default), the bundle's most
    conservative lambda* (no give-up); FULL, full reasoning (no early stop, no give-up); OFF, no
    gate."""

    FULL = "full"
    STRICT = "strict"
    OFF = "off"


SHIFT_ACTIONS: tuple[str, ...] = tuple(str(a) for a in ShiftAction)  # what argparse lists


def safe_lam(bundle: Any, action: ShiftAction) -> float:
    """The threshold a request the gate flags runs with (the engine's, `core.deployment`), and
    one the gate alarm serves (the server's, `settings.resolve`): never stop (FULL), or the
    bundle's most conservative lambda* (STRICT: the largest)."""
    if action != ShiftAction.STRICT:
        return NEVER
    return max(lam_from_json(r.lam) for r in bundle.ltt.rows)


DEFAULT_ANSWER_BUDGET = 64
# the largest answer budget a request may ask for: far above any context length, and inside the
# integer range vLLM allows in extra_args (beyond it vLLM's own 400 names `extra_args`, a field
# the client never sent)
MAX_ANSWER_BUDGET = 2**31 - 1
MIN_ANSWER_TOKENS = 8  # answer tokens the end-of-max_tokens reserve keeps (policy answer)


def _flag(v: Any) -> bool:
    """A 0/1 (or bool) setting of the wire form."""
    return bool(int(v))


@dataclass(frozen=True)
class RequestDefaults:
    """What a request without its own orca_* arguments gets in the engine (`DEFAULTS`; the
    server's --orca-* options override them through the engine config, `EngineConfig.defaults`).
    The client-settable ones share their names with `XARG_FIELDS`."""

    enabled: bool = True
    delta: float | None = None  # None: the bundle's default_delta
    policy: Policy = Policy.ANSWER
    answer_budget: int = DEFAULT_ANSWER_BUDGET
    give_up_policy: GiveUpPolicy = GiveUpPolicy.GUESS  # what a given-up request returns
    give_up_message: str | None = None  # GiveUpPolicy.MESSAGE's text (None: GIVE_UP_MESSAGE)
    shift_alpha: float | None = None  # the shift gate's level (None: the bundle's; 0: no gate)
    # the give-up side's level, >= shift_alpha (None: the bundle's, whose own default is its alpha)
    shift_give_up_alpha: float | None = None
    # what a request the gate flags gets: the bundle's largest lambda*, which keeps every
    # in-distribution guarantee (docs/METHOD.md section 11) and gives back most of the savings
    # `full` loses (benchmarks/RESULTS-archive.md, "In distribution: what the gate and its alarm
    # cost")
    shift_action: ShiftAction = ShiftAction.STRICT
    # the gate alarm's level (`--orca-gate-alarm`; 0: no alarm): each engine core's alarm on its
    # deployments' gates (`orca_serve.core.gate_alarm`)
    gate_alarm: float = DEFAULT_ALARM_LEVEL
    group: str | None = None  # a request's group tag (None: none; docs/METHOD.md section 12)

    def to_dict(self) -> dict[str, Any]:
        """The wire form (JSON: the enums are their words)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> RequestDefaults:
        """From the wire form: missing names keep `DEFAULTS`'s, words become their enums; an
        unknown name is a ValueError naming it."""
        d = dict(d or {})
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown request defaults {', '.join(unknown)} (known: "
                             f"{', '.join(f.name for f in fields(cls))})")
        return cls(**{**cls().to_dict(), **d, **{
            k: kind(d[k]) for k, kind in (("enabled", _flag), ("policy", Policy),
                                          ("give_up_policy", GiveUpPolicy),
                                          ("shift_action", ShiftAction),
                                          ("answer_budget", int)) if k in d}})


DEFAULTS = RequestDefaults()

# What a request that gives up returns (the operator's choice, `--orca-give-up-policy`; the names:
# orca_method.outcomes.GiveUpPolicy): GUESS: its answer at that point, as a stop would (policy
# answer), flagged `ended: gave_up`; MESSAGE: the end-of-thinking text, then GIVE_UP_MESSAGE (or
# --orca-give-up-message), then EOS.
GIVE_UP_MESSAGE = "I could not solve this problem."

# how long the engine keeps an unfetched result, and how many at most
RESULT_TTL_S = 600.0
MAX_RESULTS = 10_000

# -- vllm_xargs names (values are str/int/float only: vllm_xargs carry no bools) -------------------
XARG_KEY = "orca_key"  # result key, set by the server
XARG_LAM = "orca_lam"  # lambda*, resolved by the server ("inf" = never)
XARG_N = "orca_n"  # n of the parent request (set in validation; children read their index)
XARG_SEED = "orca_seed"  # the parent's seed, n > 1 only (vLLM seeds child i with seed + i)
XARG_RECORD = "orca_record"  # 0/1: keep step embeddings (calibration's collect step)
XARG_RESERVE = "orca_reserve"  # tokens kept for the answer before max_tokens (policy answer)
# 0: the request's gate decision does not feed the gate alarm (a vote's samples after the first:
# samples of one prompt are not independent draws; `orca_serve.core.gate_alarm`)
XARG_ALARM = "orca_alarm"
# checksum of the bundle the server resolved orca_lam with: the engine joins that deployment
# (hot reload: old and new bundles are live at once, and lambda* belongs to one probe)
XARG_BUNDLE = "orca_bundle"
# mu*, the give-up threshold the server resolved from the request's `orca.give_up.delta`
# (absent: the request never gives up; docs/METHOD.md section 9)
XARG_GIVE_UP_MU = "orca_give_up_mu"
# the client-settable ones (a request's `orca` fields; defaults in DEFAULTS, same names)
XARG_ENABLED = "orca_enabled"  # 0/1
XARG_DELTA = "orca_delta"  # risk level in (0, 1)
XARG_POLICY = "orca_policy"  # one of POLICIES
XARG_ANSWER_BUDGET = "orca_answer_budget"  # answer tokens after a stop (policy answer)
XARG_SHIFT_ALPHA = "orca_shift_alpha"  # the shift gate's level in [0, 1) (0: no gate)
# the give-up side's level in [0, 1), at least the stop side's (p-value at most it: no give-up)
XARG_SHIFT_GIVE_UP_ALPHA = "orca_shift_give_up_alpha"
# the operator's group tag: a group the bundle knows takes that group's lambda* (and mu*) and
# is not gated; any other is served with the main (mixture) table (docs/METHOD.md section 12)
XARG_GROUP = "orca_group"
XARG_FIELDS = {"enabled": XARG_ENABLED, "delta": XARG_DELTA, "policy": XARG_POLICY,
               "answer_budget": XARG_ANSWER_BUDGET, "shift_alpha": XARG_SHIFT_ALPHA,
               "shift_give_up_alpha": XARG_SHIFT_GIVE_UP_ALPHA, "group": XARG_GROUP}
# set by the server or the plugin, never by clients
XARG_RESERVED = {XARG_KEY, XARG_LAM, XARG_N, XARG_SEED, XARG_BUNDLE, XARG_GIVE_UP_MU, XARG_ALARM}
# Per-request xargs that run a request without the orca probe (answer probes, audits' forcing).
ORCA_OFF = {XARG_ENABLED: 0}



def child_key(key: str, index: int, n: int) -> str:
    """Result key of choice `index` of a request with `n` choices (n > 1: vLLM fans it out into
    child requests "<index>_<parent id>"): choice 0 keeps `key`, choice i > 0 is "<key>/<i>"."""
    return key if n <= 1 or index == 0 else f"{key}/{index}"


class DeltaSource(StrEnum):
    """Where a request's delta (or its `enabled`) comes from (the response's `delta_source`):
    the server's default, the request's own `orca.delta`, or its reasoning effort."""

    SERVER = "server"
    REQUEST = "request"
    EFFORT = "effort"


@dataclass(frozen=True)
class VoteSettings:
    """One voted answer from `k` samples (`orca.samples`): the bundle's consensus row for the
    request's delta with the smallest delta_vote. `t` None (the row certified none, or k is
    below the k it was certified for): no early stop at all, each sample runs to its end and the
    vote is maj@k itself (what the consensus block's rows with t null promise). The live audit
    of the vote (`orca_serve.live_audit.votes`) sets `audited` (the group aborts nothing: its
    samples run to their end after the answer) and `t_source` (FALLBACK: t is only measured,
    the group waits for every sample)."""

    k: int
    t: float | None
    delta_vote: float
    weighting: Weighting
    # the wave sizes the k samples are launched in (the schedule t was certified for); (k,):
    # all at once, as whenever t is None (nothing settles early, so waves would only wait)
    waves: tuple[int, ...]
    audited: bool = False
    t_source: Source = Source.BUNDLE
    # the confidence clause's certified cap (a version 3 block's row): one finished sample that
    # ORCA stopped within this many reasoning tokens settles the vote for a leading answer;
    # None: off
    confident_tokens: float | None = None


@dataclass(frozen=True)
class OrcaSettings:
    """What one request runs with, after defaults: one frozen type for the server and the engine.

    The server builds it once per request from the body's `orca` field, its rules, the server's
    defaults and the bundle's (or the live audit's) lambda* (`orca_serve.settings.resolve`); the
    xargs codec (`orca_serve.settings.xargs`) writes it into `vllm_xargs` and reads it back in
    the engine into this type, which the core keeps on its request (`core.registry.Request`).

    What the engine acts on travels; what only the server's report reads (where a value came
    from, the effort, the vote) does not, and keeps its default in the engine. What only the
    engine decides (record mode's default, the reserve, a refusal, the alarm's feed) keeps its
    default on the server. An audited request travels as what it means to the engine: shadow,
    recorded."""

    key: str | None  # the result key (`orca_key`, the server's; None: unkeyed)
    enabled: bool
    delta: float | None = None
    policy: Policy | None = None  # None: off (the server's); the engine's is always a Policy
    lam: float | None = None  # lambda*(delta), NEVER: never stops early; None: no probe
    # answer tokens after a stop (None: the engine's default; the engine's is always set)
    answer_budget: int | None = None
    n: int = 1  # n of the request (the engine's: of its parent; each child is its own request)
    seed: int | None = None  # the engine's, n > 1 only: the parent's seed (child i gets seed + i)
    bundle: str | None = None  # checksum of the bundle `lam` was resolved with: its deployment
    give_up_mu: float | None = None  # mu*(give_up_delta); None: never gives up
    shift_alpha: float | None = None  # the request's own gate level; None: the engine's default
    shift_give_up_alpha: float | None = None  # its own give-up side's level; likewise
    group: str | None = None  # the request's group tag (`orca.group`), if any
    # -- the engine's: keep step embeddings; tokens reserved for the answer before max_tokens
    # (None: force text + min(budget, 8)); why orca does not run although the request asked for
    # it (a delta outside the bundle's table: the server answers 400 with the same words); and
    # whether its gate decision feeds the gate alarm
    record: bool = False
    reserve: int | None = None
    refused: str | None = None
    alarm: bool = True
    # -- the server's: where `lam` comes from (AUDIT: the audit's guard; GROUP: its group's table)
    lam_source: Source = Source.BUNDLE
    audited: bool = False  # picked for a live audit: runs in shadow with record mode on
    delta_source: DeltaSource = DeltaSource.SERVER  # where `delta` (or `enabled`) comes from
    effort: str | None = None  # the request's reasoning effort, when it chose the delta
    thinking_budget: int | None = None  # vLLM's thinking_token_budget of the request, if any
    give_up_delta: float | None = None  # None: the request does not give up
    give_up_policy: GiveUpPolicy | None = None  # what it returns if it gives up
    # where give_up_mu comes from (FALLBACK: guard off; GROUP: its group's table)
    give_up_source: Source = Source.BUNDLE
    group_known: bool = False  # the bundle has that group's table (and served it)
    vote: VoteSettings | None = None  # `orca.samples`: the server runs k samples and votes


_ARRAY_TAG = "__orca_ndarray__"
_RECORDING = ("step_embeddings", "step_tokens", "step_token_ids", "prompt_token_ids",
              "output_token_ids")
_GIVE_UP = ("give_up_mu", "give_up_step", "last_give_up_score")
_SHIFT = ("shift_alpha", "shift_give_up_alpha", "shift_pvalue", "shift_flagged", "shift_barred",
          "shift_alarm")


@dataclass
class OrcaResult:
    """What the plugin reports about one finished (or running) request. Its wire form is
    `to_dict` through `to_wire` (the engine's `orca_results` RPC), read back with `from_wire`
    (`merge_results`): the server, the live audit and the metrics read these fields."""

    enabled: bool
    policy: Policy
    delta: float | None
    lam: float | None  # None: orca did not run; NEVER: it never stops early
    steps_scored: int
    stopped_early: bool
    stop_step: int | None
    would_stop_step: int | None
    last_score: float | None
    scores: list[float]
    reasoning_tokens: int
    forced_tokens: list[int]
    stop_reason: StopReason | None
    index: int
    bundle_checksum: str | None = None  # the bundle whose probe served it (None: none did)
    # the reasoning ended in the output (end tag or EOS); and how many reasoning tokens the prompt
    # already held after its open start tag (vLLM's thinking_token_budget counts them)
    reasoning_closed: bool = False
    prompt_reasoning_tokens: int = 0
    give_up_mu: float | None = None  # mu* it ran with (None: never gives up)
    give_up_step: int | None = None  # the step it gave up at
    last_give_up_score: float | None = None
    # the shift gate (None: it did not run for this request): its levels (stop side, give-up
    # side), the request's conformal p-value (None until the gate's step), whether it flagged the
    # request (p <= shift_alpha) and whether it barred its give-up (p <= shift_give_up_alpha)
    shift_alpha: float | None = None
    shift_give_up_alpha: float | None = None
    shift_pvalue: float | None = None
    shift_flagged: bool = False
    shift_barred: bool = False
    # served as a flagged request because its engine's gate alarm was raised (whatever its own
    # gate decided; `orca_serve.core.gate_alarm`)
    shift_alarm: bool = False
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    # record mode only: [steps, d] float32 numpy array (the core's [d] tensors per step until
    # `RequestTable` moves them to the host), tokens per step, ids per step
    step_embeddings: np.ndarray | list[Tensor] | None = None
    step_tokens: list[int] | None = None
    step_token_ids: list[list[int]] | None = None
    # record mode only: the request's token ids (what live audits' answer probes continue)
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    # set by the engine's worker extension (its processor ran the sampler: the last pipeline
    # stage), read by `merge_results` only
    ran_sampler: bool = False

    def __post_init__(self) -> None:
        self.policy = Policy(self.policy)  # a name (the wire's) becomes its Policy
        if self.stop_reason is not None:
            self.stop_reason = StopReason(self.stop_reason)

    @property
    def ended(self) -> Ended:
        """How its reasoning ended (the response's `ended`): answered early (the probe's stop),
        gave up (the give-up threshold), or full (ran to its own end, a budget or a limit)."""
        if self.stop_reason == StopReason.GIVE_UP:
            return Ended.GAVE_UP
        return Ended.EARLY if self.stopped_early else Ended.FULL

    @property
    def two_sided(self) -> bool:
        """It ran with a give-up threshold (or reports a give-up score)."""
        return self.give_up_mu is not None or self.last_give_up_score is not None

    @property
    def recorded(self) -> bool:
        """It carries a recording (record mode: step embeddings, tokens, ids)."""
        return self.step_tokens is not None

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict, leaving out empty optional groups (no notes, no error,
        one-sided, no recording); arrays stay numpy arrays. A trajectory record's fields."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}  # no deep copy of arrays
        d["policy"] = str(self.policy)
        d["stop_reason"] = None if self.stop_reason is None else str(self.stop_reason)
        d["lam"] = lam_to_json(self.lam)
        del d["ran_sampler"]
        for k, empty in (("notes", not self.notes), ("error", self.error is None)):
            if empty:
                del d[k]
        for k in ((() if self.two_sided else _GIVE_UP) + (() if self.recorded else _RECORDING)
                  + (() if self.shift_alpha is not None else _SHIFT)):
            del d[k]
        return d

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> OrcaResult:
        """The result `to_wire` (or `to_dict`) wrote; arrays back as numpy arrays."""
        import numpy as np  # deferred: numpy (this module loads in every vLLM process)

        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        for k, v in kw.items():
            if isinstance(v, dict) and v.get(_ARRAY_TAG):
                kw[k] = np.frombuffer(bytes(v["data"]), dtype=np.dtype(v["dtype"])).reshape(
                    v["shape"]).copy()
        kw["lam"] = lam_from_json(kw.get("lam")) if kw.get("enabled") else None
        kw["notes"] = [str(x) for x in kw.get("notes") or []]
        return cls(**kw)


@dataclass(frozen=True)
class ReloadAnswer:
    """One engine worker's answer to a hot-reload call (docs/SERVER.md, "Hot reload of the
    bundle"): `orca_load_bundle(path)` and `orca_use_bundle(checksum)` answer the bundle's
    `checksum`, `orca_retire_bundles(keep)` the checksums still `live`; a worker that cannot
    answers `error`, one line. It crosses `collective_rpc` in its wire form (`to_wire`, a dict:
    what vLLM's transport carries), built by the worker extension and read back by the server's
    reloader (`from_wire`)."""

    checksum: str | None = None
    live: tuple[str | None, ...] | None = None
    error: str | None = None

    def to_wire(self) -> dict[str, Any]:
        """The fields that are set (`live` as a list)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in
                (("checksum", self.checksum), ("live", self.live), ("error", self.error))
                if v is not None}

    @classmethod
    def from_wire(cls, d: Any) -> ReloadAnswer:
        """ValueError (one line) for anything but a worker's answer."""
        if not isinstance(d, Mapping) or not set(d) <= {"checksum", "live", "error"}:
            raise ValueError(f"unexpected answer from an engine worker: {d!r:.80}")
        live = d.get("live")
        return cls(checksum=d.get("checksum"), live=None if live is None else tuple(live),
                   error=None if d.get("error") is None else str(d["error"]))


def to_wire(result: Mapping[str, Any]) -> dict[str, Any]:
    """A result's `to_dict` with numpy arrays as {tag, dtype, shape, data: bytes}: survives every
    collective_rpc transport (vLLM's msgpack transport sends large numpy arrays out of band and,
    for an untyped RPC result, hands back only ['<f4', shape, <buffer index>]: the data would be
    lost). `OrcaResult.from_wire` reads it back."""
    import numpy as np  # deferred: numpy (this module loads in every vLLM process)

    out = dict(result)
    for k, v in out.items():
        if isinstance(v, np.ndarray):
            v = np.ascontiguousarray(v)
            out[k] = {_ARRAY_TAG: 1, "dtype": v.dtype.str, "shape": list(v.shape),
                      "data": v.tobytes()}
    return out


def merge_results(per_worker: list[dict] | None) -> dict[str, OrcaResult]:
    """Merge `collective_rpc("orca_results", args=(keys,))` answers into {key: result}.
    Always use this on the raw RPC answer.

    `per_worker`: one dict per worker, from one engine or concatenated over data-parallel engines
    (a request runs on one engine, so its key comes from that engine's reporting worker only).
    Should two workers answer for one key, a result marked `ran_sampler` (its processor ran the
    sampler's apply(): the last pipeline stage) wins over one that is not; otherwise the first.
    """
    out: dict[str, OrcaResult] = {}
    for d in per_worker or []:
        for k, r in (d or {}).items():
            if r is None:
                continue
            if k not in out or (r.get("ran_sampler") and not out[k].ran_sampler):
                out[k] = OrcaResult.from_wire(r)
    return out
