"""The calibration bundle: one JSON file that fixes everything the stop decision depends on.

Calibration writes it, the server loads it. Loading refuses anything that would make the server
compute something other than what was calibrated: another schema version, a checksum mismatch,
values of the wrong type or out of range (read strictly: no "1" for 1), weights that are not
base64 safetensors of the declared probe's shapes in float32, non-finite numbers, or a delta
without a calibrated lambda*. Every refusal is one `BundleError` whose message says what to do;
a bundle that loads has had its probe instantiated and run once.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import itertools
import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal, get_type_hints

import numpy as np
import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from orca_method.errors import first_line
from orca_method.probe import Probe, ProbeSpec

SCHEMA_VERSION = 1
MAX_WINDOW = 10_000  # the server keeps window floats per request row


class BundleError(ValueError):
    """A bundle that must not be served; the message says what is wrong and what to do."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


Fraction = Annotated[float, Field(ge=0, le=1)]


class ModelIdentity(_Strict):
    name: str = Field(min_length=1)
    hidden_size: int = Field(gt=0)
    # sha256 of the vocabulary, see tokenizer_fingerprint()
    tokenizer_fingerprint: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")


class Segmentation(_Strict):
    """How a reasoning trace is cut into steps (docs/METHOD.md section 1)."""

    delimiter: str = Field("\n\n", min_length=1)
    # e.g. ["wait", "but"]; None = every delimiter starts a step
    keywords: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    # "word": a keyword matches as a whole word, any case; "substring": verbatim, inside words too
    # (the authors' rule: a line containing "wait", "Wait", "but" or "But" opens a step)
    keyword_match: Literal["word", "substring"] = "word"
    max_step_tokens: int | None = Field(None, ge=1)  # None: steps are never cut by length


class ThinkTags(_Strict):
    """Reasoning phase markers; `enabled=False` means the whole completion is reasoning."""

    enabled: bool = True
    start: str = Field("<think>", min_length=1)
    end: str = Field("</think>", min_length=1)
    force_text: str = "\n</think>\n\n"  # what policy `answer` forces to close the reasoning

    @model_validator(mode="after")
    def _tags(self) -> ThinkTags:
        if self.enabled and self.start == self.end:
            raise ValueError(f"think start and end tags are both {self.start!r}")
        if self.enabled and self.end not in self.force_text:
            raise ValueError(f"force_text {self.force_text!r} does not contain the end tag "
                             f"{self.end!r}: policy `answer` could not close the reasoning")
        return self


class LTTRow(_Strict):
    delta: float = Field(gt=0, lt=1)
    lam: Fraction | None  # a threshold on scores in [0, 1]; None = never stop early
    # calibration facts; None when lambda* was imported (see Bundle.lambdas_from)
    risk: Fraction | None
    pvalue: Fraction | None
    savings: Fraction | None
    token_savings: Fraction | None = None


class LTTTable(_Strict):
    epsilon: float = Field(gt=0, lt=1)
    n_cal: int | None = Field(ge=1)  # None: imported lambda*, calibration set unknown
    pvalue: Literal["binomial", "hb"] = "binomial"
    grid_size: int = Field(ge=1)
    excluded_never_correct: bool = True
    rows: list[LTTRow]


class DriftReference(_Strict):
    """How the calibration set's scores behave, for the label-free drift test (docs/AUDIT.md).

    Per calibration trajectory (a seeded subsample), the two statistics of
    `orca_serve.audit.drift.drift_statistics`: the mean smoothed score over the first `k` steps
    (cut at the first crossing of `level`) and the 1-based step of that crossing (None: never).
    Optional: bundles without it load, and then the server has no drift metric.
    """

    k: int = Field(ge=1)
    level: float | None  # the most aggressive calibrated lambda*; None: no delta stops early
    n_cal: int = Field(ge=1)  # calibration trajectories the subsample was drawn from
    early_mean: list[float] = Field(min_length=1)
    stop_step: list[int | None] = Field(min_length=1)

    @model_validator(mode="after")
    def _paired(self) -> DriftReference:
        if len(self.early_mean) != len(self.stop_step):
            raise ValueError("drift reference lists early_mean and stop_step differ in length")
        return self


def _spec_fields() -> type[BaseModel]:
    """A strict pydantic view of ProbeSpec's fields (types and literals read off the dataclass)."""
    hints = get_type_hints(ProbeSpec)
    return create_model(
        "ProbeSpecFields", __config__=ConfigDict(extra="forbid", strict=True),
        **{f.name: (hints[f.name], ... if f.default is dataclasses.MISSING else f.default)
           for f in dataclasses.fields(ProbeSpec)})


_SPEC_FIELDS = _spec_fields()


class ProbeBlock(_Strict):
    spec: dict[str, Any]
    weights: str  # base64 of a safetensors blob holding the slow weights
    eta: float = Field(gt=0)  # exp(log_eta), for humans; the weights hold the truth

    @field_validator("spec")
    @classmethod
    def _spec(cls, v: dict[str, Any]) -> dict[str, Any]:
        """Exactly the fields of a ProbeSpec, of their types, in a combination it accepts."""
        try:
            ProbeSpec(**_SPEC_FIELDS.model_validate(v).model_dump())
        except ValidationError as e:
            first = e.errors()[0]
            raise ValueError(f"{'.'.join(str(x) for x in first['loc'])}: {first['msg']}") from None
        return v


class Bundle(_Strict):
    schema_version: int
    orca_serve_version: str
    model: ModelIdentity
    segmentation: Segmentation = Segmentation()
    think: ThinkTags = ThinkTags()
    normalization: Literal["token-l2", "step-l2", "none"] = "token-l2"
    probe: ProbeBlock
    window: int = Field(10, ge=1, le=MAX_WINDOW)
    label_mode: str = Field("supervised", min_length=1)
    ltt: LTTTable
    default_delta: float = Field(gt=0, lt=1)
    provenance: dict[str, Any] = {}
    # None: lambda* computed by orca-calibrate on the data in `provenance`. Otherwise a note on
    # where they come from (e.g. the authors' released lambdas.json): valid only for the sampling
    # setup they were calibrated under; orca-serve prints it at start.
    lambdas_from: str | None = None
    drift: DriftReference | None = None  # absent in older bundles: no drift test
    checksum: str = ""

    @field_validator("schema_version")
    @classmethod
    def _version(cls, v: int) -> int:
        if v != SCHEMA_VERSION:
            raise ValueError(f"bundle schema version {v} is not supported (this orca-serve reads "
                             f"version {SCHEMA_VERSION}); recalibrate with this orca-serve version")
        return v

    # -- derived ---------------------------------------------------------------------------
    def deltas(self) -> list[float]:
        return [r.delta for r in self.ltt.rows]

    def lam(self, delta: float) -> float:
        """lambda*(delta); inf means never stop early."""
        for r in self.ltt.rows:
            if math.isclose(r.delta, delta, rel_tol=0, abs_tol=1e-9):
                return math.inf if r.lam is None else r.lam
        raise BundleError(f"delta {delta} has no calibrated lambda* in this bundle; "
                          f"available deltas: {', '.join(f'{d:g}' for d in self.deltas())}")

    def spec(self) -> ProbeSpec:
        return ProbeSpec.from_dict(self.probe.spec)

    def load_probe(self) -> Probe:
        """The probe with the bundle's slow weights, checked for names, shape, dtype, finiteness.

        Every check runs before the probe is allocated, so a bundle declaring a huge probe is
        refused without allocating it.
        """
        spec = self.spec()
        tensors = decode_weights(self.probe.weights)
        expected = spec.param_shapes()
        if set(tensors) != set(expected):
            raise BundleError(f"probe weights {sorted(tensors)} do not match variant {spec.name} "
                              f"(expects {sorted(expected)}); the bundle is corrupt: recalibrate")
        for name, shape in expected.items():
            t = tensors[name]
            if tuple(t.shape) != shape:
                raise BundleError(f"probe weight '{name}' has shape {tuple(t.shape)}, expected "
                                  f"{shape}; the bundle is corrupt: recalibrate")
            if t.dtype != torch.float32:
                raise BundleError(f"probe weight '{name}' is {t.dtype}, expected torch.float32 "
                                  "(what calibration writes); the bundle is corrupt: recalibrate")
            if not torch.isfinite(t).all():
                raise BundleError(f"probe weight '{name}' contains NaN or inf; the probe diverged "
                                  "in training: retrain (lower the learning rate) and recalibrate")
        probe = Probe(spec)
        for name, t in tensors.items():
            probe.params[name].data.copy_(t)
        return probe.requires_grad_(False)

    def summary(self) -> dict[str, Any]:
        """Everything but the weights and the drift reference's numbers (for /v1/orca/bundle
        and logs)."""
        d = self.model_dump()
        d["probe"] = {"variant": self.spec().name, "spec": self.probe.spec, "eta": self.probe.eta}
        if self.drift is not None:  # the reference's numbers are for the monitor, not for people
            d["drift"] = {"k": self.drift.k, "level": self.drift.level, "n_cal": self.drift.n_cal,
                          "size": len(self.drift.early_mean)}
        return d


def encode_weights(probe: Probe) -> str:
    tensors = {k: v.detach().float().contiguous().cpu() for k, v in probe.params.items()}
    return base64.b64encode(st_save(tensors)).decode("ascii")


def decode_weights(weights: str) -> dict[str, torch.Tensor]:
    """encode_weights' inverse; anything else (stray characters included) is a BundleError."""
    try:
        blob = base64.b64decode(weights, validate=True)
    except (binascii.Error, ValueError) as e:
        raise BundleError(f"probe weights are not base64 ({e}); the bundle is corrupt: "
                          "recalibrate") from None
    try:
        return st_load(blob)
    except Exception as e:  # noqa: BLE001 - safetensors' errors share no base class but Exception
        raise BundleError(f"probe weights are not a safetensors blob "
                          f"({first_line(e)}); the bundle "
                          "is corrupt: recalibrate") from None


def _checksum(data: dict[str, Any]) -> str:
    body = {k: v for k, v in data.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, allow_nan=False).encode()).hexdigest()


def save_bundle(bundle: Bundle, path: str | Path) -> Bundle:
    """Write the bundle with its checksum; returns the sealed bundle."""
    data = bundle.model_dump()
    data["checksum"] = _checksum(data)
    sealed = Bundle.model_validate(data)
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, allow_nan=False))
    tmp.replace(path)
    return sealed


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number a bundle may hold")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"number {text[:40]} is out of range")
    return v


def _parse_json(raw: bytes, p: Path) -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity and no number that overflows to inf."""
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant,
                          parse_float=_finite_float)
    except UnicodeDecodeError:
        raise BundleError(f"bundle {p} is not UTF-8 text; is it a bundle.json?") from None
    except RecursionError:
        raise BundleError(f"bundle {p} nests too deeply to be a bundle") from None
    except ValueError as e:  # JSONDecodeError, a rejected constant, too many digits
        raise BundleError(f"bundle {p} is not valid JSON ({first_line(e)}); is it a "
                          "bundle.json?") from None


def _first_error(e: ValidationError) -> str:
    """Where and what, for the first of pydantic's errors (one line)."""
    first = e.errors()[0]
    where = ".".join(str(x) for x in first["loc"])
    got = first.get("input")
    shown = "" if first["type"] == "missing" or isinstance(got, (dict, list)) else \
        f" (got {repr(got)[:60]})"
    more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
    return f"invalid at '{where}': {first['msg'].removeprefix('Value error, ')}{shown}{more}"


def load_bundle(path: str | Path) -> Bundle:
    """Read and validate a bundle; every refusal is a BundleError with a one-line reason."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise BundleError(f"bundle {p} not found; create one with `orca-calibrate calibrate`") from None
    except IsADirectoryError:
        raise BundleError(f"bundle {p} is a directory; pass the bundle.json file") from None
    except OSError as e:
        raise BundleError(f"cannot read bundle {p}: {e.strerror or e}") from None
    try:
        return _validate(_parse_json(raw, p), p)
    except RecursionError:  # a deep structure that parsed can still overflow later passes
        raise BundleError(f"bundle {p} nests too deeply to be a bundle") from None


def _validate(data: Any, p: Path) -> Bundle:
    if not isinstance(data, dict):
        raise BundleError(f"bundle {p} is not a JSON object; is it a bundle.json?")
    if data.get("schema_version") not in (None, SCHEMA_VERSION):
        raise BundleError(f"bundle {p} has schema version {data.get('schema_version')!r:.40}, "
                          f"this orca-serve reads version {SCHEMA_VERSION}: recalibrate with this "
                          "version")
    if data.get("checksum") != _checksum(data):
        raise BundleError(f"bundle {p} fails its checksum: it was edited or truncated after "
                          "calibration; restore the original or recalibrate")
    try:
        bundle = Bundle.model_validate(data, strict=True)
    except ValidationError as e:
        raise BundleError(f"bundle {p} is {_first_error(e)}") from None
    if not bundle.ltt.rows:
        raise BundleError(f"bundle {p} has an empty LTT table; recalibrate with at least one delta")
    deltas = sorted(bundle.deltas())
    for a, b in itertools.pairwise(deltas):
        if math.isclose(a, b, rel_tol=0, abs_tol=1e-9):
            raise BundleError(f"bundle {p} lists delta {a:g} twice in its LTT table; which "
                              "lambda* applies is ambiguous: recalibrate")
    try:
        bundle.lam(bundle.default_delta)  # the default must be calibrated
    except BundleError as e:
        raise BundleError(f"bundle {p}: default_delta: {e}") from None
    spec = bundle.spec()
    if spec.dim != bundle.model.hidden_size:
        raise BundleError(f"bundle {p}: probe dim {spec.dim} != model hidden size "
                          f"{bundle.model.hidden_size}")
    try:
        _smoke_test(bundle.load_probe())
    except BundleError as e:
        raise BundleError(f"bundle {p}: {e}") from None
    return bundle


@torch.no_grad()
def _smoke_test(probe: Probe) -> None:
    """Score and update twice on a unit-norm step: extreme weights show up as non-finite scores.

    A sanity check of the instantiated probe (not a proof for every input).
    """
    phi = torch.full((1, probe.spec.dim), probe.spec.dim ** -0.5)  # [1, d]
    fast = probe.init_fast(1)
    for _ in range(2):
        score = probe.score(fast, phi)
        fast = probe.update(fast, phi)
        if not (torch.isfinite(score).all() and all(torch.isfinite(v).all()
                                                     for v in fast.values())):
            raise BundleError("the probe computes non-finite scores or fast weights on a "
                              "unit-norm step embedding (extreme weights); retrain and recalibrate")


# -- checks before a bundle is served (at start and on every reload; docs/SERVER.md) ----------------
SATURATED = 1e-6  # a score this close to 0 or 1 is saturated (float32 sigmoid's flat ends)
SATURATION_PROBES = (64, 4)  # seeded reference trajectories and steps each


def check_semantics(bundle: Bundle) -> None:
    """Refuse (BundleError, one line) a table or probe that no calibration could have produced.

    Data-free, so they hold for any bundle: lambda* is non-increasing in delta and each row is
    consistent with the others and with its own recorded risk (`check_rows`); the probe's
    scores are not saturated (`check_not_saturated`).
    """
    check_rows(bundle)
    check_not_saturated(bundle)


def check_rows(bundle: Bundle) -> None:
    """The LTT table's facts could all come from one run of orca_method/ltt.py on n_cal traces.

    "Consistent", precisely (docs/SERVER.md, "Bundle checks"):
    1. lambda* is non-increasing in delta (None, never stop, above every number): a larger delta
       passes every test a smaller one passes, so LTT never picks a higher threshold for it;
    2. a row with recorded facts and a known n_cal: risk x n_cal is a whole number of losses k;
       a finite lambda* has the p-value of k losses in n_cal at its delta (the table's p-value
       kind) and that p-value is <= epsilon (the test passed); lambda* None has p-value 1 and,
       with never-correct traces excluded, risk 0 (never stopping is right on every counted trace);
    3. two rows with facts: a lower lambda* stops every trace no later, so its risk and savings
       are no smaller; equal lambda* have equal risk and savings (the same stop steps).
    Imported tables (no recorded facts) are held to 1 only.
    """
    from orca_method.ltt import PVALUES  # here: ltt imports risk, which refers to Bundle

    t = bundle.ltt
    rows = sorted(t.rows, key=lambda r: r.delta)

    def lam(r: LTTRow) -> float:
        return math.inf if r.lam is None else r.lam

    def shown(r: LTTRow) -> str:
        return "never" if r.lam is None else f"{r.lam:g}"

    for a, b in itertools.pairwise(rows):
        if lam(b) > lam(a):
            raise BundleError(f"lambda* rises with delta (delta {a.delta:g}: {shown(a)}, delta "
                              f"{b.delta:g}: {shown(b)}), which LTT never does: the table was "
                              "edited after calibration; recalibrate")
    facts = [r for r in rows if r.risk is not None and r.pvalue is not None]
    for r in facts if t.n_cal is not None else []:
        k = r.risk * t.n_cal
        where = f"delta {r.delta:g} (lambda* {shown(r)}, risk {r.risk:g}, p-value {r.pvalue:g})"
        if abs(k - round(k)) > 1e-6:
            raise BundleError(f"{where}: risk x n_cal = {k:g} is not a whole number of losses "
                              f"out of {t.n_cal}; the table was edited: recalibrate")
        if r.lam is None:
            if r.pvalue != 1.0 or (t.excluded_never_correct and r.risk != 0.0):
                raise BundleError(f"{where}: a row that never stops early has p-value 1 and "
                                  "risk 0; the table was edited: recalibrate")
            continue
        p = float(PVALUES[t.pvalue](np.asarray([round(k)]), t.n_cal, r.delta)[0])
        if not math.isclose(p, r.pvalue, rel_tol=1e-6, abs_tol=1e-12) or p > t.epsilon:
            raise BundleError(f"{where}: {round(k)} losses in {t.n_cal} give p-value {p:.4g}"
                              f"{'' if p <= t.epsilon else f' > epsilon {t.epsilon:g}'}; the "
                              "row does not match its own risk: recalibrate")
    for a, b in itertools.pairwise(sorted(facts, key=lam, reverse=True)):
        pairs = [("risk", a.risk, b.risk), ("savings", a.savings, b.savings),
                 ("token savings", a.token_savings, b.token_savings)]
        for name, x, y in pairs:
            if x is None or y is None:
                continue
            bad = not math.isclose(x, y, abs_tol=1e-9) if lam(a) == lam(b) else x > y + 1e-9
            if bad:
                raise BundleError(f"delta {a.delta:g} (lambda* {shown(a)}) records {name} {x:g} "
                                  f"but delta {b.delta:g} (lambda* {shown(b)}) records {y:g}: "
                                  f"a lower lambda* stops no later, so its {name} is no smaller; "
                                  "the table was edited: recalibrate")


@torch.no_grad()
def check_not_saturated(bundle: Bundle, probe: Probe | None = None) -> None:
    """Refuse a probe whose every score is 0 or 1 (within SATURATED) on a seeded reference.

    The reference: SATURATION_PROBES seeded random unit-norm step embeddings per trajectory (the
    norm of a token-l2 step embedding is at most 1). A probe whose scores are all at sigmoid's
    ends (weights scaled up, e.g. x 1e30: finite, so the load-time smoke test passes) cannot
    place a threshold between steps; a trained probe gives scores spread over (0, 1) there.
    """
    probe = bundle.load_probe() if probe is None else probe
    n, steps = SATURATION_PROBES
    gen = torch.Generator().manual_seed(0)
    phi = torch.randn(n, steps, probe.spec.dim, generator=gen)  # [n, steps, d]
    phi = phi / phi.norm(dim=-1, keepdim=True)
    fast = probe.init_fast(n)
    inside = 0
    for t in range(steps):
        score = probe.score(fast, phi[:, t])  # [n]
        inside += int(((score > SATURATED) & (score < 1 - SATURATED)).sum())
        fast = probe.update(fast, phi[:, t])
    if inside == 0:
        raise BundleError(f"the probe's scores are all saturated (0 or 1 within {SATURATED:g}) "
                          f"on {n * steps} seeded unit-norm step embeddings: its weights are "
                          "out of scale (edited?); retrain and recalibrate")


def check_delimiter(bundle: Bundle, token_bytes: list[bytes], model_name: str) -> None:
    """Refuse a step delimiter that no token of the model's tokenizer contains.

    The segmenter (orca_method/steps.py) ends a step when a token completes the delimiter; a
    delimiter the model writes in the course of reasoning (a paragraph break, a newline) is part
    of some token. One that no token contains was not what the calibration data was cut at
    (the data records the delimiter of the tokenizer that made it).
    """
    d = bundle.segmentation.delimiter.encode("utf-8")
    if not any(d in t for t in token_bytes):
        raise BundleError(f"the bundle's step delimiter {bundle.segmentation.delimiter!r} is in no "
                          f"token of {model_name}'s tokenizer, so its steps would not be the "
                          "calibrated ones; wrong model, or the bundle was edited: recalibrate")


def model_aliases(name: str) -> set[str]:
    """The names a model goes by for `check_model_name`: the name and its last path component
    (a hub name `org/model`, a local folder `/models/model`), case-insensitive."""
    n = name.strip().rstrip("/").casefold()
    return {n, n.rsplit("/", 1)[-1]} - {""}


def check_model_name(bundle: Bundle, model: str, served_names: list[str] | None = None) -> None:
    """Refuse a bundle made for another model: its model name must match the served one.

    Match: the bundle's name or its last path component equals `--model` or its last path
    component (case-insensitive), or one of `--served-model-name`. `--orca-force-model` skips it.
    """
    served = model_aliases(model).union(*(model_aliases(s) for s in served_names or []))
    if model_aliases(bundle.model.name) & served:
        return
    raise BundleError(f"the bundle was made for model {bundle.model.name!r}, not {model!r}; "
                      f"serve {bundle.model.name!r}, or name it so with --served-model-name if "
                      "this is that model under another path, or pass --orca-force-model")


def tokenizer_fingerprint(vocab: dict[str, int]) -> str:
    """sha256 of the token -> id map: equal fingerprints mean the same token ids for any text."""
    items = sorted(vocab.items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


def check_model(bundle: Bundle, hidden_size: int, vocab: dict[str, int] | None,
                model_name: str) -> None:
    """Refuse to serve a bundle calibrated on another model (hidden size, tokenizer, think tags)."""
    if hidden_size != bundle.model.hidden_size:
        raise BundleError(f"bundle was calibrated on {bundle.model.name!r} (hidden size "
                          f"{bundle.model.hidden_size}) but {model_name} has hidden size "
                          f"{hidden_size}; serve the bundle's model or recalibrate")
    if vocab is None:
        return
    fp = bundle.model.tokenizer_fingerprint
    if fp and fp != tokenizer_fingerprint(vocab):
        raise BundleError(f"the tokenizer of {model_name} differs from the one the bundle was "
                          f"calibrated with ({bundle.model.name!r}); recalibrate for this model")
    if bundle.think.enabled:
        missing = [t for t in (bundle.think.start, bundle.think.end) if t not in vocab]
        if missing:
            raise BundleError(f"think tags {missing} of the bundle are not single tokens of "
                              f"{model_name}'s tokenizer; wrong model or wrong think settings")
