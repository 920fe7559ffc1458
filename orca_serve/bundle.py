"""The calibration bundle: one JSON file that fixes everything the stop decision depends on.

Calibration writes it, the server loads it. Loading refuses anything that would make the server
compute something other than what was calibrated: another schema version, a checksum mismatch,
non-finite or mis-shaped weights, or a delta without a calibrated lambda*.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from orca_serve.probe import Probe, ProbeSpec

SCHEMA_VERSION = 1


class BundleError(ValueError):
    """A bundle that must not be served; the message says what is wrong and what to do."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelIdentity(_Strict):
    name: str
    hidden_size: int = Field(gt=0)
    tokenizer_fingerprint: str | None = None  # sha256 of the vocabulary, see tokenizer_fingerprint()


class Segmentation(_Strict):
    """How a reasoning trace is cut into steps (METHOD.md section 1)."""

    delimiter: str = "\n\n"
    keywords: list[str] | None = None  # e.g. ["wait", "but"]; None = every delimiter starts a step


class ThinkTags(_Strict):
    """Reasoning phase markers; `enabled=False` means the whole completion is reasoning."""

    enabled: bool = True
    start: str = "<think>"
    end: str = "</think>"
    force_text: str = "\n</think>\n\n"  # what policy `answer` forces to close the reasoning


class LTTRow(_Strict):
    delta: float = Field(gt=0, lt=1)
    lam: float | None  # None = never stop early (no threshold rejected)
    risk: float
    pvalue: float
    savings: float
    token_savings: float | None = None


class LTTTable(_Strict):
    epsilon: float = Field(gt=0, lt=1)
    n_cal: int = Field(ge=1)
    pvalue: Literal["binomial", "hb"] = "binomial"
    grid_size: int
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


class ProbeBlock(_Strict):
    spec: dict[str, Any]
    weights: str  # base64 of a safetensors blob holding the slow weights
    eta: float  # exp(log_eta), for humans; the weights hold the truth


class Bundle(_Strict):
    schema_version: int
    orca_serve_version: str
    model: ModelIdentity
    segmentation: Segmentation = Segmentation()
    think: ThinkTags = ThinkTags()
    normalization: Literal["token-l2", "step-l2", "none"] = "token-l2"
    probe: ProbeBlock
    window: int = Field(10, ge=1)
    label_mode: str = "supervised"
    ltt: LTTTable
    default_delta: float
    provenance: dict[str, Any] = {}
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
        """The probe with the bundle's slow weights, checked for shape and finiteness."""
        spec = self.spec()
        tensors = st_load(base64.b64decode(self.probe.weights))
        expected = spec.param_shapes()
        if set(tensors) != set(expected):
            raise BundleError(f"probe weights {sorted(tensors)} do not match variant {spec.name} "
                              f"(expects {sorted(expected)}); the bundle is corrupt: recalibrate")
        probe = Probe(spec)
        for name, shape in expected.items():
            t = tensors[name]
            if tuple(t.shape) != shape:
                raise BundleError(f"probe weight '{name}' has shape {tuple(t.shape)}, expected "
                                  f"{shape}; the bundle is corrupt: recalibrate")
            if not torch.isfinite(t).all():
                raise BundleError(f"probe weight '{name}' contains NaN or inf; the probe diverged "
                                  "in training: retrain (lower the learning rate) and recalibrate")
            probe.params[name].data.copy_(t)
        return probe.requires_grad_(False)

    def summary(self) -> dict[str, Any]:
        """Everything but the weights (for /v1/orca/bundle and logs)."""
        d = self.model_dump()
        d["probe"] = {"variant": self.spec().name, "spec": self.probe.spec, "eta": self.probe.eta}
        return d


def encode_weights(probe: Probe) -> str:
    tensors = {k: v.detach().float().contiguous().cpu() for k, v in probe.params.items()}
    return base64.b64encode(st_save(tensors)).decode("ascii")


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


def load_bundle(path: str | Path) -> Bundle:
    """Read and validate a bundle; every refusal is a BundleError with a one-line reason."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise BundleError(f"bundle {p} not found; create one with `orca-calibrate calibrate`") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"bundle {p} is not valid JSON ({e}); is it a bundle.json?") from None
    if not isinstance(data, dict):
        raise BundleError(f"bundle {p} is not a JSON object; is it a bundle.json?")
    if data.get("schema_version") not in (None, SCHEMA_VERSION):
        raise BundleError(f"bundle {p} has schema version {data.get('schema_version')}, this "
                          f"orca-serve reads version {SCHEMA_VERSION}: recalibrate with this version")
    if data.get("checksum") != _checksum(data):
        raise BundleError(f"bundle {p} fails its checksum: it was edited or truncated after "
                          "calibration; restore the original or recalibrate")
    try:
        bundle = Bundle.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise BundleError(f"bundle {p} is invalid at '{where}': {first['msg']}") from None
    if not bundle.ltt.rows:
        raise BundleError(f"bundle {p} has an empty LTT table; recalibrate with at least one delta")
    bundle.lam(bundle.default_delta)  # the default must be calibrated
    spec = bundle.spec()
    if spec.dim != bundle.model.hidden_size:
        raise BundleError(f"bundle {p}: probe dim {spec.dim} != model hidden size "
                          f"{bundle.model.hidden_size}")
    bundle.load_probe()
    return bundle


def tokenizer_fingerprint(vocab: dict[str, int]) -> str:
    """sha256 of the token -> id map: equal fingerprints mean the same token ids for any text."""
    items = sorted(vocab.items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


def check_model(bundle: Bundle, hidden_size: int, vocab: dict[str, int] | None,
                model_name: str) -> None:
    """Refuse to serve a bundle calibrated on another model (hidden size, tokenizer, think tags)."""
    if hidden_size != bundle.model.hidden_size:
        raise BundleError(f"bundle was calibrated on {bundle.model.name} (hidden size "
                          f"{bundle.model.hidden_size}) but {model_name} has hidden size "
                          f"{hidden_size}; serve the bundle's model or recalibrate")
    if vocab is None:
        return
    fp = bundle.model.tokenizer_fingerprint
    if fp and fp != tokenizer_fingerprint(vocab):
        raise BundleError(f"the tokenizer of {model_name} differs from the one the bundle was "
                          f"calibrated with ({bundle.model.name}); recalibrate for this model")
    if bundle.think.enabled:
        missing = [t for t in (bundle.think.start, bundle.think.end) if t not in vocab]
        if missing:
            raise BundleError(f"think tags {missing} of the bundle are not single tokens of "
                              f"{model_name}'s tokenizer; wrong model or wrong think settings")
