"""The consensus block in the bundle (optional, versioned on its own: old bundles load and are
written unchanged) and the job's side of it: prompts held out from lambda*, t certified on them,
sealed, evaluated on the test split."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from orca_calibrate.consensus import (
    ConsensusOptions,
    add_consensus,
    evaluate_consensus,
    hold_out,
    replayed,
    sample_groups,
    stopped_groups,
)
from orca_calibrate.job import JobError, load_job
from orca_method.bundle import BundleError, ConsensusBlock, ConsensusRow, load_bundle, save_bundle
from orca_method.consensus import (
    ALL_AT_ONCE_VERSION,
    CONFIDENT_VERSION,
    CONSENSUS_VERSION,
    prompt_of,
    sample_id,
)
from orca_method.outcomes import Weighting
from orca_method.trajectories import TrajectorySet, TrajectoryWriter
from tests.bundles import small_bundle
from tests.fake_collector import FakeCollector

DEMO = Path(__file__).parent.parent / "orca_serve" / "demo"
OLD_DEMO = Path(__file__).parent / "data" / "demo-bundle-v1.json"
K, DIM = 4, 8


def block(rows: list[tuple[float, float, float | None]]) -> ConsensusBlock:
    return ConsensusBlock(version=CONSENSUS_VERSION, samples=K, weighting="score", epsilon=0.05,
                          n_cal=50, grid_size=101,
                          rows=[ConsensusRow(delta=d, delta_vote=dv, t=t, risk=0.02, pvalue=0.01,
                                             token_savings=0.3) for d, dv, t in rows])


@pytest.mark.parametrize("path", [OLD_DEMO, DEMO / "bundle.json", DEMO / "long" / "bundle.json"])
def test_bundles_without_consensus_load_unchanged(path):
    b = load_bundle(path)
    assert b.consensus is None and b.checksum == json.loads(path.read_text())["checksum"]


@pytest.mark.parametrize("path", [DEMO / "bundle.json", DEMO / "long" / "bundle.json"])
def test_bundles_without_consensus_are_written_unchanged(path, tmp_path):
    b = load_bundle(path)
    save_bundle(b, tmp_path / "again.json")
    assert "consensus" not in json.loads((tmp_path / "again.json").read_text())
    assert load_bundle(tmp_path / "again.json").checksum == b.checksum


def test_a_consensus_block_round_trips_and_names_calibrated_deltas_only(tmp_path):
    b = small_bundle()  # deltas 0.05 and 0.1
    save_bundle(b.model_copy(update={"consensus": block([(0.1, 0.05, 0.3), (0.05, 0.05, None)])}),
                tmp_path / "c.json")
    loaded = load_bundle(tmp_path / "c.json")
    assert loaded.consensus.rows[0].t == 0.3 and loaded.consensus.rows[1].t is None
    assert loaded.schema_version == b.schema_version  # the block carries its own version
    save_bundle(b.model_copy(update={"consensus": block([(0.2, 0.05, 0.3)])}), tmp_path / "x.json")
    with pytest.raises(BundleError, match="delta 0.2, which the main table does not calibrate"):
        load_bundle(tmp_path / "x.json")
    data = json.loads((tmp_path / "c.json").read_text())
    data["consensus"]["version"] = CONFIDENT_VERSION + 1
    (tmp_path / "v.json").write_text(json.dumps(data))
    with pytest.raises(BundleError):
        load_bundle(tmp_path / "v.json")


def test_a_wave_schedule_is_version_2_and_all_at_once_keeps_version_1s_bytes(tmp_path):
    b = small_bundle()
    at_once = block([(0.1, 0.05, 0.3)]).model_copy(update={"version": ALL_AT_ONCE_VERSION})
    save_bundle(b.model_copy(update={"consensus": at_once}), tmp_path / "v1.json")
    data = json.loads((tmp_path / "v1.json").read_text())
    assert data["consensus"]["version"] == 1 and "waves" not in data["consensus"]
    assert load_bundle(tmp_path / "v1.json").consensus.schedule == (K,)
    waved = block([(0.1, 0.05, 0.3)]).model_copy(update={"waves": [1, 1, 2]})
    save_bundle(b.model_copy(update={"consensus": waved}), tmp_path / "w.json")
    assert load_bundle(tmp_path / "w.json").consensus.schedule == (1, 1, 2)
    data = json.loads((tmp_path / "w.json").read_text())
    for bad, words in ((dict(version=1), "waves need version 2"),
                       (dict(waves=[1, 1, 1]), "summing to k = 4"),
                       (dict(waves=[4]), "one wave")):
        with pytest.raises(ValueError, match=words):
            ConsensusBlock.model_validate({**data["consensus"], **bad})


def test_the_confidence_clause_is_version_3_and_older_blocks_keep_their_bytes(tmp_path):
    """A block with the confidence clause (version 3) writes its path and each row's cap
    (`confident_tokens`); a version 1 or 2 block writes neither key (its bytes and checksum as
    before the clause), and a cap without the clause's path, or the path at another version, is
    refused."""
    b = small_bundle()
    for version in (ALL_AT_ONCE_VERSION, CONSENSUS_VERSION):
        old = block([(0.1, 0.05, 0.3)]).model_copy(update={"version": version})
        save_bundle(b.model_copy(update={"consensus": old}), tmp_path / "old.json")
        data = json.loads((tmp_path / "old.json").read_text())["consensus"]
        assert "confident" not in data and "confident_tokens" not in data["rows"][0]
    new = ConsensusBlock.model_validate({
        **block([(0.1, 0.05, 0.15), (0.05, 0.05, 0.3)]).model_dump(exclude={"rows"}),
        "version": CONFIDENT_VERSION, "confident": {"step": 25, "max": 4000},
        "rows": [{"delta": 0.1, "delta_vote": 0.05, "t": 0.15, "confident_tokens": 975,
                  "risk": 0.04, "pvalue": 0.02, "token_savings": 0.5},
                 {"delta": 0.05, "delta_vote": 0.05, "t": 0.3, "risk": 0.02, "pvalue": 0.01,
                  "token_savings": 0.3}]})
    save_bundle(b.model_copy(update={"consensus": new}), tmp_path / "v3.json")
    loaded = load_bundle(tmp_path / "v3.json").consensus
    assert loaded == new and [r.confident_tokens for r in loaded.rows] == [975, None]
    data = json.loads((tmp_path / "v3.json").read_text())["consensus"]
    for bad, words in (({"version": CONSENSUS_VERSION}, "exactly when its version is 3"),
                       ({"confident": None}, "exactly when its version is 3")):
        with pytest.raises(ValueError, match=words):
            ConsensusBlock.model_validate({**data, **bad})
    with pytest.raises(ValueError, match="confident_tokens, but the block no confidence clause"):
        ConsensusBlock.model_validate({**data, "version": CONSENSUS_VERSION, "confident": None})


def sampled_set(path: Path, n_prompts: int, rng: np.random.Generator, k: int = K,
                splits: bool = True) -> TrajectorySet:
    """n_prompts x k traces of 3-6 steps with random embeddings; a prompt's samples mostly
    agree on "7" (its answer), with a wrong step answer now and then."""
    with TrajectoryWriter(path, dim=DIM) as w:
        for p in range(n_prompts):
            for s in range(k):
                n = int(rng.integers(3, 7))
                final = "7" if rng.random() < 0.8 else "5"
                steps = [None if t == 0 else (final if rng.random() < 0.7 else "5")
                         for t in range(n - 1)] + [final]
                w.append({"id": sample_id(f"p{p}", s), "answer": "7", "step_tokens":
                          [int(x) for x in rng.integers(20, 60, n)], "step_answers": steps,
                          "final_answer": final,
                          "labels": {"supervised": [int(a == "7") for a in steps]},
                          "split": ("train", "calibration", "test")[p % 3] if splits else None},
                         rng.normal(size=(n, DIM)).astype(np.float32))
    return TrajectorySet.open(path)


def test_held_out_prompts_certify_t_and_the_test_split_evaluates_it(tmp_path):
    rng = np.random.default_rng(3)
    ts = sampled_set(tmp_path / "data", 90, rng)
    opts = ConsensusOptions(deltas=(0.1, 0.2), holdout=0.5)
    view, held = hold_out(ts, opts)
    lam_side = {prompt_of(ts.problems[i].id)[0] for i in view.split("calibration")}
    t_side = {prompt_of(ts.problems[i].id)[0] for i in held}
    assert lam_side and t_side and not lam_side & t_side  # whole prompts, on one side each
    assert len(view.split("calibration")) + len(held) == len(ts.split("calibration"))
    assert len(TrajectorySet.open(tmp_path / "data").split("calibration")) == 30 * K  # on disk

    groups = sample_groups(ts, held)
    assert all(len(g) == K for g in groups)
    bundle = small_bundle(dim=DIM)
    scores = replayed(bundle.load_probe(), ts, groups, bundle.window)
    stopped = stopped_groups(ts, groups, scores, bundle.lam(0.1), Weighting.SCORE)
    for g, idx in zip(stopped, groups):  # finish times are the tokens through each stop step
        assert all(f <= sum(ts.problems[i].step_tokens) for f, i in zip(g.finish, idx))
        assert g.reference in ("7", "5")
    save_bundle(bundle, tmp_path / "b.json")
    sealed = add_consensus(tmp_path / "b.json", bundle.load_probe(), ts, held, opts)
    c = load_bundle(tmp_path / "b.json").consensus
    assert c == sealed.consensus and c.samples == K and c.n_cal == len(groups)
    assert {(r.delta, r.delta_vote) for r in c.rows} == {(d, v) for d in (0.05, 0.1)
                                                         for v in (0.1, 0.2)}
    report = evaluate_consensus(load_bundle(tmp_path / "b.json"), ts, "test")
    assert report["samples"] == K and len(report["rows"]) == 4
    for r in report["rows"]:
        assert r["n"] == 30 and 0 <= r["realized_vote_error"] <= 1
        assert (r["t"] is None) == (r["errors"] == 0 and r["token_savings"] == 0)

    # certified for waves: the block says so, and evaluation replays the same schedule
    waved = ConsensusOptions(deltas=(0.1, 0.2), holdout=0.5, waves=[1, 1, 2])  # a YAML list
    save_bundle(bundle, tmp_path / "w.json")
    w = add_consensus(tmp_path / "w.json", bundle.load_probe(), ts, held, waved).consensus
    assert w.version == CONSENSUS_VERSION and w.schedule == (1, 1, 2)
    assert evaluate_consensus(load_bundle(tmp_path / "w.json"), ts, "test")["rows"]
    with pytest.raises(ValueError, match="summing to k = 4"):
        add_consensus(tmp_path / "w.json", bundle.load_probe(), ts, held,
                      ConsensusOptions(waves=(1, 2)))

    # the confidence clause: a version 3 block whose rows carry c* (or none), replayed by the
    # evaluation with the same (t*, c*)
    sure = ConsensusOptions(deltas=(0.1, 0.2), holdout=0.5, waves=[1, 1, 2], confident=True,
                            cap_step=50, cap_max=400)
    save_bundle(bundle, tmp_path / "c.json")
    c3 = add_consensus(tmp_path / "c.json", bundle.load_probe(), ts, held, sure).consensus
    assert c3.version == CONFIDENT_VERSION and c3.confident.max == 400
    assert all(r.confident_tokens is None or (r.t is not None and 0 < r.confident_tokens <= 400)
               for r in c3.rows)
    assert len(evaluate_consensus(load_bundle(tmp_path / "c.json"), ts, "test")["rows"]) == 4
    with pytest.raises(ValueError, match="cap_step <= cap_max"):
        ConsensusOptions(confident=True, cap_step=500, cap_max=400)


def test_a_job_asks_for_samples_and_consensus_consistently(tmp_path):
    def job(collect: dict, calibrate: dict) -> Path:
        p = tmp_path / "job.yaml"
        p.write_text(json.dumps({"model": "m", "prompts": "p.jsonl", "out": "o",
                                 "collect": collect, "calibrate": calibrate}))
        return p

    load_job(job({"samples": 8}, {"consensus": {"deltas": [0.05], "weighting": "count"}}))
    with pytest.raises(JobError, match="needs collect.samples >= 2"):
        load_job(job({"samples": 1}, {"consensus": {}}))
    with pytest.raises(JobError, match="temperature > 0"):
        load_job(job({"samples": 8, "temperature": 0.0}, {}))
    with pytest.raises(JobError, match="weighting must be one of"):
        load_job(job({"samples": 8}, {"consensus": {"weighting": "votes"}}))
    with pytest.raises(JobError, match="calibrate.consensus is a mapping"):
        load_job(job({"samples": 8}, {"consensus": {"t": 0.3}}))


class _SampledCollector(FakeCollector):
    """Stands in for the vLLM collector: `settings.samples` synthetic traces per prompt."""

    def run(self, prompts: list, out, progress: bool, defer=None):
        sampled_set(out, len(prompts), np.random.default_rng(5), k=self.settings.samples,
                    splits=False)
        return type("Stats", (), {"as_dict": lambda self: {}})()


def test_a_job_with_consensus_certifies_t_on_held_out_prompts(tmp_path, monkeypatch):
    """The whole job with `samples: 4` and `calibrate.consensus`: lambda*'s n_cal counts only
    the prompts left to it, the block's n_cal the held-out ones, and the test split's realized
    vote error lands in evaluation.json."""
    import orca_calibrate.job
    from orca_calibrate.job import run_job

    monkeypatch.setattr(orca_calibrate.job, "Collector", _SampledCollector)
    (tmp_path / "p.jsonl").write_text("".join(
        json.dumps({"id": f"p{i}", "prompt": "x", "answer": "7"}) + "\n" for i in range(120)))
    job = {"model": "m", "prompts": "p.jsonl", "out": "run", "collect": {"samples": K},
           "split": {"fractions": [0.4, 0.4, 0.2]}, "train": {"epochs": 1},
           "calibrate": {"deltas": [0.3], "window": 1,
                         "consensus": {"deltas": [0.2], "holdout": 0.5}}}
    (tmp_path / "job.yaml").write_text(json.dumps(job))
    run_job(tmp_path / "job.yaml", progress=False)
    bundle = load_bundle(tmp_path / "run" / "bundle.json")
    ts = TrajectorySet.open(tmp_path / "run" / "trajectories")
    cal_prompts = {prompt_of(ts.problems[i].id)[0] for i in ts.split("calibration")}
    c = bundle.consensus
    assert c.samples == K and [(r.delta, r.delta_vote) for r in c.rows] == [(0.3, 0.2)]
    assert 0 < c.n_cal < len(cal_prompts)
    assert bundle.ltt.n_cal <= (len(cal_prompts) - c.n_cal) * K  # the rest, solvable ones only
    report = json.loads((tmp_path / "run" / "evaluation.json").read_text())["consensus"]
    assert report["rows"][0]["n"] == len({prompt_of(ts.problems[i].id)[0]
                                          for i in ts.split("test")})
