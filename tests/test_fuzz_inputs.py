"""Bounded fuzzing of the three input readers (targets and oracles: tests/fuzzing.py).

Derandomized, so every run tries the same inputs; `scripts/fuzz_inputs.py` runs the same
targets for longer with fresh randomness.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from orca_calibrate.calibrate_cli import main as cli_main
from orca_method.trajectories import (
    TrajectoryError,
    TrajectorySet,
    TrajectoryWriter,
    import_pickle,
)
from tests import fuzzing

BOUNDED = settings(max_examples=300, derandomize=True, database=None, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@BOUNDED
@given(fuzzing.bundle_bytes())
def test_bundle_loader_on_bytes(raw: bytes) -> None:
    fuzzing.check_bundle_bytes(raw)


@BOUNDED
@given(fuzzing.mutated_bundle())
def test_bundle_loader_on_mutated_bundles(case: tuple[bytes, bool]) -> None:
    fuzzing.check_bundle_bytes(*case)


@BOUNDED
@given(fuzzing.segmenter_case())
def test_segmenter(case: dict) -> None:
    fuzzing.check_segmenter(case)


@BOUNDED
@given(fuzzing.corrupted_directory())
def test_trajectory_directory_reader(files: dict) -> None:
    fuzzing.check_directory(files)


@BOUNDED
@given(fuzzing.corrupted_pickle())
def test_research_pickle_reader(data: bytes) -> None:
    fuzzing.check_pickle(data)


def test_valid_inputs_are_accepted() -> None:
    """The oracles' baseline: the unmutated inputs load and pass every check."""
    for text in fuzzing.valid_bundles():
        fuzzing.check_bundle_bytes(text.encode(), good_weights=True)
    assert all(fuzzing.bundle_violation(json.loads(t)) is None for t in fuzzing.valid_bundles())
    fuzzing.check_directory(dict(fuzzing.valid_directory("float16")))
    fuzzing.check_pickle(pickle.dumps(fuzzing.valid_pickle()))


# -- what the fuzzer found in the trajectory reader, one regression test each ----------------

def _edit(path: Path, name: str, edit) -> None:
    (path / name).write_bytes(edit((path / name).read_bytes()))


def _info_field(**kw):
    return lambda b: json.dumps({**json.loads(b), **kw}).encode()


@pytest.mark.parametrize("name, edit, message", [
    ("info.json", _info_field(normalisation="none"), "unknown field.*normalisation"),
    ("info.json", _info_field(dtype=["float16"]), "dtype"),
    ("info.json", _info_field(version=True), "version True"),
    ("info.json", lambda b: b"\xff" + b, "not valid JSON"),
    ("problems.jsonl", lambda b: b.replace(b'"n_steps": 3', b'"n_steps": ' + b"9" * 5000),
     "not valid JSON"),
    ("problems.jsonl", lambda b: b.replace(b'"id": "p0"', b'"id": "\xff"'), "not valid JSON"),
])
def test_directory_defects_are_trajectory_errors(tmp_path, name, edit, message) -> None:
    path = tmp_path / "t"
    for f, data in fuzzing.valid_directory("float16").items():
        (path / f if path.exists() else (path.mkdir() or path / f)).write_bytes(data)
    _edit(path, name, edit)
    with pytest.raises(TrajectoryError, match=message):
        TrajectorySet.open(path)


def test_nonfinite_rows_are_refused_on_first_read(tmp_path, capsys) -> None:
    path = tmp_path / "t"
    with TrajectoryWriter(path, 4, "float16") as w:
        w.append({"id": "ok", "split": "train", "labels": {"supervised": [1]}}, np.ones((1, 4)))
        w.append({"id": "bad", "split": "train", "labels": {"supervised": [0, 1]}},
                 np.ones((2, 4)))
    emb = bytearray((path / "embeddings.bin").read_bytes())
    emb[-2:] = np.array([np.inf], dtype="<f2").tobytes()
    (path / "embeddings.bin").write_bytes(bytes(emb))
    ts = TrajectorySet.open(path)
    assert ts.embeddings(0).tolist() == [[1.0] * 4]
    with pytest.raises(TrajectoryError, match="'bad' .*non-finite"):
        ts.embeddings(1)
    code = cli_main(["train", "--data", str(path), "--probe", "static", "--out",
                     str(tmp_path / "p.safetensors")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "non-finite" in err, err


def _pickle_with(**problem0) -> dict:
    pkl = fuzzing.valid_pickle()
    pkl["problems"][0].update(problem0)
    return pkl


@pytest.mark.parametrize("pkl, message", [
    (_pickle_with(step_labels=[0.5, 1, 1]), "0/1"),  # was cast to 0
    (_pickle_with(step_labels=["1", "0", "1"]), "0/1"),  # was parsed as numbers
    (_pickle_with(step_labels=[256, 1, 1]), "0/1"),  # was wrapped to 0 by int8
    (_pickle_with(step_labels=[[0], [1, 0]]), "not a list of 0/1"),
    ({**fuzzing.valid_pickle(), "embed_dim": None,
      "problems": [*fuzzing.valid_pickle()["problems"][:2],
                   {"step_embeddings": np.zeros((3, 7))}]}, r"shape \(3, 7\)"),  # was accepted
    ({**fuzzing.valid_pickle(), "batch_size": 0}, "batch_size"),  # was ZeroDivisionError
    ({**fuzzing.valid_pickle(), "splits": {"train": [1.5]}}, "index"),  # was truncated to 1
    ({**fuzzing.valid_pickle(), "embed_dim": np.zeros((3, 5))}, "embed_dim"),  # message on 3 lines
    ({**fuzzing.valid_pickle(), "splits": np.zeros(0)}, "splits"),  # was an ambiguous truth value
    (_pickle_with(step_embeddings="abc"), "not a numeric"),
    ({"problems": [1, 2]}, "expected a dict with 'step_embeddings'"),
])
def test_research_pickle_defects_are_trajectory_errors(tmp_path, pkl, message) -> None:
    (tmp_path / "x.pkl").write_bytes(pickle.dumps(pkl))
    for read in (lambda: TrajectorySet.open(tmp_path / "x.pkl"),
                 lambda: import_pickle(tmp_path / "x.pkl", tmp_path / "out1"),
                 lambda: import_pickle(pkl, tmp_path / "out2")):
        with pytest.raises(TrajectoryError, match=message) as e:
            read()
        assert "\n" not in str(e.value)


def test_truncated_pickle(tmp_path) -> None:
    data = pickle.dumps(fuzzing.valid_pickle())
    (tmp_path / "x.pkl").write_bytes(data[:len(data) // 2])
    with pytest.raises(TrajectoryError, match="not a readable pickle.*truncated"):
        TrajectorySet.open(tmp_path / "x.pkl")
