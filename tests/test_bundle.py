"""The bundle refuses everything that would make the server compute something else."""

import base64
import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as st_save

from orca_method.bundle import (
    Bundle,
    BundleError,
    _checksum,
    check_model,
    encode_weights,
    load_bundle,
    save_bundle,
    tokenizer_fingerprint,
)
from orca_method.bundle_checks import check_semantics
from orca_method.probe import Probe, ProbeSpec
from tests.bundles import SMALL_VOCAB, small_bundle, with_give_up, with_saturated_give_up
from tests.serving import refusals


def _rewrite(path, mutate) -> None:
    """Edit a saved bundle and re-seal it, so only the edited property is wrong."""
    data = json.loads(path.read_text())
    mutate(data)
    data["checksum"] = _checksum(data)
    path.write_text(json.dumps(data))


def test_roundtrip_and_lookup(tmp_path) -> None:
    b = save_bundle(small_bundle(), tmp_path / "b.json")
    loaded = load_bundle(tmp_path / "b.json")
    assert loaded == b
    assert loaded.lam(0.1) == 0.8 and loaded.lam(0.05) == float("inf")
    probe = loaded.load_probe()
    assert probe.spec == ProbeSpec(dim=8)
    assert "weights" not in json.dumps(loaded.summary())


def test_every_variant_roundtrips(tmp_path) -> None:
    spec = ProbeSpec(dim=8, kind="qk", d_h=4, norm="ln", eta_mode="input")
    save_bundle(small_bundle(spec=spec), tmp_path / "b.json")
    probe = load_bundle(tmp_path / "b.json").load_probe()
    ref = Probe(spec, seed=0)
    for k, v in ref.params.items():
        torch.testing.assert_close(probe.params[k], v.detach())


def test_delta_not_in_table_lists_available(tmp_path) -> None:
    b = save_bundle(small_bundle(), tmp_path / "b.json")
    with pytest.raises(BundleError, match="available deltas: 0.05, 0.1"):
        b.lam(0.2)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(schema_version=2), "schema version 2"),
    (lambda d: d["ltt"].update(rows=[]), "empty LTT table"),
    (lambda d: d.update(default_delta=0.3), "delta 0.3 has no calibrated"),
    (lambda d: d["model"].update(hidden_size=16), "probe dim 8 != model hidden size 16"),
    (lambda d: d["ltt"].update(epsilon=2), "ltt.epsilon"),
    (lambda d: d.update(extra_field=1), "extra_field"),
])
def test_invalid_bundles_are_refused(tmp_path, mutate, message) -> None:
    save_bundle(small_bundle(), tmp_path / "b.json")
    _rewrite(tmp_path / "b.json", mutate)
    with pytest.raises(BundleError, match=message):
        load_bundle(tmp_path / "b.json")


@pytest.mark.parametrize("drop", ["window", "give_up.window"])
def test_a_bundle_without_its_window_is_refused(tmp_path, drop) -> None:
    """No default stands in for the smoothing window the thresholds were calibrated at (the
    loader once gave every such bundle 10; the demo's are 1 and 3): refused in one line."""
    save_bundle(with_give_up(small_bundle(), [(0.05, 0.2)]), tmp_path / "b.json")

    def mutate(d):
        *parents, key = drop.split(".")
        for k in parents:
            d = d[k]
        del d[key]
    _rewrite(tmp_path / "b.json", mutate)
    with pytest.raises(BundleError, match=f"has no '{drop}'") as e:
        load_bundle(tmp_path / "b.json")
    assert "\n" not in str(e.value)


def test_every_shipped_bundle_records_its_window() -> None:
    """The bundles shipped with the code (the two demos, the version-1 one kept for tests)
    load now that the window is required, with the windows they were calibrated at."""
    root = Path(__file__).parents[1]
    shipped = {root / "orca_serve/demo/bundle.json": (1, 1),
               root / "orca_serve/demo/long/bundle.json": (3, 3),
               root / "tests/data/demo-bundle-v1.json": (1, None)}
    for path, (window, give_up) in shipped.items():
        b = load_bundle(path)
        assert (b.window, b.give_up and b.give_up.window) == (window, give_up), path


def test_checksum_mismatch(tmp_path) -> None:
    save_bundle(small_bundle(), tmp_path / "b.json")
    data = json.loads((tmp_path / "b.json").read_text())
    data["window"] = 3
    (tmp_path / "b.json").write_text(json.dumps(data))
    with pytest.raises(BundleError, match="checksum"):
        load_bundle(tmp_path / "b.json")


@pytest.mark.parametrize("tensors, message", [
    ({"w": torch.full((8,), float("nan")), "b": torch.zeros(()), "log_eta": torch.zeros(())},
     "NaN or inf"),
    ({"w": torch.zeros(9), "b": torch.zeros(()), "log_eta": torch.zeros(())}, "shape"),
    ({"w": torch.zeros(8), "log_eta": torch.zeros(())}, "do not match"),
])
def test_bad_weights(tmp_path, tensors, message) -> None:
    save_bundle(small_bundle(), tmp_path / "b.json")
    blob = base64.b64encode(st_save(tensors)).decode()
    _rewrite(tmp_path / "b.json", lambda d: d["probe"].update(weights=blob))
    with pytest.raises(BundleError, match=message):
        load_bundle(tmp_path / "b.json")


def test_not_a_bundle(tmp_path) -> None:
    with pytest.raises(BundleError, match="not found"):
        load_bundle(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{oops")
    with pytest.raises(BundleError, match="not valid JSON"):
        load_bundle(tmp_path / "x.json")


def test_check_model() -> None:
    b = small_bundle()
    check_model(b, 8, SMALL_VOCAB, "tiny")
    with pytest.raises(BundleError, match="hidden size 16"):
        check_model(b, 16, SMALL_VOCAB, "other")
    with pytest.raises(BundleError, match="tokenizer"):
        check_model(b, 8, {**SMALL_VOCAB, "c": 4}, "other")
    assert tokenizer_fingerprint(SMALL_VOCAB) == hashlib.sha256(
        json.dumps(sorted(SMALL_VOCAB.items(), key=lambda kv: kv[1])).encode()).hexdigest()


# -- every way a bundle can be wrong is one BundleError line (issue 9) -------------------------

def _blob(**tensors) -> str:
    base = {"w": torch.zeros(8), "b": torch.zeros(()), "log_eta": torch.tensor(math.log(0.01))}
    return base64.b64encode(st_save({**base, **tensors})).decode()


def _set(*path_value):
    """A mutation setting data[path] = value (path: keys separated by '.')."""
    *path, value = path_value

    def mutate(d):
        keys = path[0].split(".")
        for k in keys[:-1]:
            d = d[int(k)] if isinstance(d, list) else d[k]
        d[keys[-1]] = value
    return mutate


@pytest.mark.parametrize("mutate, message", [
    (_set("probe.weights", "!!!notbase64"), "not base64"),
    (_set("probe.weights", "AAAAAAAAAAAA"), "not a safetensors blob"),
    (lambda d: d["probe"].update(weights=d["probe"]["weights"][:8] + "\n" + d["probe"]["weights"][8:]),
     "not base64"),
    (_set("probe.weights", _blob(w=torch.zeros(8, dtype=torch.float16))), "float16, expected"),
    (_set("probe.weights", _blob(log_eta=torch.tensor(100.0))), "non-finite scores"),
    (_set("probe.spec.kind", "foo"), r"probe.spec.*kind.*'noqk' or 'qk'"),
    (_set("probe.spec.dim", "8"), r"probe.spec.*dim.*valid integer"),
    (_set("probe.spec.extra", 1), r"probe.spec.*extra"),
    (_set("probe.spec.d_h", 4), "d_h and shared_qk only apply"),
    (_set("probe.eta", -1), "probe.eta"),
    (_set("model.hidden_size", True), "model.hidden_size"),
    (_set("model.tokenizer_fingerprint", "abc"), "tokenizer_fingerprint"),
    (_set("window", "3"), "window"),
    (_set("window", 10**9), "window.*less than or equal to 10000"),
    (_set("ltt.rows.1.lam", -0.5), r"ltt.rows.1.lam.*greater than or equal to 0 \(got -0.5\)"),
    (_set("ltt.rows.1.lam", 1.5), "ltt.rows.1.lam"),
    (_set("ltt.rows.1.risk", 2.0), "ltt.rows.1.risk"),
    (_set("ltt.rows.1.delta", 1.0), "ltt.rows.1.delta"),
    (_set("ltt.rows.1.delta", 0.05), "delta 0.05 twice"),
    (_set("ltt.grid_size", 0), "ltt.grid_size"),
    (_set("default_delta", 0.0), "default_delta"),
    (_set("segmentation", {"delimiter": ""}), "segmentation.delimiter"),
    (_set("segmentation", {"keywords": []}), "segmentation.keywords"),
    (_set("segmentation", {"keywords": ["wait", ""]}), "segmentation.keywords.1"),
    (_set("think", {"start": "<t>", "end": "<t>"}), "both '<t>'"),
    (_set("think", {"force_text": "\n\n"}), "does not contain the end tag"),
    (_set("label_mode", ""), "label_mode"),
    (_set("schema_version", "2\nx"), r"schema version '2\\nx'"),  # found by the fuzzer: 2 lines
])
def test_every_defect_is_one_bundle_error(tmp_path, mutate, message) -> None:
    save_bundle(small_bundle(), tmp_path / "b.json")
    _rewrite(tmp_path / "b.json", mutate)
    with pytest.raises(BundleError, match=message) as e:
        load_bundle(tmp_path / "b.json")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text, message", [
    ('{"a": NaN}', "NaN is not a number"),
    ('{"a": -Infinity}', "-Infinity is not a number"),
    ('{"a": 1e999}', "out of range"),
    ('{"a": ' + "1" * 5000 + "}", "not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, "nests too deeply|not valid JSON"),
    ("[]", "not a JSON object"),
])
def test_json_a_bundle_never_holds(tmp_path, text, message) -> None:
    (tmp_path / "b.json").write_text(text)
    with pytest.raises(BundleError, match=message):
        load_bundle(tmp_path / "b.json")


def test_nan_in_a_sealed_table_is_refused_not_a_crash(tmp_path) -> None:
    save_bundle(small_bundle(), tmp_path / "b.json")
    data = json.loads((tmp_path / "b.json").read_text())
    data["ltt"]["rows"][1]["risk"] = float("nan")
    (tmp_path / "b.json").write_text(json.dumps(data))  # json writes NaN
    with pytest.raises(BundleError, match="NaN"):
        load_bundle(tmp_path / "b.json")


def test_unreadable_paths(tmp_path) -> None:
    with pytest.raises(BundleError, match="is a directory"):
        load_bundle(tmp_path)
    (tmp_path / "b.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(BundleError, match="not UTF-8"):
        load_bundle(tmp_path / "b.json")


def test_only_a_regular_file_of_a_bundles_size_is_read(tmp_path, monkeypatch) -> None:
    """A device read whole exhausted the server's memory on reload (/dev/zero: killed by the
    kernel), and a pipe held every later reload waiting: both are refused before a read, as
    is a regular file far larger than any bundle."""
    import os

    import orca_method.bundle

    with pytest.raises(BundleError, match="/dev/zero is not a regular file"):
        load_bundle("/dev/zero")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(BundleError, match="is not a regular file"):  # returns: nothing opened
        load_bundle(tmp_path / "fifo")
    monkeypatch.setattr(orca_method.bundle, "MAX_BUNDLE_BYTES", 1000)
    (tmp_path / "big.json").write_bytes(b" " * 2**20)
    with pytest.raises(BundleError, match=r"is 1 MiB, more than a bundle holds \(0 MiB"):
        load_bundle(tmp_path / "big.json")


def test_a_huge_declared_probe_is_refused_before_allocation(tmp_path) -> None:
    """dim 10^12 with matching hidden size: the weights' shapes are checked before Probe()."""
    save_bundle(small_bundle(), tmp_path / "b.json")
    _rewrite(tmp_path / "b.json", lambda d: (d["probe"]["spec"].update(dim=10**12),
                                             d["model"].update(hidden_size=10**12)))
    with pytest.raises(BundleError, match=r"shape \(8,\), expected \(1000000000000,\)"):
        load_bundle(tmp_path / "b.json")


def test_bundles_are_read_strictly_but_written_as_before(tmp_path) -> None:
    """An int where a float goes is the same number; a string or bool for a number is not."""
    save_bundle(small_bundle(), tmp_path / "b.json")
    _rewrite(tmp_path / "b.json", _set("ltt.rows.1.lam", 1))
    assert load_bundle(tmp_path / "b.json").lam(0.1) == 1.0
    _rewrite(tmp_path / "b.json", _set("ltt.n_cal", 100.0))
    with pytest.raises(BundleError, match="ltt.n_cal"):
        load_bundle(tmp_path / "b.json")


BAD_BUNDLES = {  # the defects of issue 9 that used to end in a traceback, and a shape mismatch
    "directory": None,
    "not-base64": _set("probe.weights", "!!!notbase64"),
    "not-safetensors": _set("probe.weights", "AAAAAAAAAAAA"),
    "nan-in-ltt": "nan",  # written by json.dumps, which allows NaN (the checksum cannot cover it)
    "shape": _set("probe.weights", _blob(w=torch.zeros(9))),
}


def _bad_bundle(tmp_path, name: str):
    if BAD_BUNDLES[name] is None:
        return tmp_path
    save_bundle(small_bundle(), tmp_path / "b.json")
    if BAD_BUNDLES[name] == "nan":
        data = json.loads((tmp_path / "b.json").read_text())
        data["ltt"]["rows"][1]["lam"] = float("nan")
        (tmp_path / "b.json").write_text(json.dumps(data))
    else:
        _rewrite(tmp_path / "b.json", BAD_BUNDLES[name])
    return tmp_path / "b.json"


# -- orca-serve's refusals through its real entry point ----------------------------------------
# Each test below builds its command lines with a function of its own (`SERVED`); `refused` runs
# them all in one process, as tests/serving.py `refusals` does for a test's own lines: a process
# for each test cost ~2.5 s of CPU, and none of these lines gets as far as starting a server.
Cases = dict[str, list[str]]


def _bad_bundle_cases(d: Path) -> Cases:
    cases = {}
    for name in BAD_BUNDLES:
        (d / name).mkdir()
        cases[name] = ["--calib", str(_bad_bundle(d / name, name)), "--model", "x"]
    return cases


def _table_and_name_cases(d: Path) -> Cases:
    model = ["--model", str(DEMO / "model")]
    rising = _resealed(d, SEMANTIC["lambda rises with delta"][0])
    (d / "other").mkdir()
    other_config = _resealed(d / "other", lambda b: b["model"].update(
        config_fingerprint={**_demo_config(), "num_layers": 48}))
    return {"rises with delta": ["--calib", str(rising), *model,
                                 "--served-model-name", "orca-toy-reasoner"],
            "made for model 'orca-toy-reasoner'": ["--calib", str(DEMO / "bundle.json"), *model],
            "config differs (num_layers 48 vs": ["--calib", str(other_config), *model,
                                                 "--served-model-name", "orca-toy-reasoner"]}


def _fewer_layers_cases(d: Path) -> Cases:
    """The toy's architecture with one layer fewer (its config.json says so; tokenizer and
    weights files as the toy's), served under the toy's name with the shipped toy bundle."""
    model = d / "model"
    model.mkdir()
    for f in (DEMO / "model").iterdir():
        if f.name != "config.json":
            (model / f.name).symlink_to(f)
    config = json.loads((DEMO / "model" / "config.json").read_text())
    config["num_hidden_layers"] -= 1
    config["layer_types"] = config["layer_types"][:-1]
    (model / "config.json").write_text(json.dumps(config))
    return {"other config": ["--calib", str(DEMO / "bundle.json"), "--model", str(model),
                             "--served-model-name", "orca-toy-reasoner"]}


def _give_up_policy_cases(d: Path) -> Cases:
    """The demo bundle (certified for "guess") under --orca-give-up-policy message, and one
    certified for "message" under the default "guess"."""
    message = _resealed(d, lambda b: b["give_up"].update(policy="message"))
    return {"message": ["--demo", "--orca-give-up-policy", "message"],
            "guess": ["--calib", str(message), "--model", str(DEMO / "model")]}


SERVED = (_bad_bundle_cases, _table_and_name_cases, _fewer_layers_cases, _give_up_policy_cases)


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[str, dict[str, tuple[list[str], int, str]]]:
    """{builder's name: {case: (command line, exit code, stderr)}} for every builder of
    `SERVED`, each in a folder of its own; vLLM not imported by the end (so by none of them)."""
    lines = {build.__name__: build(tmp_path_factory.mktemp(build.__name__)) for build in SERVED}
    got, vllm_imported = refusals({f"{b}/{k}": argv for b, cases in lines.items()
                                   for k, argv in cases.items()})
    assert not vllm_imported, "a refusal imported vLLM"
    return {b: {k: (argv, *got[f"{b}/{k}"]) for k, argv in cases.items()}
            for b, cases in lines.items()}


def test_orca_serve_refuses_a_bad_bundle_in_one_line_before_vllm(refused) -> None:
    """The real entry point: exit 2, one line on stderr, and vLLM never imported."""
    for name, (_, code, err) in refused["_bad_bundle_cases"].items():
        assert code == 2, (name, err)
        assert err.count("\n") == 1 and err.startswith("orca-serve: error: bundle"), (name, err)


@pytest.mark.parametrize("name", sorted(BAD_BUNDLES))
def test_orca_calibrate_evaluate_refuses_a_bad_bundle_in_one_line(tmp_path, capsys, name) -> None:
    """orca-calibrate's entry function (in-process: a subprocess per case costs seconds)."""
    from orca_calibrate.calibrate_cli import main

    path = _bad_bundle(tmp_path, name)
    code = main(["evaluate", "--data", str(tmp_path / "none"), "--bundle", str(path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("orca-calibrate evaluate: error: bundle"), err


# -- checks before serving: the model, the table, the probe's scale (issue 16) ----------------
DEMO = Path(__file__).parents[1] / "orca_serve" / "demo"


@pytest.fixture(scope="module")
def demo_facts():
    from orca_serve.checks.bundle import model_facts

    return model_facts(str(DEMO / "model"))


def _resealed(tmp_path, mutate) -> Path:
    """The demo bundle with one property changed and sealed again: only that property is wrong."""
    path = tmp_path / "bundle.json"
    shutil.copy(DEMO / "bundle.json", path)
    _rewrite(path, mutate)
    return path


def _rows(data) -> list[dict]:
    return sorted(data["ltt"]["rows"], key=lambda r: r["delta"])


def _scaled_weights(data) -> None:
    probe = Bundle.model_validate(data).load_probe()
    for p in probe.params.values():
        p.data.mul_(1e30)
    data["probe"]["weights"] = encode_weights(probe)


def _scaled_give_up_weights(data) -> None:
    """The same damage to the give-up probe (the demo bundle is two-sided)."""
    damaged = with_saturated_give_up(Bundle.model_validate(data))
    data["give_up"]["probe"]["weights"] = damaged.give_up.probe.weights


def _swap_savings(data) -> None:
    """Savings swapped between two rows: each row alone is consistent with its risk."""
    a, b = _rows(data)[1], _rows(data)[2]
    a["savings"], b["savings"] = b["savings"], a["savings"]


SEMANTIC = {  # resealed bad bundle -> what the one-line refusal says
    "lambda rises with delta": (lambda d: _rows(d)[1].update(lam=0.0), "rises with delta"),
    "p-value not its risk's": (lambda d: _rows(d)[0].update(pvalue=0.001), "p-value"),
    "risk not a count": (lambda d: _rows(d)[0].update(risk=_rows(d)[0]["risk"] + 1e-3),
                         "whole number"),
    "never beside a risk": (lambda d: _rows(d)[0].update(lam=None), "never stops"),
    "savings fall as lambda falls": (_swap_savings, "no smaller"),
    "weights x 1e30": (_scaled_weights, "the probe's scores are all saturated"),
    "give-up weights x 1e30": (_scaled_give_up_weights, "give-up probe's scores are all saturated"),
    "delimiter no token has": (lambda d: d["segmentation"].update(delimiter="#~#"), "delimiter"),
}


@pytest.mark.parametrize("name", sorted(SEMANTIC))
def test_resealed_bad_bundles_are_refused_before_serving(tmp_path, demo_facts, name) -> None:
    from orca_serve.checks.bundle import check_served

    mutate, why = SEMANTIC[name]
    bundle = load_bundle(_resealed(tmp_path, mutate))  # the checksum holds: it was resealed
    with pytest.raises(BundleError, match=why) as e:
        check_served(bundle, demo_facts, str(DEMO / "model"), served_names=["orca-toy-reasoner"])
    assert "\n" not in str(e.value)


def test_the_demo_bundle_passes_every_check(demo_facts) -> None:
    from orca_serve.checks.bundle import check_served

    bundle = load_bundle(DEMO / "bundle.json")
    assert check_served(bundle, demo_facts, str(DEMO / "model"),
                        served_names=[bundle.model.name]) is None
    check_semantics(bundle)


def test_another_model_is_refused_unless_forced(tmp_path, demo_facts) -> None:
    """The model name must match --model (or its last path component) or --served-model-name;
    a bundle that names no tokenizer is refused too; --orca-force-model lets both through with
    a note, but never a different tokenizer."""
    from orca_serve.checks.bundle import check_served

    model = str(DEMO / "model")
    other = load_bundle(_resealed(tmp_path, lambda d: d["model"].update(name="Qwen/QwQ-32B")))
    with pytest.raises(BundleError, match="made for model 'Qwen/QwQ-32B'"):
        check_served(other, demo_facts, model)
    with pytest.raises(BundleError, match="made for model"):
        check_served(other, demo_facts, model, served_names=["orca-toy-reasoner"])
    assert check_served(other, demo_facts, "/models/qwq-32b") is None  # same last component
    assert check_served(other, demo_facts, model, served_names=["Qwen/QwQ-32B"]) is None
    note = check_served(other, demo_facts, model, force=True)
    assert note.startswith("--orca-force-model") and "Qwen/QwQ-32B" in note
    unnamed = load_bundle(_resealed(tmp_path, lambda d: d["model"].update(
        tokenizer_fingerprint=None)))
    with pytest.raises(BundleError, match="names no tokenizer"):
        check_served(unnamed, demo_facts, model, served_names=["orca-toy-reasoner"])
    assert "names no tokenizer" in check_served(unnamed, demo_facts, model, force=True,
                                                served_names=["orca-toy-reasoner"])
    retok = load_bundle(_resealed(tmp_path, lambda d: d["model"].update(
        tokenizer_fingerprint="0" * 64)))
    with pytest.raises(BundleError, match="tokenizer"):
        check_served(retok, demo_facts, model, force=True)


def _demo_config() -> dict:
    from transformers import AutoConfig

    from orca_method.bundle import config_fingerprint

    return config_fingerprint(AutoConfig.from_pretrained(DEMO / "model")).model_dump()


def test_a_model_with_the_bundles_name_but_another_config_is_refused(tmp_path, demo_facts):
    """Issues 23 and 37: the bundle records the model's config fingerprint (the shipped toy
    bundle too); a model of another shape is refused whatever it is served as, unless
    --orca-force-model. A bundle without one is checked by name, hidden size and tokenizer."""
    from dataclasses import replace

    from orca_serve.checks.bundle import check_served

    model, names = str(DEMO / "model"), ["orca-toy-reasoner"]
    assert demo_facts.config is not None
    shipped = load_bundle(DEMO / "bundle.json")
    assert shipped.model.config_fingerprint.model_dump() == _demo_config()
    assert check_served(shipped, demo_facts, model, served_names=names) is None
    # the toy's architecture with one layer fewer, served under the toy's name and tokenizer
    fewer = replace(demo_facts, config=demo_facts.config.model_copy(
        update={"num_layers": demo_facts.config.num_layers - 1}))
    with pytest.raises(BundleError, match="config differs \\(num_layers 4 vs 3"):
        check_served(shipped, fewer, model, served_names=names)
    unprinted = load_bundle(_resealed(tmp_path, lambda d: d["model"].update(
        config_fingerprint=None)))
    assert check_served(unprinted, fewer, model, served_names=names) is None
    for field, value in (("architecture", "LlamaForCausalLM"), ("num_layers", 48),
                         ("vocab_size", 32000)):
        other = load_bundle(_resealed(tmp_path, lambda d: d["model"].update(
            config_fingerprint={**_demo_config(), field: value})))
        with pytest.raises(BundleError, match=f"config differs \\({field} "):
            check_served(other, demo_facts, model, served_names=names)
        note = check_served(other, demo_facts, model, served_names=names, force=True)
        assert note.startswith("--orca-force-model") and field in note


def test_orca_serve_refuses_them_in_one_line_before_vllm(refused) -> None:
    """The real entry point: a resealed table (lambda* rising with delta) under the right
    model name, and the demo bundle under another name: exit 2, one line, vLLM not imported."""
    for why, (_, code, err) in refused["_table_and_name_cases"].items():
        assert code == 2, (why, err)
        assert err.count("\n") == 1 and why in err, (why, err)


def test_orca_serve_refuses_the_toy_bundle_on_a_model_of_another_config(refused) -> None:
    """Issue 37: the shipped toy bundle on the toy's architecture with one layer fewer, served
    under the toy's name: the real entry point reads the served model's config.json and refuses
    in one line before vLLM (the check function's cases, --orca-force-model included: the test
    above)."""
    (_, code, err), = refused["_fewer_layers_cases"].values()
    assert code == 2 and err.count("\n") == 1, err
    assert "config differs (num_layers 4 vs 3" in err, err


def test_orca_serve_serves_mu_only_under_the_give_up_policy_it_was_certified_for(refused):
    """docs/METHOD.md section 9: each give-up policy has its own loss. The real entry point
    refuses the demo bundle (certified for "guess") under --orca-give-up-policy message, and a
    bundle certified for "message" under the default "guess": exit 2, one line naming the flag
    that fits, vLLM not imported. The matching combination passes the same pre-flight."""
    from orca_serve.checks.errors import StartupError
    from orca_serve.startup.preflight import preflight

    got = refused["_give_up_policy_cases"]
    for served, certified in (("message", "guess"), ("guess", "message")):
        _, code, err = got[served]
        assert code == 2 and err.count("\n") == 1, (served, err)
        assert err.startswith(f"orca-serve: error: --orca-give-up-policy {served}: the bundle's "
                              f"give-up threshold mu* was certified for give-up policy "
                              f"'{certified}'"), err
        assert f"serve it with --orca-give-up-policy {certified}," in err, err
        assert f"calibrate.give_up.policy: {served}" in err, err
    argv = got["guess"][0]
    message = argv[argv.index("--calib") + 1]  # the bundle certified for "message"
    pre = preflight(["--calib", message, "--orca-give-up-policy", "message"])
    assert pre.bundle is not None and pre.bundle.give_up.policy == "message"
    assert preflight(["--demo"]).bundle.give_up.policy == "guess"
    with pytest.raises(StartupError, match="--calib is empty"):  # was "bundle . is a directory"
        preflight(["--calib", ""])


def test_orca_serve_serves_a_vote_only_in_the_schedule_it_was_certified_for(tmp_path):
    """docs/METHOD.md section 14, "Waves": a consensus t holds for one launch schedule. The
    pre-flight refuses a bundle certified for waves without --orca-vote-waves naming them, and
    the demo's schedule (all at once) under waves; the matching schedule passes."""
    from orca_serve.checks.errors import StartupError
    from orca_serve.startup.preflight import preflight
    from tests.bundles import with_consensus

    waved = tmp_path / "waved.json"
    save_bundle(with_consensus(load_bundle(DEMO / "bundle.json"), waves=[1, 1, 2]), waved)
    at_once = tmp_path / "at-once.json"
    save_bundle(with_consensus(load_bundle(DEMO / "bundle.json")), at_once)
    model = ["--model", str(DEMO / "model"), "--served-model-name", "orca-toy-reasoner"]
    with pytest.raises(StartupError, match="serve it with --orca-vote-waves 1\\+1\\+2,"):
        preflight(["--calib", str(waved), *model])
    with pytest.raises(StartupError, match="serve it without --orca-vote-waves,"):
        preflight(["--calib", str(at_once), *model, "--orca-vote-waves", "2+2"])
    pre = preflight(["--calib", str(waved), *model, "--orca-vote-waves", "1+1+2"])
    assert pre.bundle.consensus.schedule == (1, 1, 2)


def test_a_model_config_of_the_wrong_type_is_named_in_its_one_line(tmp_path):
    """transformers' validation error announces its field with a colon and says what is wrong on
    the next line; the one-line refusal carries both (it ended at the colon)."""
    import shutil

    from orca_serve.checks.bundle import model_facts
    from orca_serve.checks.errors import StartupError

    model = tmp_path / "model"
    shutil.copytree(DEMO / "model", model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "hidden_size": "256"}))
    with pytest.raises(StartupError) as e:
        model_facts(str(model))
    msg = str(e.value)
    assert "\n" not in msg and "hidden_size" in msg and not msg.endswith(":"), msg
    assert "'256'" in msg, msg


def test_a_model_folder_without_config_is_named_so(tmp_path):
    """transformers asked for a `model_type` key in the config.json the folder lacks; the
    server's check is the offline collector's (`check_model_folder`)."""
    from orca_serve.checks.bundle import model_facts
    from orca_serve.checks.errors import StartupError

    with pytest.raises(StartupError, match=f"model folder {tmp_path} has no config.json: give "
                                           "the folder that holds"):
        model_facts(str(tmp_path))


def test_a_model_folder_without_tokenizer_files_is_named_so(tmp_path):
    """transformers stands in a one-token tokenizer for a folder without tokenizer files; the
    check said the tokenizer differed from the bundle's, not that it was missing."""
    import shutil

    from orca_serve.checks.bundle import model_facts
    from orca_serve.checks.errors import StartupError

    model = tmp_path / "model"
    shutil.copytree(DEMO / "model", model, ignore=shutil.ignore_patterns("tokenizer*"))
    with pytest.raises(StartupError, match="has no tokenizer .* tokenizer files .* missing"):
        model_facts(str(model))
