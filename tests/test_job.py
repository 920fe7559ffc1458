"""Job files and collection bookkeeping that need no engine."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from orca_calibrate.collect import CollectSettings, _problem_fields, read_prompts
from orca_calibrate.job import JobError, load_job
from orca_method.answer_probes import probe_prompts, step_ends
from orca_method.trajectories import TrajectorySet
from tests.fake_collector import FakeCollector


def test_step_ends() -> None:
    gen = [9, 1, 2, 3, 4, 5, 7, 8]  # 9 = a generated <think>; 7, 8 = after </think>
    assert step_ends(gen, [[1, 2], [3, 4, 5]]) == [3, 6]
    # a <think> (9) written again inside the reasoning is in no step: the steps have a gap
    assert step_ends([9, 1, 2, 9, 3, 4, 5, 7], [[1, 2], [3, 4, 5]]) == [3, 7]
    # ... and inside a step (a trace of the toy at temperature 0.7 crashed its collection):
    assert step_ends([9, 1, 2, 9, 3, 9, 4, 5, 7], [[1, 2], [3, 4, 5]]) == [3, 8]
    with pytest.raises(RuntimeError, match="step 1"):  # a counted token inside: no match
        step_ends([9, 1, 2, 3, 1, 4, 5, 7], [[1, 2], [3, 4, 5]])
    with pytest.raises(RuntimeError, match="disagree"):
        step_ends(gen, [[2, 1]])
    with pytest.raises(RuntimeError, match="step 1"):
        step_ends(gen, [[3, 4], [1, 2]])  # out of order


def test_probe_prompts_cut_after_each_labelled_step() -> None:
    gen = [9, 1, 2, 3, 4, 5, 7, 8]
    record = {"step_tokens": [2, 3], "step_token_ids": [[1, 2], [3, 4, 5]]}
    assert probe_prompts([50, 51], gen, record, [60], label_every=1) == [
        (0, [50, 51, 9, 1, 2, 60]), (1, [50, 51, 9, 1, 2, 3, 4, 5, 60])]
    assert [t for t, _ in probe_prompts([50], gen, record, [60], label_every=5)] == [1]


def test_problem_fields_labels() -> None:
    out = SimpleNamespace(outputs=[SimpleNamespace(
        text="<think>\nTry 5\n\nTry 7\n</think>\nThe answer is \\boxed{7}.", finish_reason="stop",
        token_ids=list(range(20)))])
    res = {"step_tokens": [3, 4, 2]}
    rec = {"id": "p1", "messages": [{"role": "user", "content": "q"}], "answer": "7"}
    f = _problem_fields("p1", rec, out, res, {0: "5", 1: "7", 2: "7"})
    assert f["labels"]["supervised"] == [0, 1, 1]
    assert f["labels"]["consistent"] == [0, 1, 1]
    assert f["final_answer"] == "7" and f["extra"]["final_correct"] is True
    wrong = {**rec, "answer": "8"}
    assert _problem_fields("p1", wrong, out, res, {0: "5", 2: "8"})["labels"] == {
        "consistent": [0, 0, 0], "supervised": [0, 0, 1]}


def test_each_trace_has_a_seed_of_its_own() -> None:
    """A trace's sampling seed depends on the collection's seed and the trace's id only, so a
    rerun, a shard or a pipelined schedule draws it the same (tests/test_shards_engine.py); it
    differs between traces (a prompt's samples included) and between seeds."""
    from orca_calibrate.collect import trace_seed

    keys = [f"p{i}" for i in range(50)] + [f"p0#{n}" for n in range(1, 8)]
    seeds = {trace_seed(0, k) for k in keys}
    assert len(seeds) == len(keys) and all(0 <= s < 2**32 for s in seeds)
    assert trace_seed(0, "p0") == trace_seed(0, "p0") != trace_seed(1, "p0")


def test_the_collector_keeps_prefills_whole_on_vllms_cpu_build() -> None:
    """Every trace is seeded, and vLLM 0.32's CPU build crashes on a seeded request prefilled in
    chunks (docs/KNOWN-ISSUES.md): refused before the engine starts."""
    from orca_calibrate.collect import Collector, CollectSettings
    from orca_serve.vllm_compat import launch

    if not launch.is_cpu_platform():
        pytest.skip("vLLM's CPU build only")
    for engine in ({"enable_chunked_prefill": True}, {"long_prefill_token_threshold": 64}):
        with pytest.raises(ValueError, match=f"collect.engine.{next(iter(engine))} is refused: "
                                             "on vLLM's CPU build a seeded request"):
            Collector("m", CollectSettings(engine=engine))
    # a step budget below the model's context length (derived from its config.json here)
    model = str(Path(__file__).parents[1] / "orca_serve" / "demo" / "model")
    with pytest.raises(ValueError, match="collect.engine.max_num_batched_tokens 256 is below the "
                                         "context length 1024: on vLLM's CPU build"):
        Collector(model, CollectSettings(engine={"max_num_batched_tokens": 256}))


def test_an_engine_argument_vllm_does_not_take_is_one_line() -> None:
    """A misspelt `collect.engine` key (or `--engine` of `gate`, `reweight`) ended in vLLM's
    traceback (exit 1); vLLM reads it when the engine is built, before any process starts."""
    from orca_calibrate.collect import Collector, CollectSettings

    model = str(Path(__file__).parents[1] / "orca_serve" / "demo" / "model")
    with pytest.raises(ValueError, match=r"^engine arguments \(collect.engine, --engine\): "
                                         r".*unexpected keyword argument 'tensor_paralel_size'"):
        Collector(model, CollectSettings(engine={"tensor_paralel_size": 1}))


def test_a_model_folder_without_config_is_one_line_before_vllm(tmp_path, capsys) -> None:
    """An empty folder as `collect --model` ended in vLLM's 8-line ModelConfig error; refused in
    one line before vLLM is imported, nothing written. A name that is no folder may be a hub id:
    left to vLLM. The config is looked for where vLLM reads it (`hf_config_path`)."""
    import sys

    from orca_calibrate.calibrate_cli import main
    from orca_calibrate.collect import Collector, CollectSettings

    (tmp_path / "m").mkdir()
    (tmp_path / "p.jsonl").write_text('{"id": "p0", "prompt": "a"}\n')
    vllm_loaded = "vllm" in sys.modules
    assert main(["collect", "--model", str(tmp_path / "m"), "--prompts",
                 str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"orca-calibrate collect: error: model folder {tmp_path / 'm'} has no "
                   "config.json: give the folder that holds the model's config.json, tokenizer "
                   "and weights, or a hub name"], err
    assert not (tmp_path / "o").exists() and ("vllm" in sys.modules) == vllm_loaded
    elsewhere = tmp_path / "config"
    elsewhere.mkdir()
    with pytest.raises(ValueError, match=f"model folder {elsewhere} has no config.json"):
        Collector(str(tmp_path / "m"), CollectSettings(engine={"hf_config_path": str(elsewhere)}))


def test_a_job_without_its_prompts_file_writes_nothing(tmp_path, capsys) -> None:
    """The shipped GPU jobs name prompts files they do not ship: `run` refuses such a job in one
    line, exit 2, and leaves no empty `out` folder behind (it made `runs/<job>` before reading
    the prompts)."""
    from orca_calibrate.calibrate_cli import main

    job = tmp_path / "job.yaml"
    job.write_text("model: Org/Model\nprompts: data/p.jsonl\nout: runs/job\n")
    assert main(["run", "--config", str(job)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"orca-calibrate run: error: prompts file {tmp_path / 'data' / 'p.jsonl'} "
                   "not found"], err
    assert not (tmp_path / "runs").exists()


def test_read_prompts_errors(tmp_path) -> None:
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n')
    with pytest.raises(ValueError, match="duplicate id"):
        read_prompts(p)
    p.write_text('{"id": 1}\n')
    with pytest.raises(ValueError, match="needs `id` and `messages`"):
        read_prompts(p)
    p.write_text('{"id": 1, "prompt": "a"}\n{"id": 2, "messages": []}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: `messages` is empty"):
        read_prompts(p)  # the engine's refusal named nothing but "prompt"
    with pytest.raises(FileNotFoundError):
        read_prompts(tmp_path / "nope.jsonl")
    p.write_bytes(b"\xcc\xff\n")
    with pytest.raises(ValueError, match=f"prompts file {p} is not text"):
        read_prompts(p)


def test_job_file_errors(tmp_path) -> None:
    j = tmp_path / "job.yaml"
    j.write_text("model: m\nprompts: p.jsonl\n")
    with pytest.raises(JobError, match="missing required key 'out'"):
        load_job(j)
    j.write_text("model: m\nprompts: p.jsonl\nout: o\ncollect: {temprature: 1}\n")
    with pytest.raises(JobError, match="unknown collect settings"):
        load_job(j)
    j.write_text("model: ./m\nprompts: p.jsonl\nout: o\n")
    with pytest.raises(JobError, match=f"model {tmp_path / 'm'} is not a folder"):
        load_job(j)  # a local path, checked before vLLM would take it for a hub id
    (tmp_path / "m").mkdir()
    with pytest.raises(JobError, match=f"job.yaml: model folder {tmp_path / 'm'} has no "
                                       "config.json: give the folder"):
        load_job(j)  # vLLM's 8-line pydantic error once the job had made its out folder
    (tmp_path / "m" / "config.json").write_text("{}")
    job = load_job(j)
    assert job["prompts"] == str(tmp_path / "p.jsonl") and job["model"] == str(tmp_path / "m")
    for text, words in [("model: [unclosed\n",
                         r"not valid YAML at line 2, column 1: expected ',' or ']'"),
                        ("model: m\nprompts: 5\nout: o\n", "prompts is a path \\(text\\), got 5"),
                        ("model: m\nprompts: p\nout: o\ncollect: abc\n",
                         "collect is a mapping of settings, got 'abc'"),
                        ("model: m\nprompts: p\nout: job.yaml\n",
                         "out .* is a file, not a folder")]:
        j.write_text(text)
        with pytest.raises(JobError, match=words):
            load_job(j)
    j.write_bytes(b"\xcc\xff")
    with pytest.raises(JobError, match="is not a text file"):
        load_job(j)


@pytest.mark.parametrize("blocks, words", [
    # a misspelt key used to fall back to the default deltas without a word
    ("calibrate: {delta: [0.1]}", r"calibrate: unknown keys \['delta'\] \(known: deltas, epsilon, "
                                  r"window, give_up, groups, consensus, gate\)"),
    ("calibrate: {deltas: [0.1, 1.5]}", r"calibrate: deltas are risk levels in \(0, 1\)"),
    ("calibrate: {deltas: []}", r"calibrate: deltas are risk levels"),
    ("calibrate: {deltas: 0.1}", r"calibrate.deltas is a list"),
    ("calibrate: {deltas: [0.1, 0.1]}", r"deltas are listed once each"),
    ("calibrate: {epsilon: 0}", r"calibrate: epsilon is in \(0, 1\), got 0"),
    ("calibrate: {window: 2.5}", r"calibrate: window is a whole number of steps"),
    ("calibrate: {window: 100000}", r"calibrate: window .* in \[1, 10000\], got 100000"),
    ("calibrate: [0.1]", r"calibrate is a mapping of settings, got \[0.1\]"),
    ("split: {fraction: [0.5, 0.3, 0.2]}", r"split: unknown keys \['fraction'\]"),
    ("split: {fractions: [0.5, 0.3]}", r"split: fractions are 3 non-negative numbers \(train, "),
    ("split: {fractions: [0.6, 0.3, 0.3]}", r"summing to 1, got \[0.6, 0.3, 0.3\]"),
    ("split: {seed: x}", r"split: seed is a whole number >= 0, got 'x'"),
    # these were found after the collection (hours on a real model), or after the training
    ("split: {seed: -1}", r"split: seed is a whole number >= 0, got -1"),
    ("split: {fractions: [0.9, 0.0, 0.1]}", r"split: fractions give the train and the "
                                           r"calibration split a share each"),
    ("train: {seed: -1}", r"train.seed is a whole number >= 0, got -1"),
    ("collect: {seed: -1}", r"collect.seed is a whole number >= 0, got -1"),
    # these failed after the collection (hours on a real model) or with a traceback
    ("collect: {samples: '2'}", r"collect.samples is a whole number >= 1, got '2'"),
    ("collect: {temperature: hot}", r"collect.temperature is a number in \[0, 2\], got 'hot'"),
    ("collect: {temperature: 2.5}", r"collect.temperature is a number in \[0, 2\], got 2.5"),
    ("collect: {top_p: 0}", r"collect.top_p is a number in \(0, 1\], got 0"),
    # the model authors' sampling (docs/RECIPES.md, "Sampling"): top_k 0 and min_p 0 are none
    ("collect: {top_k: -1}", r"collect.top_k is a whole number >= 0, got -1"),
    ("collect: {top_k: 20.5}", r"collect.top_k is a whole number >= 0, got 20.5"),
    ("collect: {min_p: 1.5}", r"collect.min_p is a number in \[0, 1\], got 1.5"),
    ("collect: {min_p: none}", r"collect.min_p is a number in \[0, 1\], got 'none'"),
    ("collect: {batch: 0}", r"collect.batch is a whole number >= 1, got 0"),
    ("collect: {dtype: int8}", r"collect.dtype is one of float16, float32, not 'int8'"),
    ("collect: {engine: x}", r"collect.engine is a mapping, got 'x'"),
    # these were read first when the collect stage built its engine, in pydantic's four lines
    ("collect: {segmentation: {keywordz: [wait]}}",
     r"collect.segmentation: invalid at 'keywordz': Extra inputs are not permitted$"),
    ("collect: {think: {force_text: 3}}",
     r"collect.think: invalid at 'force_text': Input should be a valid string \(got 3\)$"),
    ("train: {epochs: ten}", r"train.epochs is a whole number >= 1, got 'ten'"),
    ("train: {lr: fast}", r"train.lr is a number in \(0, 1\], got 'fast'"),
    ("train: {probe: nope}", r"train.probe is one of static, .*, not 'nope'"),
    ("train: {epoch_select: best}", r"train.epoch_select is one of validation, last"),
    ("train: {label_mode: supervized}",
     r"train.label_mode is one of supervised, consistent, judge \(the labels a collection "),
    ("calibrate: {give_up: {label_mode: consistent}}",
     r"calibrate.give_up: a give-up risk needs reference labels"),
    ("train: {batch_size: 40000}",
     r"train.lr is not set, and batch_size 40000 gives 1.17 by the batch rule .* at most 31622$"),
    ("calibrate: {give_up: {deltas: [2]}}",
     r"calibrate.give_up: deltas are risk levels in \(0, 1\)"),
    ("calibrate: {gate: {step: 2}}", r"calibrate.gate: unknown keys \['step'\] \(known: steps, "),
    ("calibrate: {gate: {steps: 0}}", r"calibrate.gate: steps is a whole number >= 1, got 0"),
    ("calibrate: {gate: {alpha: 0}}", r"calibrate.gate: alpha is a number in \(0, 1\), got 0"),
    ("calibrate: {gate: {rank: 1.5}}", r"calibrate.gate: rank is a whole number >= 1, got 1.5"),
    ("calibrate: {gate: {alpha: 0.1, give_up_alpha: 0.05}}",
     r"calibrate.gate: the give-up side's gate level \(0.05\) must be at least"),
    ("calibrate: {gate: [2]}", r"calibrate.gate is a mapping of settings, got \[2\]"),
])
def test_job_blocks_are_checked_when_read(tmp_path, blocks, words) -> None:
    """Every block's settings are typed when the job is read: a misspelt key or a value of the
    wrong type or out of range is one line naming it, before any stage runs."""
    j = tmp_path / "job.yaml"
    j.write_text(f"model: m\nprompts: p.jsonl\nout: o\n{blocks}\n")
    with pytest.raises(JobError, match=words):
        load_job(j)


def test_a_jobs_top_k_and_min_p_are_collect_settings(tmp_path) -> None:
    """A job samples as the model's authors advise (Qwen3 thinking mode: top_k 20, min_p 0);
    left out, neither is used (vLLM's 0), as before the settings existed."""
    j = tmp_path / "job.yaml"
    j.write_text("model: m\nprompts: p.jsonl\nout: o\n"
                 "collect: {temperature: 0.6, top_p: 0.95, top_k: 20, min_p: 0.05}\n")
    s = CollectSettings(**load_job(j)["collect"])
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.6, 0.95, 20, 0.05)
    assert (CollectSettings().top_k, CollectSettings().min_p) == (0, 0.0)


def test_job_split_and_calibrate_blocks_reach_the_stages(tmp_path) -> None:
    from orca_calibrate.job import job_split
    from orca_calibrate.job_options import DEFAULT_DELTAS, LttOptions, ltt_options, split_options

    j = tmp_path / "job.yaml"
    j.write_text("model: m\nprompts: p.jsonl\nout: o\nsplit: {fractions: [0.5, 0.5, 0], seed: 3}\n"
                 "calibrate: {deltas: [0.2, 0.1], window: 4, groups: {field: family}}\n")
    job = load_job(j)
    assert ltt_options(job["calibrate"]) == LttOptions((0.2, 0.1), 0.05, 4)
    assert ltt_options(None).deltas == DEFAULT_DELTAS
    parts = job_split([f"q{i}" for i in range(40)], split_options(job["split"]))
    assert set(parts.values()) == {"train", "calibration"}  # no test part at fraction 0


def test_a_jobs_gate_block_sets_the_bundles_gate(tmp_path, monkeypatch) -> None:
    """`calibrate.gate` is the gate the calibrate stage fits (steps, levels, rank); without it,
    the defaults (orca_method.shift_gate)."""
    import json

    import orca_calibrate.job
    from orca_calibrate.job import run_job
    from orca_method.bundle import decode_weights, load_bundle
    from orca_method.shift_gate import DEFAULT_GATE_ALPHA, DEFAULT_GATE_STEPS

    monkeypatch.setattr(orca_calibrate.job, "Collector", _FakeCollector)
    (tmp_path / "p.jsonl").write_text("".join(
        json.dumps({"id": f"q{i}", "prompt": "x", "answer": "1"}) + "\n" for i in range(60)))
    job = {"model": "m", "prompts": "p.jsonl", "out": "run", "train": {"epochs": 1},
           "calibrate": {"deltas": [0.3], "window": 2}}
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(job))
    run_job(path, progress=False)
    gate = load_bundle(tmp_path / "run" / "bundle.json").shift_gate
    assert (gate.steps, gate.alpha) == (DEFAULT_GATE_STEPS, DEFAULT_GATE_ALPHA)
    job["calibrate"]["gate"] = {"steps": 3, "alpha": 0.1, "rank": 2}
    path.write_text(json.dumps(job))
    assert "skipped" not in run_job(path, progress=False)[5]  # the calibrate stage reruns
    gate = load_bundle(tmp_path / "run" / "bundle.json").shift_gate
    assert (gate.steps, gate.alpha, gate.give_up_alpha) == (3, 0.1, 0.1)  # give-ups: >= alpha
    assert decode_weights(gate.tensors, "gate")["basis"].shape[0] <= 2  # its rank


def test_run_says_when_a_delta_certified_nothing(tmp_path, monkeypatch, capsys) -> None:
    """A job whose calibration split is too small for a delta ended with exit 0 and a bundle
    whose lambda* is "never" there, without a word (only the evaluation's zeros hinted)."""
    import json

    import orca_calibrate.job
    from orca_calibrate.calibrate_cli import main

    monkeypatch.setattr(orca_calibrate.job, "Collector", _FakeCollector)
    (tmp_path / "p.jsonl").write_text("".join(
        json.dumps({"id": f"q{i}", "prompt": "x", "answer": "1"}) + "\n" for i in range(60)))
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps({"model": "m", "prompts": "p.jsonl", "out": "run",
                                "train": {"epochs": 1},
                                "calibrate": {"deltas": [0.3, 0.001], "window": 2}}))
    assert main(["run", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "note: no lambda* certified for delta 0.001 (n_cal " in out
    assert "delta 0.3" not in out.split("note:")[1]  # a certified one is not named


def test_a_job_without_a_test_split_ends_with_its_bundle(tmp_path, monkeypatch) -> None:
    """`split.fractions` may give the test part nothing: the evaluate stage failed after the
    bundle was written; it now evaluates what there is (here nothing) and says so."""
    import json

    import orca_calibrate.job
    from orca_calibrate.job import run_job

    monkeypatch.setattr(orca_calibrate.job, "Collector", _FakeCollector)
    (tmp_path / "p.jsonl").write_text("".join(
        json.dumps({"id": f"q{i}", "prompt": "x", "answer": "1"}) + "\n" for i in range(60)))
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps({"model": "m", "prompts": "p.jsonl", "out": "run",
                                "train": {"epochs": 1}, "split": {"fractions": [0.5, 0.5, 0]},
                                "calibrate": {"deltas": [0.3], "window": 2}}))
    run_job(path, progress=False)
    assert json.loads((tmp_path / "run" / "evaluation.json").read_text()) == {}
    assert "no test part" in (tmp_path / "run" / "evaluation.md").read_text()


def test_job_give_up_policy_is_checked(tmp_path) -> None:
    """calibrate.give_up.policy: the give-up policy mu* is certified for (the server serves no
    other), refused in one line at load unless it is one the server has."""
    j = tmp_path / "job.yaml"
    base = "model: m\nprompts: p.jsonl\nout: o\ncalibrate: {give_up: {label_mode: supervised"
    j.write_text(base + ", policy: stop}}\n")
    with pytest.raises(JobError, match="calibrate.give_up.policy .* one of guess, message, "
                                       "not 'stop'"):
        load_job(j)
    j.write_text(base + ", policy: message}}\n")
    assert load_job(j)["calibrate"]["give_up"]["policy"] == "message"


def test_a_label_mode_is_refused_when_read_unless_the_collection_gives_it(tmp_path) -> None:
    """A side labelled `supervised` (train's default, and the give-up's) needs every prompt of
    every prompt file to carry its reference `answer`, a `judge` one a collect.judge block:
    such jobs failed at the train, calibrate or evaluate stage, after the collection."""
    import json

    def prompts(name: str, answered: int, bare: int = 0) -> None:
        (tmp_path / name).write_text("".join(json.dumps(
            {"id": f"{name[0]}{i}", "prompt": "x", **({"answer": "1"} if i < answered else {})})
            + "\n" for i in range(answered + bare)))

    j = tmp_path / "job.yaml"
    prompts("p.jsonl", 20, 1)
    j.write_text("model: m\nprompts: p.jsonl\nout: o\n")  # train.label_mode: supervised
    with pytest.raises(JobError, match=f"train.label_mode is supervised .* prompt 'p20' of "
                                       f"{tmp_path / 'p.jsonl'} has no answer"):
        load_job(j)
    j.write_text("model: m\nprompts: p.jsonl\nout: o\ntrain: {label_mode: consistent}\n")
    load_job(j)
    prompts("p.jsonl", 20)
    prompts("s.jsonl", 2, 1)
    j.write_text("model: m\nprompts: p.jsonl\nshifted_prompts: s.jsonl\nout: o\n"
                 "train: {label_mode: consistent}\ncalibrate: {give_up: {deltas: [0.1]}}\n")
    with pytest.raises(JobError, match="calibrate.give_up.label_mode is supervised .* prompt "
                                       "'s2' of .*s.jsonl has no answer"):
        load_job(j)
    prompts("s.jsonl", 3)
    load_job(j)
    j.write_text("model: m\nprompts: p.jsonl\nout: o\ntrain: {label_mode: consistent}\n"
                 "calibrate: {give_up: {label_mode: judge}}\n")
    with pytest.raises(JobError, match="calibrate.give_up.label_mode judge needs a "
                                       "collect.judge block"):
        load_job(j)
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "x", "answer": "1"}\n{"id": "a"}\n')
    with pytest.raises(JobError, match=f"job.yaml: {tmp_path / 'p.jsonl'}:2: each line needs"):
        load_job(j)  # a prompts file is read with the job
    (tmp_path / "p.jsonl").unlink()  # a recipe's data, not built yet: the run refuses it
    j.write_text("model: m\nprompts: p.jsonl\nout: o\n")
    load_job(j)


@pytest.mark.parametrize("n, settings, parts", [
    (1, "", "training part gets 1 trace.* calibration part 0 .*needs 2, LTT 1.*; 6 prompts"),
    (3, "split: {fractions: [0.5, 0.25, 0.25]}\n", "gets 2 .* calibration part 0 .*; 5 prompts"),
    (3, "split: {fractions: [0.2, 0.6, 0.2]}\n", "gets 1 .* part 1 .*needs 2.*; 11 prompts"),
])
def test_a_job_with_too_few_prompts_for_its_split_is_refused_when_read(tmp_path, n, settings,
                                                                       parts) -> None:
    """Prompts too few for the split to give training the problems it takes (2 for a TTT probe)
    and LTT a calibration trace failed at the train or calibrate stage, after the collection.
    The split's parts depend on the prompt count alone: it is refused when the job is read,
    with the count and a count that does; what only the collection shows (which traces are
    solvable) is left to the stages."""
    import json

    def prompts(count: int) -> None:
        (tmp_path / "p.jsonl").write_text("".join(
            json.dumps({"id": f"q{i}", "prompt": "x", "answer": "1"}) + "\n"
            for i in range(count)))

    j = tmp_path / "job.yaml"
    j.write_text(f"model: m\nprompts: p.jsonl\nout: o\n{settings}")
    prompts(n)
    with pytest.raises(JobError, match=f"p.jsonl holds {n} prompt\\(s\\), too few for "
                                       f"split.fractions .*{parts} or more give them"):
        load_job(j)
    enough = int(parts.rsplit(" ", 2)[-2])
    prompts(enough)
    load_job(j)


def test_the_split_check_counts_samples_and_the_probe(tmp_path) -> None:
    """A training part of one prompt holds its k samples, 2 problems for meta-training; the
    static probe's fit takes one: neither job is refused."""
    import json

    (tmp_path / "p.jsonl").write_text("".join(
        json.dumps({"id": f"q{i}", "prompt": "x", "answer": "1"}) + "\n" for i in range(2)))
    j = tmp_path / "job.yaml"
    fractions = "split: {fractions: [0.5, 0.5, 0]}\n"
    j.write_text(f"model: m\nprompts: p.jsonl\nout: o\n{fractions}")
    with pytest.raises(JobError, match="training part gets 1 trace"):
        load_job(j)
    j.write_text(f"model: m\nprompts: p.jsonl\nout: o\n{fractions}collect: {{samples: 2}}\n")
    load_job(j)
    j.write_text(f"model: m\nprompts: p.jsonl\nout: o\n{fractions}train: {{probe: static}}\n")
    load_job(j)


def test_a_consensus_holdout_leaving_a_side_empty_is_refused_when_read(tmp_path) -> None:
    """The consensus block holds a share of the calibration prompts out of lambda*'s
    calibration; with one calibration prompt a side is empty, which the calibrate stage found
    after the collection: the held-out split is by prompt and seeded, known when read."""
    import json

    def prompts(count: int) -> None:
        (tmp_path / "p.jsonl").write_text("".join(
            json.dumps({"id": f"q{i}", "prompt": "x", "answer": "1"}) + "\n"
            for i in range(count)))

    j = tmp_path / "job.yaml"
    j.write_text("model: m\nprompts: p.jsonl\nout: o\nsplit: {fractions: [0.5, 0.5, 0]}\n"
                 "collect: {samples: 2, temperature: 0.7}\ncalibrate: {consensus: {}}\n")
    prompts(2)  # one calibration prompt: all held out or none
    with pytest.raises(JobError, match=r"calibrate.consensus: consensus holdout 0.5 of 2 "
                                       r"calibration traces leaves one side empty"):
        load_job(j)
    prompts(8)
    load_job(j)


class _FakeCollector(FakeCollector):
    """Stands in for the vLLM collector (tests/test_toy_job.py runs the real one): writes a
    synthetic trajectory set for the prompts, so the job's own bookkeeping can be tested fast."""

    runs = 0

    def run(self, prompts: list, out, progress: bool, defer=None):
        from orca_calibrate.synth import generate

        _FakeCollector.runs += 1
        generate(out, n_problems=len(prompts), dim=8, mean_steps=12, seed=len(prompts))
        return SimpleNamespace(as_dict=lambda: {"trajectories": len(prompts)})


def test_rerun_follows_edits_and_refuses_changed_collection(tmp_path, monkeypatch) -> None:
    import json

    import orca_calibrate.job
    from orca_calibrate.job import run_job

    monkeypatch.setattr(orca_calibrate.job, "Collector", _FakeCollector)
    monkeypatch.setattr(_FakeCollector, "runs", 0)
    (tmp_path / "p.jsonl").write_text("".join(
        json.dumps({"id": f"q{i}", "prompt": "x", "answer": "1"}) + "\n" for i in range(60)))
    job = {"model": "m", "prompts": "p.jsonl", "out": "run", "collect": {"max_tokens": 64},
           "train": {"epochs": 1}, "calibrate": {"deltas": [0.3], "window": 2}}
    path = tmp_path / "job.yaml"

    def run(**edits) -> list[str]:
        path.write_text(json.dumps({**job, **edits}))
        return [line.split(":")[1].strip() for line in run_job(path, progress=False)]

    first = run()
    assert len(first) == 7 and all("skipped" not in x for x in first)
    assert run() == ["done already, skipped"] * 7
    # a new training setting reruns training and everything after it, nothing before
    got = run(train={"epochs": 2})
    assert got[:2] == ["done already, skipped"] * 2 and all("skipped" not in x for x in got[2:])
    assert json.loads((tmp_path / "run" / ".done-train").read_text())["settings"]
    got = run(train={"epochs": 2}, calibrate={"deltas": [0.3], "window": 1})
    assert got[:3] == ["done already, skipped"] * 3 and "skipped" not in got[3]
    assert _FakeCollector.runs == 1
    with pytest.raises(JobError, match="collect settings .* changed"):
        run(collect={"max_tokens": 128})
    assert (tmp_path / "run" / "trajectories" / "problems.jsonl").exists()  # nothing deleted


def test_job_train_settings_are_checked(tmp_path) -> None:
    j = tmp_path / "job.yaml"
    j.write_text("model: m\nprompts: p.jsonl\nout: o\ntrain: {epoch_selct: last}\n")
    with pytest.raises(JobError, match="unknown train settings"):
        load_job(j)
    j.write_text("model: m\nprompts: p.jsonl\nout: o\n"
                 "train: {probe: ttt-noqk, epoch_select: last, batch_size: 1, lr: 0.001}\n")
    assert load_job(j)["train"]["epoch_select"] == "last"


def test_run_ends_with_the_results_table(tmp_path, monkeypatch, capsys) -> None:
    """`orca-calibrate run` shows what the job produced, not only how long its stages took."""
    import json

    import orca_calibrate.job
    from orca_calibrate.calibrate_cli import main

    monkeypatch.setattr(orca_calibrate.job, "Collector", _FakeCollector)
    (tmp_path / "p.jsonl").write_text("".join(
        json.dumps({"id": f"q{i}", "prompt": "x", "answer": "1"}) + "\n" for i in range(60)))
    (tmp_path / "jobs").mkdir()
    path = tmp_path / "jobs" / "job.yaml"  # paths relative to it print normalised, no jobs/..
    path.write_text(json.dumps({"model": "m", "prompts": "../p.jsonl", "out": "../run",
                                "train": {"epochs": 1},
                                "calibrate": {"deltas": [0.3], "window": 2}}))
    assert main(["run", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert ".." not in out
    table = (tmp_path / "run" / "evaluation.md").read_text().rstrip()
    assert f"results ({tmp_path / 'run' / 'evaluation.md'}):\n{table}" in out
    assert "delta=0.3" in table and out.rstrip().endswith(f"bundle: {tmp_path / 'run' / 'bundle.json'}")


def test_a_job_with_give_up_writes_a_two_sided_bundle(tmp_path, monkeypatch) -> None:
    """`calibrate.give_up` fits the give-up probe and adds mu* per give-up delta (version 2);
    an unknown key in it is refused when the job is read."""
    import json

    import orca_calibrate.job
    from orca_calibrate.job import run_job
    from orca_method.bundle import load_bundle

    monkeypatch.setattr(orca_calibrate.job, "Collector", _FakeCollector)
    (tmp_path / "p.jsonl").write_text("".join(
        json.dumps({"id": f"q{i}", "prompt": "x", "answer": "1"}) + "\n" for i in range(80)))
    job = {"model": "m", "prompts": "p.jsonl", "out": "run", "train": {"epochs": 1},
           "calibrate": {"deltas": [0.3], "window": 2,
                         "give_up": {"deltas": [0.2, 0.3], "epsilon": 0.1}}}
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(job))
    run_job(path, progress=False)
    bundle = load_bundle(tmp_path / "run" / "bundle.json")
    assert bundle.schema_version == 2 and bundle.give_up.label_mode == "supervised"
    assert bundle.give_up_deltas() == [0.2, 0.3] and bundle.give_up.window == 2
    assert bundle.mu(0.2) <= bundle.mu(0.3)
    job["calibrate"]["give_up"] = {"detlas": [0.2]}
    path.write_text(json.dumps(job))
    with pytest.raises(JobError, match="calibrate.give_up is a mapping of"):
        load_job(path)


def test_run_help_says_what_config_is(capsys) -> None:
    from orca_calibrate.calibrate_cli import main

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "--config JOB.yaml the job file (YAML" in " ".join(capsys.readouterr().out.split())


def test_run_keeps_the_resource_trackers_leftover_report_out(tmp_path, monkeypatch) -> None:
    """`run` and `collect` start Python's resource tracker with QUIET_TRACKER, so its exit
    report on shared memory left by force-killed vLLM workers (it unlinks it) no longer follows
    the job's table; shown here on a segment leaked on purpose."""
    import subprocess
    import sys

    from orca_calibrate.calibrate_cli import QUIET_TRACKER, main

    monkeypatch.setattr(sys, "warnoptions", [])
    assert main(["run", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert sys.warnoptions == [QUIET_TRACKER]
    leak = ("from multiprocessing import shared_memory\n"
            "m = shared_memory.SharedMemory(create=True, size=16)\nprint('table')")
    for opts, reported in (([], True), (["-W", QUIET_TRACKER], False)):
        r = subprocess.run([sys.executable, *opts, "-c", leak], capture_output=True, text=True,
                           timeout=60, check=True)
        assert r.stdout == "table\n" and ("leaked shared_memory" in r.stderr) == reported


def test_a_job_with_groups_calibrates_each_tagged_group(tmp_path, monkeypatch, capsys) -> None:
    """`calibrate.groups` ({field, min_n}) adds a table per group of the calibration split's
    traces (the fake collection tags every problem `family: in-dist`); a malformed block is
    refused when the job is read."""
    import json

    import orca_calibrate.job
    from orca_calibrate.job import run_job
    from orca_method.bundle import load_bundle

    monkeypatch.setattr(orca_calibrate.job, "Collector", _FakeCollector)
    (tmp_path / "p.jsonl").write_text("".join(
        json.dumps({"id": f"q{i}", "prompt": "x", "answer": "1"}) + "\n" for i in range(80)))
    job = {"model": "m", "prompts": "p.jsonl", "out": "run", "train": {"epochs": 1},
           "calibrate": {"deltas": [0.3], "window": 2,
                         "groups": {"field": "family", "min_n": 5}}}
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(job))
    run_job(path, progress=False)
    bundle = load_bundle(tmp_path / "run" / "bundle.json")
    assert list(bundle.groups) == ["in-dist"]
    assert bundle.groups["in-dist"].ltt.n_cal == bundle.ltt.n_cal  # one group: the whole split
    for bad, words in (({"field": "family", "min": 3}, "calibrate.groups is a mapping of"),
                       ({"field": "family", "min_n": 0}, "min_n >= 1"),
                       ({"field": "family", "min_n": "x"}, "min_n 'x'"), ("family", "mapping")):
        job["calibrate"]["groups"] = bad
        path.write_text(json.dumps(job))
        with pytest.raises(JobError, match=words):
            load_job(path)


class _GroupCollector(_FakeCollector):
    """Collects a set of the family its folder is named for, with no split (as the job's
    collector leaves a set it does not split)."""

    def run(self, prompts: list, out, progress: bool, defer=None):
        from orca_calibrate.synth import generate_mixture
        from orca_method.trajectories import set_splits

        if out.parent.name != "trajectories-groups":
            return super().run(prompts, out, progress, defer)
        _FakeCollector.runs += 1
        generate_mixture(out, {out.name: len(prompts)}, dim=8, mean_steps=12, seed=3)
        set_splits(out, {p.id: None for p in TrajectorySet.open(out).problems})
        return SimpleNamespace(as_dict=lambda: {"trajectories": len(prompts)})


def test_group_prompts_calibrate_groups_apart_from_the_job(tmp_path, monkeypatch) -> None:
    """`group_prompts` files are collected by the job's collector into
    out/trajectories-groups/<stem> and each group found there is certified on those traces
    only; the main table is the one the job certifies without them, and a rerun collects
    nothing again. group_prompts without calibrate.groups, or two files of one stem, are
    refused when the job is read."""
    import json

    import orca_calibrate.job
    from orca_calibrate.job import run_job
    from orca_method.bundle import load_bundle

    monkeypatch.setattr(orca_calibrate.job, "Collector", _GroupCollector)
    monkeypatch.setattr(_FakeCollector, "runs", 0)
    for name, n in (("p", 80), ("shifted", 60), ("sub/in-dist", 10)):
        (tmp_path / f"{name}.jsonl").parent.mkdir(exist_ok=True)
        (tmp_path / f"{name}.jsonl").write_text("".join(
            json.dumps({"id": f"{name}{i}", "prompt": "x", "answer": "1"}) + "\n"
            for i in range(n)))
    job = {"model": "m", "prompts": "p.jsonl", "out": "run", "train": {"epochs": 1},
           "calibrate": {"deltas": [0.3], "window": 2}}
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(job))
    run_job(path, progress=False)
    alone = load_bundle(tmp_path / "run" / "bundle.json")
    job = {**job, "group_prompts": ["shifted.jsonl", "sub/in-dist.jsonl"],
           "calibrate": {**job["calibrate"], "groups": {"field": "family", "min_n": 20}}}
    path.write_text(json.dumps(job))
    log = run_job(path, progress=False)
    assert [x.split(":")[1].strip() for x in log][:3] == ["done already, skipped"] * 3
    bundle = load_bundle(tmp_path / "run" / "bundle.json")
    assert list(bundle.groups) == ["shifted"]  # in-dist's 10 traces are below min_n
    shifted = TrajectorySet.open(tmp_path / "run" / "trajectories-groups" / "shifted")
    assert bundle.groups["shifted"].ltt.n_cal <= len(shifted) == 60
    assert bundle.ltt == alone.ltt and bundle.probe == alone.probe
    runs = _FakeCollector.runs
    run_job(path, progress=False)
    assert _FakeCollector.runs == runs  # collected already: no engine, nothing again
    for edit, words in (({"calibrate": {"deltas": [0.3]}}, "add calibrate.groups"),
                        ({"group_prompts": ["shifted.jsonl", "x/shifted.jsonl"]}, "stems"),
                        ({"group_prompts": "shifted.jsonl"}, "list of prompt files")):
        path.write_text(json.dumps({**job, **edit}))
        with pytest.raises(JobError, match=words):
            load_job(path)


class _FakeEngine(_FakeCollector):
    """A fake engine that answers probes: synthetic traces (orca_calibrate/synth.py) with an
    answer at every step, recorded by the collector's own record code (`trajectory_fields`,
    and for deferred traces the collector's pending records), so every-step and selective
    labelling of one job can be compared on the same traces without vLLM."""

    probes = 0

    def __init__(self, model: str, settings) -> None:
        super().__init__(model, settings)
        self.stats = SimpleNamespace(answer_probes=0, probe_s=0.0)

    @staticmethod
    def trace(key: str):
        import zlib

        import numpy as np

        from orca_calibrate.synth import FAMILIES, _problem, world

        rng = np.random.default_rng(zlib.crc32(key.encode()))
        return _problem(rng, FAMILIES["in-dist"], world(8), 14)

    def run(self, prompts: list, out, progress: bool, defer=None):
        import json

        from orca_calibrate.collect import PENDING_FILE, _deferred_fields
        from orca_method.answer_probes import trajectory_fields
        from orca_method.trajectories import TrajectoryWriter

        with TrajectoryWriter(out, dim=8, dtype="float32", model="m") as writer:
            for rec in prompts:
                key = str(rec["id"])
                fields, emb = self.trace(key)
                n = len(fields["step_answers"])
                p = {"id": key, "rec": {**rec, "answer": fields["answer"]}, "text": "",
                     "finish_reason": "stop", "completion_tokens": sum(fields["step_tokens"]),
                     "step_tokens": fields["step_tokens"], "prompt_ids": [],
                     "gen_ids": list(range(n)), "step_ends": list(range(1, n + 1))}
                if defer is not None and defer(key):
                    with open(out / PENDING_FILE, "a") as f:
                        f.write(json.dumps(p) + "\n")
                    record = _deferred_fields(p, {})
                else:
                    _FakeEngine.probes += n
                    record = trajectory_fields(key, p["rec"], text="", finish_reason="stop",
                                               completion_tokens=p["completion_tokens"],
                                               step_tokens=p["step_tokens"],
                                               probed=dict(enumerate(fields["step_answers"])))
                writer.append(record, emb)
        return SimpleNamespace(as_dict=lambda: {"trajectories": len(prompts)})

    def probe_steps(self, traces: list) -> list[dict]:
        out = []
        for _, _, p, steps in traces:
            answers = self.trace(p["id"])[0]["step_answers"]
            out.append({t: answers[t] for t in steps})
            _FakeEngine.probes += len(steps)
        return out


def test_selective_labelling_certifies_what_every_step_labelling_does(tmp_path, monkeypatch):
    """The job with `collect.label_steps: selective` collects the calibration split unprobed,
    trains, then probes only the steps LTT reads: its bundle's tables (lambda* per delta, mu*
    per give-up delta, with risks, p-values and savings) equal the every-step job's on the
    same traces, for fewer probes. Editing the split afterwards is a changed collection."""
    import json

    import orca_calibrate.job
    from orca_calibrate.job import run_job
    from orca_method.bundle import load_bundle
    from orca_method.trajectories import TrajectorySet

    monkeypatch.setattr(orca_calibrate.job, "Collector", _FakeEngine)
    (tmp_path / "p.jsonl").write_text("".join(
        json.dumps({"id": f"q{i}", "prompt": "x", "answer": "1"}) + "\n" for i in range(240)))
    bundles, probes = {}, {}
    for mode in ("every", "selective"):
        monkeypatch.setattr(_FakeEngine, "probes", 0)
        job = {"model": "m", "prompts": "p.jsonl", "out": mode,
               "collect": {"label_steps": mode}, "split": {"fractions": [0.4, 0.4, 0.2]},
               "train": {"epochs": 2, "label_mode": "consistent"},
               "calibrate": {"deltas": [0.1, 0.2, 0.3], "window": 2,
                             "give_up": {"deltas": [0.1, 0.2], "label_mode": "supervised"}}}
        path = tmp_path / f"{mode}.yaml"
        path.write_text(json.dumps(job))
        run_job(path, progress=False)
        bundles[mode], probes[mode] = load_bundle(tmp_path / mode / "bundle.json"), _FakeEngine.probes
    every, sel = bundles["every"], bundles["selective"]
    assert sel.ltt == every.ltt and sel.give_up.ltt == every.give_up.ltt
    assert any(r.lam is not None for r in every.ltt.rows)  # a certificate worth comparing
    assert probes["selective"] < probes["every"]
    stats = json.loads((tmp_path / "selective" / "label-stats.json").read_text())
    assert stats["answer_probes"] < stats["every_step_probes"] and stats["rounds"] >= 1
    ts = TrajectorySet.open(tmp_path / "selective" / "trajectories")
    cal = ts.split("calibration")
    assert cal and all(ts.problems[i].extra["selective"]["resolved"] ==
                       {"stop": "consistent", "give_up": "supervised"} for i in cal)
    assert not any("selective" in (ts.problems[i].extra or {}) for i in ts.split("train"))
    job["split"] = {"fractions": [0.5, 0.3, 0.2]}
    path.write_text(json.dumps(job))
    with pytest.raises(JobError, match="collect settings .* changed"):
        run_job(path, progress=False)


def test_plan_scales_the_pilot_to_the_job(tmp_path, monkeypatch, capsys) -> None:
    """`orca-calibrate plan` runs the job's collection on a random pilot of its prompts and one
    epoch of its training, then scales per-trace figures to the whole job (the fake engine's
    times are what it measured; the arithmetic is the plan's)."""
    import json

    import orca_calibrate.plan
    from orca_calibrate.calibrate_cli import main
    from orca_calibrate.collect import Stats

    class Timed(_FakeEngine):
        def __init__(self, model: str, settings) -> None:
            super().__init__(model, settings)
            self.llm = SimpleNamespace(llm_engine=SimpleNamespace(model_config=SimpleNamespace(
                get_hidden_size=lambda: 8)))

        def run(self, prompts, out, progress, defer=None):
            super().run(prompts, out, progress, defer)
            return Stats(generate_s=2.0 * len(prompts), probe_s=1.0 * len(prompts),
                         answer_probes=_FakeEngine.probes)

    monkeypatch.setattr(orca_calibrate.plan, "Collector", Timed)
    monkeypatch.setattr(_FakeEngine, "probes", 0)
    (tmp_path / "p.jsonl").write_text("".join(
        json.dumps({"id": f"q{i}", "prompt": "x", "answer": "1"}) + "\n" for i in range(100)))
    (tmp_path / "job.yaml").write_text(json.dumps({
        "model": "m", "prompts": "p.jsonl", "out": "run", "collect": {"dtype": "float16"},
        "split": {"fractions": [0.5, 0.25, 0.25]}, "train": {"epochs": 4}}))
    assert main(["plan", "--config", str(tmp_path / "job.yaml"), "--pilot", "20"]) == 0
    plan = json.loads((tmp_path / "run" / "plan" / "trajectories" / ".." / "plan.json").read_text())
    assert plan["pilot_traces"] == 20 and plan["job_traces"] == 100
    assert plan["train_traces"] == 50 and plan["epochs"] == 4
    assert plan["collect_s"] == pytest.approx(plan["engine_start_s"] + 100 * 3.0)
    assert plan["train_s"] == pytest.approx(plan["train_s_per_trace_epoch"] * 50 * 4)
    assert plan["embeddings_bytes"] == pytest.approx(100 * plan["steps_per_trace"] * 8 * 2)
    assert plan["probes_per_trace"] == pytest.approx(plan["steps_per_trace"])  # every step
    # record mode's device memory: the job's batch (64 by default) of the pilot's longest traces
    pilot = TrajectorySet.open(tmp_path / "run" / "plan" / "trajectories")
    longest = max(p.n_steps for p in pilot.problems)
    assert plan["longest_steps"] == longest >= plan["steps_per_trace"]
    assert plan["record_device_bytes"] == 64 * longest * 8 * 4
    out = capsys.readouterr().out
    assert "disk:" in out and "device memory:" in out
