"""A bundle checked against the model it is about to serve, without loading the model's weights
(its config.json and tokenizer: transformers' AutoConfig/AutoTokenizer, a local folder or a hub
name): at start, before vLLM is imported, and again on every hot reload (`check_served`).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orca_method.errors import first_line
from orca_method.steps import token_bytes_from_tokenizer
from orca_serve.checks.errors import PROG, StartupError

if TYPE_CHECKING:
    from orca_method.bundle import ConfigFingerprint


@dataclass(frozen=True)
class ModelFacts:
    """What the bundle checks need of a model, read without loading its weights."""

    hidden_size: int  # config.json
    vocab: dict[str, int]  # the tokenizer's token -> id
    token_bytes: list[bytes]  # each token id's bytes (orca_method.steps)
    config: ConfigFingerprint | None = None  # of config.json (None: it lacks one of its fields)


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
