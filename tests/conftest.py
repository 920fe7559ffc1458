"""Fixtures shared by the engine tests: the tiny model (built once per session) and its tokenizer.

A module that needs another `model` (e.g. a served model's id) defines its own fixture of that
name, which takes precedence within that module.

`make test` runs two pytest-xdist workers on a 2-core host, a group of tests per worker at a time
(`pytest_xdist_make_scheduler` below): each module is a group, except the modules that share one
server (`SHARED_SERVER`), which form one. The settings below keep the workers from taking each
other's core.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Before torch is imported. One OpenMP thread per process: a second one spin-waits on the core
# the other worker (or its servers) needs. No pinning of engines: vLLM's automatic binding puts
# every single-rank engine on the same core, so two workers' engines would share one core while
# the other idles (test_parallel pins its two ranks itself).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

from orca_serve.startup import ipc_dir  # noqa: E402 - imports neither torch nor vLLM

# vLLM never removes its ZMQ IPC sockets' files (orca_serve/startup/ipc_dir.py says why), so
# every server and engine of the run would leave its own in the temp dir, thousands over many
# runs; orca-serve itself puts them in a directory of its own, but the tests' in-process engines
# do not run its start-up. The run's own directory instead, removed at its end
# (`pytest_unconfigure`, by the process that made it): the xdist workers, their zygotes and the
# servers forked or exec'd inherit the variable.
RPC_DIR = None if ipc_dir.VARIABLE in os.environ else ipc_dir.own_rpc_dir()
if RPC_DIR is not None:
    os.environ[ipc_dir.VARIABLE] = RPC_DIR

# Engines started in the tests' own processes (`LLM`, the calibrate job's `Collector`) run their
# core in that process with its single worker (executor "uni"): no process importing vLLM again
# (~9 s of CPU each); the tests that need processes of their own say so themselves
# (test_parallel, test_plugin's multiprocess engine). Set here, before any test module is
# imported, so a module's engines run the same way whichever modules were collected with it.
from tests.serving import ENGINE_LAYOUT  # noqa: E402 - imports neither torch nor vLLM

for _name, _value in ENGINE_LAYOUT.items():
    os.environ.setdefault(_name, _value)
# Test servers forked from a zygote that imported vLLM's server stack once per worker, not
# exec'd (tests/zygote.py says why and what stays exec'd); ORCA_TEST_ZYGOTE=0 execs them all.
os.environ.setdefault("ORCA_TEST_ZYGOTE", "1")
if os.environ["ORCA_TEST_ZYGOTE"] == "1":
    # and the processes the tests' own engines spawn, from a forker a zygote forks (the worker
    # itself has threads): tests/engine_fork.py `fork_spawns_of_test_process`
    from tests.engine_fork import fork_spawns_of_test_process  # noqa: E402 - no torch, no vLLM

    fork_spawns_of_test_process()

import pytest

from tests.redis_server import RedisServer
from tests.serving import COMMON, Server, orca_serve_cmd
from tests.tiny_model import build_tiny_model

# The bundles' helpers (torch, the method) are imported in the fixtures that use them: the
# xdist controller loads this file too, runs no fixture, and starts the workers once it has
# (~1.8 s less before the first test)

TOY = Path(__file__).parents[1] / "orca_serve" / "demo"  # the embedded toy reasoner
TOY_VOTE_K = 4  # `toy_server`'s consensus block: votes over groups of this many samples

# The modules that take longest (engines, servers, long simulations), longest first: the workers
# take modules in collection order, so starting with these keeps both busy to the end instead of
# one finishing a long module alone while the other idles. A module left off this list runs
# among the quick ones, in file-name order (test_shards_cluster's 45 s of engines began 800 s
# into an 850 s run). Measured with `make test`'s timings; order only, no skips.
# test_server_apis runs last of the shared-server group (its last test stops that server), and
# test_server_gate_alarm last of the toy server's (it leaves that server's gate alarm raised).
LONGEST_FIRST = ["test_parallel", "test_speculation_engine", "test_fuzz_http", "test_audit_server",
                 "test_toy_job", "test_server_samples", "test_server_gate_alarm",
                 "test_startup_stop", "test_plugin", "test_audit_fleet_server",
                 "test_audit_selective_server", "test_server", "test_server_give_up",
                 "test_server_shift_gate", "test_server_apis", "test_demo_long",
                 "test_shards_cluster", "test_demo", "test_audit_stats", "test_stock_vllm",
                 "test_audit_tools", "test_hot_reload", "test_audit_give_up_recalibration",
                 "test_bundle", "test_deploy", "test_shards_engine", "test_pipeline_engine",
                 "test_import_probe_engine", "test_calibrate_groups", "test_gate_alarm"]


# Modules that use one session-scoped server (`tiny_server`, `toy_server`): one group each, so one
# worker runs them all and the server starts once.
SHARED_SERVER = {"test_server": "tiny_server", "test_server_apis": "tiny_server",
                 "test_server_give_up": "tiny_server", "test_server_shift_gate": "tiny_server",
                 "test_fuzz_http": "toy_server", "test_server_samples": "toy_server",
                 "test_server_gate_alarm": "toy_server"}


# gc's own freeze and unfreeze, put back at the end of the run (`pytest_unconfigure`)
GC_FREEZE = (gc.freeze, gc.unfreeze)
# What an in-process engine imports as it starts (the offline `LLM`, its core, the CPU worker,
# the tests' models: Qwen2), imported before the heap is frozen where vLLM tests were collected
ENGINE_MODULES = ("vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.worker.cpu_worker",
                  "vllm.model_executor.models.qwen2")


def pytest_collection_finish(session: pytest.Session) -> None:
    """The heap as collection leaves it (the libraries the tests import, the engine's modules,
    the collected tests), frozen once: out of the cyclic collector's sight for the rest of the
    run; freezes and unfreezes after it do nothing. vLLM freezes the heap when an engine starts
    and unfreezes it all when the engine shuts down (a server: one engine in its process); a
    test process starts engines one after another, and after the first shutdown each full
    collection (vLLM runs some at every start and shutdown, the tests one after each) scanned
    ~800,000 objects again, ~0.4 s each (test_toy_job, test_pipeline_engine, test_plugin and
    test_import_probe_engine in one process: 22 s of full collections in a 96 s run, 4.4 s
    now). The engines' own objects are not frozen, and are collected as before. Frozen objects
    are still freed when nothing refers to them; only a cycle among them is kept."""
    if any(item.get_closest_marker("vllm") for item in session.items):
        for name in ENGINE_MODULES:
            importlib.import_module(name)
    gc.collect()
    gc.freeze()
    gc.freeze = gc.unfreeze = lambda: None  # type: ignore[assignment]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.stem, len(rank)))  # stable: same order otherwise


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under `-n N`: whole groups to a worker (a module, or the modules of SHARED_SERVER), in
    collection order (xdist would otherwise put the groups with most tests first). Not xdist's
    `loadgroup`: with pytest 9 its group marks never reach the scheduler."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return SHARED_SERVER.get(Path(module).stem, module)

    config.option.loadscopereorder = False
    return ModuleGroups(config, log)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """An xdist worker ends here, after its last report (xdist counts it done from its
    "workerfinished", sent at session finish): the interpreter's own exit would tear down the
    heap its in-process engines left (torch, vLLM: ~4-5 s of CPU), at the end of the run when
    nothing else is left to overlap. Its servers are stopped by then (session fixtures); its
    zygotes and engine forker end when its pipes close."""
    gc.freeze, gc.unfreeze = GC_FREEZE
    gc.unfreeze()  # for the interpreter's exit (a run without xdist): it frees what it holds
    if RPC_DIR is not None:  # made here: the controller's, or a run without xdist
        shutil.rmtree(RPC_DIR, ignore_errors=True)
    if hasattr(config, "workerinput"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


@pytest.fixture
def quiet_audit_log() -> Iterator[None]:
    """The live audit's warnings off for a test that drives many audits (guard changes, reaped
    audits): errors still show."""
    logging.getLogger("orca_serve.live_audit").setLevel(logging.ERROR)
    yield
    logging.getLogger("orca_serve.live_audit").setLevel(logging.NOTSET)


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> Path:
    """The tiny model's folder; shared across sessions through the pytest base temp's parent."""
    return build_tiny_model(tmp_path_factory.getbasetemp().parent / "orca-tiny-model")


@pytest.fixture(scope="session")
def tiny_server(model, tmp_path_factory) -> Iterator[dict]:
    """orca-serve on the tiny model and `make_bundle`'s bundle (delta 0.05 -> never, 0.1 ->
    lambda 0.99, 0.2 -> 0.5: stops at step 1), `--orca-answer-budget 8`, `--orca-effort-map
    medium=0.1`. Its bundle has a shift gate that flags every request it runs for, off by
    default (`--orca-shift-alpha 0`): requests opt in with `orca.shift_alpha`. It records a
    calibration in bfloat16 (at the tiny model's default sampling), served in float32: the
    start-up's dtype warning (test_server). Started, not waited for: a test calls `.wait()`
    when it needs it."""
    from orca_method.bundle import Generation
    from tests.bundles import make_bundle

    d = tmp_path_factory.mktemp("tiny_server")
    bundle = make_bundle(d / "bundle.json", model, gate=True, collected_under=Generation(
        dtype="bfloat16", temperature=1.0, top_p=1.0))
    server = Server(orca_serve_cmd("--model", str(model), "--calib", str(bundle),
                                   "--orca-answer-budget", "8", "--orca-effort-map", "medium=0.1",
                                   "--orca-shift-alpha", "0"),
                    d / "orca.log", COMMON)
    try:
        yield {"server": server, "model": model, "bundle": bundle}
    finally:
        server.stop()


@pytest.fixture(scope="session")
def toy_server(tmp_path_factory) -> Iterator[Server]:
    """orca-serve on the embedded toy reasoner (orca_serve/demo) with its shipped bundle plus a
    consensus block (tests/bundles.py `with_consensus`: `orca.samples` votes), under the
    bundle's model name, in its dtype, greedy requests reproducible (`--seed 0`): what
    `orca-serve --demo` serves, plus the consensus block. Shared by test_fuzz_http,
    test_server_samples and test_server_gate_alarm, in that order: the last raises the gate
    alarm, which stays raised.
    `--orca-shift-action full`, so that a request served as flagged shows as one that never
    stopped (the default, `strict`, serves the bundle's largest lambda*).
    Started, not waited for: a test calls `.wait()`."""
    from orca_method.bundle import load_bundle
    from tests.bundles import with_consensus, write_bundle

    d = tmp_path_factory.mktemp("toy_server")
    shipped = load_bundle(TOY / "bundle.json")
    bundle = write_bundle(with_consensus(shipped, samples=TOY_VOTE_K), d / "bundle.json")
    server = Server(orca_serve_cmd("--model", str(TOY / "model"), "--calib", str(bundle),
                                   "--orca-shift-action", "full"),
                    d / "orca.log",
                    ["--host", "127.0.0.1", "--enforce-eager", "--seed", "0",
                     "--reasoning-parser", "deepseek_r1", "--disable-uvicorn-access-log",
                     "--served-model-name", shipped.model.name])
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_store(tmp_path_factory) -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port (tests/redis_server.py), stopped after."""
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="session")
def tok(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


# The simulated engine's bundles (tests/core_sim.py), module-scoped like the engines using them.
@pytest.fixture(scope="module")
def bundle_path(tmp_path_factory):
    from tests.core_sim import sim_bundle

    return sim_bundle(tmp_path_factory)


@pytest.fixture(scope="module")
def other_bundle_path(tmp_path_factory):
    """Another probe for the same model (hot reload): other scores, another checksum."""
    from tests.core_sim import sim_bundle

    return sim_bundle(tmp_path_factory, seed=7)


@pytest.fixture(scope="module")
def keyword_bundle_path(tmp_path_factory):
    """Steps open at sections with the keyword "x" (sections merge, steps end one late)."""
    from tests.core_sim import sim_bundle

    return sim_bundle(tmp_path_factory, keywords=["x"])
