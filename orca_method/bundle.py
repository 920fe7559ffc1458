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
import stat
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_type_hints

import torch
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from orca_method.answer_probes import (
    CONSISTENT,
    DEFAULT_ANSWER_TOKENS,
    DEFAULT_SUFFIX,
    SUPERVISED,
)
from orca_method.consensus import (
    ALL_AT_ONCE_VERSION,
    CONFIDENT_VERSION,
    CONSENSUS_VERSION,
    check_waves,
    format_waves,
)
from orca_method.errors import first_line
from orca_method.normalizations import DEFAULT_NORMALIZATION, Normalization
from orca_method.outcomes import (
    GiveUpPolicy,
    KeywordMatch,
    PValue,
    Weighting,
)
from orca_method.probe import SPEC_WORDS, Probe, ProbeSpec
from orca_method.shift_gate import DEFAULT_GATE_RANK, ShiftGate, fit_gate, give_up_level
from orca_method.steps import DEFAULT_DELIMITER, THINK_END, THINK_START
from orca_method.thresholds import (
    GIVE_UP_NEVER,
    GROUP_NAME_MAX,
    MAX_WINDOW,
    lam_from_json,
    mu_from_json,
)

# Version 1: the one-sided bundle (lambda* only). Version 2: the same plus a `give_up` block (the
# lower threshold mu*, docs/METHOD.md section 9). A bundle is written as version 1 whenever it has
# no give_up block, so one-sided bundles stay readable by readers of version 1, which refuse a
# version 2 bundle in one line ("has schema version 2, this orca-serve reads version 1").
SCHEMA_VERSION = 1
TWO_SIDED_VERSION = 2
SCHEMA_VERSIONS = (SCHEMA_VERSION, TWO_SIDED_VERSION)


class BundleError(ValueError):
    """A bundle that must not be served; the message says what is wrong and what to do."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


Fraction = Annotated[float, Field(ge=0, le=1)]


def _word_of(kind: type[StrEnum]) -> Any:
    """A field of the closed set `kind`, written in the file as its word: the word becomes its
    member (strict validation takes no word), and any other value is refused naming the words."""
    def member(v: Any) -> StrEnum:
        if not isinstance(v, str) or v not in kind._value2member_map_:
            raise ValueError(f"must be one of {', '.join(kind)}")
        return kind(v)
    return Annotated[kind, BeforeValidator(member)]


class ConfigFingerprint(_Strict):
    """What a model's config.json says of its shape (`config_fingerprint`): two checkpoints that
    differ here are different models, whatever they are called. Not a proof of equal weights
    (a fine-tune keeps all four), which is why the tokenizer and the name are checked too."""

    architecture: str = Field(min_length=1)  # config.architectures[0], else its model_type
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    vocab_size: int = Field(gt=0)


class ModelIdentity(_Strict):
    name: str = Field(min_length=1)
    hidden_size: int = Field(gt=0)
    # sha256 of the vocabulary, see tokenizer_fingerprint()
    tokenizer_fingerprint: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    # absent in bundles written before it was recorded (and in imported ones whose model's
    # config.json was not at hand): then the name, hidden size and tokenizer are what is checked
    config_fingerprint: ConfigFingerprint | None = None


class Segmentation(_Strict):
    """How a reasoning trace is cut into steps (docs/METHOD.md section 1)."""

    delimiter: str = Field(DEFAULT_DELIMITER, min_length=1)
    # e.g. ["wait", "but"]; None = every delimiter starts a step
    keywords: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    # "word": a keyword matches as a whole word, any case; "substring": verbatim, inside words too
    # (the authors' rule: a line containing "wait", "Wait", "but" or "But" opens a step)
    keyword_match: _word_of(KeywordMatch) = KeywordMatch.WORD
    max_step_tokens: int | None = Field(None, ge=1)  # None: steps are never cut by length


class ThinkTags(_Strict):
    """Reasoning phase markers; `enabled=False` means the whole completion is reasoning."""

    enabled: bool = True
    start: str = Field(THINK_START, min_length=1)
    end: str = Field(THINK_END, min_length=1)
    force_text: str = f"\n{THINK_END}\n\n"  # what policy `answer` forces to close the reasoning

    @model_validator(mode="after")
    def _tags(self) -> ThinkTags:
        if self.enabled and self.start == self.end:
            raise ValueError(f"think start and end tags are both {self.start!r}")
        if self.enabled and self.end not in self.force_text:
            raise ValueError(f"force_text {self.force_text!r} does not contain the end tag "
                             f"{self.end!r}: policy `answer` could not close the reasoning")
        return self


class Labelling(_Strict):
    """How the calibration data's steps were labelled (`orca-calibrate collect`'s answer probes,
    orca_method/answer_probes.py): the answer-forcing suffix and the greedy answer tokens after
    it. The live audit labels its requests the same way, or it measures another risk.

    Compatibility: the block is written only when it differs from these defaults (`save_bundle`),
    so a bundle labelled with the defaults stays readable by readers that predate the block (and
    that audit with the defaults: right), while one labelled otherwise, which such a reader would
    audit wrongly, is refused by it (it reads bundles strictly: an unknown block is an error). A
    bundle without the block means these defaults, or, for one written before the block existed,
    whatever its collection used: only then may the server's `--orca-audit-suffix` /
    `--orca-audit-answer-tokens` say it (`labelling_for`)."""

    suffix: str = Field(DEFAULT_SUFFIX, min_length=1)
    answer_tokens: int = Field(DEFAULT_ANSWER_TOKENS, ge=1)


DEFAULT_LABELLING = Labelling()

# provenance's key for the conditions the calibration traces were generated under (`Generation`),
# and the data's info.json's, from which calibration copies it
COLLECTED_UNDER = "collected_under"


class Generation(_Strict):
    """The conditions a model generated under that shape its hidden states and its traces: the
    dtype its engine computed in (vLLM's resolved dtype, e.g. float32) and the sampling of each
    trace (temperature, top_p, top_k, min_p).

    A bundle records the ones its calibration data was collected under (`orca-calibrate
    collect` writes them into the data's info.json, calibration copies them into the bundle's
    `provenance.collected_under`): the probe was fitted, and lambda* certified, on hidden states
    of that dtype and on traces of that sampling; a server that computes in another dtype reads
    other hidden states, one that samples otherwise makes other traces. orca-serve compares them
    with what it serves at start (orca_serve/checks/bundle.py `serving_warnings`) and warns: an
    operator may serve otherwise knowingly, so it is not a refusal. Optional: bundles written
    before it was recorded, and imported ones, have none."""

    # torch's name without "torch.", as vLLM resolves a model's dtype; each also a `--dtype`
    # choice of vLLM's, which the server passes when the command line names none
    dtype: Literal["float16", "bfloat16", "float32"]
    temperature: float = Field(ge=0)
    top_p: float = Field(gt=0, le=1)
    # 0: none (vLLM's SamplingParams' own); absent from records made before the collector took
    # them, whose traces were sampled with neither
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    # the sampling fields, and those of them whose 0 is none
    SAMPLING: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "top_k", "min_p")
    NONE_AT_0: ClassVar[tuple[str, ...]] = ("top_k", "min_p")

    def record(self) -> dict[str, Any]:
        """As the data's info.json and a bundle's provenance hold it: top_k and min_p only when
        used, so that a collection without them records what one did before they were
        recorded: a set collected then resumes under the same info, and an orca-serve from
        then still reads the bundle (one that uses either, it refuses: an unknown key)."""
        return self.model_dump(exclude={name for name in self.NONE_AT_0 if not getattr(self, name)})


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
    pvalue: _word_of(PValue) = PValue.BINOMIAL
    grid_size: int = Field(ge=1)
    excluded_never_correct: bool = True
    rows: list[LTTRow]


class DriftReference(_Strict):
    """How the calibration set's scores behave, for the label-free drift test (docs/AUDIT.md).

    Per calibration trajectory (a seeded subsample), the two statistics of
    `orca_method.audit.drift.drift_statistics`: the mean smoothed score over the first `k` steps
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


class GateReference(_Strict):
    """The per-request shift gate's reference (orca_method/shift_gate.py, docs/METHOD.md section
    11): the nonconformity model fitted on the training split (`tensors`: base64 safetensors of
    mean [d], basis [rank, d], var [rank], res_scale [1]) and the calibration split's sorted
    scores. Optional: a bundle without it serves every request ungated.

    `give_up_alpha`, the give-up side's default level (>= alpha), is optional too: absent (every
    bundle written before it), it is alpha, one level for both sides, as those bundles meant;
    written only when set (`save_bundle`), so their checksums stay what they were."""

    steps: int = Field(ge=1)  # step embeddings the gate reads (it decides at this step)
    alpha: float = Field(gt=0, lt=1)  # the default level: in-distribution requests flagged
    n_fit: int = Field(ge=2)  # training requests the model was fitted on
    tensors: str = Field(min_length=1)
    scores: list[float] = Field(min_length=1)
    # the default level of the give-up side: in-distribution requests denied their give-up
    give_up_alpha: float | None = Field(default=None, gt=0, lt=1)

    @field_validator("scores")
    @classmethod
    def _sorted(cls, v: list[float]) -> list[float]:
        if any(b < a for a, b in itertools.pairwise(v)):
            raise ValueError("shift gate scores must be sorted ascending")
        return v

    @model_validator(mode="after")
    def _levels(self) -> GateReference:
        give_up_level(self.alpha, self.give_up_alpha)  # ValueError below alpha
        return self


class GiveUpRow(_Strict):
    delta: float = Field(gt=0, lt=1)  # delta_2: the give-up risk level
    mu: Fraction | None  # give up at the first step whose smoothed score <= mu; None = never
    risk: Fraction  # calibration facts at mu*
    pvalue: Fraction
    give_up_rate: Fraction


class GiveUpTable(_Strict):
    """LTT over the give-up thresholds: one mu* per delta_2, valid for every lambda*."""

    epsilon: float = Field(gt=0, lt=1)  # epsilon_2; the joint statement: docs/METHOD.md section 9
    n_cal: int = Field(ge=1)  # every calibration trace (unsolvable ones included)
    pvalue: _word_of(PValue) = PValue.BINOMIAL
    grid_size: int = Field(ge=1)
    rows: list[GiveUpRow] = Field(min_length=1)


def _spec_fields() -> type[BaseModel]:
    """A strict pydantic view of ProbeSpec's fields (types read off the dataclass; an enum's field
    as the literal words a bundle's JSON holds, as before they were enums)."""
    hints = get_type_hints(ProbeSpec) | {
        name: Literal[tuple(str(m) for m in words)] for name, words in SPEC_WORDS.items()}
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


class GroupTable(_Strict):
    """One group's own thresholds (docs/METHOD.md section 12): lambda* per delta certified by
    LTT on the calibration traces of that group only (its n_cal), and, in a two-sided bundle,
    optionally mu* per give-up delta on them. The same deltas as the bundle's main tables
    (`load_bundle` refuses others), so a request's delta means one thing in every group."""

    ltt: LTTTable
    give_up: GiveUpTable | None = None  # None: a request in this group never gives up


class ConsensusRow(_Strict):
    """One certified pair: with each sample stopped at the main table's lambda* for `delta`, the
    group settles at margin `t` (null: never early, the samples run to their end) so that its
    vote differs from maj@k of the full samples with probability <= `delta_vote`."""

    delta: float = Field(gt=0, lt=1)  # the per-sample delta (a row of the main table)
    delta_vote: float = Field(gt=0, lt=1)
    t: Fraction | None
    risk: Fraction  # calibration facts at t (at t = 1 when t is null)
    pvalue: Fraction
    token_savings: Fraction  # against every sample running to its own stop
    # the confidence clause's certified cap c* (version 3): a finished sample that ORCA stopped
    # early within c reasoning tokens settles the vote when its answer leads; None: the clause
    # is off for this row (LTT stopped on the margin's part of the path, or before)
    confident_tokens: float | None = Field(default=None, gt=0)


class ConfidentPath(_Strict):
    """The caps c a version 3 block's LTT tested after the margin's part of its path
    (`orca_method.consensus.confident_path`): step, 2 step, ... up to `max`, at the smallest
    t under which no lone sample settles by the margin."""

    step: float = Field(gt=0)
    max: float = Field(gt=0)


class ConsensusBlock(_Strict):
    """The consensus stop for k samples of a prompt (docs/METHOD.md section 14): optional, and
    versioned on its own (`version`), so that a later rule can change it without touching the
    bundle's schema version; written only when present (`save_bundle`)."""

    version: Literal[ALL_AT_ONCE_VERSION, CONSENSUS_VERSION, CONFIDENT_VERSION]
    samples: int = Field(ge=2)  # the k it was certified for: a group of another size is not
    weighting: _word_of(Weighting)
    epsilon: float = Field(gt=0, lt=1)
    n_cal: int = Field(ge=1)  # calibration groups (prompts), none of them seen by lambda*
    pvalue: _word_of(PValue) = PValue.BINOMIAL
    grid_size: int = Field(ge=2)
    rows: list[ConsensusRow] = Field(min_length=1)
    # the launch schedule every t was certified for (version 2): wave sizes summing to
    # `samples`, each wave launched once the one before has finished and left the vote
    # unsettled; None: all at once (every version 1 block). Written only when present.
    waves: list[int] | None = None
    # the confidence clause's path (version 3); None: the margin alone. Written only when present
    confident: ConfidentPath | None = None

    @model_validator(mode="after")
    def _confident(self) -> ConsensusBlock:
        if (self.confident is not None) != (self.version >= CONFIDENT_VERSION):
            raise ValueError(f"a consensus block carries the confidence clause's path "
                             f"(`confident`) exactly when its version is {CONFIDENT_VERSION}")
        if self.confident is None and any(r.confident_tokens is not None for r in self.rows):
            raise ValueError("a consensus row has confident_tokens, but the block no "
                             "confidence clause")
        return self

    @model_validator(mode="after")
    def _waves(self) -> ConsensusBlock:
        if self.waves is None:
            return self
        if self.version < CONSENSUS_VERSION:
            raise ValueError(f"a consensus block of version {self.version} launches all samples "
                             f"at once: waves need version {CONSENSUS_VERSION}")
        check_waves(self.waves, self.samples)
        if len(self.waves) < 2:
            raise ValueError(f"waves {format_waves(self.waves)} is one wave: all at once is "
                             "spelled without waves")
        return self

    @property
    def schedule(self) -> tuple[int, ...]:
        """The wave sizes the samples are launched in ((samples,): all at once)."""
        return (self.samples,) if self.waves is None else tuple(self.waves)


def give_up_label_mode(mode: str) -> str:
    """`mode`, unless a give-up risk cannot be measured under it (ValueError): the bundle's rule,
    and a job's when it is read (orca_calibrate.calibrate.GiveUpOptions)."""
    if mode == CONSISTENT:
        raise ValueError("a give-up risk needs reference labels: under consistency labels "
                         "every trace ends with its own final answer, so every give-up "
                         "would be a loss")
    return mode


class GiveUpBlock(_Strict):
    """The lower threshold (schema version 2): its own probe, smoothing and reference labels.

    The probe scores whether the trace will end right; it is the static linear probe (no
    fast-weight update: docs/METHOD.md section 9 says why), run on the same step embeddings.
    """

    probe: ProbeBlock
    window: int = Field(ge=1, le=MAX_WINDOW)  # required: see Bundle.window
    label_mode: str = Field(min_length=1)  # reference labels ("ends right"); never "consistent"
    ltt: GiveUpTable
    default_delta: float = Field(gt=0, lt=1)
    # the give-up policy mu* was certified for (`--orca-give-up-policy`; its loss:
    # orca_method.give_up.give_up_losses); the server serves no other (`check_give_up_policy`).
    # Written only when not "guess" (`save_bundle`): bundles from before the field mean "guess"
    # and keep their checksums, and a reader that predates it refuses a "message" bundle.
    policy: _word_of(GiveUpPolicy) = GiveUpPolicy.GUESS

    @field_validator("label_mode")
    @classmethod
    def _reference(cls, v: str) -> str:
        return give_up_label_mode(v)


class Bundle(_Strict):
    schema_version: int
    orca_serve_version: str
    model: ModelIdentity
    segmentation: Segmentation = Segmentation()
    think: ThinkTags = ThinkTags()
    normalization: _word_of(Normalization) = DEFAULT_NORMALIZATION
    probe: ProbeBlock
    # the smoothing window lambda* were calibrated at: required, since no default is right for
    # every bundle (the demo's are 1 and 3), and scores smoothed otherwise than calibrated void
    # the certificate; save_bundle has always written it (model_dump keeps defaults)
    window: int = Field(ge=1, le=MAX_WINDOW)
    label_mode: str = Field(SUPERVISED, min_length=1)
    ltt: LTTTable
    default_delta: float = Field(gt=0, lt=1)
    # what made it, free-form, but for `collected_under` (`Generation`), read by the server
    provenance: dict[str, Any] = {}
    # None: lambda* computed by orca-calibrate on the data in `provenance`. Otherwise a note on
    # where they come from (e.g. the authors' released lambdas.json): valid only for the sampling
    # setup they were calibrated under; orca-serve prints it at start.
    lambdas_from: str | None = None
    drift: DriftReference | None = None  # absent in older bundles: no drift test
    give_up: GiveUpBlock | None = None  # schema version 2 only: the lower threshold
    shift_gate: GateReference | None = None  # absent in older bundles: no gate
    # how the data was labelled; None: not recorded (the defaults, see Labelling)
    labelling: Labelling | None = None
    # per group name (a request's `orca.group`), its own tables; None: no groups, every request
    # takes the main (mixture) table. Written only when present (`save_bundle`)
    groups: dict[Annotated[str, Field(min_length=1, max_length=GROUP_NAME_MAX)],
                 GroupTable] | None = None
    # the consensus stop for k samples; None: none calibrated. Written only when present
    consensus: ConsensusBlock | None = None
    checksum: str = ""

    @field_validator("schema_version")
    @classmethod
    def _version(cls, v: int) -> int:
        if v not in SCHEMA_VERSIONS:
            raise ValueError(f"bundle schema version {v} is not supported (this orca-serve reads "
                             f"versions {SCHEMA_VERSION} and {TWO_SIDED_VERSION}); recalibrate "
                             "with this orca-serve version")
        return v

    @field_validator("provenance")
    @classmethod
    def _generation(cls, v: dict[str, Any]) -> dict[str, Any]:
        """`collected_under`, when present, is a `Generation` (the server reads it)."""
        if v.get(COLLECTED_UNDER) is not None:
            try:
                Generation.model_validate(v[COLLECTED_UNDER])
            except ValidationError as e:
                first = e.errors()[0]
                where = ".".join([COLLECTED_UNDER, *(str(x) for x in first["loc"])])
                raise ValueError(f"{where}: {first['msg']}") from None
        return v

    @model_validator(mode="after")
    def _version_matches(self) -> Bundle:
        want = schema_version_for(self.give_up is not None)
        if self.schema_version != want:
            raise ValueError(f"schema version {self.schema_version} "
                             f"{'with' if self.give_up else 'without'} a give_up block; a bundle "
                             f"{'with' if self.give_up else 'without'} one is version {want}")
        return self

    # -- derived ---------------------------------------------------------------------------
    def collected_under(self) -> Generation | None:
        """The conditions the calibration data was generated under (`Generation`); None for a
        bundle that does not record them."""
        v = self.provenance.get(COLLECTED_UNDER)
        return None if v is None else Generation.model_validate(v)

    def deltas(self) -> list[float]:
        return [r.delta for r in self.ltt.rows]

    def group(self, name: str | None) -> GroupTable | None:
        """The tables of group `name`; None for no group or one the bundle does not know
        (such a request takes the main table, the mixture's)."""
        return None if name is None or self.groups is None else self.groups.get(name)

    def lam(self, delta: float, group: str | None = None) -> float:
        """lambda*(delta) of `group`'s table when the bundle knows the group, else of the main
        (mixture) table; inf means never stop early."""
        g = self.group(group)
        for r in (self.ltt if g is None else g.ltt).rows:
            if math.isclose(r.delta, delta, rel_tol=0, abs_tol=1e-9):
                return lam_from_json(r.lam)
        raise BundleError(f"delta {delta} has no calibrated lambda* in this bundle; "
                          f"available deltas: {', '.join(f'{d:g}' for d in self.deltas())}")

    def give_up_deltas(self) -> list[float]:
        return [] if self.give_up is None else [r.delta for r in self.give_up.ltt.rows]

    def mu(self, delta_2: float, group: str | None = None) -> float:
        """mu*(delta_2); GIVE_UP_NEVER (-inf) means never give up. The same mu* holds with
        every lambda*(delta) of the table (docs/METHOD.md section 9), so the pair for
        (delta, delta_2) is ``(lam(delta), mu(delta_2))``. A group the bundle knows takes its
        own give-up table, and never gives up without one: the mixture's mu* is not certified
        for it (a known group is exactly traffic the mixture may not stand for)."""
        if self.give_up is None:
            raise BundleError("this bundle has no give-up threshold (a one-sided bundle, schema "
                              "version 1): calibrate it with a give-up probe")
        g = self.group(group)
        if g is not None and g.give_up is None:
            self.mu(delta_2)  # the main table's refusal of a delta it lacks
            return GIVE_UP_NEVER
        for r in (self.give_up.ltt if g is None else g.give_up).rows:  # type: ignore[union-attr]
            if math.isclose(r.delta, delta_2, rel_tol=0, abs_tol=1e-9):
                return mu_from_json(r.mu)
        raise BundleError(f"give-up delta {delta_2} has no calibrated mu* in this bundle; "
                          f"available: {', '.join(f'{d:g}' for d in self.give_up_deltas())}")

    def spec(self) -> ProbeSpec:
        return ProbeSpec.from_dict(self.probe.spec)

    def load_probe(self) -> Probe:
        """The probe with the bundle's slow weights, checked for names, shape, dtype, finiteness.

        Every check runs before the probe is allocated, so a bundle declaring a huge probe is
        refused without allocating it.
        """
        return _load_probe(self.probe)

    def load_give_up_probe(self) -> Probe | None:
        """The give-up probe (checked as `load_probe`), or None for a one-sided bundle."""
        return None if self.give_up is None else _load_probe(self.give_up.probe)

    def load_gate(self, device: str | torch.device = "cpu") -> ShiftGate | None:
        """The shift gate (None without one), its tensors checked for names, shapes against the
        model's hidden size, and finiteness (BundleError otherwise)."""
        g = self.shift_gate
        if g is None:
            return None
        t = decode_weights(g.tensors, "shift gate tensors")
        d = self.model.hidden_size
        want = {"mean": (d,), "var": None, "basis": None, "res_scale": (1,)}
        if set(t) != set(want):
            raise BundleError(f"shift gate tensors are {sorted(t)}, expected {sorted(want)}: "
                              "the bundle is corrupt, rebuild its gate")
        r = t["var"].shape[0] if t["var"].ndim == 1 else -1
        want.update(var=(r,), basis=(r, d))
        for k, shape in want.items():
            if tuple(t[k].shape) != shape or t[k].dtype != torch.float32:
                raise BundleError(f"shift gate tensor {k} is {t[k].dtype} {tuple(t[k].shape)}, "
                                  f"expected float32 {shape} (hidden size {d}): rebuild its gate")
            if not torch.isfinite(t[k]).all():
                raise BundleError(f"shift gate tensor {k} has non-finite values: rebuild its gate")
        if r < 1 or (t["var"] <= 0).any() or float(t["res_scale"][0]) <= 0:
            raise BundleError("shift gate variances must be positive: rebuild its gate")
        return ShiftGate(t, g.scores, g.steps, g.alpha, device, g.give_up_alpha)

    def summary(self) -> dict[str, Any]:
        """Everything but the weights and the drift reference's numbers (for /v1/orca/bundle
        and logs)."""
        d = self.model_dump()
        d["probe"] = {"variant": self.spec().name, "spec": self.probe.spec, "eta": self.probe.eta}
        if self.drift is not None:  # the reference's numbers are for the monitor, not for people
            d["drift"] = {"k": self.drift.k, "level": self.drift.level, "n_cal": self.drift.n_cal,
                          "size": len(self.drift.early_mean)}
        if self.shift_gate is not None:
            sg = self.shift_gate
            d["shift_gate"] = {"steps": sg.steps, "alpha": sg.alpha,
                               "give_up_alpha": give_up_level(sg.alpha, sg.give_up_alpha),
                               "n_fit": sg.n_fit, "n_cal": len(sg.scores)}
        if self.give_up is not None:
            g = self.give_up
            d["give_up"]["probe"] = {"variant": ProbeSpec.from_dict(g.probe.spec).name,
                                     "spec": g.probe.spec}
        return d


def gate_reference(fit: Any, cal: Any, *, steps: int, alpha: float,
                   give_up_alpha: float | None = None,
                   rank: int = DEFAULT_GATE_RANK) -> GateReference:
    """A bundle's shift gate from gate features ([N, d] of the training split, [M, d] of the
    calibration split; orca_method.shift_gate.gate_features), at levels `alpha` and
    `give_up_alpha` (None: alpha's, one level)."""
    tensors, scores = fit_gate(fit, cal, rank)
    return GateReference(steps=steps, alpha=alpha, give_up_alpha=give_up_alpha, n_fit=len(fit),
                         tensors=encode_tensors({k: torch.from_numpy(v)
                                                 for k, v in tensors.items()}), scores=scores)


def schema_version_for(two_sided: bool) -> int:
    """The version a bundle is written with: 2 only when it carries a give_up block."""
    return TWO_SIDED_VERSION if two_sided else SCHEMA_VERSION


def labelling_for(bundle: Bundle, given: Mapping[str, tuple[str, Any]]) -> Labelling:
    """How audits of `bundle` are labelled: its labelling block, or, for a bundle without one,
    `given` over the defaults. `given` maps a Labelling field to (what set it, its value or None
    when unset): the server's --orca-audit-* flags, or the labelling an audit directory records.

    A given value that contradicts the bundle's block is a BundleError (one line): the audit
    would measure another risk than the one certified. The one rule for the server's audit
    (orca_serve/live_audit/options.py) and the offline tools that read audits
    (orca_calibrate/audit_report.py)."""
    block = bundle.labelling
    if block is None:
        return Labelling(**{**DEFAULT_LABELLING.model_dump(),
                            **{k: v for k, (_, v) in given.items() if v is not None}})
    for name, (source, value) in given.items():
        ours = getattr(block, name)
        if value is not None and value != ours:
            raise BundleError(f"{source} {value!r:.60} contradicts the bundle's labelling "
                              f"{name} {ours!r:.60}: that is how its calibration data was "
                              "labelled, and audits labelled otherwise measure another risk")
    return block


def _load_probe(block: ProbeBlock) -> Probe:
    """A probe block's probe, every check before allocation (`Bundle.load_probe`)."""
    spec = ProbeSpec.from_dict(block.spec)
    tensors = decode_weights(block.weights)
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


def encode_weights(probe: Probe) -> str:
    return encode_tensors(probe.params)


def encode_tensors(tensors: Mapping[str, Any]) -> str:
    """Named float32 tensors (or arrays) as base64 safetensors, the bundle's form for numbers."""
    t = {k: torch.as_tensor(v).detach().float().contiguous().cpu() for k, v in tensors.items()}
    return base64.b64encode(st_save(t)).decode("ascii")


def decode_weights(weights: str, what: str = "probe weights") -> dict[str, torch.Tensor]:
    """encode_weights' inverse; anything else (stray characters included) is a BundleError."""
    try:
        blob = base64.b64decode(weights, validate=True)
    except (binascii.Error, ValueError) as e:
        raise BundleError(f"{what} are not base64 ({e}); the bundle is corrupt: "
                          "recalibrate") from None
    try:
        return st_load(blob)
    except Exception as e:  # noqa: BLE001 - safetensors' errors share no base class but Exception
        raise BundleError(f"{what} are not a safetensors blob "
                          f"({first_line(e)}); the bundle "
                          "is corrupt: recalibrate") from None


def _checksum(data: dict[str, Any]) -> str:
    body = {k: v for k, v in data.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, allow_nan=False).encode()).hexdigest()


def save_bundle(bundle: Bundle, path: str | Path) -> Bundle:
    """Write the bundle with its checksum; returns the sealed bundle."""
    # a one-sided bundle is written exactly as before version 2 (no give_up key): readers of
    # version 1 read it, and its checksum is what they compute; likewise a bundle labelled with
    # the default labelling has no labelling key (Labelling says why)
    drop: dict[str, Any] = {"give_up": True} if bundle.give_up is None else {}
    if bundle.give_up is not None and bundle.give_up.policy == GiveUpPolicy.GUESS:
        drop["give_up"] = {"policy": True}  # as before the field: "guess" (GiveUpBlock)
    if bundle.shift_gate is None:  # older readers refuse an unknown key; checksums unchanged
        drop["shift_gate"] = True
    elif bundle.shift_gate.give_up_alpha is None:  # likewise: one level, as before the field
        drop["shift_gate"] = {"give_up_alpha": True}
    if bundle.labelling in (None, DEFAULT_LABELLING):
        drop["labelling"] = True
    if bundle.groups is None:
        drop["groups"] = True
    if bundle.consensus is None:
        drop["consensus"] = True
    else:  # all at once, or the margin alone: as a version 1 or 2 block was written
        drop["consensus"] = ({"waves": True} if bundle.consensus.waves is None else {}) | (
            {"confident": True, "rows": {"__all__": {"confident_tokens"}}}
            if bundle.consensus.confident is None else {}) or None
        if drop["consensus"] is None:
            del drop["consensus"]
    data = bundle.model_dump(exclude=drop or None)
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


def first_error(e: ValidationError) -> str:
    """Where and what, for the first of pydantic's errors (one line)."""
    first = e.errors()[0]
    where = ".".join(str(x) for x in first["loc"])
    got = first.get("input")
    shown = "" if first["type"] == "missing" or isinstance(got, (dict, list)) else \
        f" (got {repr(got)[:60]})"
    more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
    return f"invalid at '{where}': {first['msg'].removeprefix('Value error, ')}{shown}{more}"


# a real model's bundle is a few MB (its probes and gate basis grow with the hidden size: ~5 MB at
# 12,288); anything far larger is another file, which reading whole could exhaust memory
MAX_BUNDLE_BYTES = 256 * 2**20


def load_bundle(path: str | Path) -> Bundle:
    """Read and validate a bundle; every refusal is a BundleError with a one-line reason.

    Only a regular file of at most MAX_BUNDLE_BYTES is read: a device (/dev/zero) or a pipe
    would block or exhaust memory in the server's reload, not fail."""
    p = Path(path)
    try:
        st = p.stat()
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError
        if not stat.S_ISREG(st.st_mode):
            raise BundleError(f"bundle {p} is not a regular file; pass the bundle.json file")
        if st.st_size > MAX_BUNDLE_BYTES:
            raise BundleError(f"bundle {p} is {st.st_size / 2**20:.0f} MiB, more than a bundle "
                              f"holds ({MAX_BUNDLE_BYTES // 2**20} MiB at most); is it a "
                              "bundle.json?")
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
    if data.get("schema_version") not in (None, *SCHEMA_VERSIONS):
        raise BundleError(f"bundle {p} has schema version {data.get('schema_version')!r:.40}, "
                          f"this orca-serve reads versions {SCHEMA_VERSION} and "
                          f"{TWO_SIDED_VERSION}: recalibrate with this version")
    if data.get("checksum") != _checksum(data):
        raise BundleError(f"bundle {p} fails its checksum: it was edited or truncated after "
                          "calibration; restore the original or recalibrate")
    for where, block in (("", data), ("give_up.", data.get("give_up"))):
        if isinstance(block, dict) and "window" not in block:
            raise BundleError(f"bundle {p} has no '{where}window' (the smoothing window its "
                              "thresholds were calibrated at, which no default can stand in "
                              "for): recalibrate, or restore the file calibration wrote")
    try:
        bundle = Bundle.model_validate(data, strict=True)
    except ValidationError as e:
        raise BundleError(f"bundle {p} is {first_error(e)}") from None
    if not bundle.ltt.rows:
        raise BundleError(f"bundle {p} has an empty LTT table; recalibrate with at least one delta")
    _once(bundle.deltas(), f"bundle {p} lists delta {{:g}} twice in its LTT table; which "
          "lambda* applies is ambiguous: recalibrate")
    try:
        bundle.lam(bundle.default_delta)  # the default must be calibrated
    except BundleError as e:
        raise BundleError(f"bundle {p}: default_delta: {e}") from None
    spec = bundle.spec()
    if spec.dim != bundle.model.hidden_size:
        raise BundleError(f"bundle {p}: probe dim {spec.dim} != model hidden size "
                          f"{bundle.model.hidden_size}")
    if bundle.give_up is not None:
        _check_give_up(bundle, p)
    _check_groups(bundle, p)
    _check_consensus(bundle, p)
    try:
        bundle.load_gate()
        _smoke_test(bundle.load_probe())
        if bundle.give_up is not None:
            _smoke_test(bundle.load_give_up_probe())
    except BundleError as e:
        raise BundleError(f"bundle {p}: {e}") from None
    return bundle


def _once(deltas: list[float], message: str) -> None:
    """Refuse a table listing a delta twice (`message` formats the delta)."""
    for a, b in itertools.pairwise(sorted(deltas)):
        if math.isclose(a, b, rel_tol=0, abs_tol=1e-9):
            raise BundleError(message.format(a))


def _check_give_up(bundle: Bundle, p: Path) -> None:
    """The give_up block's table: no delta twice, its default calibrated, its probe's width."""
    g = bundle.give_up
    _once(bundle.give_up_deltas(), f"bundle {p} lists give-up delta {{:g}} twice; which mu* "
          "applies is ambiguous: recalibrate")
    try:
        bundle.mu(g.default_delta)
    except BundleError as e:
        raise BundleError(f"bundle {p}: give_up.default_delta: {e}") from None
    dim = ProbeSpec.from_dict(g.probe.spec).dim
    if dim != bundle.model.hidden_size:
        raise BundleError(f"bundle {p}: give-up probe dim {dim} != model hidden size "
                          f"{bundle.model.hidden_size}")


def _check_groups(bundle: Bundle, p: Path) -> None:
    """Each group's tables list exactly the main tables' deltas, each once (so its default is
    calibrated and a request's delta means the same in every group); a give-up table only in a
    two-sided bundle. Row semantics: `bundle_checks.check_semantics`, as for the main tables."""
    def same(have: list[float], want: list[float]) -> bool:
        return len(have) == len(want) and all(
            any(math.isclose(a, b, rel_tol=0, abs_tol=1e-9) for b in want) for a in have)

    for name, g in (bundle.groups or {}).items():
        where = f"bundle {p}: group {name!r:.70}"
        deltas = [r.delta for r in g.ltt.rows]
        _once(deltas, f"{where} lists delta {{:g}} twice in its LTT table; which lambda* "
              "applies is ambiguous: recalibrate")
        if not same(deltas, bundle.deltas()):
            raise BundleError(f"{where} has lambda* for deltas {sorted(deltas)}, the main table "
                              f"for {sorted(bundle.deltas())}: a group's table covers the same "
                              "deltas (the default included); recalibrate")
        if g.give_up is None:
            continue
        if bundle.give_up is None:
            raise BundleError(f"{where} has a give-up table but the bundle is one-sided: "
                              "recalibrate")
        deltas = [r.delta for r in g.give_up.rows]
        _once(deltas, f"{where} lists give-up delta {{:g}} twice; which mu* applies is "
              "ambiguous: recalibrate")
        if not same(deltas, bundle.give_up_deltas()):
            raise BundleError(f"{where} has mu* for give-up deltas {sorted(deltas)}, the main "
                              f"table for {sorted(bundle.give_up_deltas())}: recalibrate")


def _check_consensus(bundle: Bundle, p: Path) -> None:
    """Each consensus row stops its samples at a lambda* of the main table, and names a
    (delta, delta_vote) pair once."""
    if bundle.consensus is None:
        return
    seen: set[tuple[float, float]] = set()
    for r in bundle.consensus.rows:
        if not any(math.isclose(r.delta, d, rel_tol=0, abs_tol=1e-9) for d in bundle.deltas()):
            raise BundleError(f"bundle {p}: a consensus row is for delta {r.delta:g}, which the "
                              "main table does not calibrate: recalibrate")
        if (r.delta, r.delta_vote) in seen:
            raise BundleError(f"bundle {p}: consensus lists delta {r.delta:g}, delta_vote "
                              f"{r.delta_vote:g} twice; which t applies is ambiguous: recalibrate")
        seen.add((r.delta, r.delta_vote))


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


def tokenizer_fingerprint(vocab: dict[str, int]) -> str:
    """sha256 of the token -> id map: equal fingerprints mean the same token ids for any text."""
    items = sorted(vocab.items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


def config_fingerprint(config: Any) -> ConfigFingerprint | None:
    """The `ConfigFingerprint` of a transformers config (its text part for a multimodal model);
    None when the config lacks one of the four (an unusual architecture: not fingerprinted)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    archs = getattr(config, "architectures", None) or [getattr(config, "model_type", None)]
    facts = {"architecture": archs[0], "hidden_size": getattr(text, "hidden_size", None),
             "num_layers": getattr(text, "num_hidden_layers", None),
             "vocab_size": getattr(text, "vocab_size", None)}
    try:
        return ConfigFingerprint.model_validate(facts, strict=True)
    except ValidationError:
        return None


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
