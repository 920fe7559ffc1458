"""Evaluation and `compare` report both savings definitions, each under its own name."""

import json

import numpy as np
import pytest

from orca_calibrate.calibrate import calibrate_bundle
from orca_calibrate.calibrate_cli import main
from orca_calibrate.evaluate import evaluate_bundle, markdown_table
from orca_calibrate.synth import generate
from orca_calibrate.train import meta_train
from orca_method.outcomes import GiveUpPolicy
from orca_method.probe import ProbeSpec
from orca_method.stop_metrics import stop_indices
from orca_method.trajectories import TrajectorySet

D = 16


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> TrajectorySet:
    out = tmp_path_factory.mktemp("eval") / "data"
    generate(out, n_problems=240, dim=D, mean_steps=20, seed=3)
    return TrajectorySet.open(out)


def test_evaluate_reports_both_savings(data: TrajectorySet, tmp_path) -> None:
    probe = meta_train(data, ProbeSpec(dim=D), "supervised", epochs=2, progress=False).probe
    bundle = calibrate_bundle(probe, data, tmp_path / "b.json", deltas=[0.2, 0.3], window=3)
    report, scored = evaluate_bundle(bundle, data)
    lengths = np.array([len(s) for s in scored.scores])
    for d, row in report["deltas"].items():
        tau = stop_indices(scored.scores, np.array([bundle.lam(float(d))]))[0]
        assert row["savings_per_problem"] == pytest.approx(np.mean(1 - (tau + 1) / lengths))
        assert row["savings_total_steps"] == pytest.approx(1 - (tau + 1).sum() / lengths.sum())
        assert row["token_savings_total"] is not None and "savings" not in row
    table = markdown_table([("p", report)])
    assert "sav/problem / sav/total" in table and "the paper's definition" in table


def test_compare_writes_both_definitions(data: TrajectorySet, tmp_path, capsys) -> None:
    out = tmp_path / "cmp"
    assert main(["compare", "--data", str(data.path), "--out", str(out), "--probes", "ttt-noqk",
                 "--label-modes", "supervised", "--epochs", "1", "--window", "3"]) == 0
    text = (out / "compare.md").read_text()
    assert "ttt-noqk (supervised)" in text and "savings_per_problem" in text
    assert json.loads((out / "ttt-noqk-supervised.json").read_text())["ltt"]["rows"]


def test_evaluate_a_set_without_test_split(data: TrajectorySet, tmp_path, capsys) -> None:
    """A job's shifted set has no splits: evaluate replays all of it instead of failing with a
    diagnosis about labels; an explicit empty split says so and how to get what was meant."""
    probe = meta_train(data, ProbeSpec(dim=D), "supervised", epochs=1, progress=False).probe
    bundle = tmp_path / "b.json"
    calibrate_bundle(probe, data, bundle, deltas=[0.3], window=3)
    shifted = tmp_path / "shifted"
    generate(shifted, n_problems=30, dim=D, mean_steps=12, seed=5, shift=True,
             splits=(1.0, 0.0, 0.0))
    assert main(["evaluate", "--data", str(shifted), "--bundle", str(bundle)]) == 0
    out = capsys.readouterr()
    assert "no test split: evaluating all 30 problems" in out.err and "delta=0.3" in out.out
    assert main(["evaluate", "--data", str(shifted), "--bundle", str(bundle),
                 "--split", "test"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [(f"orca-calibrate evaluate: error: {shifted} has no problem in the test "
                    "split; pass --split all to evaluate every problem")]


def test_evaluate_two_sided_arms_and_risks(data: TrajectorySet, tmp_path) -> None:
    """The offline two-sided evaluation (what bench scripts call): the arms' tokens are ordered
    as their rules are, and each risk is its events over its counted traces with an interval."""
    from orca_calibrate.calibrate import GiveUpOptions
    from orca_calibrate.evaluate import evaluate_two_sided
    from orca_calibrate.train import train_give_up, train_static

    probe = train_static(data, "supervised", pca_dim=8)  # any upper probe does here
    give_up = (train_give_up(data, "supervised"), GiveUpOptions(deltas=(0.1, 0.2), epsilon=0.1))
    bundle = calibrate_bundle(probe, data, tmp_path / "b.json", deltas=[0.2, 0.3], window=3,
                              give_up=give_up)
    with pytest.raises(ValueError, match="no give-up threshold"):
        evaluate_two_sided(bundle.model_copy(update={"give_up": None}), data)
    r = evaluate_two_sided(bundle, data, "test", delta=0.3, delta_2=0.2)
    assert r["n"] == len(data.split("test")) and r["mu"] == bundle.mu(0.2)
    a = r["arms"]
    tok = {k: v["tokens_per_request"] for k, v in a.items()}
    assert tok["full"] >= tok["one_sided"] >= tok["two_sided"]
    assert tok["oracle_stop"] >= tok["oracle_two_sided"]
    assert a["full"]["gave_up"] == a["one_sided"]["gave_up"] == 0.0
    assert a["oracle_two_sided"]["give_up_error"]["k"] == 0  # it never gives up on a right one
    for arm in a.values():
        for risk in ("stop_error", "give_up_error"):
            x = arm[risk]
            assert x["rate"] == pytest.approx(x["k"] / x["n"])
            assert x["ci95"][0] <= x["rate"] <= x["ci95"][1]
    assert a["two_sided"]["accuracy"] <= a["two_sided"]["accuracy_best_guess"]


def test_calibration_certifies_mu_for_the_give_up_policy_and_evaluation_measures_its_loss(
        data: TrajectorySet, tmp_path, monkeypatch) -> None:
    """calibrate.give_up.policy reaches the bundle: certified for "message" (its loss counts
    every give-up on a trace right at some step, at least "guess"'s), each mu* is no higher
    than "guess"'s, and the bundle records the policy. The offline evaluation measures the loss
    of the policy the bundle records: at one mu*, "guess" counts the give-ups with a right step
    ahead, "message" those on a trace right at any step."""
    from orca_calibrate.calibrate import GiveUpOptions
    from orca_calibrate.evaluate import evaluate_two_sided
    from orca_calibrate.train import train_give_up, train_static
    from orca_method.bundle import load_bundle
    from orca_method.give_up import last_right, two_sided_ends
    from orca_method.procedure import replay
    from orca_method.thresholds import mu_from_json

    probe = train_static(data, "supervised", pca_dim=8)
    give_up_probe = train_give_up(data, "supervised")
    bundles = {policy: calibrate_bundle(probe, data, tmp_path / f"{policy}.json", deltas=[0.3],
                                        window=3, give_up=(give_up_probe, GiveUpOptions(
                                            deltas=(0.1, 0.2), epsilon=0.1, policy=policy)))
               for policy in ("guess", "message")}
    guess, message = bundles["guess"], bundles["message"]
    assert (guess.give_up.policy, message.give_up.policy) == ("guess", "message")
    assert load_bundle(tmp_path / "message.json").give_up.policy == "message"
    for g, m in zip(guess.give_up.ltt.rows, message.give_up.ltt.rows):
        assert g.delta == m.delta and mu_from_json(m.mu) <= mu_from_json(g.mu)
    # guess's mu*, measured as certified for "message"
    at_mu = guess.model_copy(update={"give_up": guess.give_up.model_copy(
        update={"policy": GiveUpPolicy.MESSAGE})})
    idx = data.split("test")
    embs = [data.embeddings(i) for i in idx]
    stop = [s.numpy() for _, s in replay(guess.load_probe(), embs, window=guess.window)]
    give_up = [s.numpy() for _, s in replay(guess.load_give_up_probe(), embs,
                                            window=guess.give_up.window)]
    end, how = two_sided_ends(stop, give_up, guess.lam(0.3), guess.mu(0.2))
    gave = np.array(how) == "gave_up"
    # synthetic traces rarely lose a right answer; these, given up on after their first step,
    # are made right at their first step only: lost to "message", not to "guess"
    talked_out = {i for i, e, g in zip(idx, end, gave) if g and e >= 1}
    raw_labels = data.raw_labels

    def edited(i: int, mode: str) -> np.ndarray:
        labels = raw_labels(i, mode)
        if i in talked_out and mode == "supervised":
            labels = np.zeros_like(labels)
            labels[0] = 1
        return labels

    monkeypatch.setattr(data, "raw_labels", edited)
    last = np.array([last_right(data.raw_labels(i, "supervised")) for i in idx])
    want = {"guess": int((gave & (end <= last)).sum()), "message": int((gave & (last >= 0)).sum())}
    assert want["message"] >= want["guess"] + len(talked_out) > want["guess"]
    for policy, bundle in (("guess", guess), ("message", at_mu)):
        r = evaluate_two_sided(bundle, data, "test", delta=0.3, delta_2=0.2)["arms"]["two_sided"]
        assert r["give_up_error"]["k"] == want[policy], policy
