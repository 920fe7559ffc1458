import numpy as np
import pytest
from scipy.optimize import minimize
from scipy.stats import rankdata

from orca_calibrate.synth import generate
from orca_method.trajectories import TrajectorySet

KW = {"n_problems": 120, "dim": 32, "mean_steps": 30}


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth")
    return (TrajectorySet.open(generate(root / "in", **KW)),
            TrajectorySet.open(generate(root / "shift", shift=True, **KW)))


def test_reproducible(tmp_path):
    a, b, c = (generate(tmp_path / n, seed=s, **KW) for n, s in (("a", 0), ("b", 0), ("c", 1)))
    for name in ("info.json", "problems.jsonl", "embeddings.bin"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "embeddings.bin").read_bytes() != (c / "embeddings.bin").read_bytes()


def test_resume_gives_same_bytes(tmp_path):
    full = generate(tmp_path / "full", **KW)
    part = tmp_path / "part"
    generate(part, **KW)
    lines = (part / "problems.jsonl").read_bytes().splitlines(keepends=True)
    (part / "problems.jsonl").write_bytes(b"".join(lines[:50]) + lines[50][:20])  # "killed"
    generate(part, **KW)
    for name in ("problems.jsonl", "embeddings.bin"):
        assert (part / name).read_bytes() == (full / name).read_bytes()


def test_sizes_and_dtypes(tmp_path, sets):
    ts = sets[0]
    rows = sum(p.n_steps for p in ts.problems)
    assert ts.info["dtype"] == "float16" and ts.info["normalization"] == "step-l2"
    assert (ts.path / "embeddings.bin").stat().st_size == rows * 32 * 2
    assert abs(rows / len(ts) - 30) < 5
    norms = np.linalg.norm(ts.embeddings(0).astype(np.float32), axis=1)
    np.testing.assert_allclose(norms, 1, atol=2e-3)
    f32 = TrajectorySet.open(generate(tmp_path / "f", n_problems=5, dim=16, dtype="float32"))
    assert f32.embeddings(0).dtype == np.float32 and f32.dim == 16
    assert {len(ts.split(s)) for s in ("train", "calibration", "test")} <= {72, 24}


def test_labels(sets):
    ts = sets[0]
    assert ts.label_modes == ("consistent", "supervised")
    never = differ = 0
    for i, p in enumerate(ts.problems):
        assert len(p.step_tokens) == p.n_steps and min(p.step_tokens) >= 20
        sup, con = ts.labels(i, "supervised"), ts.labels(i, "consistent")
        assert np.all(np.diff(sup) >= 0) and con[-1] == 1 and p.family == "in-dist"
        b = p.extra["breakthrough"]
        assert sup.tolist() == ([0] * p.n_steps if b is None else [0] * b + [1] * (p.n_steps - b))
        assert (np.array(p.step_answers) == p.answer).astype(int).tolist() == p.labels["supervised"]
        assert p.final_answer == p.step_answers[-1]
        never += b is None
        differ += not np.array_equal(sup, con)
    assert 0.05 < never / len(ts) < 0.3 and differ > 0


def _features(ts: TrajectorySet, idx: list[int]) -> tuple[np.ndarray, np.ndarray]:
    x = np.concatenate([ts.embeddings(i).astype(np.float64) for i in idx])
    y = np.concatenate([ts.labels(i, "supervised") for i in idx]).astype(np.float64)
    return x, y


def _logistic(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """L2 logistic regression (C = 1) on standardised features, like the static baseline."""
    def loss(w):
        z = x @ w[:-1] + w[-1]
        p = 1 / (1 + np.exp(-z))
        return (np.logaddexp(0, z) - y * z).sum() + 0.5 * w[:-1] @ w[:-1], \
            np.append(x.T @ (p - y) + w[:-1], (p - y).sum())
    return minimize(loss, np.zeros(x.shape[1] + 1), jac=True, method="L-BFGS-B").x


def _auc(score: np.ndarray, y: np.ndarray) -> float:
    r = rankdata(score)
    n1 = y.sum()
    return float((r[y == 1].sum() - n1 * (n1 + 1) / 2) / (n1 * (len(y) - n1)))


def test_static_probe_has_signal_and_transfers_worse(sets):
    ind, shifted = sets
    x, y = _features(ind, ind.split("train"))
    mean, std = x.mean(0), x.std(0)
    w = _logistic((x - mean) / std, y)

    def auc(ts, idx):
        xt, yt = _features(ts, idx)
        return _auc((xt - mean) / std @ w[:-1], yt)

    in_auc, shift_auc = auc(ind, ind.split("test")), auc(shifted, range(len(shifted)))
    assert in_auc > 0.7
    assert shift_auc < in_auc - 0.05


def test_shifted_family_breaks_through_earlier(sets):
    def mean_fraction(ts):
        return np.mean([p.extra["breakthrough"] / p.n_steps for p in ts.problems
                        if p.extra["breakthrough"] is not None])
    ind, shifted = sets
    assert all(p.family == "shifted" for p in shifted.problems)
    assert mean_fraction(shifted) < mean_fraction(ind) - 0.15
