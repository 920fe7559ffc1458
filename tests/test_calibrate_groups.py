"""Group-conditional calibration (docs/METHOD.md section 12), statistically, on synthetic
mixtures (orca_calibrate.synth.generate_mixture: an in-distribution and a shifted family in one
set, each problem tagged with its family).

The probe is fixed (a static probe reading the synthetic "solved" direction), so what varies
between repetitions is the data: each repetition draws a fresh mixture (seeded), calibrates a
bundle with `calibrate.groups` through `calibrate_bundle`, and measures each group's realized
stop error on that group's held-out (test split) traces, at its group's lambda* and at the
mixture's. The claim tested: per group, the mean realized error over repetitions is <= delta
(tolerance 0: the measured margins are 3-5 standard errors), while the mixture's lambda*
exceeds delta on the shifted group at delta 0.1 (by more than 0.015). The slow variant repeats
it 30 times and also bounds how often one repetition's error exceeds delta by more than two
binomial standard errors of its test set (<= 15% of repetitions; LTT allows epsilon = 5% of
calibrations to fail, plus the test set's own noise).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from orca_calibrate.calibrate import GroupOptions, calibrate_bundle, score_split
from orca_calibrate.synth import generate_mixture, world
from orca_method.bundle import load_bundle
from orca_method.probe import Probe, ProbeSpec
from orca_method.risk import losses, stop_indices
from orca_method.thresholds import lam_to_json
from orca_method.trajectories import TrajectorySet

DIM, WINDOW, DELTAS = 16, 2, (0.1, 0.2)
COUNTS = {"in-dist": 1000, "shifted": 400}  # the shifted family is the minority
FAMILIES = tuple(COUNTS)


def _probe() -> Probe:
    """A static probe reading the synthetic world's "solved" direction: its scores run high
    early on the shifted family (offsets more aligned with that direction), so a lambda*
    calibrated on the mixture stops the shifted traces too early."""
    probe = Probe(ProbeSpec(dim=DIM, online=False), seed=0)
    probe.params["w"].data = torch.tensor(world(DIM).v * 8, dtype=torch.float32)
    probe.params["b"].data.fill_(-2.0)
    return probe


def _simulate(tmp_path, reps: int) -> dict[tuple[str, float, str], list[tuple[float, int]]]:
    """Per (family, delta, "group" | "mixture"): each repetition's (realized test error, n)."""
    probe, out = _probe(), {}
    for rep in range(reps):
        ts = TrajectorySet.open(generate_mixture(
            tmp_path / f"mix{rep}", COUNTS, dim=DIM, mean_steps=20, seed=rep,
            splits=(0.1, 0.45, 0.45)))
        calibrate_bundle(probe, ts, tmp_path / f"b{rep}.json", deltas=DELTAS, window=WINDOW,
                         groups=GroupOptions("family", 30))
        bundle = load_bundle(tmp_path / f"b{rep}.json")
        assert sorted(bundle.groups) == sorted(FAMILIES)
        for family in FAMILIES:
            test = [i for i in ts.split("test") if ts.problems[i].family == family]
            scored = score_split(probe, ts, "test", "supervised", WINDOW, members=test)
            for delta in DELTAS:
                for which, lam in (("group", bundle.lam(delta, family)),
                                   ("mixture", bundle.lam(delta))):
                    tau = stop_indices(scored.scores, np.array([lam]))
                    err = float(losses(tau, scored.labels).mean())
                    out.setdefault((family, delta, which), []).append((err, len(scored.ids)))
    return out


def _check(results, *, exceed_share: float | None) -> None:
    for family in FAMILIES:
        for delta in DELTAS:
            runs = results[(family, delta, "group")]
            mean = float(np.mean([e for e, _ in runs]))
            assert mean <= delta, (family, delta, mean)
            if exceed_share is not None:
                over = sum(e > delta + 2 * math.sqrt(delta * (1 - delta) / n) for e, n in runs)
                assert over <= exceed_share * len(runs), (family, delta, over)
    shifted = float(np.mean([e for e, _ in results[("shifted", 0.1, "mixture")]]))
    assert shifted > 0.1 + 0.015, shifted  # the mixture's lambda* breaks the shifted group


def test_group_lambdas_hold_within_each_group_where_the_mixtures_does_not(tmp_path, capsys):
    _check(_simulate(tmp_path, 6), exceed_share=None)


@pytest.mark.slow
def test_group_lambdas_hold_within_each_group_over_many_calibrations(tmp_path):
    _check(_simulate(tmp_path, 30), exceed_share=0.15)


def test_a_group_below_min_n_gets_no_table_and_a_note(tmp_path, capsys):
    """min_n counts a group's solvable calibration traces (its lambda* n_cal); a smaller group
    is left to the main table, and calibration says so."""
    ts = TrajectorySet.open(generate_mixture(tmp_path / "m", {"in-dist": 300, "shifted": 40},
                                             dim=DIM, mean_steps=12, splits=(0.2, 0.5, 0.3)))
    bundle = calibrate_bundle(_probe(), ts, tmp_path / "b.json", deltas=DELTAS, window=WINDOW,
                              groups=GroupOptions("family", 30))
    assert list(bundle.groups) == ["in-dist"]
    assert bundle.groups["in-dist"].ltt.n_cal >= 30 and bundle.groups["in-dist"].give_up is None
    assert "group 'shifted' gets no table of its own" in capsys.readouterr().out
    # the group's table is certified on that group's traces only: fewer than the mixture's
    assert bundle.groups["in-dist"].ltt.n_cal < bundle.ltt.n_cal
    with pytest.raises(ValueError, match="no problem of .* has a 'topic' tag"):
        calibrate_bundle(_probe(), ts, tmp_path / "c.json", deltas=DELTAS, window=WINDOW,
                         groups=GroupOptions("topic", 30))
    with pytest.raises(ValueError, match="min_n >= 1"):
        GroupOptions("family", 0)


def _set_apart(path, family: str, n: int, seed: int) -> TrajectorySet:
    """A calibration-only set of one family (no split: as `orca-calibrate groups` takes it)."""
    from orca_method.trajectories import set_splits

    generate_mixture(path, {family: n}, dim=DIM, mean_steps=20, seed=seed)
    set_splits(path, {p.id: None for p in TrajectorySet.open(path).problems})
    return TrajectorySet.open(path)


def _main_bundle(tmp_path):
    """A two-sided bundle calibrated in distribution only, as the shipped demo bundles are."""
    from orca_calibrate.calibrate import GiveUpOptions

    ts = TrajectorySet.open(generate_mixture(tmp_path / "main", {"in-dist": 600}, dim=DIM,
                                             mean_steps=20, splits=(0.2, 0.5, 0.3)))
    gu = Probe(ProbeSpec(dim=DIM, online=False), seed=1)
    return ts, calibrate_bundle(_probe(), ts, tmp_path / "main.json", deltas=DELTAS,
                                window=WINDOW, give_up=(gu, GiveUpOptions(deltas=(0.05, 0.1))))


def test_groups_from_sets_apart_leave_the_main_tables_as_they_were(tmp_path, capsys):
    """`add_groups` certifies each group on its own set's traces only (all of them: the set is
    calibration-only), with the bundle's probes, window and label modes, and changes nothing
    else: every other field of the bundle, the provenance's old keys included, is as it was. A
    group below min_n gets no table and a note; a set a job split, a group in two sets and a
    group the bundle has already are refused."""
    import json

    from orca_calibrate.calibrate import add_groups, run_ltt

    main_ts, parent = _main_bundle(tmp_path)
    shifted = _set_apart(tmp_path / "shifted", "shifted", 200, seed=7)
    few = _set_apart(tmp_path / "few", "in-dist", 20, seed=8)
    sealed = add_groups(parent, [shifted, few], GroupOptions("family", 30), tmp_path / "g.json")
    assert "group 'in-dist' gets no table of its own" in capsys.readouterr().out
    assert list(sealed.groups) == ["shifted"]
    old, new = (json.loads((tmp_path / f).read_text()) for f in ("main.json", "g.json"))
    assert {k: v for k, v in new.items() if k not in ("groups", "checksum", "provenance")} == \
        {k: v for k, v in old.items() if k not in ("checksum", "provenance")}
    assert {k: new["provenance"][k] for k in old["provenance"]} == old["provenance"]
    assert [d["data"] for d in new["provenance"]["group_data"]] == [str(shifted.path),
                                                                     str(few.path)]
    # the group's lambda* is LTT on every solvable trace of its set, and on nothing else
    scored = score_split(_probe(), shifted, "all", "supervised", WINDOW)
    direct = run_ltt(scored, DELTAS, parent.ltt.epsilon, "binomial")
    g = sealed.groups["shifted"]
    assert g.ltt.n_cal == len(scored.ids) > 150
    assert [r.lam for r in g.ltt.rows] == [lam_to_json(round(r.lam, 6)) for r in direct]
    assert g.give_up is not None and g.give_up.n_cal == len(shifted)
    assert load_bundle(tmp_path / "g.json").lam(0.1, "shifted") == sealed.lam(0.1, "shifted")
    with pytest.raises(ValueError, match="in a job's 'calibration' split|in a job's 'train'"):
        add_groups(parent, [main_ts], GroupOptions(), tmp_path / "x.json")
    twin = _set_apart(tmp_path / "twin", "shifted", 40, seed=9)
    with pytest.raises(ValueError, match="has calibration traces in .* and in"):
        add_groups(parent, [shifted, twin], GroupOptions(), tmp_path / "x.json")
    with pytest.raises(ValueError, match="has a table for group 'shifted' already"):
        add_groups(sealed, [twin], GroupOptions(), tmp_path / "x.json")
    with pytest.raises(ValueError, match="no table to add"):
        add_groups(parent, [few], GroupOptions(), tmp_path / "x.json")
    # a later group joins the earlier ones, and the provenance keeps where each came from
    more = _set_apart(tmp_path / "more", "in-dist", 60, seed=10)
    both = add_groups(sealed, [more], GroupOptions(), tmp_path / "y.json")
    assert sorted(both.groups) == ["in-dist", "shifted"] and both.groups["shifted"] == g
    assert [d["data"] for d in both.provenance["group_data"]] == [str(shifted.path),
                                                                  str(few.path), str(more.path)]


def test_a_group_calibrated_apart_holds_on_its_held_out_traces(tmp_path):
    """Statistically: a shifted group certified on a set apart from the bundle's job (fresh
    each repetition, seeded) keeps its realized stop error on fresh held-out traces of the
    group <= delta on average over 6 repetitions (tolerance 0; measured 0.071 at delta 0.1 and
    0.153 at 0.2, 5 and more standard errors of the mean inside), where the main lambda*
    exceeds delta = 0.1 on them (0.156)."""
    from orca_calibrate.calibrate import add_groups

    _, parent = _main_bundle(tmp_path)
    test = _set_apart(tmp_path / "test", "shifted", 600, seed=100)
    scored = score_split(_probe(), test, "all", "supervised", WINDOW)
    errs: dict[tuple[float, str], list[float]] = {}
    for rep in range(6):
        cal = _set_apart(tmp_path / f"cal{rep}", "shifted", 200, seed=rep)
        sealed = add_groups(parent, [cal], GroupOptions(), tmp_path / f"g{rep}.json")
        for delta in DELTAS:
            for which, lam in (("group", sealed.lam(delta, "shifted")),
                               ("main", sealed.lam(delta))):
                tau = stop_indices(scored.scores, np.array([lam]))
                errs.setdefault((delta, which), []).append(float(losses(tau, scored.labels).mean()))
    for delta in DELTAS:
        assert np.mean(errs[(delta, "group")]) <= delta, (delta, errs[(delta, "group")])
    assert np.mean(errs[(0.1, "main")]) > 0.1, errs[(0.1, "main")]


def test_orca_calibrate_groups_reseals_and_refuses_in_one_line(tmp_path, capsys):
    """`orca-calibrate groups`: the tables it adds are those `add_groups` computes, printed per
    group; a set a job split ends with one line and exit code 2."""
    from orca_calibrate.calibrate_cli import main

    main_ts, _ = _main_bundle(tmp_path)
    _set_apart(tmp_path / "shifted", "shifted", 120, seed=3)
    out = tmp_path / "g.json"
    assert main(["groups", "--bundle", str(tmp_path / "main.json"), "--data",
                 str(tmp_path / "shifted"), "--out", str(out)]) == 0
    g = load_bundle(out).groups["shifted"]
    assert f"group shifted: n_cal {g.ltt.n_cal}, lambda* " in capsys.readouterr().out
    assert main(["groups", "--bundle", str(tmp_path / "main.json"), "--data", str(main_ts.path),
                 "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a group set holds calibration traces only" in err[0]
    assert not (tmp_path / "x.json").exists()


def test_a_group_set_labelled_or_cut_otherwise_than_the_bundles_data_is_refused(tmp_path):
    """A group's losses are the bundle's only if its set was labelled with the same answer
    probe (suffix, tokens) and its steps end where the bundle's reasoning ends (think tags):
    `add_groups` refuses a set that records another of either, and takes one that records the
    same (or none, as older sets)."""
    import json

    from orca_calibrate.calibrate import add_groups

    labelling = {"suffix": "\n</think>\nThe answer is \\boxed{", "answer_tokens": 6}
    main = generate_mixture(tmp_path / "main", {"in-dist": 600}, dim=DIM, mean_steps=20,
                            splits=(0.2, 0.5, 0.3))
    info = json.loads((main / "info.json").read_text())
    (main / "info.json").write_text(json.dumps({**info, "labelling": labelling}))
    parent = calibrate_bundle(_probe(), TrajectorySet.open(main), tmp_path / "main.json",
                              deltas=DELTAS, window=WINDOW)
    assert parent.labelling is not None and parent.labelling.model_dump() == labelling

    def recorded(name: str, **fields) -> TrajectorySet:
        ts = _set_apart(tmp_path / name, "shifted", 80, seed=4)
        info = json.loads((ts.path / "info.json").read_text())
        (ts.path / "info.json").write_text(json.dumps({**info, **fields}))
        return TrajectorySet.open(ts.path)

    force = "\n</think>\n"  # the default's prefix: the refusal names the setting, in full
    for name, fields, words in (
            ("suffix", {"labelling": {**labelling, "suffix": "\nThe answer is \\boxed{"}},
             r"labelling.suffix '\\nThe answer is \\\\boxed\{', the bundle's data with "
             r"'\\n</think>\\nThe answer"),
            ("think", {"think": {**parent.think.model_dump(), "enabled": False}},
             r"think.enabled False, the bundle's data with True"),
            ("force", {"think": {**parent.think.model_dump(), "force_text": force}},
             r"think.force_text '\\n</think>\\n', the bundle's data with '\\n</think>\\n\\n'")):
        with pytest.raises(ValueError, match=words):
            add_groups(parent, [recorded(name, **fields)], GroupOptions(), tmp_path / "x.json")
        assert not (tmp_path / "x.json").exists()
    same = recorded("same", labelling=labelling, think=parent.think.model_dump())
    assert "shifted" in add_groups(parent, [same], GroupOptions(), tmp_path / "ok.json").groups
