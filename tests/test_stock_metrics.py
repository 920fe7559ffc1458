"""The parts of orca metrics on a stock vLLM server that run without an engine
(orca_serve/metrics/stock.py, orca_serve/metrics/snapshots.py); the served path is
tests/test_stock_vllm.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from orca_serve.metrics import snapshots
from orca_serve.metrics import stock as stock_metrics
from orca_serve.metrics.snapshots import ENV_SERVER, metrics_dir, read_snapshots
from orca_serve.metrics.stock import OrcaStatLogger, PublishedStats


def _config(orca: dict | None) -> SimpleNamespace:
    return SimpleNamespace(additional_config={"orca": orca} if orca is not None else {},
                           model_config=SimpleNamespace(served_model_name=["m"], model="/x/m"))


def test_a_worker_finds_the_directory_of_its_api_server():
    """Two generations down (API server -> engine core -> worker), as vLLM starts them."""
    d = metrics_dir(os.getpid())
    d.mkdir(exist_ok=True)
    try:
        code = ("import subprocess, sys; print(subprocess.run([sys.executable, '-c', "
                "'from orca_serve.metrics.snapshots import _ancestor_dir; print(_ancestor_dir())'],"
                " capture_output=True, text=True).stdout.strip())")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()}, check=True)
        assert out.stdout.strip() == str(d)
    finally:
        d.rmdir()


def test_no_publisher_in_orca_serves_processes(monkeypatch):
    """orca-serve fetches the stats itself: its engine processes (ENV_SERVER inherited) start
    no thread that would write snapshots into an ancestor's directory."""
    monkeypatch.setattr(snapshots, "_publisher", None)
    monkeypatch.setenv(ENV_SERVER, "1")
    snapshots.start_publisher()
    assert snapshots._publisher is None
    monkeypatch.setattr(snapshots, "_publish_forever", lambda: None)
    monkeypatch.delenv(ENV_SERVER)
    snapshots.start_publisher()  # a stock server's process: one thread, as before
    assert snapshots._publisher is not None
    snapshots._publisher.join(10)


def test_collector_sums_workers_and_never_goes_down(tmp_path):
    (tmp_path / "1.json").write_text(json.dumps({"probe_ns": 2_000_000_000, "engine_steps": 10,
                                                 "steps_scored": 4, "deployments": 1}))
    (tmp_path / "2.json").write_text(json.dumps({"probe_ns": 1_000_000_000, "engine_steps": 5,
                                                 "steps_scored": 3, "deployments": 2}))
    (tmp_path / ".3.tmp").write_text("{half")  # being written: not read
    assert len(read_snapshots(tmp_path)) == 2
    reg = CollectorRegistry()
    reg.register(PublishedStats(tmp_path, "m"))
    text = generate_latest(reg).decode()
    assert 'orca_probe_seconds_total{model_name="m"} 3.0' in text
    assert 'orca_engine_steps_total{model_name="m"} 15.0' in text
    assert 'orca_steps_scored_total{model_name="m"} 7.0' in text
    assert 'orca_engine_bundles_loaded{model_name="m"} 2.0' in text
    (tmp_path / "2.json").unlink()  # a worker gone: its counts stay counted
    text = generate_latest(reg).decode()
    assert 'orca_steps_scored_total{model_name="m"} 7.0' in text


@pytest.mark.parametrize("orca, env", [(None, None), ({"bundle": "b"}, "1")])
def test_stat_logger_stays_out_when_not_wanted(orca, env, monkeypatch):
    """Without the orca processor, or under orca-serve (which exports these metrics itself)."""
    monkeypatch.setattr(stock_metrics, "_registered", False)
    if env is None:
        monkeypatch.delenv(ENV_SERVER, raising=False)
    else:
        monkeypatch.setenv(ENV_SERVER, env)
    OrcaStatLogger(_config(orca))
    assert not stock_metrics._registered and not metrics_dir(os.getpid()).exists()


def test_stat_logger_registers_once_per_process(monkeypatch):
    registered = []
    monkeypatch.setattr(stock_metrics, "_registered", False)
    monkeypatch.setattr(stock_metrics.REGISTRY, "register", registered.append)
    monkeypatch.delenv(ENV_SERVER, raising=False)
    d = metrics_dir(os.getpid())
    try:
        for engine in range(2):  # vLLM makes one per engine under data parallelism
            OrcaStatLogger(_config({"bundle": "b"}), engine)
        assert len(registered) == 1 and registered[0].directory == d and d.is_dir()
        assert registered[0].model_name == "m"
    finally:
        d.rmdir()
