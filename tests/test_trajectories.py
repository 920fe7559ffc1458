import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from orca_method.trajectories import (
    TrajectoryError,
    TrajectorySet,
    TrajectoryWriter,
    cumulative,
    expand_block_labels,
    import_pickle,
    set_splits,
    split_ids,
)

DIM = 8


def _problem(i: int, n: int, split: str | None = "train") -> tuple[dict, np.ndarray]:
    rng = np.random.default_rng(i)
    sup = [0] * (n // 2) + [1] * (n - n // 2)
    fields = {"id": f"p{i}", "prompt": f"q{i}", "answer": "42", "split": split,
              "family": "in-dist", "step_tokens": [3] * n, "step_answers": ["1"] * n,
              "final_answer": "42",
              "labels": {"supervised": sup, "consistent": [0, 1] * (n // 2) + [1] * (n % 2)}}
    return fields, rng.standard_normal((n, DIM)).astype(np.float32)


def _write(path: Path, sizes=(3, 5, 2), **kw) -> list[np.ndarray]:
    embs = []
    with TrajectoryWriter(path, DIM, **kw) as w:
        for i, n in enumerate(sizes):
            fields, emb = _problem(i, n)
            w.append(fields, emb)
            embs.append(emb)
    return embs


def test_cumulative():
    assert cumulative(np.array([0, 1, 0, 0, 1])).tolist() == [0, 1, 1, 1, 1]
    assert cumulative(np.array([0, 0])).dtype == np.int8


def test_roundtrip(tmp_path):
    embs = _write(tmp_path / "t", dtype="float32", model="m", normalization="none")
    ts = TrajectorySet.open(tmp_path / "t")
    assert len(ts) == 3 and ts.dim == DIM and ts.info["model"] == "m"
    assert ts.label_modes == ("consistent", "supervised")
    assert [p.offset for p in ts.problems] == [0, 3, 8]
    for i, emb in enumerate(embs):
        e = ts.embeddings(i)
        np.testing.assert_array_equal(e, emb)
        assert not e.flags.owndata and not e.flags.writeable  # a view of the memmap
    assert ts.labels(1, "consistent").tolist() == [0, 1, 1, 1, 1]
    assert ts.labels(1, "consistent").dtype == np.int8
    assert ts.problems[1].labels["consistent"] == [0, 1, 0, 1, 1]  # stored raw
    assert ts.split("train") == [0, 1, 2] and ts.split("test") == []
    assert (tmp_path / "t" / "embeddings.bin").stat().st_size == 10 * DIM * 4
    ts.check_finite()


def test_float16_default_and_missing_mode(tmp_path):
    embs = _write(tmp_path / "t")
    ts = TrajectorySet.open(tmp_path / "t")
    assert ts.embeddings(0).dtype == np.float16
    np.testing.assert_allclose(ts.embeddings(0), embs[0], rtol=1e-3, atol=1e-3)
    with pytest.raises(TrajectoryError, match=r"'p0'.*'judge'.*consistent.*supervised"):
        ts.labels(0, "judge")


def _rewrite_lines(path: Path, edit) -> None:
    lines = [json.loads(x) for x in (path / "problems.jsonl").read_text().splitlines()]
    edit(lines)
    (path / "problems.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def _edit_info(path: Path, **kw) -> None:
    info = json.loads((path / "info.json").read_text())
    (path / "info.json").write_text(json.dumps({**info, **kw}))


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


@pytest.mark.parametrize("corrupt, message", [
    (lambda p: os.remove(p / "embeddings.bin"), "missing embeddings.bin"),
    (lambda p: _edit_info(p, format="other"), "not an orca trajectory"),
    (lambda p: _edit_info(p, version=2), "version 2 is not supported"),
    (lambda p: _edit_info(p, dtype="int8"), "dtype"),
    (lambda p: _append(p / "embeddings.bin", b"\0" * 16), "TrajectoryWriter to repair"),
    (lambda p: os.truncate(p / "embeddings.bin", 16), "re-collect"),
    (lambda p: _rewrite_lines(p, lambda ls: ls[1].update(offset=4)), "contiguous"),
    (lambda p: _rewrite_lines(p, lambda ls: ls[1]["labels"].update(judge=[1])),
     "1 entries but n_steps is 5"),
    (lambda p: _rewrite_lines(p, lambda ls: ls[1]["labels"].update(judge=[2] * 5)), "only 0/1"),
    (lambda p: _rewrite_lines(p, lambda ls: ls[1].update(id="p0")), "duplicate problem id 'p0'"),
    (lambda p: _rewrite_lines(p, lambda ls: ls[1].update(spilt="train")), "unknown field"),
    (lambda p: _append(p / "problems.jsonl", b'{"id": "x"'), "incomplete"),
])
def test_validation_on_open(tmp_path, corrupt, message):
    _write(tmp_path / "t")
    corrupt(tmp_path / "t")
    with pytest.raises(TrajectoryError, match=message):
        TrajectorySet.open(tmp_path / "t")


def test_missing_directory(tmp_path):
    with pytest.raises(TrajectoryError, match="does not exist"):
        TrajectorySet.open(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TrajectoryError, match="missing info.json"):
        TrajectorySet.open(tmp_path / "empty")


def test_check_finite(tmp_path):
    _write(tmp_path / "t", dtype="float32")
    with open(tmp_path / "t" / "embeddings.bin", "r+b") as f:  # poke NaN into problem p1
        f.seek(4 * DIM * 4)
        f.write(np.float32(np.nan).tobytes())
    with pytest.raises(TrajectoryError, match="'p1'"):
        TrajectorySet.open(tmp_path / "t").check_finite()


def test_writer_resume_drops_incomplete_tail(tmp_path):
    path = tmp_path / "t"
    embs = _write(path)
    # A killed job: rows of a 4th problem without metadata, then a partial metadata line.
    with open(path / "embeddings.bin", "ab") as f:
        f.write(np.zeros((4, DIM), np.float16).tobytes()[:-3])
    with open(path / "problems.jsonl", "ab") as f:
        f.write(b'{"id": "p3", "n_st')
    with TrajectoryWriter(path, DIM) as w:
        assert w.ids == {"p0", "p1", "p2"}
        fields, emb = _problem(3, 4)
        w.append(fields, emb)
    ts = TrajectorySet.open(path)
    assert [p.id for p in ts.problems] == ["p0", "p1", "p2", "p3"]
    np.testing.assert_allclose(ts.embeddings(3), emb, atol=1e-3, rtol=1e-3)
    np.testing.assert_allclose(ts.embeddings(2), embs[2], atol=1e-3, rtol=1e-3)


def test_writer_resume_metadata_complete_but_more_rows(tmp_path):
    path = tmp_path / "t"
    _write(path, sizes=(2, 2))
    with open(path / "embeddings.bin", "ab") as f:
        f.write(np.ones((3, DIM), np.float16).tobytes())
    TrajectoryWriter(path, DIM).close()
    assert len(TrajectorySet.open(path)) == 2
    assert (path / "embeddings.bin").stat().st_size == 4 * DIM * 2


def test_writer_rejects(tmp_path):
    path = tmp_path / "t"
    _write(path)
    with pytest.raises(TrajectoryError, match="different settings"):
        TrajectoryWriter(path, DIM + 1)
    with pytest.raises(TrajectoryError, match="different settings"):
        TrajectoryWriter(path, DIM, normalization="none")
    with pytest.raises(TypeError, match="unknown info field"):
        TrajectoryWriter(tmp_path / "u", DIM, modle="x")
    fields, emb = _problem(9, 3)
    with TrajectoryWriter(path, DIM) as w:
        with pytest.raises(TrajectoryError, match="shape"):
            w.append(fields, emb[:, :4])
        with pytest.raises(TrajectoryError, match="already in"):
            w.append({**fields, "id": "p0"}, emb)
        with pytest.raises(TrajectoryError, match="NaN/inf"):
            w.append(fields, np.full((3, DIM), np.nan))
        with pytest.raises(TrajectoryError, match="65504"):
            w.append(fields, np.full((3, DIM), 1e6))
        with pytest.raises(TrajectoryError, match="'step_tokens' has 2 entries"):
            w.append({**fields, "step_tokens": [1, 2]}, emb)
        with pytest.raises(TrajectoryError, match="n_steps 2 but 3"):
            w.append({**fields, "n_steps": 2, "step_tokens": None, "step_answers": None,
                      "labels": {}}, emb)
        w.append({**fields, "labels": {"supervised": np.array([0, 1, 1])}}, emb)  # numpy ok
    assert len(TrajectorySet.open(path)) == 4


def test_set_splits(tmp_path):
    path = tmp_path / "t"
    _write(path)
    set_splits(path, {"p0": "calibration", "p2": "test"})
    ts = TrajectorySet.open(path)
    assert [p.split for p in ts.problems] == ["calibration", "train", "test"]
    assert not (path / "problems.jsonl.tmp").exists()
    with pytest.raises(TrajectoryError, match="not in the set"):
        set_splits(path, {"zz": "train"})
    with pytest.raises(TrajectoryError, match="unknown split"):
        set_splits(path, {"p0": "val"})


def test_split_ids():
    ids = [f"q{i}-s{j}" for i in range(50) for j in range(4)]
    groups = {x: x.split("-")[0] for x in ids}
    a = split_ids(ids, groups=groups, seed=1)
    assert a == split_ids(list(reversed(ids)), groups=groups, seed=1)  # order-independent
    assert a != split_ids(ids, groups=groups, seed=2)
    assert set(a) == set(ids)
    for g in set(groups.values()):
        assert len({a[x] for x in ids if groups[x] == g}) == 1
    counts = {s: sum(v == s for v in a.values()) for s in ("train", "calibration", "test")}
    assert counts == {"train": 120, "calibration": 40, "test": 40}
    assert set(split_ids(ids, fractions=(1, 0, 0)).values()) == {"train"}
    with pytest.raises(ValueError, match="sum"):
        split_ids(ids, fractions=(0.5, 0.2, 0.2))


# ----------------------------------------------------------------------- research pickles


def test_expand_block_labels():
    lab = [0, 1, 1]  # n=25, batch 10: labelled steps 9, 19, 24
    pess = expand_block_labels(lab, 25, 10, "pessimistic")
    assert pess.tolist() == [0] * 19 + [1] * 6
    research = expand_block_labels(lab, 25, 10, "research")
    assert research.tolist() == [0] * 10 + [1] * 15
    # pessimistic never borrows from the future: block 0 = 1 is only known from step 9 on
    assert expand_block_labels([1, 0], 12, 10).tolist() == [0] * 9 + [1, 1, 0]
    assert expand_block_labels([1], 4, 10).tolist() == [0, 0, 0, 1]
    with pytest.raises(TrajectoryError, match=r"expected ceil\(25/10\) = 3"):
        expand_block_labels([0, 1], 25, 10)


def _fake_pickle(with_ids: bool) -> dict:
    rng = np.random.default_rng(0)
    problems = []
    for i, n in enumerate([25, 10, 7]):
        nb = -(-n // 10)
        p = {"step_embeddings": rng.standard_normal((n, DIM)).astype(np.float32),
             "step_labels": [j % 2 for j in range(nb)], "step_labels_consistent": [1] * nb,
             "question": f"what is {i}?", "level": 3}
        if with_ids:
            p["unique_id"] = f"u{i}"
        problems.append(p)
    return {"model": "Qwen/QwQ-32B", "embed_dim": DIM, "batch_size": 10,
            "splits": {"train": [0], "calibration": [2], "test": [1]}, "problems": problems}


def test_open_pickle(tmp_path):
    pkl = _fake_pickle(with_ids=False)
    (tmp_path / "r.pkl").write_bytes(pickle.dumps(pkl))
    (tmp_path / "noext").write_bytes(pickle.dumps(pkl))
    ts = TrajectorySet.open(tmp_path / "r.pkl")
    assert [p.id for p in ts.problems] == ["0", "1", "2"]
    assert ts.info["model"] == "Qwen/QwQ-32B" and ts.info["dtype"] == "float32"
    assert ts.label_modes == ("consistent", "supervised")
    assert ts.split("calibration") == [2] and ts.split("test") == [1]
    assert ts.problems[0].prompt == "what is 0?" and ts.problems[0].extra["level"] == 3
    assert ts.problems[0].step_tokens is None
    np.testing.assert_array_equal(ts.embeddings(0), pkl["problems"][0]["step_embeddings"])
    assert ts.labels(0, "supervised").tolist() == [0] * 19 + [1] * 6
    research = TrajectorySet.open(tmp_path / "noext", pickle_labels="research")
    assert research.labels(0, "supervised").tolist() == [0] * 10 + [1] * 15
    with pytest.raises(TrajectoryError, match="pickle_labels"):
        TrajectorySet.open(tmp_path / "r.pkl", pickle_labels="optimistic")


def test_pickle_more_or_fewer_embeddings_than_labels_cover(tmp_path):
    """Labels cover batch_size steps each; surplus embeddings or labels are dropped, as the
    authors drop them (problem 1: 10 embeddings, 2 labels; problem 0: 25 embeddings, 1 label)."""
    pkl = _fake_pickle(with_ids=False)
    pkl["problems"][1]["step_labels"] = [0, 1]
    pkl["problems"][1]["step_labels_consistent"] = [1, 1]
    pkl["problems"][0]["step_labels"] = [1]
    (tmp_path / "r.pkl").write_bytes(pickle.dumps(pkl))
    ts = TrajectorySet.open(tmp_path / "r.pkl", pickle_labels="research")
    assert [p.n_steps for p in ts.problems] == [10, 10, 7]  # min over embeddings and label modes
    assert ts.labels(1, "supervised").tolist() == [0] * 10
    assert ts.problems[0].extra["pickle_unlabelled_steps"] == 15
    np.testing.assert_array_equal(ts.embeddings(0), pkl["problems"][0]["step_embeddings"][:10])


@pytest.mark.parametrize("strip_text", [False, True])
def test_released_pickle_shape_uses_the_authors_alignment(tmp_path, strip_text):
    """A pickle shaped like the released ones (long steps embedded as 500-token chunks, labels
    per block of unsplit steps, text fields stripped as in their GPQA release) opens with the
    embeddings and per-step labels their training and calibration loops use."""
    from tests.authors_format import authors_alignment, authors_pickle

    pkl = authors_pickle(seed=3, n_problems=12, dim=DIM, strip_text=strip_text)
    longer = sum(len(p["step_embeddings"]) > 10 * len(p["step_labels"]) for p in pkl["problems"])
    assert longer >= 3  # the fixture exercises the released shape
    (tmp_path / "r.pkl").write_bytes(pickle.dumps(pkl))
    ts = TrajectorySet.open(tmp_path / "r.pkl", pickle_labels="research")
    assert len(ts) == 12 and ts.info["normalization"] == "none"
    assert ts.split("calibration") == [4, 5, 6, 7]
    for i, prob in enumerate(pkl["problems"]):
        emb, lab = authors_alignment(prob)
        np.testing.assert_array_equal(ts.embeddings(i), emb)
        assert ts.labels(i, "supervised").tolist() == lab
        assert ts.labels(i, "consistent").tolist() == authors_alignment(
            prob, key="step_labels_consistent")[1]
        sizes = [b - a for a, b in prob["step_limits"] if b > a]
        assert ts.problems[i].step_tokens == sizes[:len(lab)]
        assert ts.problems[i].id == str(i)
        assert (ts.problems[i].prompt is None) == strip_text
    out = import_pickle(tmp_path / "r.pkl", tmp_path / "d", dtype="float32",
                        pickle_labels="research")
    back = TrajectorySet.open(out)
    assert [p.n_steps for p in back.problems] == [p.n_steps for p in ts.problems]


def test_pickle_problems_without_steps_are_skipped(tmp_path):
    pkl = _fake_pickle(with_ids=True)
    pkl["problems"][1]["step_embeddings"] = np.empty((0, DIM), np.float32)
    pkl["problems"][2]["step_labels"] = []
    (tmp_path / "r.pkl").write_bytes(pickle.dumps(pkl))
    assert [p.id for p in TrajectorySet.open(tmp_path / "r.pkl").problems] == ["u0"]


def test_import_pickle(tmp_path):
    pkl = _fake_pickle(with_ids=True)
    (tmp_path / "r.pkl").write_bytes(pickle.dumps(pkl))
    out = import_pickle(tmp_path / "r.pkl", tmp_path / "d", dtype="float32")
    direct, ts = TrajectorySet.open(tmp_path / "r.pkl"), TrajectorySet.open(out)
    assert [p.id for p in ts.problems] == ["u0", "u1", "u2"]
    assert ts.info["normalization"] == "none" and ts.info["source"].startswith("research-pickle")
    for i in range(3):
        np.testing.assert_array_equal(ts.embeddings(i), direct.embeddings(i))
        assert ts.problems[i] == direct.problems[i]
    import_pickle(tmp_path / "r.pkl", out, dtype="float32")  # resuming a complete import: no-op
    assert len(TrajectorySet.open(out)) == 3


@pytest.mark.parametrize("problems", [
    [],
    [{"step_embeddings": np.empty((0, DIM), np.float32), "step_labels": []},
     {"step_embeddings": np.ones((3, DIM), np.float32), "step_labels": []}],
])
def test_a_pickle_with_no_usable_problem_is_refused_before_writing(tmp_path, capsys, problems):
    """It converted to an empty set, exit 0 (every problem is skipped, as the research code
    skips problems without steps or labels); now one line naming the pickle, nothing written."""
    from orca_calibrate.calibrate_cli import main

    pkl = {**_fake_pickle(with_ids=True), "splits": None, "problems": problems}
    (tmp_path / "r.pkl").write_bytes(pickle.dumps(pkl))
    assert main(["import-pickle", str(tmp_path / "r.pkl"), "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{tmp_path / 'r.pkl'} holds no problems" in err[0], err
    assert not (tmp_path / "d").exists()
    with pytest.raises(TrajectoryError, match="holds no problems"):
        TrajectorySet.open(tmp_path / "r.pkl")
