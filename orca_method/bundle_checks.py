"""Checks of a bundle before it is used (docs/SERVER.md, "Bundle checks"): a table and a probe
that calibration could have produced, a step delimiter the model's tokenizer has, the model the
bundle names. Each refusal is one `BundleError` line.

`check_bundle` is the one entry: orca-serve runs it against the served model at start and on
every hot reload, and every offline tool that reads a bundle (`orca-calibrate evaluate`,
`audit-report`, `recalibrate`) against the data it replays the bundle on (`data_target`), so a
bundle the server would refuse is refused there too, with the same line.

A module of their own: `load_bundle` (orca_method/bundle.py) reads and validates the file, while
these checks need what the bundle is used with, and the table check needs LTT's p-values
(orca_method/ltt.py, whose loss module refers to the bundle).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError

from orca_method.bundle import (
    Bundle,
    BundleError,
    ConfigFingerprint,
    GiveUpTable,
    LTTRow,
    LTTTable,
    Segmentation,
    check_model,
)
from orca_method.ltt import pvalue_fn
from orca_method.probe import Probe
from orca_method.thresholds import lam_from_json, mu_from_json
from orca_method.trajectories import TrajectoryError

SATURATED = 1e-6  # a score this close to 0 or 1 is saturated (float32 sigmoid's flat ends)
SATURATION_PROBES = (64, 4)  # seeded reference trajectories and steps each


@dataclass(frozen=True)
class Target:
    """What a bundle is about to be used with: the served model (orca-serve) or the data an
    offline tool replays it on (`data_target`). A fact left None is unknown and not checked."""

    model: str | None = None  # --model, or the model the data records
    served_names: Sequence[str] = ()  # --served-model-name
    hidden_size: int | None = None
    vocab: Mapping[str, int] | None = None  # the tokenizer's token -> id (the server reads it)
    token_bytes: Sequence[bytes] | None = None  # each token id's bytes (orca_method.steps)
    tokenizer_fingerprint: str | None = None  # what the data records of its tokenizer
    config_fingerprint: ConfigFingerprint | None = None
    segmentation: Segmentation | None = None  # how the data was cut into steps
    normalization: str | None = None  # how the data's step embeddings were pooled
    needs_tokenizer: bool = False  # the server: a bundle naming no tokenizer is an identity gap


def data_target(info: Mapping[str, Any], dim: int) -> Target:
    """The `Target` of a trajectory set (its info.json, docs/TRAJECTORIES.md): what the data
    records of the model and the procedure that produced it."""
    config, seg = info.get("model_config"), info.get("segmentation")
    try:
        return Target(model=info.get("model"), hidden_size=dim,
                      tokenizer_fingerprint=info.get("tokenizer_fingerprint"),
                      config_fingerprint=None if config is None else ConfigFingerprint(**config),
                      segmentation=None if seg is None else Segmentation(**seg),
                      normalization=info.get("normalization"))
    except ValidationError as e:
        first = e.errors()[0]
        raise TrajectoryError(f"info.json: {'.'.join(str(x) for x in first['loc'])}: "
                              f"{first['msg']}") from None


def check_bundle(bundle: Bundle, target: Target, *, force: bool = False) -> str | None:
    """Every check of a bundle against what it is used with; raises BundleError (one line).
    Returns what `force` let through (the refusal's first clause), for the caller to print.

    Identity (`force` overrides it, it may be the same model under another name): the model
    name (`check_model_name`), the config fingerprint (`check_config`), and for the server a
    bundle that names no tokenizer. Never overridden: the hidden size, tokenizer and think
    tags (`check_model`; the recorded tokenizer fingerprint for data), the step delimiter
    (`check_delimiter`; the recorded segmentation and pooling for data), and the table and probe
    (`check_semantics`): with any of those wrong the stop decision is not the calibrated one.
    """
    note = None
    try:
        if target.model is not None:
            check_model_name(bundle, target.model, list(target.served_names))
        check_config(bundle, target.config_fingerprint, target.model or "the model")
        if target.needs_tokenizer and bundle.model.tokenizer_fingerprint is None:
            raise BundleError(f"the bundle names no tokenizer (no tokenizer_fingerprint), so it "
                              f"cannot be checked against {target.model}'s; recalibrate, or "
                              "import it again with `orca-calibrate import-probe`, or pass "
                              "--orca-force-model")
    except BundleError as e:
        if not force:
            raise
        note = str(e).split("; ")[0]
    name = target.model or "the data's model"
    if target.hidden_size is not None:
        check_model(bundle, target.hidden_size,
                    None if target.vocab is None else dict(target.vocab), name)
    fp = bundle.model.tokenizer_fingerprint
    if target.tokenizer_fingerprint and fp and fp != target.tokenizer_fingerprint:
        raise BundleError(f"the data was made with another tokenizer than the bundle's "
                          f"({bundle.model.name!r}): its token ids are not the calibrated ones")
    if target.token_bytes is not None:
        check_delimiter(bundle, list(target.token_bytes), name)
    if target.segmentation is not None and target.segmentation != bundle.segmentation:
        raise BundleError(f"the data was cut into steps with {target.segmentation!r}, the bundle "
                          f"with {bundle.segmentation!r}: its steps are not the calibrated ones; "
                          "wrong data, or the bundle was edited: recalibrate")
    if target.normalization is not None and target.normalization != bundle.normalization:
        raise BundleError(f"the data's step embeddings are pooled {target.normalization!r}, the "
                          f"bundle's probe expects {bundle.normalization!r}; wrong data, or the "
                          "bundle was edited: recalibrate")
    check_semantics(bundle)
    return note


def check_config(bundle: Bundle, config: ConfigFingerprint | None, model_name: str) -> None:
    """Refuse a model whose config fingerprint (architecture, hidden size, layers, vocabulary)
    differs from the one the bundle records: another model, whatever it is called. A bundle
    without a fingerprint (older, or imported without the model's config) and a model whose
    config has none are not checked here (the name, hidden size and tokenizer still are)."""
    ours = bundle.model.config_fingerprint
    if ours is None or config is None or ours == config:
        return
    diff = ", ".join(f"{k} {getattr(ours, k)!r} vs {getattr(config, k)!r}"
                     for k in type(ours).model_fields if getattr(ours, k) != getattr(config, k))
    raise BundleError(f"{model_name} is not the model the bundle was calibrated on "
                      f"({bundle.model.name!r}): its config differs ({diff}); serve that model, "
                      "recalibrate for this one, or force it if it is the same model (orca-serve "
                      "--orca-force-model, orca-calibrate --force-model)")


def check_semantics(bundle: Bundle) -> None:
    """Refuse (BundleError, one line) a table or probe that no calibration could have produced.

    Data-free, so they hold for any bundle: lambda* is non-increasing in delta and each row is
    consistent with the others and with its own recorded risk (`check_rows`), and the same for
    mu* of a two-sided bundle (`check_give_up_rows`), and for each group's tables
    (`check_table`, `check_give_up_table`, their refusals prefixed with the group's name);
    neither the probe's scores nor the give-up probe's are saturated (`check_not_saturated`, the
    same check for both: a saturated give-up probe gives up on every request or on none,
    whatever its mu*).
    """
    check_rows(bundle)
    check_give_up_rows(bundle)
    for name, g in (bundle.groups or {}).items():  # each group's tables, by the same rules
        check_table(g.ltt, f"group {name!r:.70}: ")
        if g.give_up is not None:
            check_give_up_table(g.give_up, f"group {name!r:.70}: ")
    check_not_saturated(bundle.load_probe())
    give_up = bundle.load_give_up_probe()
    if give_up is not None:
        check_not_saturated(give_up, "give-up probe")


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
    check_table(bundle.ltt)


def check_table(t: LTTTable, where: str = "") -> None:
    """`check_rows` on one LTT table (the main one, or a group's: `where` names it)."""
    rows = sorted(t.rows, key=lambda r: r.delta)

    def lam(r: LTTRow) -> float:
        return lam_from_json(r.lam)

    def shown(r: LTTRow) -> str:
        return "never" if r.lam is None else f"{r.lam:g}"

    for a, b in itertools.pairwise(rows):
        if lam(b) > lam(a):
            raise BundleError(f"{where}lambda* rises with delta (delta {a.delta:g}: {shown(a)}, "
                              f"delta {b.delta:g}: {shown(b)}), which LTT never does: the table "
                              "was edited after calibration; recalibrate")
    facts = [r for r in rows if r.risk is not None and r.pvalue is not None]
    for r in facts if t.n_cal is not None else []:
        row = (f"{where}delta {r.delta:g} (lambda* {shown(r)}, risk {r.risk:g}, "
               f"p-value {r.pvalue:g})")
        k = _losses(row, r.risk, t.n_cal)
        if r.lam is None:
            if r.pvalue != 1.0 or (t.excluded_never_correct and r.risk != 0.0):
                raise BundleError(f"{row}: a row that never stops early has p-value 1 and "
                                  "risk 0; the table was edited: recalibrate")
            continue
        _check_pvalue(row, k, r.delta, r.pvalue, t)
    for a, b in itertools.pairwise(sorted(facts, key=lam, reverse=True)):
        pairs = [("risk", a.risk, b.risk), ("savings", a.savings, b.savings),
                 ("token savings", a.token_savings, b.token_savings)]
        for name, x, y in pairs:
            if x is None or y is None:
                continue
            bad = not math.isclose(x, y, abs_tol=1e-9) if lam(a) == lam(b) else x > y + 1e-9
            if bad:
                raise BundleError(f"{where}delta {a.delta:g} (lambda* {shown(a)}) records "
                                  f"{name} {x:g} but delta {b.delta:g} (lambda* {shown(b)}) "
                                  f"records {y:g}: "
                                  f"a lower lambda* stops no later, so its {name} is no smaller; "
                                  "the table was edited: recalibrate")


def _losses(where: str, risk: float, n_cal: int) -> float:
    """A recorded risk's losses out of n_cal (a whole number, else the table was edited)."""
    k = risk * n_cal
    if abs(k - round(k)) > 1e-6:
        raise BundleError(f"{where}: risk x n_cal = {k:g} is not a whole number of losses "
                          f"out of {n_cal}; the table was edited: recalibrate")
    return k


def _check_pvalue(row: str, k: float, delta: float, recorded: float,
                  t: LTTTable | GiveUpTable) -> None:
    """A row's recorded p-value is the one its k losses in the table's n_cal give at its delta,
    under the table's p-value, and it is <= the table's epsilon (stop and give-up tables alike:
    both come from one LTT run)."""
    p = float(pvalue_fn(t.pvalue)(np.asarray([round(k)]), t.n_cal, delta)[0])
    if not math.isclose(p, recorded, rel_tol=1e-6, abs_tol=1e-12) or p > t.epsilon:
        raise BundleError(f"{row}: {round(k)} losses in {t.n_cal} give p-value {p:.4g}"
                          f"{'' if p <= t.epsilon else f' > epsilon {t.epsilon:g}'}; the "
                          "row does not match its own risk: recalibrate")


def check_give_up_rows(bundle: Bundle) -> None:
    """The give-up table could come from one run of orca_method/give_up.py on n_cal traces: mu*
    is non-decreasing in delta_2 (None, never give up, below every number), and each row's risk
    is a whole number of losses whose p-value is the recorded one and <= epsilon_2 (a row that
    never gives up: p-value 1, risk 0)."""
    if bundle.give_up is not None:
        check_give_up_table(bundle.give_up.ltt)


def check_give_up_table(t: GiveUpTable, where: str = "") -> None:
    """`check_give_up_rows` on one give-up table (the main one, or a group's: `where`)."""
    rows = sorted(t.rows, key=lambda r: r.delta)

    def mu(r) -> float:
        return mu_from_json(r.mu)

    for a, b in itertools.pairwise(rows):
        if mu(b) < mu(a):
            raise BundleError(f"{where}give-up mu* falls as delta_2 rises (delta_2 "
                              f"{a.delta:g}: {a.mu}, {b.delta:g}: {b.mu}), which LTT never "
                              "does: the table was edited "
                              "after calibration; recalibrate")
    for r in rows:
        row = (f"{where}give-up delta {r.delta:g} (mu* {r.mu}, risk {r.risk:g}, "
               f"p-value {r.pvalue:g})")
        k = _losses(row, r.risk, t.n_cal)
        if r.mu is None:
            if r.pvalue != 1.0 or r.risk != 0.0:
                raise BundleError(f"{row}: a row that never gives up has p-value 1 and risk 0; "
                                  "the table was edited: recalibrate")
            continue
        _check_pvalue(row, k, r.delta, r.pvalue, t)


@torch.no_grad()
def check_not_saturated(probe: Probe, what: str = "probe") -> None:
    """Refuse a probe (`what` names it in the refusal: the stop probe or the give-up probe)
    whose every score is 0 or 1 (within SATURATED) on a seeded reference.

    The reference: SATURATION_PROBES seeded random unit-norm step embeddings per trajectory (the
    norm of a token-l2 step embedding is at most 1). A probe whose scores are all at sigmoid's
    ends (weights scaled up, e.g. x 1e30: finite, so the load-time smoke test passes) cannot
    place a threshold between steps; a trained probe gives scores spread over (0, 1) there.
    """
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
        raise BundleError(f"the {what}'s scores are all saturated (0 or 1 within {SATURATED:g}) "
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
    component (case-insensitive), or one of `--served-model-name`. Forcing skips it
    (`check_bundle`).
    """
    served = model_aliases(model).union(*(model_aliases(s) for s in served_names or []))
    if model_aliases(bundle.model.name) & served:
        return
    raise BundleError(f"the bundle was made for model {bundle.model.name!r}, not {model!r}; "
                      f"serve {bundle.model.name!r}, or name it so with --served-model-name if "
                      "this is that model under another path, or force it (orca-serve "
                      "--orca-force-model, orca-calibrate --force-model)")
