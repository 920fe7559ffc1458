"""The conditions a bundle's calibration traces were generated under (`provenance.collected_under`:
the engine's dtype, each trace's temperature, top_p, top_k and min_p): recorded by collect in the
data's info.json, copied by calibrate into the bundle, optional for older bundles, and compared by
orca-serve with what it serves (a warning, not a refusal)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orca_calibrate.calibrate_cli import main
from orca_calibrate.synth import generate
from orca_calibrate.train import save_probe, train_static
from orca_method.bundle import (
    COLLECTED_UNDER,
    BundleError,
    Generation,
    _checksum,
    load_bundle,
    save_bundle,
)
from orca_method.trajectories import TrajectoryError, TrajectorySet
from tests.bundles import small_bundle

OLD_DEMO = Path(__file__).parent / "data" / "demo-bundle-v1.json"  # written before the record
COLLECTED = Generation(dtype="float32", temperature=0.7, top_p=0.95)
QWEN3 = COLLECTED.model_copy(update={"top_k": 20, "min_p": 0.05})  # a job with both set


def _with_info(data: Path, **fields: object) -> Path:
    info = json.loads((data / "info.json").read_text())
    info.update(fields)
    (data / "info.json").write_text(json.dumps(info))
    return data


def test_calibration_copies_the_datas_conditions_into_the_provenance(tmp_path):
    data = generate(tmp_path / "data", n_problems=120, dim=8, mean_steps=6,
                    splits=(0.5, 0.5, 0.0))
    _with_info(data, collected_under=QWEN3.record())
    probe = train_static(TrajectorySet.open(data), "supervised", seed=0)
    save_probe(probe, tmp_path / "p.safetensors", {"label_mode": "supervised", "seed": "0"})
    assert main(["calibrate", "--data", str(data), "--probe", str(tmp_path / "p.safetensors"),
                 "--out", str(tmp_path / "bundle.json"), "--delta", "0.1", "0.2"]) == 0
    bundle = load_bundle(tmp_path / "bundle.json")
    assert bundle.collected_under() == QWEN3
    assert bundle.provenance[COLLECTED_UNDER] == {**COLLECTED.model_dump(), "top_k": 20,
                                                  "min_p": 0.05}


def test_a_record_without_top_k_or_min_p_sampled_with_neither():
    """Data and bundles recorded before top_k and min_p were (and the shipped demo bundles) read
    as sampled without them, which they were; a record leaves them out when they are none, so
    such a set resumes under the same info and an older reader reads what it always read."""
    old = {"dtype": "float32", "temperature": 0.7, "top_p": 0.95}
    assert Generation.model_validate(old) == COLLECTED
    assert (COLLECTED.top_k, COLLECTED.min_p) == (0, 0.0)
    assert COLLECTED.record() == old
    assert QWEN3.record() == {**old, "top_k": 20, "min_p": 0.05}
    assert Generation.model_validate(QWEN3.record()) == QWEN3


def test_bundles_without_the_record_still_load(tmp_path):
    assert load_bundle(OLD_DEMO).collected_under() is None
    assert save_bundle(small_bundle(), tmp_path / "b.json").collected_under() is None


@pytest.mark.parametrize("bad, field", [({"dtype": "float32", "temperature": -1, "top_p": 1},
                                         "temperature"),
                                        ({"dtype": "float32", "temperature": 0.7}, "top_p"),
                                        ({"dtype": "", "temperature": 0.7, "top_p": 1}, "dtype"),
                                        ({"dtype": "float8", "temperature": 0.7, "top_p": 1},
                                         "dtype"),
                                        ({"dtype": "float32", "temperature": 0.7, "top_p": 1,
                                          "top_k": -1}, "top_k"),
                                        ({"dtype": "float32", "temperature": 0.7, "top_p": 1,
                                          "min_p": 2}, "min_p"),
                                        ("float32", COLLECTED_UNDER)])
def test_a_malformed_record_is_refused_at_load_in_one_line(tmp_path, bad, field):
    save_bundle(small_bundle(), tmp_path / "b.json")
    data = json.loads((tmp_path / "b.json").read_text())
    data["provenance"][COLLECTED_UNDER] = bad
    data["checksum"] = _checksum(data)  # sealed: only the record is wrong
    (tmp_path / "b.json").write_text(json.dumps(data))
    with pytest.raises(BundleError, match=field) as e:
        load_bundle(tmp_path / "b.json")
    assert "\n" not in str(e.value)


def test_a_data_set_records_an_object_or_nothing(tmp_path):
    data = generate(tmp_path / "data", n_problems=4, dim=8, mean_steps=3)
    assert TrajectorySet.open(data).info[COLLECTED_UNDER] is None  # older sets: not recorded
    _with_info(data, collected_under="float32")
    with pytest.raises(TrajectoryError, match="collected_under must be an object or null"):
        TrajectorySet.open(data)


def _recorded(under: Generation | None):
    b = small_bundle()
    provenance = {} if under is None else {COLLECTED_UNDER: under.model_dump()}
    return b.model_copy(update={"provenance": provenance})


def test_serving_as_calibrated_warns_of_nothing():
    from orca_serve.checks.bundle import serving_warnings

    assert serving_warnings(_recorded(COLLECTED), (COLLECTED, {})) == []
    other = COLLECTED.model_copy(update={"dtype": "x"})
    assert serving_warnings(_recorded(None), (other, {})) == []
    assert serving_warnings(_recorded(COLLECTED), None) == []  # vLLM could not say


def test_another_dtype_is_one_line_naming_both():
    from orca_serve.checks.bundle import serving_warnings

    served = COLLECTED.model_copy(update={"dtype": "bfloat16"})
    (line,) = serving_warnings(_recorded(COLLECTED), (served, {}))
    assert "computed in float32, this server computes in bfloat16" in line
    assert line.endswith("serve with --dtype float32") and "\n" not in line


@pytest.mark.parametrize("change", [{"temperature": 1.0}, {"top_p": 1.0}])
def test_other_default_sampling_is_one_line(change):
    from orca_serve.checks.bundle import serving_warnings

    (line,) = serving_warnings(_recorded(COLLECTED), (COLLECTED.model_copy(update=change), {}))
    served = {**COLLECTED.model_dump(), **change}
    assert "sampled at temperature 0.7, top_p 0.95" in line and "\n" not in line
    assert f"temperature {served['temperature']:g}, top_p {served['top_p']:g} (" in line
    both = COLLECTED.model_copy(update={"dtype": "float16", **change})
    assert len(serving_warnings(_recorded(COLLECTED), (both, {}))) == 2


def test_the_same_top_k_and_min_p_warn_of_nothing():
    """A bundle calibrated with top_k 20 (Qwen3's advice) served by a model whose generation
    config says top_k 20: a request that sets none is sampled as the calibration traces were."""
    from orca_serve.checks.bundle import serving_warnings

    assert serving_warnings(_recorded(QWEN3), (QWEN3, {})) == []


@pytest.mark.parametrize("recorded, served, was, now", [
    (QWEN3, QWEN3.model_copy(update={"top_k": 40}), "top_k 20, min_p 0.05", "top_k 40, min_p 0.05"),
    (QWEN3, QWEN3.model_copy(update={"min_p": 0.0}), "top_k 20, min_p 0.05", "top_k 20, no min_p"),
    # recorded before top_k was (the collector then used none), served with QwQ's file's 40
    (COLLECTED, COLLECTED.model_copy(update={"top_k": 40}), "no top_k", "top_k 40"),
    (QWEN3, COLLECTED, "top_k 20, min_p 0.05", "no top_k, no min_p"),
])
def test_another_default_top_k_or_min_p_is_one_line_naming_both(recorded, served, was, now):
    from orca_serve.checks.bundle import serving_warnings

    (line,) = serving_warnings(_recorded(recorded), (served, {}))
    assert f"sampled at temperature 0.7, top_p 0.95, {was};" in line and "\n" not in line
    assert f"sampled here at temperature 0.7, top_p 0.95, {now} (" in line


def test_a_penalty_the_collector_never_uses_is_one_line():
    """A generation config that sets a penalty: a request that sets none is sampled with it,
    the collector's traces were not (it leaves every penalty at vLLM's neutral value)."""
    from orca_serve.checks.bundle import serving_warnings

    (line,) = serving_warnings(_recorded(QWEN3),
                               (QWEN3, {"repetition_penalty": 1.05, "presence_penalty": 1.5}))
    assert "vLLM's neutral repetition_penalty, presence_penalty;" in line and "\n" not in line
    assert "sampled here with repetition_penalty 1.05, presence_penalty 1.5 (" in line


def test_a_reloads_note_carries_the_serving_warnings():
    """A reload's bundle is compared with what this server serves, as at start: the shipped toy
    bundle (float32) on a server computing in bfloat16 passes with the dtype line as its note;
    served as calibrated, no note."""
    from orca_serve.checks.bundle import model_facts, reload_note
    from orca_serve.startup.preflight import demo_paths

    model, path = demo_paths()
    bundle = load_bundle(path)
    facts, names = model_facts(str(model)), [bundle.model.name]
    same = bundle.collected_under()
    assert reload_note(bundle, facts, str(model), (same, {}), served_names=names) is None
    other = same.model_copy(update={"dtype": "bfloat16"})
    other = other.model_copy(update={"top_k": 40})
    note = reload_note(bundle, facts, str(model), (other, {}), served_names=names)
    assert "this server computes in bfloat16" in note and "top_k 40" in note
    assert "\n" not in note


@pytest.mark.parametrize("under", [QWEN3, None])
def test_the_gates_collector_samples_as_the_calibration_traces_were(monkeypatch, under):
    """`gate` and `reweight --traffic-prompts` run prompts to the gate's step: with the
    bundle's recorded top_p, top_k and min_p (the traffic the gate is for is sampled so, served
    as calibrated), the temperature their option says; a bundle that records nothing, with
    none (as before they were recorded)."""
    import orca_calibrate.collect as collect
    from orca_calibrate.gate import gate_collector

    monkeypatch.setattr(collect, "Collector", lambda model, settings: settings)
    s = gate_collector("m", _recorded(under), max_tokens=64, temperature=0.6, seed=0, engine={})
    want = (0.95, 20, 0.05) if under else (1.0, 0, 0.0)
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.6, *want)
