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
    COLLECTED_UNDER,
    Bundle,
    GateReference,
    Generation,
    GiveUpBlock,
    GiveUpRow,
    GiveUpTable,
    GroupTable,
    LTTRow,
    LTTTable,
    ModelIdentity,
    ProbeBlock,
    encode_weights,
    gate_reference,
    save_bundle,
    schema_version_for,
    tokenizer_fingerprint,
)
from orca_method.ltt import binomial_pvalues
from orca_method.probe import Probe, ProbeSpec
from tests.tiny_model import HIDDEN


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
        ltt=ltt_table(rows, n_cal=n_cal, epsilon=epsilon),
        default_delta=rows[0][0] if default_delta is None else default_delta,
        provenance=provenance or {}, **fields)


def ltt_table(rows: Iterable[tuple[float, float | None]], *, n_cal: int = 100,
              epsilon: float = 0.05) -> LTTTable:
    """An LTT table of lambda* per delta from `rows`, its facts those of no loss in `n_cal`."""
    return LTTTable(epsilon=epsilon, n_cal=n_cal, grid_size=10,
                    rows=[LTTRow(delta=d, lam=lam, risk=0.0,
                                 pvalue=1.0 if lam is None else
                                 float(binomial_pvalues(np.asarray([0]), n_cal, d)[0]),
                                 savings=0.0 if lam is None else 0.3)
                          for d, lam in rows])


def give_up_table(rows: Iterable[tuple[float, float | None]], *,
                  n_cal: int = 100) -> GiveUpTable:
    """A give-up table of mu* per give-up delta from `rows`, facts of no loss in `n_cal`."""
    return GiveUpTable(epsilon=0.05, n_cal=n_cal, grid_size=1001,
                       rows=[GiveUpRow(delta=d, mu=mu, risk=0.0,
                                       pvalue=1.0 if mu is None else
                                       float(binomial_pvalues(np.asarray([0]), n_cal, d)[0]),
                                       give_up_rate=0.0 if mu is None else 0.5)
                             for d, mu in rows])


def with_groups(bundle: Bundle, groups: Mapping[str, Mapping[str, Any]]) -> Bundle:
    """`bundle` with a groups block: per name, `lam` rows (delta, lambda*) and optionally `mu`
    rows (give-up delta, mu*), each table's facts those of no loss in `n_cal` (default 60)."""
    block = {name: GroupTable(ltt=ltt_table(g["lam"], n_cal=g.get("n_cal", 60)),
                              give_up=None if g.get("mu") is None else
                              give_up_table(g["mu"], n_cal=g.get("n_cal", 60)))
             for name, g in groups.items()}
    return bundle.model_copy(update={"groups": block, "checksum": ""})


def write_bundle(bundle: Bundle, path: Path) -> Path:
    """Save `bundle` at `path` (parents created); returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_bundle(bundle, path)
    return path


# The live-server tests' table: delta -> lambda* (0.2 stops at once with bias 3, 0.1 only near
# 1, 0.05 never), and the give-up table: delta_2 -> mu* (the give-up probe scores 0.5 at every
# step, so 0.05 gives up at the first step, 0.02 never).
DELTAS = {0.05: None, 0.1: 0.99, 0.2: 0.5}
GIVE_UP_DELTAS = {0.02: None, 0.05: 0.6}
CAUTIOUS = "cautious"  # the gated bundle's one group (`orca.group`): never stops early


def far_gate(hidden: int, n: int = 39) -> GateReference:
    """A shift gate fitted on features clustered tightly around one axis: any real step
    embedding is far from them, so the gate flags every request it runs for (p = 1 / (n + 1))."""
    rng = np.random.default_rng(0)
    centre = np.zeros(hidden)
    centre[0] = 1.0
    return gate_reference(centre + 0.01 * rng.normal(size=(n + 1, hidden)),
                          centre + 0.01 * rng.normal(size=(n, hidden)), steps=1, alpha=0.05,
                          rank=4)


def make_bundle(path: Path, model_dir: Path, *, hidden: int = HIDDEN, bias: float = 3.0,
                gate: bool = False, collected_under: Generation | None = None) -> Path:
    """The tiny model's two-sided bundle with lambda* from DELTAS and a constant probe bias
    (scores sit near sigmoid(bias) whatever the hidden state, so which deltas stop is known),
    and mu* from GIVE_UP_DELTAS (default 0.05); with `gate`, `far_gate`'s shift gate and a
    group CAUTIOUS whose table never stops (and which has no mu*: never gives up); with
    `collected_under`, that record of its (fictitious) calibration data's conditions."""
    from transformers import AutoTokenizer

    probe = Probe(ProbeSpec(dim=hidden), seed=0)
    probe.params["b"].data.fill_(bias)
    vocab = AutoTokenizer.from_pretrained(str(model_dir)).get_vocab()
    one_sided = tiny_bundle(probe, DELTAS.items(), vocab=vocab, window=3, name=model_dir.name,
                            default_delta=0.2, provenance={"test": "test_server", **(
                                {} if collected_under is None
                                else {COLLECTED_UNDER: collected_under.record()})})
    two_sided = with_give_up(one_sided, GIVE_UP_DELTAS.items(), default_delta=0.05)
    if gate:
        two_sided = with_groups(two_sided.model_copy(update={"shift_gate": far_gate(hidden)}),
                                {CAUTIOUS: {"lam": [(d, None) for d in DELTAS]}})
    return write_bundle(two_sided, path)


# A four-token vocabulary and an 8-wide probe: bundles for the loader's and checks' unit tests.
SMALL_VOCAB = {"a": 0, "b": 1, "<think>": 2, "</think>": 3}


def small_bundle(dim: int = 8, spec: ProbeSpec | None = None) -> Bundle:
    """A valid bundle (delta 0.05 never stops, 0.1 at lambda 0.8) for unit tests, no model."""
    return tiny_bundle(Probe(spec or ProbeSpec(dim=dim), seed=0), [(0.05, None), (0.1, 0.8)],
                       vocab=SMALL_VOCAB, default_delta=0.1)


def with_give_up(bundle: Bundle, rows: Iterable[tuple[float, float | None]], *,
                 bias: float = 0.0, window: int = 1, n_cal: int = 100,
                 default_delta: float | None = None) -> Bundle:
    """`bundle` made two-sided (schema version 2): a static give-up probe whose score is
    sigmoid(bias) whatever the step (so which give-up deltas give up is known) and mu* per
    give-up delta from `rows`, with facts consistent with no loss out of `n_cal`."""
    probe = Probe(ProbeSpec(dim=bundle.model.hidden_size, online=False), seed=0)
    probe.params["w"].data.zero_()
    probe.params["b"].data.fill_(bias)
    rows = list(rows)
    block = GiveUpBlock(
        probe=ProbeBlock(spec=json.loads(probe.spec.to_json()), weights=encode_weights(probe),
                         eta=0.01),
        window=window, label_mode="supervised",
        default_delta=rows[0][0] if default_delta is None else default_delta,
        ltt=give_up_table(rows, n_cal=n_cal))
    return bundle.model_copy(update={"schema_version": schema_version_for(True),
                                     "give_up": block, "checksum": ""})


def with_saturated_give_up(bundle: Bundle) -> Bundle:
    """`bundle` (made two-sided first if it is not: give-up probe bias 1) with its give-up
    probe's weights x 1e30, unsealed: finite, so the loader's smoke test passes, but every
    give-up score is 0 or 1 (the damage issue 38 found accepted; the stop probe's is refused)."""
    if bundle.give_up is None:
        bundle = with_give_up(bundle, [(0.05, None)], bias=1.0)
    probe = bundle.load_give_up_probe()
    for name, p in probe.params.items():
        if name != "log_eta":  # eta stays a number: only the scores saturate
            p.data.mul_(1e30)
    block = bundle.give_up.probe.model_copy(update={"weights": encode_weights(probe)})
    return bundle.model_copy(update={
        "give_up": bundle.give_up.model_copy(update={"probe": block}), "checksum": ""})


def with_consensus(bundle: Bundle, *, samples: int = 4, weighting: str = "count",
                   delta_vote: float = 0.1, n_cal: int = 60,
                   waves: list[int] | None = None, cap_max: float | None = None) -> Bundle:
    """`bundle` with a consensus block certified by LTT (orca_method/consensus_ltt.py) on `n_cal`
    synthetic groups of `samples` whose samples all agree and finish one after another: no
    margin t can err on them, so every row certifies t* = 0 (the first finished sample
    decides), the fastest settle, which makes aborts certain in the serving tests. With
    `cap_max`, the two-parameter rule (version 3), its path cut after its caps (cap_max / 2 and
    cap_max at `first_t`, where no lone sample settles by the margin): t* = first_t,
    c* = cap_max."""
    from orca_method.consensus import (
        DEFAULT_GRID_SIZE,
        Group,
        block_version,
        confident_path,
        launched,
    )
    from orca_method.consensus_ltt import calibrate_consensus
    from orca_method.bundle import ConfidentPath, ConsensusBlock, ConsensusRow

    finish = np.arange(1.0, samples + 1)
    groups = [Group(finish=finish, answers=("7",) * samples, weights=np.ones(samples),
                    reference="7", stop_tokens=finish) for _ in range(n_cal)]
    groups = launched(groups, waves)  # `waves`: certified for that launch schedule
    grid, caps = ((None, None) if cap_max is None else
                  confident_path(samples, cap_step=cap_max / 2, cap_max=cap_max))
    if caps is not None:  # the path up to its last cap: t* stays first_t (nothing below it)
        grid, caps = grid[:int(np.argmax(caps)) + 1], caps[:int(np.argmax(caps)) + 1]
    rows = []
    for d in bundle.deltas():
        (r,) = calibrate_consensus(groups, [delta_vote], grid=grid, caps=caps)
        rows.append(ConsensusRow(delta=d, delta_vote=r.delta_vote, t=r.t, risk=r.risk,
                                 pvalue=r.pvalue, token_savings=r.token_savings,
                                 confident_tokens=r.cap))
    block = ConsensusBlock(version=block_version(waves, cap_max is not None), samples=samples,
                           weighting=weighting, epsilon=0.05, n_cal=n_cal,
                           grid_size=DEFAULT_GRID_SIZE, rows=rows, waves=waves,
                           confident=None if cap_max is None else
                           ConfidentPath(step=cap_max / 2, max=cap_max))
    return bundle.model_copy(update={"consensus": block})
