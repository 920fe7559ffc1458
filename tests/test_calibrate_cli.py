"""`orca-calibrate`'s options: one default per meaning for the embeddings' dtype."""

from types import SimpleNamespace

import pytest

from orca_calibrate.calibrate_cli import build_parser
from orca_calibrate.collect import CollectSettings
from orca_method.trajectories import RECORDED_DTYPE, STORED_DTYPE

REQUIRED = {"synth": ["--out", "o"], "import-pickle": ["x.pkl", "--out", "o"],
            "collect": ["--model", "m", "--prompts", "p", "--out", "o"]}


@pytest.mark.parametrize("cmd, default", [("synth", STORED_DTYPE), ("import-pickle", STORED_DTYPE),
                                          ("collect", RECORDED_DTYPE)])
def test_the_stored_embeddings_dtype_has_one_default_per_meaning(cmd, default):
    """Given numbers are stored compactly, recorded ones as the server's probe reads them; the
    option names the stored dtype (vLLM's `--dtype` spelling stays an alias)."""
    p = build_parser()
    assert p.parse_args([cmd, *REQUIRED[cmd]]).dtype == default
    other = "float32" if default == "float16" else "float16"
    for flag in ("--embeddings-dtype", "--dtype"):
        assert p.parse_args([cmd, *REQUIRED[cmd], flag, other]).dtype == other
    assert CollectSettings().dtype == RECORDED_DTYPE != STORED_DTYPE


@pytest.mark.parametrize("argv, words", [
    (["synth", "--out", "o", "--problems", "-1"], "argument --problems: must be >= 1, got -1"),
    (["synth", "--out", "o", "--problems", "many"], "not an integer: 'many'"),
    (["synth", "--out", "o", "--bogus"], "unrecognized arguments: --bogus"),
    (["synth"], "the following arguments are required: --out"),
    ([], "the following arguments are required: cmd"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["calibrate", "--data", "d", "--probe", "p", "--out", "o", "--pvalue", "z"],
     "invalid choice: 'z'"),
    (["calibrate", "--data", "d", "--probe", "p", "--out", "o", "--window", "0"],
     "must be >= 1, got 0"),
    (["calibrate", "--data", "d", "--probe", "p", "--out", "o", "--delta", "0.1", "1.5"],
     "argument --delta: must be in (0, 1), got 1.5"),
    (["calibrate", "--data", "d", "--probe", "p", "--out", "o", "--epsilon", "0"],
     "argument --epsilon: must be in (0, 1), got 0.0"),
    (["collect", "--model", "m", "--prompts", "p", "--out", "o", "--batch", "0"],
     "must be >= 1, got 0"),
    (["collect", "--model", "m", "--prompts", "p", "--out", "o", "--top-k", "-1"],
     "argument --top-k: must be >= 0, got -1"),
    (["collect", "--model", "m", "--prompts", "p", "--out", "o", "--min-p", "1.5"],
     "argument --min-p: must be in [0, 1], got 1.5"),
    # these named no option ("expected non-negative integer"), or failed after generating
    (["synth", "--out", "o", "--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    # found after the training (a traceback), or written into the working folder
    (["train", "--data", "d", "--out", "."], "argument --out: '.' is a folder: give a file path"),
    (["calibrate", "--data", "d", "--probe", "p", "--out", "."], "argument --out: '.' is a folder"),
    (["synth", "--out", ""], "argument --out: is empty: give a folder path"),
    (["gate", "--model", "m", "--bundle", "b", "--prompts", "p", "--out", "o",
      "--fit-fraction", "nan"], "argument --fit-fraction: must be in (0, 1), got nan"),
])
def test_a_bad_option_is_one_line(argv, words, capsys):
    """docs/CALIBRATE.md: bad input ends with one line on stderr and exit code 2 (no usage)."""
    from orca_calibrate.calibrate_cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # the subcommand's parser names it; unknown options are the top parser's to report
    prog = "orca-calibrate" if not argv or argv[0] == "frobnicate" or "--bogus" in argv \
        else f"orca-calibrate {argv[0]}"
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    assert words in err[0] and "--help lists the options" in err[0] and "usage" not in err[0]


def test_collect_samples_with_the_top_k_and_min_p_it_is_given(tmp_path, monkeypatch):
    """`collect --top-k/--min-p` reach the collector's settings (the model authors' sampling,
    docs/RECIPES.md); left out, neither is used, as before the options existed."""
    import contextlib

    import orca_calibrate.calibrate_cli as cli
    from orca_calibrate.collect import Stats

    seen = []

    @contextlib.contextmanager
    def collector(model, settings):
        seen.append(settings)
        yield SimpleNamespace(run=lambda prompts, out: Stats())

    monkeypatch.setattr(cli, "Collector", collector)
    (tmp_path / "p.jsonl").write_text('{"id": "p0", "prompt": "x"}\n')
    argv = ["collect", "--model", "m", "--prompts", str(tmp_path / "p.jsonl"), "--out",
            str(tmp_path / "o")]
    assert cli.main(argv) == 0
    assert cli.main([*argv, "--top-k", "20", "--min-p", "0.05"]) == 0
    assert [(s.top_k, s.min_p) for s in seen] == [(0, 0.0), (20, 0.05)]
    assert (seen[0].top_k, seen[0].min_p) == (CollectSettings().top_k, CollectSettings().min_p)


def test_synth_writes_nothing_for_a_negative_count(tmp_path, capsys):
    from orca_calibrate.calibrate_cli import main

    assert main(["synth", "--out", str(tmp_path / "s"), "--problems", "-1"]) == 2
    assert not (tmp_path / "s").exists() and "wrote" not in capsys.readouterr().out


def test_synth_refuses_a_set_the_disk_cannot_hold(tmp_path, capsys):
    """10^11 problems started writing (11.5 GB before it was killed); refused before writing,
    naming the estimate (problems x mean steps x dim x stored dtype), the free space and the
    flags to lower. A resumed set needs only what it has not written yet."""
    from orca_calibrate.calibrate_cli import main
    from orca_calibrate.synth import disk_room

    out = tmp_path / "a" / "s"
    assert main(["synth", "--out", str(out), "--problems", str(10**11)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs about 1,192,092.9 GiB of step embeddings" in err[0], err
    assert "GiB free where --out is; lower --problems, --steps or --dim" in err[0]
    assert not (tmp_path / "a").exists()
    assert disk_room(out, 8, 4, 5, "float32")[0] == 8 * 5 * 4 * 4
    assert main(["synth", "--out", str(out), "--problems", "8", "--dim", "4", "--steps", "5",
                 "--dtype", "float32"]) == 0
    written = (out / "embeddings.bin").stat().st_size
    assert disk_room(out, 8, 4, 5, "float32")[0] == max(8 * 5 * 4 * 4 - written, 0)


def test_wrong_files_are_one_line_not_a_traceback(tmp_path, capsys):
    """An output path that is a file, a probe that is not one: one line and exit 2 (they were
    tracebacks: FileExistsError, safetensors' header error)."""
    from orca_calibrate.calibrate_cli import main

    not_probe = tmp_path / "probe.json"
    not_probe.write_text("{}")
    assert main(["synth", "--out", str(tmp_path / "data"), "--problems", "8", "--dim", "4",
                 "--steps", "5"]) == 0
    capsys.readouterr()
    cases = [(["synth", "--out", str(not_probe), "--problems", "5"], "File exists"),
             (["calibrate", "--data", str(tmp_path / "data"), "--probe", str(not_probe),
               "--out", str(tmp_path / "b.json")], "is not a probe file (safetensors)"),
             (["calibrate", "--data", str(tmp_path / "data"), "--probe", str(tmp_path),
               "--out", str(tmp_path / "b.json")], "not found (or not a file)")]
    for argv, words in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], (argv, err)


def test_gate_refuses_a_give_up_level_below_its_alpha(bundle_path, tmp_path, capsys):
    """Before any engine starts: one line, exit 2 (docs/METHOD.md section 11)."""
    from orca_calibrate.calibrate_cli import main

    out = tmp_path / "gated.json"
    assert main(["gate", "--model", "m", "--bundle", str(bundle_path), "--prompts", "p",
                 "--out", str(out), "--alpha", "0.05", "--give-up-alpha", "0.02"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--give-up-alpha" in err[0] and "at least the stop side's" in err[0]
    assert not out.exists()


def test_gate_adds_the_gate_its_flags_ask_for(bundle_path, tmp_path, monkeypatch, capsys):
    """`orca-calibrate gate` fits the gate on the prompts' first-step features (a fake engine
    here: the features drawn at random) with its flags' steps, levels and rank, and seals it."""
    import contextlib

    import numpy as np

    import orca_calibrate.gate as gate
    from orca_calibrate.calibrate_cli import main
    from orca_method.bundle import decode_weights, load_bundle

    hidden = load_bundle(bundle_path).model.hidden_size
    seen = {}

    @contextlib.contextmanager
    def collector(model, bundle, **kw):
        yield "engine"

    def features(engine, prompts, steps):
        seen["steps"] = steps
        return np.random.default_rng(0).normal(size=(40, hidden))

    monkeypatch.setattr(gate, "gate_collector", collector)
    monkeypatch.setattr(gate, "first_step_features", features)
    (tmp_path / "p.jsonl").write_text('{"id": "p0", "prompt": "x"}\n')
    out = tmp_path / "gated.json"
    assert main(["gate", "--model", "m", "--bundle", str(bundle_path), "--prompts",
                 str(tmp_path / "p.jsonl"), "--out", str(out), "--steps", "2", "--alpha", "0.1",
                 "--rank", "3"]) == 0
    g = load_bundle(out).shift_gate
    assert seen["steps"] == 2 and (g.steps, g.alpha, g.give_up_alpha, g.n_fit) == (2, 0.1, 0.1, 20)
    assert decode_weights(g.tensors, "gate")["basis"].shape[0] <= 3
    assert "shift gate on 2 step(s), fitted on 20 prompts" in capsys.readouterr().out


def test_sigterm_unwinds_as_ctrl_c_does(tmp_path):
    """The command under SIGTERM (a scheduler's stop) raises as under Ctrl-C, so a stage's
    engines are shut down on the way out (the process used to die at once, its vLLM engine and
    worker running on, orphaned; measured by hand on a job's collection: now gone in seconds), and
    ends with one line and exit 130; a second SIGTERM does not cut the clean-up short."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from orca_calibrate.calibrate_cli import main; "
         "sys.argv[0] = 'orca-calibrate'; sys.exit(main())", "synth", "--out",
         str(tmp_path / "s"), "--problems", "5000000", "--dim", "8", "--steps", "2"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    def catches_sigterm() -> bool:  # the handler installed (Linux: the caught-signals mask)
        status = Path(f"/proc/{proc.pid}/status").read_text()
        mask = int(next(x for x in status.splitlines() if x.startswith("SigCgt:")).split()[1], 16)
        return bool(mask >> (signal.SIGTERM - 1) & 1)

    deadline = time.monotonic() + 60
    while not catches_sigterm() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # the synthesis under way
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-500:]
    assert err.strip().splitlines()[-1].startswith("orca-calibrate synth: interrupted")
    assert "Traceback" not in err
