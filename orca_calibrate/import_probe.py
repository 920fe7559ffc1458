"""Turn one of the authors' released probes (`probe.pt` + `lambdas.json`) into a bundle.

The authors released meta-trained TTT probes per model and label mode, each a PyTorch state dict
of their probe class with the lambda* of their own calibration keyed by delta (and usually the
run's `config.json` beside it). This module maps such a state dict onto `orca_method.probe`
(docs/METHOD.md section 8 lists what their settings are and why each maps as it does):

| their key (shape)                    | ours                     |
|--------------------------------------|--------------------------|
| `W0` [1, d_w], `b0` [1]              | `w` [d_w], `b` []        |
| `theta_Q.weight`, `theta_K.weight`   | `theta_q`, `theta_k` [d_h, d] (one `theta_q` if shared) |
| `W10` [d_w, 4d_w], `b10` [1, 4d_w]   | `w1` [4d_w, d_w] (transposed), `b1` [4d_w] |
| `W20` [4d_w, 1], `b20` [1]           | `w2` [4d_w], `b2` []     |
| `ln_weight`, `ln_bias` [d_w]         | `ln_gamma`, `ln_beta`    |
| `lr_weight` [1, d], `lr_bias` [1]    | `eta_a` [d], `eta_c` [] with `log_eta` = log(base_lr) |
| `log_eta` []                         | `log_eta`                |

and writes their serving settings into the bundle: a new step at every line containing "wait",
"Wait", "but" or "But" (verbatim, inside words too), steps cut into 500-token chunks, the mean of
the L2-normalised final-norm hidden states of each step's tokens ("token-l2": their embedding
script asks vLLM's pooling runner for per-token embeddings, which vLLM L2-normalises by default),
their smoothing window, LayerNorm epsilon 1e-6 and tanh GELU. Anything else is refused in one
line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from orca_calibrate.train import save_probe
from orca_method.answer_probes import SUPERVISED
from orca_method.bundle import (
    SCHEMA_VERSION,
    Bundle,
    ConfigFingerprint,
    LTTRow,
    LTTTable,
    ModelIdentity,
    ProbeBlock,
    Segmentation,
    config_fingerprint,
    encode_weights,
    save_bundle,
    tokenizer_fingerprint,
)
from orca_method.errors import first_line
from orca_method.ltt import DEFAULT_EPSILON
from orca_method.outcomes import KeywordMatch
from orca_method.probe import EtaMode, Gelu, InnerNorm, Kind, Probe, ProbeSpec
from orca_serve import __version__

# The authors' step rule and chunk size (their data preparation), and their LTT grid.
AUTHORS_KEYWORDS = ["wait", "Wait", "but", "But"]
AUTHORS_MAX_STEP_TOKENS = 500
AUTHORS_GRID = 10000
AUTHORS_LN_EPS = 1e-6
AUTHORS_BASE_LR = 0.01  # their default inner learning rate (used by input-dependent eta)
LAMBDAS_FROM = ("come from the authors' own calibration (their released lambdas.json: their "
                "model, data, sampling and labels); they are off-policy for any other sampling "
                "setup: recalibrate with `orca-calibrate calibrate` on your own trajectories")

KNOWN_KEYS = {"theta_K.weight", "theta_Q.weight", "W0", "b0", "W10", "b10", "W20", "b20",
              "log_eta", "lr_weight", "lr_bias", "ln_weight", "ln_bias"}
_FLAGS = ("no_kq", "use_ln", "use_residual", "share_kq", "use_mlp", "learnable_eta", "use_pca",
          "no_online_update")


class ProbeImportError(ValueError):
    """A released probe this importer cannot map exactly; the message says why."""


def _load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ProbeImportError(f"{path} not found") from None
    except Exception as e:  # noqa: BLE001 - any unreadable file: one line
        first = first_line(e)
        raise ProbeImportError(f"{path} is not a PyTorch state dict of tensors (their TTT "
                               f"probe.pt; the static probe.pkl is not supported): {first}") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ProbeImportError(f"{path} is not a state dict of tensors (their TTT probe.pt)")
    unknown = sorted(set(sd) - KNOWN_KEYS)
    if unknown:
        raise ProbeImportError(f"{path} has unknown keys {unknown[:5]}: not a layout of the "
                               "authors' TTT probe this importer knows")
    return {k: v.detach().float() for k, v in sd.items()}


def _read_config(path: Path | None) -> dict[str, Any]:
    if path is None or not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProbeImportError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ProbeImportError(f"{path} is not a JSON object (their run's config.json)")
    return cfg


def _need(sd: dict[str, torch.Tensor], key: str, shape: tuple[int, ...]) -> torch.Tensor:
    if key not in sd:
        raise ProbeImportError(f"the probe lacks {key!r}, which its other keys require")
    t = sd[key]
    if tuple(t.shape) != shape:
        raise ProbeImportError(f"{key!r} has shape {tuple(t.shape)}, expected {shape}")
    if not torch.isfinite(t).all():
        raise ProbeImportError(f"{key!r} contains NaN or inf")
    return t


def authors_probe(sd: dict[str, torch.Tensor], config: dict[str, Any]) -> Probe:
    """Our probe computing exactly what their probe computes, from their state dict.

    The state dict decides the structure; `config` (their run's config.json, may be empty) adds
    what keys cannot show (LayerNorm with or without residual, base_lr) and must agree with them.
    """
    flags = {k: bool(config.get(k, False)) for k in _FLAGS}
    if flags["use_pca"]:
        raise ProbeImportError("probes with PCA preprocessing (use_pca, a fitted scaler + PCA "
                               "in pca.pkl) are not supported")
    has_k, has_q = "theta_K.weight" in sd, "theta_Q.weight" in sd
    if has_k != has_q:
        raise ProbeImportError("the probe has only one of theta_K/theta_Q: unknown layout")
    mlp, ln, eta_input = "W10" in sd, "ln_weight" in sd, "lr_weight" in sd
    for flag, present, what in (("no_kq", not has_k, "theta_K/theta_Q"),
                                ("use_mlp", mlp, "W10"), ("use_ln", ln, "ln_weight"),
                                ("learnable_eta", eta_input, "lr_weight")):
        if config and flag in config and flags[flag] != present:
            raise ProbeImportError(f"config.json says {flag}={flags[flag]} but the state dict "
                                   f"{'has' if present != (flag == 'no_kq') else 'lacks'} {what}")
    if ln and "use_residual" not in config:
        raise ProbeImportError("a LayerNorm probe needs its config.json (use_residual tells "
                               "ln from ln_res); pass --config")
    if mlp and ln:
        raise ProbeImportError("an MLP probe with LayerNorm is not a layout the authors train")
    if has_k:
        d_h, dim = sd["theta_K.weight"].shape if sd["theta_K.weight"].dim() == 2 else (0, 0)
        shared = (flags["share_kq"] if "share_kq" in config
                  else torch.equal(sd["theta_K.weight"], sd["theta_Q.weight"]))
    else:
        ref = sd.get("W10") if mlp else sd.get("W0")
        if ref is None or ref.dim() != 2:
            raise ProbeImportError("the probe has neither W0 nor W10 of rank 2: unknown layout")
        dim, d_h, shared = (ref.shape[0] if mlp else ref.shape[1]), None, False
    if flags["no_online_update"] and (has_k or mlp or ln or eta_input):
        raise ProbeImportError("a probe without online updates is supported only as the plain "
                               "linear no-QK probe")
    try:
        norm = (InnerNorm.LN_RES if flags["use_residual"] else InnerNorm.LN) if ln \
            else InnerNorm.NONE
        spec = ProbeSpec(dim=int(dim), kind=Kind.QK if has_k else Kind.NOQK,
                         d_h=int(d_h) if has_k else None, shared_qk=bool(shared), norm=norm,
                         eta_mode=EtaMode.INPUT if eta_input else EtaMode.FIXED, mlp=mlp,
                         online=not flags["no_online_update"], ln_eps=AUTHORS_LN_EPS,
                         gelu=Gelu.TANH)
    except ValueError as e:
        raise ProbeImportError(f"unsupported probe layout: {e}") from None
    d, dw, h = spec.dim, spec.d_w, spec.hidden
    ours: dict[str, torch.Tensor] = {}
    if has_k:
        ours["theta_q"] = _need(sd, "theta_Q.weight", (dw, d))
        if not shared:
            ours["theta_k"] = _need(sd, "theta_K.weight", (dw, d))
        elif not torch.equal(sd["theta_K.weight"], sd["theta_Q.weight"]):
            raise ProbeImportError("config.json says share_kq but theta_K != theta_Q")
    if mlp:
        ours |= {"w1": _need(sd, "W10", (dw, h)).T.contiguous(),
                 "b1": _need(sd, "b10", (1, h)).reshape(h),
                 "w2": _need(sd, "W20", (h, 1)).reshape(h), "b2": _need(sd, "b20", (1,)).reshape(())}
    else:
        ours |= {"w": _need(sd, "W0", (1, dw)).reshape(dw), "b": _need(sd, "b0", (1,)).reshape(())}
    if ln:
        ours |= {"ln_gamma": _need(sd, "ln_weight", (dw,)), "ln_beta": _need(sd, "ln_bias", (dw,))}
    if eta_input:
        base_lr = float(config.get("base_lr", AUTHORS_BASE_LR))
        if not base_lr > 0:
            raise ProbeImportError(f"config.json base_lr must be > 0, got {base_lr}")
        ours |= {"eta_a": _need(sd, "lr_weight", (1, d)).reshape(d),
                 "eta_c": _need(sd, "lr_bias", (1,)).reshape(()),
                 "log_eta": torch.tensor(math.log(base_lr))}
    else:
        ours["log_eta"] = _need(sd, "log_eta", ())
    probe = Probe(spec)
    if set(ours) != set(spec.param_shapes()):
        raise ProbeImportError(f"keys {sorted(ours)} do not make variant {spec.name}")
    with torch.no_grad():
        for k, v in ours.items():
            probe.params[k].copy_(v)
    return probe.requires_grad_(False)


def read_lambdas(path: Path) -> dict[float, float]:
    """Their lambdas.json: {"<delta>": lambda*}, deltas in (0, 1), lambda* in [0, 1]."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProbeImportError(f"{path} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProbeImportError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(raw, dict) or not raw:
        raise ProbeImportError(f"{path} must be a non-empty object delta -> lambda*")
    out = {}
    for k, v in raw.items():
        try:
            delta = float(k)
        except ValueError:
            raise ProbeImportError(f"{path}: key {k!r} is not a number (a delta)") from None
        if not 0 < delta < 1:
            raise ProbeImportError(f"{path}: delta {k} is not in (0, 1)")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            raise ProbeImportError(f"{path}: lambda* for delta {k} must be a number in [0, 1], "
                                   f"got {v!r}")
        out[delta] = float(v)
    return dict(sorted(out.items()))


def tokenizer_fingerprint_of(source: str) -> str:
    """The fingerprint (orca_method.bundle.tokenizer_fingerprint) of the tokenizer at `source`,
    a local model or tokenizer folder."""
    from transformers import AutoTokenizer  # deferred: transformers (only with a local tokenizer)
    from transformers.utils import logging as hf_logging  # deferred: transformers

    hf_logging.set_verbosity_error()
    try:
        vocab = AutoTokenizer.from_pretrained(source).get_vocab()
    except Exception as e:  # noqa: BLE001 - any unreadable tokenizer: one line
        raise ProbeImportError(f"cannot load the tokenizer at {source}: {first_line(e)}") from None
    return tokenizer_fingerprint(vocab)


def config_fingerprint_of(model: str) -> ConfigFingerprint | None:
    """The config fingerprint (orca_method.bundle.config_fingerprint) of `model` when it is a
    local folder with a config.json; None otherwise (a hub name is not fetched)."""
    if not (Path(model) / "config.json").is_file():
        return None
    from transformers import AutoConfig  # deferred: transformers (only with a local model)

    try:
        return config_fingerprint(AutoConfig.from_pretrained(model))
    except Exception as e:  # noqa: BLE001 - any unreadable config: one line
        raise ProbeImportError(f"cannot read the config of {model}: {first_line(e)}") from None


def import_probe(probe_pt: str | Path, lambdas: str | Path, model: str, out: str | Path, *,
                 tokenizer: str | None = None,
                 config: str | Path | None = None, window: int | None = None,
                 label_mode: str | None = None, epsilon: float = DEFAULT_EPSILON,
                 default_delta: float | None = None,
                 max_step_tokens: int | None = AUTHORS_MAX_STEP_TOKENS,
                 normalization: str = "token-l2", probe_out: str | Path | None = None) -> Bundle:
    """Write a bundle serving the released probe with the authors' settings; returns it.

    `config` defaults to the config.json beside probe.pt when there is one; `window` and
    `label_mode` default to that config's values (else 10 and "supervised"). `epsilon` is not in
    lambdas.json: 0.05 is what their scripts use. `normalization` must be what the probe was
    trained on: "token-l2" for embeddings made as their script makes them (docs/METHOD.md
    section 8); a pickle of the training data tells (TrajectorySet.open(pkl).info).
    `probe_out` also writes the probe as `orca-calibrate train` does, to recalibrate it on-policy.
    The bundle names `model` and the fingerprint of `tokenizer` (a local folder; default `model`
    when it is one), and `model`'s config fingerprint when it is a local folder. Without a local
    tokenizer it records none, and orca-serve then refuses the bundle unless
    `--orca-force-model` (a hub name is not fetched: the hub may be unreachable).
    """
    probe_pt = Path(probe_pt)
    cfg_path = Path(config) if config is not None else probe_pt.with_name("config.json")
    if config is not None and not cfg_path.is_file():
        raise ProbeImportError(f"{cfg_path} not found")
    cfg = _read_config(cfg_path)
    probe = authors_probe(_load_state_dict(probe_pt), cfg)
    label_mode = label_mode or str(cfg.get("label_mode") or SUPERVISED)
    if probe_out is not None:
        save_probe(probe, Path(probe_out), {"imported_probe": str(probe_pt),
                                            "label_mode": label_mode})
    lams = read_lambdas(Path(lambdas))
    deltas = list(lams)
    default = default_delta if default_delta is not None else (0.1 if 0.1 in lams else deltas[0])
    if default not in lams:
        raise ProbeImportError(f"default delta {default} is not in {lambdas} "
                               f"(it has {', '.join(f'{d:g}' for d in deltas)})")
    source = tokenizer or (model if Path(model).is_dir() else None)
    fingerprint = None if source is None else tokenizer_fingerprint_of(source)
    window = window or int(cfg.get("smooth_window") or 10)
    rows = [LTTRow(delta=d, lam=lam, risk=None, pvalue=None, savings=None)
            for d, lam in lams.items()]
    bundle = Bundle(
        schema_version=SCHEMA_VERSION, orca_serve_version=__version__,
        model=ModelIdentity(name=model, hidden_size=probe.spec.dim,
                            tokenizer_fingerprint=fingerprint,
                            config_fingerprint=config_fingerprint_of(model)),
        segmentation=Segmentation(delimiter="\n", keywords=AUTHORS_KEYWORDS,
                                  keyword_match=KeywordMatch.SUBSTRING, max_step_tokens=max_step_tokens),
        normalization=normalization,
        probe=ProbeBlock(spec=json.loads(probe.spec.to_json()), weights=encode_weights(probe),
                         eta=probe.params["log_eta"].exp().item()),
        window=window, label_mode=label_mode,
        ltt=LTTTable(epsilon=epsilon, n_cal=None, grid_size=AUTHORS_GRID, rows=rows),
        default_delta=default,
        provenance={"imported_probe": str(probe_pt), "imported_lambdas": str(lambdas),
                    "imported_config": str(cfg_path) if cfg else None,
                    "authors_flags": {k: cfg[k] for k in (*_FLAGS, "d_hidden", "base_lr",
                                                          "smooth_window") if k in cfg}},
        lambdas_from=LAMBDAS_FROM)
    return save_bundle(bundle, out)
