"""`orca-calibrate`'s options: one default per meaning for the embeddings' dtype."""

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
