"""A bundle checked against what it is about to serve, at start and again on every hot reload:
the model (`check_served`: its config.json and tokenizer, read without loading its weights, with
transformers' AutoConfig/AutoTokenizer, a local folder or a hub name; before vLLM is imported)
and the options the server runs with (`check_options`, orca_serve/startup/preflight.py and
orca_serve/api_server/reload.py: a bundle that does not satisfy them is refused, in one line
naming the option and the fix). `check_model_folder` (a local model folder needs config.json)
is the offline collector's check too, so both refuse such a folder in the same line.
`serving_warnings` (at start) compares the dtype and default sampling the server will serve
with those the bundle's calibration data was collected under: a warning line each, never a
refusal.

The options are fixed for the server's life, so a reload to a bundle that cannot serve them would
turn every request they shape into an error (or, for the give-up policy, serve a guarantee the
bundle does not state); checked here, such a bundle never replaces the one serving.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orca_method.consensus import format_waves
from orca_method.errors import first_line
from orca_method.outcomes import GiveUpPolicy
from orca_method.shift_gate import give_up_level
from orca_method.steps import token_bytes_from_tokenizer
from orca_serve.checks.errors import PROG, StartupError
from orca_serve.settings.effort import check_effort_map

if TYPE_CHECKING:
    from orca_method.bundle import Bundle, ConfigFingerprint, Generation


@dataclass(frozen=True)
class ModelFacts:
    """What the bundle checks need of a model, read without loading its weights."""

    hidden_size: int  # config.json
    vocab: dict[str, int]  # the tokenizer's token -> id
    token_bytes: list[bytes]  # each token id's bytes (orca_method.steps)
    config: ConfigFingerprint | None = None  # of config.json (None: it lacks one of its fields)


def check_model_folder(model: str, hf_config_path: str | None = None) -> None:
    """Refuse (ValueError, one line) a local model folder without config.json, before anything
    reads it: transformers then asks for a `model_type` in the missing file, vLLM for a hub id or
    a folder in an 8-line pydantic error. The config is read from `hf_config_path` when given,
    as vLLM and `model_facts` read it. A path that is no folder may be a hub name: not ours."""
    folder = Path(str(hf_config_path or model))
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise ValueError(f"model folder {folder} has no config.json: give the folder that holds "
                         "the model's config.json, tokenizer and weights, or a hub name")


def model_facts(model: str, *, tokenizer: str | None = None, revision: str | None = None,
                tokenizer_revision: str | None = None, hf_config_path: str | None = None,
                trust_remote_code: bool = False) -> ModelFacts:
    """Hidden size and config fingerprint (config.json) and tokenizer of a model, without
    loading its weights."""
    # deferred: transformers (only a bundle's check), torch (orca_method.bundle)
    from transformers import AutoConfig, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from orca_method.bundle import config_fingerprint

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        check_model_folder(model, hf_config_path)
        cfg = AutoConfig.from_pretrained(hf_config_path or model, revision=revision,
                                         trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any failure is one line for the user
        raise StartupError(f"cannot read the config of model {model!r}: "
                           f"{first_line(e)}") from None
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    hidden = getattr(text, "hidden_size", None)
    if not isinstance(hidden, int):
        raise StartupError(f"the config of model {model!r} has no hidden_size; cannot check the "
                           "bundle against it")
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer or model,
                                            revision=tokenizer_revision or revision,
                                            trust_remote_code=trust_remote_code)
        vocab = tok.get_vocab()
    except Exception as e:  # noqa: BLE001
        raise StartupError(f"cannot load the tokenizer of model {model!r}: "
                           f"{first_line(e)}") from None
    if len(vocab) < 2:  # transformers' stand-in when a folder has no tokenizer files
        raise StartupError(f"model {tokenizer or model!r} has no tokenizer (its vocabulary has "
                           f"{len(vocab)} token): are its tokenizer files (tokenizer.json, "
                           "tokenizer_config.json) missing? --tokenizer names another folder")
    return ModelFacts(hidden, vocab, token_bytes_from_tokenizer(tok), config_fingerprint(cfg))


def check_served(bundle: Any, facts: ModelFacts, model: str, *,
                 served_names: list[str] | None = None, force: bool = False) -> str | None:
    """Every check of a bundle against the model it is about to serve (at start and on reload):
    orca_method.bundle_checks.check_bundle, the one the offline tools run against their data;
    raises BundleError. Returns a note to print when `force` (--orca-force-model) let an
    identity mismatch through (name, config fingerprint, a bundle naming no tokenizer); a
    different tokenizer, hidden size or a bad table is refused always.
    """
    # deferred: torch (not needed by --check-vllm)
    from orca_method.bundle_checks import Target, check_bundle

    target = Target(model=model, served_names=tuple(served_names or ()),
                    hidden_size=facts.hidden_size, vocab=facts.vocab,
                    token_bytes=facts.token_bytes, config_fingerprint=facts.config,
                    needs_tokenizer=True)
    note = check_bundle(bundle, target, force=force)
    return None if note is None else f"--orca-force-model: serving anyway although {note}"


def check_bundle(bundle: Any, model: str, *, served_names: list[str] | None = None,
                 force: bool = False, **kw: Any) -> ModelFacts:
    """`check_served` against `model`'s facts (returned, for the checks of later reloads)."""
    from orca_method.bundle import BundleError  # deferred: torch (not needed by --check-vllm)

    facts = model_facts(model, **kw)
    try:
        note = check_served(bundle, facts, model, served_names=served_names, force=force)
    except BundleError as e:
        raise StartupError(str(e)) from None
    if note:
        print(f"{PROG}: warning: {note}", file=sys.stderr, flush=True)
    return facts


def serving_warnings(bundle: Bundle,
                     served: tuple[Generation, Mapping[str, float]] | None) -> list[str]:
    """One line each where the server generates otherwise than the bundle's calibration data
    was collected (`Bundle.collected_under`): another dtype (the probe reads other hidden states
    than it was fitted and lambda* certified on), another default temperature, top_p, top_k or
    min_p (a record from before top_k and min_p were recorded: sampled with neither, as the
    collector then did), other default sampling beside them (`served`'s second part: a penalty
    the model's generation config sets, which the collector leaves at vLLM's neutral values): a
    request that sets none makes other traces than the calibrated ones. Warnings, not refusals:
    an operator may serve another dtype knowingly, and a request may set its own sampling.
    Nothing to compare (a bundle that records nothing, or a model config vLLM could not build:
    `served` None): no line."""
    recorded = bundle.collected_under()
    if recorded is None or served is None:
        return []
    generation, other = served
    lines = []
    if generation.dtype != recorded.dtype:
        lines.append(f"the bundle was calibrated on {bundle.model.name}'s hidden states computed "
                     f"in {recorded.dtype}, this server computes in {generation.dtype}: the probe "
                     "reads other hidden states than lambda* was certified on; serve with "
                     f"--dtype {recorded.dtype}")
    if not all(math.isclose(getattr(generation, n), getattr(recorded, n), abs_tol=1e-9)
               for n in recorded.SAMPLING):
        # a field whose 0 is none is named only where one side uses it
        shown = [n for n in recorded.SAMPLING if n not in recorded.NONE_AT_0
                 or getattr(generation, n) or getattr(recorded, n)]
        lines.append(f"the bundle was calibrated on traces sampled at "
                     f"{_sampling(recorded, shown)}; a request that sets none is sampled here at "
                     f"{_sampling(generation, shown)} (the model's generation_config.json, "
                     "--generation-config, --override-generation-config), so its traces are "
                     "not the calibrated ones")
    if other:
        lines.append("the bundle was calibrated on traces sampled with vLLM's neutral "
                     f"{', '.join(other)}; a request that sets none is sampled here with "
                     f"{', '.join(f'{k} {v:g}' for k, v in other.items())} (the model's "
                     "generation_config.json, --override-generation-config), so its traces are "
                     "not the calibrated ones")
    return lines


def _sampling(g: Generation, names: list[str]) -> str:
    """`names` of `g`'s sampling in words, e.g. "temperature 0.6, top_p 0.95, no top_k"."""
    return ", ".join(f"no {n}" if n in g.NONE_AT_0 and not getattr(g, n)
                     else f"{n} {getattr(g, n):g}" for n in names)


def reload_note(bundle: Bundle, facts: ModelFacts, model: str,
                served: tuple[Generation, Mapping[str, float]] | None, *,
                served_names: list[str] | None = None, force: bool = False) -> str | None:
    """A reload's bundle against the served model (`check_served`, raising BundleError) and
    against what this server serves (`serving_warnings`, `served` read once at start): the
    note to log and answer, None if there is none."""
    note = check_served(bundle, facts, model, served_names=served_names, force=force)
    return "; ".join([*([note] if note else []), *serving_warnings(bundle, served)]) or None


def check_options(bundle: Bundle, *, delta: float | None, give_up_delta: float | None,
                  give_up_policy: GiveUpPolicy, effort_map: Mapping[str, str | float],
                  shift_alpha: float | None = None, shift_give_up_alpha: float | None = None,
                  vote_waves: tuple[int, ...] | None = None) -> None:
    """Refuse (BundleError, one line starting with the option) a bundle lacking what the
    options name: --orca-delta's lambda*, --orca-give-up-delta's mu*, a delta of
    --orca-effort-map, a give-up threshold certified for --orca-give-up-policy, a gate whose
    stop level (--orca-shift-alpha, else the bundle's) is above --orca-shift-give-up-alpha, or
    a consensus block certified for --orca-vote-waves."""
    from orca_method.bundle import BundleError  # deferred: torch (not needed by --check-vllm)

    if shift_give_up_alpha is not None and bundle.shift_gate is not None:
        alpha = bundle.shift_gate.alpha if shift_alpha is None else shift_alpha
        try:
            give_up_level(alpha, shift_give_up_alpha)
        except ValueError as e:
            source = "the bundle" if shift_alpha is None else "--orca-shift-alpha"
            raise BundleError(f"--orca-shift-give-up-alpha {shift_give_up_alpha:g}: {e} (the "
                              f"stop side's is {source}'s {alpha:g})") from None

    if delta is not None:
        try:
            bundle.lam(delta)
        except BundleError as e:
            raise BundleError(f"--orca-delta {delta:g}: {e}") from None
    if give_up_delta is not None:  # every request gives up with it
        try:
            bundle.mu(give_up_delta)
        except BundleError as e:
            raise BundleError(f"--orca-give-up-delta {give_up_delta:g}: {e}") from None
    try:
        check_effort_map(effort_map, bundle)
    except BundleError as e:
        raise BundleError(f"--orca-effort-map: {e}") from None
    check_give_up_policy(bundle, give_up_policy)
    check_vote_waves(bundle, vote_waves)


def check_give_up_policy(bundle: Bundle, policy: GiveUpPolicy) -> None:
    """A two-sided bundle's mu* is served only under the give-up policy it was certified for.

    Each policy has its own give-up loss (orca_method.give_up.give_up_losses): under MESSAGE a
    given-up request answers nothing, and GUESS's loss does not bound that cost (docs/METHOD.md
    section 9, "The guarantee per give-up policy"); the other way round the guarantee holds but
    the bundle's table, and what the live audit and `audit-report` measure, are another policy's.
    A one-sided bundle never gives up: any policy."""
    from orca_method.bundle import BundleError  # deferred: torch (not needed by --check-vllm)

    if bundle.give_up is None or bundle.give_up.policy == policy:
        return
    certified = bundle.give_up.policy
    raise BundleError(f"--orca-give-up-policy {policy}: the bundle's give-up threshold mu* was "
                      f"certified for give-up policy '{certified}', not '{policy}', and each has "
                      f"its own give-up loss (docs/METHOD.md section 9); serve it with "
                      f"--orca-give-up-policy {certified}, or recalibrate with "
                      f"calibrate.give_up.policy: {policy}")


def check_vote_waves(bundle: Bundle, waves: tuple[int, ...] | None) -> None:
    """`orca.samples` is served only in the launch schedule its t was certified for.

    A wave that is launched only once the vote before it is unsettled changes when the group's
    samples finish, so a t certified for one schedule says nothing of another (docs/METHOD.md
    section 14, "Waves"). The operator names the schedule (`waves`, None: all at once) and the
    bundle's consensus block must carry that one; a bundle without the block serves no
    `orca.samples` at all: any schedule."""
    from orca_method.bundle import BundleError  # deferred: torch (not needed by --check-vllm)

    if bundle.consensus is None:
        return
    certified = bundle.consensus.waves
    if (None if certified is None else tuple(certified)) == waves:
        return
    have = "all at once" if certified is None else f"in waves {format_waves(certified)}"
    fix = ("serve it without --orca-vote-waves" if certified is None else
           f"serve it with --orca-vote-waves {format_waves(certified)}")
    asked = "all at once" if waves is None else format_waves(waves)
    raise BundleError(f"--orca-vote-waves {asked}: the bundle's consensus margin t was certified "
                      f"for samples launched {have}, and t holds for that schedule only "
                      f"(docs/METHOD.md section 14); {fix}, or recalibrate with "
                      f"calibrate.consensus.waves")
