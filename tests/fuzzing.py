"""Fuzzing targets shared by tests/test_fuzz_inputs.py (bounded) and scripts/fuzz_inputs.py.

Each target is a hypothesis strategy of inputs plus a `check_*` function that raises
`AssertionError` (or lets an unexpected exception escape) when a property is violated:

* bundle loader: raw bytes and structured mutations of valid bundles. `load_bundle` must raise
  `BundleError` or return a bundle, and it must accept exactly what the independent oracle
  `bundle_violation` (written from the documented format, not from the loader) calls valid.
* segmenter: `Segmenter`/`TokenTable` on arbitrary token streams. Steps must partition the
  counted tokens in order, the counter-only online protocol (what the plugin runs) must agree
  with the offline `segment()` that record mode and calibration use, and both must equal a
  text-level reference written from the rules in steps.py's docstring.
* trajectory reader: our directory format and research pickles with one corruption. Reading
  everything must raise `TrajectoryError` or give data the oracle `read_violation` accepts.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import itertools
import json
import math
import pickle
import re
import shutil
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from orca_method.bundle import (
    Bundle,
    BundleError,
    LTTRow,
    LTTTable,
    ModelIdentity,
    ProbeBlock,
    Segmentation,
    ThinkTags,
    encode_weights,
    load_bundle,
    save_bundle,
    tokenizer_fingerprint,
)
from orca_method.probe import Probe, ProbeSpec
from orca_method.steps import CLOSE, MERGE, NONE, STEP, STEP_PREV, Segmenter, TokenTable, segment
from orca_method.trajectories import TrajectoryError, TrajectorySet, TrajectoryWriter, import_pickle

def one_line_error(e: BaseException) -> None:
    msg = str(e)
    assert msg and "\n" not in msg, f"error message is not one line: {msg!r}"


# =========================================================================== bundle loader

DIM = 6
SPECS = [ProbeSpec(dim=DIM), ProbeSpec(dim=DIM, kind="qk", d_h=3),
         ProbeSpec(dim=DIM, kind="qk", d_h=2, shared_qk=True, norm="ln"),
         ProbeSpec(dim=DIM, kind="qk", d_h=2, mlp=True, eta_mode="input"),
         ProbeSpec(dim=DIM, norm="ln_res"), ProbeSpec(dim=DIM, online=False)]


@cache
def valid_bundles() -> tuple[str, ...]:
    """Sealed valid bundles (JSON text), one per probe variant, with varied optional blocks."""
    out = []
    for i, spec in enumerate(SPECS):
        probe = Probe(spec, seed=i)
        b = Bundle(
            schema_version=1, orca_serve_version="0.1.0",
            model=ModelIdentity(name="tiny", hidden_size=DIM,
                                tokenizer_fingerprint=tokenizer_fingerprint({"a": 0}) if i % 2
                                else None),
            segmentation=Segmentation(keywords=["wait", "but"]) if i % 3 == 1 else Segmentation(),
            think=ThinkTags(enabled=i != 2),
            probe=ProbeBlock(spec=dataclasses.asdict(spec), weights=encode_weights(probe),
                             eta=probe.params["log_eta"].exp().item()),
            window=1 + i,
            ltt=LTTTable(epsilon=0.05, n_cal=50, grid_size=101, rows=[
                LTTRow(delta=0.05, lam=None, risk=0.0, pvalue=1.0, savings=0.0),
                LTTRow(delta=0.1, lam=0.8, risk=0.04, pvalue=0.01, savings=0.3,
                       token_savings=0.25)]),
            default_delta=0.1, provenance={"fuzz": i})
        with tempfile.TemporaryDirectory(prefix="orca-fuzz-") as tmp:
            path = Path(tmp) / f"valid-{i}.json"
            save_bundle(b, path)
            out.append(path.read_text())
    return tuple(out)


def checksum(data: dict) -> str:
    body = {k: v for k, v in data.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# -- the oracle: what the format documentation says a valid bundle is ----------------------

_B64 = re.compile(r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _in01(v: Any, open_: bool = False) -> bool:
    return _is_num(v) and ((0 < v < 1) if open_ else (0 <= v <= 1))


def _nonempty_str(v: Any) -> bool:
    return isinstance(v, str) and len(v) > 0


def _keys(d: Any, allowed: set[str], required: set[str] = frozenset()) -> bool:
    return isinstance(d, dict) and required <= set(d) <= allowed


_SPEC_CHOICES = {"kind": ("noqk", "qk"), "norm": ("none", "ln", "ln_res"),
                 "eta_mode": ("fixed", "input")}


def _spec_violation(s: Any) -> str | None:
    if not _keys(s, {f.name for f in dataclasses.fields(ProbeSpec)}, {"dim"}):
        return "spec keys"
    s = {"kind": "noqk", "d_h": None, "shared_qk": False, "norm": "none", "eta_mode": "fixed",
         "mlp": False, "online": True, **s}
    if not (_is_int(s["dim"]) and s["dim"] >= 1):
        return "spec dim"
    for k, choices in _SPEC_CHOICES.items():
        if not (isinstance(s[k], str) and s[k] in choices):
            return f"spec {k}"
    if not all(isinstance(s[k], bool) for k in ("shared_qk", "mlp", "online")):
        return "spec flags"
    if s["d_h"] is not None and not _is_int(s["d_h"]):
        return "spec d_h type"
    if s["kind"] == "qk" and not (s["d_h"] is not None and s["d_h"] >= 1):
        return "qk without d_h"
    if s["kind"] == "noqk" and (s["d_h"] is not None or s["shared_qk"]):
        return "noqk with d_h/shared"
    if s["mlp"] and s["norm"] != "none":
        return "mlp with norm"
    ln_eps, gelu = s.get("ln_eps", 1e-5), s.get("gelu", "erf")
    if not (_is_num(ln_eps) and ln_eps > 0
            and isinstance(gelu, str) and gelu in ("erf", "tanh")):
        return "spec ln_eps/gelu"
    if not s["online"] and (s["kind"], s["norm"], s["eta_mode"], s["mlp"]) != (
            "noqk", "none", "fixed", False):
        return "static not plain"
    return None


def _weights_violation(w: Any, spec: dict) -> str | None:
    if not isinstance(w, str) or not _B64.fullmatch(w):
        return "weights not base64"
    try:
        tensors = st_load(base64.b64decode(w))
    except Exception:  # noqa: BLE001 - any parse failure means: not safetensors
        return "weights not safetensors"
    shapes = ProbeSpec(**spec).param_shapes()
    if set(tensors) != set(shapes):
        return "weight names"
    for k, shape in shapes.items():
        t = tensors[k]
        if tuple(t.shape) != shape or t.dtype != torch.float32 or not torch.isfinite(t).all():
            return f"weight {k}"
    return None


def _drift_violation(r: Any) -> str | None:
    """The optional drift reference: None, or paired lists of early means and stop steps."""
    if r is None:
        return None
    if not (_keys(r, {"k", "level", "n_cal", "early_mean", "stop_step"},
                  {"k", "level", "n_cal", "early_mean", "stop_step"})
            and _is_int(r["k"]) and r["k"] >= 1 and _is_int(r["n_cal"]) and r["n_cal"] >= 1
            and (r["level"] is None or _is_num(r["level"]))
            and isinstance(r["early_mean"], list) and r["early_mean"]
            and all(_is_num(x) for x in r["early_mean"])
            and isinstance(r["stop_step"], list)
            and len(r["stop_step"]) == len(r["early_mean"])
            and all(x is None or _is_int(x) for x in r["stop_step"])):
        return "drift"
    return None


def bundle_violation(d: Any) -> str | None:
    """Why `d` (parsed JSON) is not a valid schema-1 bundle, or None when it is."""
    top = {"schema_version", "orca_serve_version", "model", "segmentation", "think",
           "normalization", "probe", "window", "label_mode", "ltt", "default_delta",
           "provenance", "lambdas_from", "drift", "checksum"}
    if not _keys(d, top, {"schema_version", "orca_serve_version", "model", "probe", "ltt",
                          "default_delta"}):
        return "top-level keys"
    if d.get("checksum") != checksum(d):
        return "checksum"
    if not (_is_int(d["schema_version"]) and d["schema_version"] == 1):
        return "schema_version"
    if not isinstance(d["orca_serve_version"], str):
        return "orca_serve_version"
    m = d["model"]
    if not (_keys(m, {"name", "hidden_size", "tokenizer_fingerprint", "config_fingerprint"},
                  {"name", "hidden_size"})
            and _nonempty_str(m["name"]) and _is_int(m["hidden_size"]) and m["hidden_size"] > 0
            and (m.get("tokenizer_fingerprint") is None
                 or (isinstance(m["tokenizer_fingerprint"], str)
                     and _HEX64.fullmatch(m["tokenizer_fingerprint"])))):
        return "model"
    cfg = m.get("config_fingerprint")
    sizes = ("hidden_size", "num_layers", "vocab_size")
    if cfg is not None and not (_keys(cfg, {"architecture", *sizes}, {"architecture", *sizes})
                                and _nonempty_str(cfg["architecture"])
                                and all(_is_int(cfg[k]) and cfg[k] > 0 for k in sizes)):
        return "model"
    seg = d.get("segmentation", {})
    kw = seg.get("keywords") if isinstance(seg, dict) else None
    cut = seg.get("max_step_tokens") if isinstance(seg, dict) else None
    if not (_keys(seg, {"delimiter", "keywords", "keyword_match", "max_step_tokens"})
            and _nonempty_str(seg.get("delimiter", "\n\n"))
            and (kw is None or (isinstance(kw, list) and kw and all(map(_nonempty_str, kw))))
            and seg.get("keyword_match", "word") in ("word", "substring")
            and (cut is None or (_is_int(cut) and cut >= 1))):
        return "segmentation"
    if not isinstance(d.get("think", {}), dict):
        return "think"
    th = {"enabled": True, "start": "<think>", "end": "</think>", "force_text": "\n</think>\n\n",
          **d.get("think", {})}
    if not (set(th) <= {"enabled", "start", "end", "force_text"}
            and isinstance(th["enabled"], bool) and _nonempty_str(th["start"])
            and _nonempty_str(th["end"]) and isinstance(th["force_text"], str)
            and (not th["enabled"] or (th["start"] != th["end"]
                                       and th["end"] in th["force_text"]))):
        return "think"
    if d.get("normalization", "token-l2") not in ("token-l2", "step-l2", "none"):
        return "normalization"
    p = d["probe"]
    if not (_keys(p, {"spec", "weights", "eta"}, {"spec", "weights", "eta"})
            and _is_num(p["eta"]) and p["eta"] > 0):
        return "probe block"
    if (why := _spec_violation(p["spec"])) is not None:
        return why
    if p["spec"]["dim"] != m["hidden_size"]:
        return "dim != hidden size"
    if (why := _weights_violation(p["weights"], p["spec"])) is not None:
        return why
    w = d.get("window", 10)
    if not (_is_int(w) and 1 <= w <= 10_000):
        return "window"
    if not _nonempty_str(d.get("label_mode", "supervised")):
        return "label_mode"
    if not isinstance(d.get("provenance", {}), dict):
        return "provenance"
    if not (d.get("lambdas_from") is None or isinstance(d["lambdas_from"], str)):
        return "lambdas_from"
    if (why := _drift_violation(d.get("drift"))) is not None:
        return why
    lt = d["ltt"]
    if not (_keys(lt, {"epsilon", "n_cal", "pvalue", "grid_size", "excluded_never_correct",
                       "rows"}, {"epsilon", "n_cal", "grid_size", "rows"})
            and _in01(lt["epsilon"], open_=True)
            and (lt["n_cal"] is None or (_is_int(lt["n_cal"]) and lt["n_cal"] >= 1))
            and lt.get("pvalue", "binomial") in ("binomial", "hb")
            and _is_int(lt["grid_size"]) and lt["grid_size"] >= 1
            and isinstance(lt.get("excluded_never_correct", True), bool)
            and isinstance(lt["rows"], list) and lt["rows"]):
        return "ltt"
    for r in lt["rows"]:
        if not (_keys(r, {"delta", "lam", "risk", "pvalue", "savings", "token_savings"},
                      {"delta", "lam", "risk", "pvalue", "savings"})
                and _in01(r["delta"], open_=True) and (r["lam"] is None or _in01(r["lam"]))
                and all(r[k] is None or _in01(r[k]) for k in ("risk", "pvalue", "savings"))
                and (r.get("token_savings") is None or _in01(r["token_savings"]))):
            return "ltt row"
    deltas = sorted(r["delta"] for r in lt["rows"])
    if any(b - a <= 1e-9 for a, b in itertools.pairwise(deltas)):
        return "duplicate delta"
    dd = d["default_delta"]
    if not (_in01(dd, open_=True) and any(abs(dd - x) <= 1e-9 for x in deltas)):
        return "default_delta"
    return None


def check_bundle_file(path: Path, *, weights_known_good: bool = False) -> None:
    """load_bundle(path) refuses with one BundleError line or accepts, agreeing with the oracle.

    A bundle the oracle accepts may still be refused for the probe's smoke test (extreme
    weights), but only when its weights are not those of a known good bundle.
    """
    raw = path.read_bytes()
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=lambda c: math.nan)
    except (ValueError, RecursionError):
        data = None
    why = bundle_violation(data) if not _has_nonfinite(data) else "non-finite number"
    try:
        bundle = load_bundle(path)
    except BundleError as e:
        one_line_error(e)
        assert why is not None or (not weights_known_good and "non-finite scores" in str(e)), \
            f"a valid bundle was refused: {e}"
        return
    assert why is None, f"an invalid bundle was accepted ({why})"
    # accepted: exactly what the file says, nothing coerced, and it round-trips
    dumped = bundle.model_dump(mode="json")  # a closed set's member as its word
    for k, v in data.items():
        assert _same(dumped[k], v), f"field {k!r} was coerced: {v!r} -> {dumped[k]!r}"
    with tempfile.TemporaryDirectory(prefix="orca-fuzz-") as tmp:
        again = Path(tmp) / "roundtrip.json"
        save_bundle(bundle, again)
        reloaded = load_bundle(again).model_dump()  # its checksum now covers the defaults too
    assert {**reloaded, "checksum": ""} == {**dumped, "checksum": ""}
    probe = bundle.load_probe()
    assert probe.spec.dim == bundle.model.hidden_size
    assert bundle.lam(bundle.default_delta) >= 0


def _same(a: Any, b: Any) -> bool:
    """Equal values of equal JSON types (1 and 1.0 count as the same number)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() >= b.keys() and all(_same(a[k], v) for k, v in b.items())
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return type(a) is type(b) and a == b or (_is_num(a) and _is_num(b) and a == b)


def _has_nonfinite(v: Any) -> bool:
    if isinstance(v, float):
        return not math.isfinite(v)
    if isinstance(v, dict):
        return any(map(_has_nonfinite, v.values()))
    if isinstance(v, list):
        return any(map(_has_nonfinite, v))
    return False


# -- strategies -----------------------------------------------------------------------------

_ODD_VALUES = [None, True, False, 0, 1, -1, 2, 0.0, -0.0, 0.5, 1.0, 1.5, -0.5, 1e-12, 1e308,
               10**30, 2**63, "", "x", "1", "0.1", "noqk", "qk", "\n", [], [1], {}, {"a": 1}]
_JSON_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" * 5000]


def _paths(v: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(v, dict):
        for k, x in v.items():
            out += _paths(x, (*prefix, k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            out += _paths(x, (*prefix, i))
    return out


def _get(d: Any, path: tuple) -> Any:
    for k in path:
        d = d[k]
    return d


def _weights_blob(spec: dict, mutate: str, seed: int) -> str:
    """base64 safetensors for `spec` with one defect (or none)."""
    shapes = ProbeSpec(**spec).param_shapes()
    gen = torch.Generator().manual_seed(seed)
    tensors = {k: torch.randn(s, generator=gen) * 0.1 for k, s in shapes.items()}
    name = sorted(tensors)[seed % len(tensors)]
    if mutate == "drop":
        tensors.pop(name)
    elif mutate == "extra":
        tensors["zz"] = torch.zeros(2)
    elif mutate == "shape":
        tensors[name] = torch.zeros(*tensors[name].shape, 2)
    elif mutate in ("float16", "float64", "int32", "bfloat16"):
        tensors[name] = tensors[name].to(getattr(torch, mutate))
    elif mutate in ("nan", "inf", "huge"):
        t = tensors[name].reshape(-1).clone()
        t[seed % max(t.numel(), 1) if t.numel() else 0] = {"nan": math.nan, "inf": math.inf,
                                                         "huge": 3e38}[mutate]
        tensors[name] = t.reshape(tensors[name].shape)
    return base64.b64encode(st_save(tensors)).decode()


@st.composite
def mutated_bundle(draw: st.DrawFn) -> tuple[bytes, bool]:
    """(file bytes, weights known good): a valid bundle with one field mutated, mostly resealed."""
    text = draw(st.sampled_from(valid_bundles()))
    d = json.loads(text)
    op = draw(st.sampled_from(["replace", "replace", "delete", "add", "weights", "weights_text",
                               "number", "spec", "none"]))
    good_weights = op not in ("weights", "weights_text")
    paths = [p for p in _paths(d) if p != ("checksum",)]
    raw_number = None
    if op in ("replace", "delete", "add", "number"):
        path = draw(st.sampled_from(paths))
        parent, key = _get(d, path[:-1]), path[-1]
        if op == "replace":
            parent[key] = draw(st.sampled_from(_ODD_VALUES) | st.floats(allow_nan=False,
                               allow_infinity=False) | st.integers() | st.text(max_size=5))
        elif op == "delete":
            if isinstance(parent, dict):
                del parent[key]
            else:
                parent.pop(key)
        elif op == "add":
            target = parent if isinstance(parent, dict) else d
            target[draw(st.sampled_from(["extra", "weights", "lam", "dim"]))] = 1
        else:
            raw_number = draw(st.sampled_from(_JSON_NUMBERS))
            parent[key] = "@@NUMBER@@"
    elif op == "spec":
        spec = d["probe"]["spec"]
        spec[draw(st.sampled_from(sorted(spec) + ["dim"]))] = draw(
            st.sampled_from(["qk", "mlp", "ln", "input", True, False, None, 0, 2, 3, DIM, 10**9]))
    elif op == "weights":
        spec = d["probe"]["spec"]
        if _spec_violation(spec) is None:
            d["probe"]["weights"] = _weights_blob(spec, draw(st.sampled_from(
                ["none", "drop", "extra", "shape", "float16", "float64", "int32", "bfloat16",
                 "nan", "inf", "huge"])), draw(st.integers(0, 99)))
    elif op == "weights_text":
        w = d["probe"]["weights"]
        i = draw(st.integers(0, len(w)))
        d["probe"]["weights"] = draw(st.sampled_from([
            w[:i], w[:i] + "!" + w[i:], w[:i] + "\n" + w[i:], w[:i] + "é" + w[i:],
            base64.b64encode(draw(st.binary(max_size=64))).decode(),
            base64.b64encode(base64.b64decode(w)[:i]).decode()]))
    seal = draw(st.sampled_from(["reseal"] * 8 + ["stale", "tamper"]))
    if seal == "reseal" and raw_number is None:
        d["checksum"] = checksum(d)
    elif seal == "tamper":
        d["checksum"] = "0" * 64
    text = json.dumps(d)
    if raw_number is not None:
        text = text.replace('"@@NUMBER@@"', raw_number)
    return text.encode(), good_weights


_json_leaf = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
json_values = st.recursive(_json_leaf, lambda c: st.lists(c, max_size=4)
                           | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=20)


@st.composite
def bundle_bytes(draw: st.DrawFn) -> bytes:
    """Arbitrary bytes, arbitrary JSON, and byte-level damage to a valid bundle."""
    kind = draw(st.sampled_from(["binary", "json", "damage", "truncate"]))
    if kind == "binary":
        return draw(st.binary(max_size=300))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    raw = bytearray(draw(st.sampled_from(valid_bundles())).encode())
    i = draw(st.integers(0, len(raw) - 1))
    if kind == "truncate":
        return bytes(raw[:i])
    raw[i] = draw(st.integers(0, 255))
    return bytes(raw)


def check_bundle_bytes(raw: bytes, good_weights: bool = False) -> None:
    with tempfile.TemporaryDirectory(prefix="orca-fuzz-") as tmp:
        path = Path(tmp) / "fuzz.json"
        path.write_bytes(raw)
        check_bundle_file(path, weights_known_good=good_weights)


# ============================================================================== segmenter

_PIECES = ["a", "b", " ", "\n", "\n\n", ".\n\n", "\n\nx", "x\n", " wait", "Wait", " but",
           "but\n\n", "é", "\n\n\n", "", "||", "|", "ab", "aa", "\xff"]
_DELIMS = ["\n\n", "\n", "ab", "aa", "||", "|a|"]


@st.composite
def segmenter_case(draw: st.DrawFn) -> dict[str, Any]:
    pieces = draw(st.lists(st.sampled_from(_PIECES), min_size=3, max_size=12))
    token_bytes = [p.encode("utf-8") if p != "\xff" else b"\xff" for p in pieces]
    think = draw(st.booleans())
    n = len(token_bytes)
    special = draw(st.permutations(range(n)))
    start_id, end_id = (special[0], special[1]) if think else (None, None)
    eos = frozenset(draw(st.lists(st.sampled_from(list(range(n))), max_size=2)))
    keywords = draw(st.none() | st.lists(st.sampled_from(["wait", "but", "a", "x y"]),
                                         min_size=1, max_size=2).map(tuple))
    table = TokenTable(token_bytes=tuple(token_bytes), delimiter=draw(
        st.sampled_from(_DELIMS)).encode(), keywords=keywords, think_enabled=think,
        start_id=start_id, end_id=end_id, eos_ids=eos)
    any_id = st.integers(-2, n + 2)
    prompt = draw(st.none() | st.lists(any_id, max_size=6))
    ids = draw(st.lists(any_id, max_size=60))
    return {"table": table, "prompt": prompt, "ids": ids}


def reference_steps(t: TokenTable, ids: list[int], prompt: list[int] | None) -> list[list[int]]:
    """The rules of steps.py's docstring applied to whole texts (no incremental state)."""
    if not t.think_enabled or not prompt:
        reasoning = True
    else:
        last = {tid: max((i for i, x in enumerate(prompt) if x == tid), default=-1)
                for tid in (t.start_id, t.end_id)}
        reasoning = not last[t.end_id] > last[t.start_id]
    phases: list[list[int]] = [[]] if reasoning else []
    for tid in ids:  # precedence: start tag, end tag, EOS (an id may be several of them)
        if t.think_enabled and tid == t.start_id:
            if not reasoning:
                reasoning = True
                phases.append([])
        elif t.think_enabled and tid == t.end_id:
            reasoning = False
        elif tid in t.eos_ids:
            break
        elif reasoning:
            phases[-1].append(tid)
    steps: list[list[int]] = []
    for phase in phases:
        steps += _phase_steps(t, phase)
    return steps


def _phase_steps(t: TokenTable, toks: list[int]) -> list[list[int]]:
    def tb(i: int) -> bytes:
        return t.token_bytes[i] if 0 <= i < len(t.token_bytes) else b""

    text = b"".join(tb(i) for i in toks)
    ends_at = np.cumsum([len(tb(i)) for i in toks])  # byte end of each token
    cut = set()
    pos = text.find(t.delimiter)
    while pos >= 0:
        end = pos + len(t.delimiter)
        cut.add(int(np.searchsorted(ends_at, end)))  # the token holding the occurrence's last byte
        pos = text.find(t.delimiter, end)
    sections, cur = [], []
    for j, tid in enumerate(toks):
        cur.append(tid)
        if j in cut:
            sections.append((cur, True))
            cur = []
    if cur:
        sections.append((cur, False))
    if t.keywords is None:
        return [s for s, _ in sections]
    kw = re.compile(r"\b(?:" + "|".join(map(re.escape, t.keywords)) + r")\b", re.IGNORECASE)
    steps: list[list[int]] = []
    for k, (sec, ended) in enumerate(sections):
        has = ended and kw.search(b"".join(map(tb, sec)).decode("utf-8", "replace"))
        if k > 0 and has:
            steps.append(sec)
        elif steps:
            steps[-1] = steps[-1] + sec
        else:
            steps.append(sec)
    return steps


def check_segmenter(case: dict[str, Any]) -> None:
    t, ids, prompt = case["table"], case["ids"], case["prompt"]
    offline = segment(t, ids, prompt)
    # the online protocol: counters only (as in the plugin), ops applied to id accumulators
    seg = Segmenter(t, prompt)
    rec = Segmenter(t, prompt, keep_ids=True)
    a: list[int] = []
    s: list[int] = []
    online: list[list[int]] = []
    counted_ids = []
    for tid in ids:
        counted, op = seg.feed(tid)
        assert rec.feed(tid) == (counted, op), "keep_ids changed the ops"
        assert op in (NONE, MERGE, STEP, STEP_PREV, CLOSE)
        if counted:
            s.append(tid)
            counted_ids.append(tid)
        if op == MERGE:
            a, s = a + s, []
        elif op == STEP:
            online.append(a + s)
            a, s = [], []
        elif op == STEP_PREV:
            online.append(a)
            a, s = s, []
        elif op == CLOSE:
            online.append(a + s)
            a, s = [], []
        assert seg.pending == len(a) + len(s) == rec.pending
        assert seg.counted_total == sum(map(len, online)) + seg.pending
    if a + s:
        online.append(a + s)
    assert all(online_step for online_step in online), "an empty step"
    assert [x for step in online for x in step] == counted_ids, "steps do not partition tokens"
    assert online == offline, "online op protocol disagrees with offline segment()"
    assert offline == reference_steps(t, ids, prompt), "segment() disagrees with the rules"


# ====================================================================== trajectory reader

TDIM = 4


def _problem(i: int, n: int) -> tuple[dict, np.ndarray]:
    rng = np.random.default_rng(i)
    return ({"id": f"p{i}", "split": ["train", "calibration", "test"][i % 3],
             "step_tokens": [2] * n, "labels": {"supervised": [0] * (n - 1) + [1]}},
            rng.standard_normal((n, TDIM)).astype(np.float32))


@cache
def valid_directory(dtype: str) -> dict[str, bytes]:
    with tempfile.TemporaryDirectory(prefix="orca-fuzz-") as tmp:
        path = Path(tmp) / f"valid-{dtype}"
        with TrajectoryWriter(path, TDIM, dtype) as w:
            for i, n in enumerate((3, 1, 4)):
                w.append(*_problem(i, n))
        return {f.name: f.read_bytes() for f in path.iterdir()}


_FIELD_VALUES = [None, -1, 0, 1, 2, 3, 4, 8, 1.5, "1", "p0", "p1", "train", "valid", True,
                 [], [0], [1, 0, 1], [0, 0, 0, 1], [2, 0, 1], [0.5, 0, 1], [None, 0, 1], {},
                 {"supervised": [0, 1]}, {"": [0, 0, 1]}, 10**20]


@st.composite
def corrupted_directory(draw: st.DrawFn) -> dict[str, bytes | None]:
    """The files of a valid directory with one corruption (None: file missing)."""
    files: dict[str, bytes | None] = dict(valid_directory(draw(st.sampled_from(
        ["float16", "float32"]))))
    name = draw(st.sampled_from(sorted(files)))
    op = draw(st.sampled_from(["field", "field", "field", "truncate", "flip", "append", "delete",
                               "nonfinite", "json"]))
    data = files[name]
    if op == "field" and name != "embeddings.bin":
        lines = data.decode().splitlines()
        li = draw(st.integers(0, len(lines) - 1)) if name == "problems.jsonl" else None
        obj = json.loads(lines[li]) if li is not None else json.loads(data)
        key = draw(st.sampled_from(sorted(obj) + ["labels.supervised", "extra_key"]))
        value = draw(st.sampled_from(_FIELD_VALUES))
        if key == "labels.supervised" and isinstance(obj.get("labels"), dict):
            obj["labels"]["supervised"] = value
        elif draw(st.booleans()) and key in obj:
            del obj[key]
        else:
            obj[key] = value
        if li is not None:
            lines[li] = json.dumps(obj)
            files[name] = ("\n".join(lines) + "\n").encode()
        else:
            files[name] = json.dumps(obj).encode()
    elif op == "truncate":
        files[name] = data[:draw(st.integers(0, max(len(data) - 1, 0)))]
    elif op == "flip" and data:
        b = bytearray(data)
        b[draw(st.integers(0, len(b) - 1))] = draw(st.integers(0, 255))
        files[name] = bytes(b)
    elif op == "append":
        files[name] = data + draw(st.binary(min_size=1, max_size=40))
    elif op == "delete":
        files[name] = None
    elif op == "nonfinite":
        info = json.loads(files["info.json"])
        item = np.dtype(info["dtype"]).itemsize
        emb = bytearray(files["embeddings.bin"])
        at = draw(st.integers(0, len(emb) // item - 1)) * item
        emb[at:at + item] = np.array([draw(st.sampled_from([np.nan, np.inf, -np.inf]))],
                                     dtype=info["dtype"]).tobytes()
        files["embeddings.bin"] = bytes(emb)
    elif op == "json":
        files[name] = json.dumps(draw(json_values)).encode()
    return files


def read_everything(ts: TrajectorySet) -> None:
    """What train/calibrate/evaluate read."""
    modes = ts.label_modes
    for i in range(len(ts)):
        ts.embeddings(i)
        for m in modes:
            ts.labels(i, m)
    for name in ("train", "calibration", "test"):
        ts.split(name)


_INFO_TYPES = {"format": str, "version": int, "dim": int, "dtype": str, "model": (str, type(None)),
               "normalization": str, "segmentation": (dict, type(None)),
               "source": (str, type(None)), "think": (dict, type(None)),
               "tokenizer_fingerprint": (str, type(None)), "model_config": (dict, type(None)),
               "labelling": (dict, type(None)), "collected_under": (dict, type(None))}


def read_violation(ts: TrajectorySet) -> str | None:
    """Is what a successful read returned genuinely valid data?"""
    info = ts.info
    if not (set(info) <= set(_INFO_TYPES) and all(isinstance(info.get(k), t) or k not in info
                                                  for k, t in _INFO_TYPES.items())):
        return "info fields"
    if (info["format"], info["version"], type(info["version"])) != ("orca-trajectories", 1, int) \
            or info["dtype"] not in ("float16", "float32") \
            or info["normalization"] not in ("token-l2", "step-l2", "none"):
        return "info values"
    lab = info.get("labelling")
    if lab is not None and not (set(lab) == {"suffix", "answer_tokens"} and lab["suffix"]
                                and isinstance(lab["suffix"], str)
                                and _is_int(lab["answer_tokens"]) and lab["answer_tokens"] >= 1):
        return "info labelling"
    ids = [p.id for p in ts.problems]
    if len(set(ids)) != len(ids) or not all(isinstance(x, str) and x for x in ids):
        return "ids"
    if not (_is_int(ts.dim) and ts.dim >= 1):
        return "dim"
    for i, p in enumerate(ts.problems):
        e = ts.embeddings(i)
        if e.shape != (p.n_steps, ts.dim) or p.n_steps < 1 or not np.isfinite(e).all():
            return f"embeddings of {p.id}"
        for m in ts.label_modes:
            lab = ts.labels(i, m)
            if lab.shape != (p.n_steps,) or not np.isin(lab, (0, 1)).all():
                return f"labels of {p.id}"
            if np.any(np.diff(lab) < 0):
                return "labels not cumulative"
        if p.split not in (None, "train", "calibration", "test"):
            return "split"
        if p.step_tokens is not None and (len(p.step_tokens) != p.n_steps
                                          or not all(_is_int(x) and x >= 1
                                                     for x in p.step_tokens)):
            return "step_tokens"
    return None


def check_directory(files: dict[str, bytes | None]) -> None:
    path = Path(tempfile.mkdtemp(prefix="orca-fuzz-"))
    try:
        for name, data in files.items():
            if data is not None:
                (path / name).write_bytes(data)
        _check_open(path, expect_same_as=files)
    finally:
        shutil.rmtree(path)


def _check_open(path: Path, expect_same_as: dict[str, bytes | None] | None = None) -> None:
    try:
        ts = TrajectorySet.open(path)
        read_everything(ts)
    except TrajectoryError as e:
        one_line_error(e)
        return
    why = read_violation(ts)
    assert why is None, f"invalid data was accepted ({why})"
    if expect_same_as is not None:  # the rows are the bytes of embeddings.bin, in order
        raw = expect_same_as["embeddings.bin"] or b""
        rows = np.frombuffer(raw, dtype=ts.info["dtype"]).reshape(-1, ts.dim)
        got = np.concatenate([ts.embeddings(i) for i in range(len(ts))] or [rows[:0]])
        assert np.array_equal(got, rows), "embeddings differ from the file"


def valid_pickle() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    problems = []
    for i, n in enumerate((12, 5, 3)):
        nb = -(-n // 5)
        problems.append({"step_embeddings": rng.standard_normal((n, TDIM)).astype(np.float32),
                         "step_labels": [j % 2 for j in range(nb)],
                         "step_labels_consistent": [1] * nb, "question": f"q{i}",
                         "unique_id": f"u{i}"})
    return {"model": "m", "embed_dim": TDIM, "batch_size": 5,
            "splits": {"train": [0], "calibration": [1], "test": [2]}, "problems": problems}


_PICKLE_VALUES = [None, 0, -1, 1, 5, 2.5, "5", True, [], [0], [0, 1], [2, 0, 1], [0.5, 1, 1],
                  [np.nan, 0, 1], ["1", "0", "1"], [[0], [1, 0]], {}, {"train": [0, 0]},
                  {"train": [7]}, {"train": [1.5]}, {"valid": [0]}, {"train": "0"},
                  np.zeros((0, TDIM)), np.zeros((3, TDIM + 1)), np.zeros(TDIM),
                  np.full((3, TDIM), np.nan), np.full((12, TDIM), np.inf),
                  np.zeros((5, TDIM), dtype=object), "text", 10**30]


@st.composite
def corrupted_pickle(draw: st.DrawFn) -> bytes:
    pkl = valid_pickle()
    op = draw(st.sampled_from(["top", "problem", "problem", "bytes", "whole"]))
    if op == "top":
        key = draw(st.sampled_from(["model", "embed_dim", "batch_size", "splits", "problems"]))
        if draw(st.booleans()):
            pkl.pop(key)
        else:
            pkl[key] = draw(st.sampled_from(_PICKLE_VALUES))
    elif op == "problem":
        raw = pkl["problems"][draw(st.integers(0, 2))]
        key = draw(st.sampled_from(["step_embeddings", "step_labels", "step_labels_consistent",
                                    "question", "unique_id"]))
        if draw(st.booleans()):
            raw.pop(key)
        else:
            raw[key] = draw(st.sampled_from(_PICKLE_VALUES))
    elif op == "whole":
        pkl = draw(st.sampled_from([[], {}, {"problems": 3}, {"problems": [1, 2]}, "x", None,
                                    {"problems": [{"step_embeddings": "abc"}]}]))
    data = pickle.dumps(pkl)
    if op == "bytes":
        i = draw(st.integers(0, len(data) - 1))
        data = draw(st.sampled_from([data[:i], data[:i] + bytes([draw(st.integers(0, 255))])
                                     + data[i + 1:]]))
    return data


def check_pickle(data: bytes) -> None:
    """Read in memory, then import to a directory and read that."""
    path = Path(tempfile.mkdtemp(prefix="orca-fuzz-"))
    try:
        (path / "x.pkl").write_bytes(data)
        _check_open(path / "x.pkl")
        try:
            out = import_pickle(path / "x.pkl", path / "imported", "float32")
        except TrajectoryError as e:
            one_line_error(e)
            return
        _check_open(out)
    finally:
        shutil.rmtree(path)
