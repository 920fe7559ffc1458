"""Bundles for tests: a given probe and lambda table wrapped as the server and plugin load them.

Tests choose lambda* by hand (e.g. where a replayed score is known to cross), so every field
that LTT would fill is set to a fixed value consistent with it (`orca_method.bundle_checks.check_rows`:
no loss out of n_cal and its p-value, which the server's start-up check recomputes); only the
rows' (delta, lambda) and the model identity matter to what is tested.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from orca_method.bundle import (
    Bundle,
    LTTRow,
    LTTTable,
    ModelIdentity,
    ProbeBlock,
    encode_weights,
    save_bundle,
    tokenizer_fingerprint,
)
from orca_method.ltt import binomial_pvalues
from orca_method.probe import Probe


def tiny_bundle(probe: Probe, rows: Iterable[tuple[float, float | None]], *,
                vocab: Mapping[str, int] | None = None, window: int = 10, n_cal: int = 100,
                epsilon: float = 0.05, default_delta: float | None = None,
                provenance: dict[str, Any] | None = None, name: str = "tiny",
                hidden_size: int | None = None, **fields: Any) -> Bundle:
    """A bundle for the tiny test model serving `probe` with lambda* per delta from `rows`.

    `vocab` given: the bundle carries the tokenizer's fingerprint (checked at engine start);
    without it only the hidden size is checked. `default_delta` defaults to the first row's.
    `hidden_size` other than the probe's makes a bundle for another model; `fields` set other
    Bundle fields (segmentation, normalization, ...).
    """
    rows = list(rows)
    return Bundle(
        schema_version=1, orca_serve_version="0.1.0",
        model=ModelIdentity(name=name, hidden_size=hidden_size or probe.spec.dim,
                            tokenizer_fingerprint=None if vocab is None
                            else tokenizer_fingerprint(vocab)),
        probe=ProbeBlock(spec=json.loads(probe.spec.to_json()), weights=encode_weights(probe),
                         eta=0.01),
        window=window,
        ltt=LTTTable(epsilon=epsilon, n_cal=n_cal, grid_size=10,
                     rows=[LTTRow(delta=d, lam=lam, risk=0.0,
                                  pvalue=1.0 if lam is None else
                                  float(binomial_pvalues(np.asarray([0]), n_cal, d)[0]),
                                  savings=0.0 if lam is None else 0.3)
                           for d, lam in rows]),
        default_delta=rows[0][0] if default_delta is None else default_delta,
        provenance=provenance or {}, **fields)


def write_bundle(bundle: Bundle, path: Path) -> Path:
    """Save `bundle` at `path` (parents created); returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_bundle(bundle, path)
    return path
