"""`orca-serve --check-vllm`: every touch point of orca_serve/vllm_compat resolved, no engine.

The real check runs on the installed vLLM (a supported release: all must resolve); the failure
paths run on a fake compat module whose touch points name things that do not exist.
"""

from __future__ import annotations

import types

import pytest

from orca_serve.startup import cli as cli
from orca_serve.startup import vllm_check as touch_points
from orca_serve.startup.vllm_check import check, resolve


def test_installed_vllm_resolves_every_touch_point(capsys):
    results = check()
    assert results and all(r.found is not None for r in results), \
        [(r.entry, r.error) for r in results if r.found is None]
    assert touch_points.main("vLLM here") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "vLLM here" and lines[-1] == f"{len(results)} of {len(results)} touch " \
        "points resolve"
    assert sum(line.startswith("ok ") for line in lines) == len(results)


@pytest.fixture
def fake_compat(monkeypatch):
    """A compat package of one module: one present name, one moved (second alternative
    present), one gone."""
    points = ("json:dumps", "json:no_such_name | json:JSONDecoder.decode",
              "json.no_such_module:x | json:gone.deeper")
    mod = types.ModuleType("orca_serve.vllm_compat.fake")
    mod.TOUCH_POINTS = points
    monkeypatch.setattr(touch_points, "compat_modules", lambda: iter([(mod.__name__, points)]))
    return points


def test_alternatives_and_missing_names(fake_compat):
    ok, moved, gone = (resolve("m", e) for e in fake_compat)
    assert ok.found == "json:dumps" and moved.found == "json:JSONDecoder.decode"
    assert gone.found is None and gone.error.startswith("AttributeError")


def test_check_vllm_exits_1_with_one_line_per_touch_point(fake_compat, monkeypatch, capsys):
    def refuse(*_a, **_k):
        raise RuntimeError("vLLM 9.9 is not supported")

    # the check runs before (and whatever) the supported-version check says
    monkeypatch.setattr("orca_serve.startup.preflight.check_vllm_version", refuse)
    with pytest.raises(SystemExit) as e:
        cli.main(["--check-vllm"])
    assert e.value.code == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 + len(fake_compat)
    assert [line.split()[0] for line in out[1:-1]] == ["ok", "ok", "MISSING"]
    assert "json.no_such_module:x | json:gone.deeper" in out[3] and "AttributeError" in out[3]
    assert out[-1].startswith("2 of 3 touch points resolve; 1 missing")


def test_check_vllm_takes_no_other_option(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--check-vllm", "--model", "m"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == "orca-serve: error: --check-vllm takes no other option"


def test_help_where_vllm_cannot_build_its_parser(monkeypatch, capsys):
    """vLLM 0.33's GPU wheel on a machine without a GPU fails building its own parser (its
    option defaults need the device): --help still lists ours and says why vLLM's are missing."""
    from orca_serve.vllm_compat import launch

    def no_device(*_a, **_k):
        raise RuntimeError("Failed to infer device type, please set the environment variable\n"
                           "more")

    monkeypatch.setattr(launch, "serve_parser", no_device)
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--calib" in out and "--orca-delta" in out and "--check-vllm" in out
    assert out.rstrip().splitlines()[-1] == ("vLLM's own options are not listed: vLLM cannot "
                                             "build its parser here (Failed to infer device "
                                             "type, please set the environment variable)")
    with pytest.raises(RuntimeError, match="infer device"):  # not asking for help: vLLM's error
        cli.main(["--model", "m"])
