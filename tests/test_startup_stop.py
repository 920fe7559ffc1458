"""Stopping a server that is still starting: `orca-serve` on SIGTERM, and `make demo`.

A real `orca-serve --demo` each, stopped at a chosen point of its start-up; what is checked is
that it ends within a bound and leaves no process of its session behind (vLLM's EngineCore and
its helpers are children of the API server, in its process group). The one stopped during its
imports is exec'd as the demo starts it; the two stopped while the engine loads are forked with
their engine from the worker's zygote (~9 s of CPU less each: their imports are done already).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from orca_serve.startup import demo, ipc_dir
from tests.serving import SERVER_OWNS_IPC_DIR, free_port, server_env, start

ENGINE = "EngineCore"  # vLLM names its engine process VLLM::EngineCore
STOP_BOUND_S = 60  # on 2 shared cores the engine's forced stop and the exit take ~16 s


def wait_gone(pgid: int, bound: float) -> list[psutil.Process]:
    """Poll until group `pgid` is empty or `bound` seconds passed; what is left."""
    deadline = time.monotonic() + bound
    while (left := demo.group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def wait_for_engine(proc: subprocess.Popen, log: Path, bound: float = 300) -> None:
    """Until the server has started vLLM's EngineCore (its weights are loading then)."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        if any(ENGINE in p.name() for p in demo.group_members(proc.pid)):
            return
        time.sleep(0.2)
    raise AssertionError("no EngineCore within the bound:\n" + log.read_text()[-3000:])


def sigterm_and_wait(proc: subprocess.Popen, log: Path) -> float:
    """SIGTERM to the API server alone (as `kill PID` or an orchestrator sends it); seconds it
    took to exit, checked against the bound, and nothing left in its group."""
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"orca-serve ignored SIGTERM for {STOP_BOUND_S} s:\n"
                    + log.read_text()[-3000:])
    took = time.monotonic() - t
    left = wait_gone(proc.pid, 10)
    assert not left, [(p.pid, p.name()) for p in left]
    return took


def _killed_at_the_end(proc, log: Path, own_ipc_dir: bool = False):
    """The group SIGKILLed after the test, whatever it did. `own_ipc_dir`: the server picked its
    sockets' directory itself, which a kill -9 leaves (a test that failed before its SIGTERM):
    removed here, found by the sockets the group still holds."""
    yield proc, log
    left = {d for d in socket_dirs(proc.pid) if d.name.startswith(ipc_dir.PREFIX)} \
        if own_ipc_dir else set()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)
    for d in left:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def server(tmp_path: Path):
    """`orca-serve --demo` started as the demo starts it (exec'd, own session, log to a file);
    the group is killed at the end whatever the test did."""
    log = tmp_path / "server.log"
    yield from _killed_at_the_end(demo.start_server(free_port(), str(log)), log)


@pytest.fixture
def loading_server(tmp_path: Path):
    """The demo's server command, forked with its engine from the worker's zygote
    (tests/serving.py `start`: own session, log to a file), for the tests that stop it while its
    engine loads: its imports are not what they stop (`server` runs them). Without the suite's
    `VLLM_RPC_BASE_PATH`, as a user starts it: the server picks its sockets' directory itself.
    Killed at the end."""
    log = tmp_path / "server.log"
    env = server_env()
    env.pop(ipc_dir.VARIABLE, None)
    yield from _killed_at_the_end(start(demo.server_command(free_port()), log, env), log,
                                  own_ipc_dir=True)


def socket_dirs(pgid: int) -> set[Path]:
    """The directories of the unix sockets with a file that the processes of group `pgid` hold
    (not the abstract ones, without a file)."""
    found = set()
    for p in demo.group_members(pgid):
        try:
            found |= {Path(c.laddr).parent for c in p.net_connections("unix")
                      if c.laddr.startswith("/")}
        except psutil.NoSuchProcess:  # ended since it was listed: it holds none
            pass
    return found


def test_sigterm_early_in_start_up_stops_it(server) -> None:
    """A couple of seconds in: pre-flight, imports; no engine yet."""
    proc, log = server
    time.sleep(2)
    assert proc.poll() is None, log.read_text()
    sigterm_and_wait(proc, log)


@pytest.mark.vllm
def test_sigterm_while_the_engine_loads_stops_it_and_the_engine(loading_server) -> None:
    """vLLM's own start-up handler raised KeyboardInterrupt, which its engine handshake
    swallows: the server went on waiting for the engine (orca_serve/vllm_compat/launch.py)."""
    proc, log = loading_server
    wait_for_engine(proc, log)
    # vLLM's IPC sockets: in a directory of the server's own (where the temp dir leaves room)
    sockets = socket_dirs(proc.pid)
    if SERVER_OWNS_IPC_DIR:
        assert len(sockets) == 1 and next(iter(sockets)).name.startswith(ipc_dir.PREFIX), sockets
    sigterm_and_wait(proc, log)
    assert proc.returncode == 128 + signal.SIGTERM  # orca-serve's handler, not a crash
    assert "Traceback" not in log.read_text()
    if SERVER_OWNS_IPC_DIR:
        assert not next(iter(sockets)).exists()  # removed on the way out, its files with it


@pytest.mark.vllm
def test_the_demos_stop_reaches_the_engine_of_a_loading_server(loading_server) -> None:
    """What the demo does when its wait ends: the whole group, EngineCore included."""
    proc, log = loading_server
    wait_for_engine(proc, log)
    t = time.monotonic()
    demo.stop_server(proc)
    assert time.monotonic() - t < demo.STOP_GRACE_S + 10 + 1
    assert not demo.group_members(proc.pid)
    assert proc.returncode is not None


def test_demo_ends_within_its_wait_in_one_line_and_leaves_nothing() -> None:
    """`make demo` on a machine too slow for its wait (forced: --wait 1)."""
    port = free_port()
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "orca_serve.startup.demo", "--wait", "1", "--port",
                        str(port)], capture_output=True, text=True, timeout=120,
                       env=server_env(), check=False)
    took = time.monotonic() - t
    assert r.returncode == 1, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("demo: error:"), r.stderr
    assert f"127.0.0.1:{port}" in err[0] and "within 1 s" in err[0] and "--wait" in err[0]
    pid = int(re.search(r"starting \(pid (\d+)", r.stdout).group(1))
    assert not demo.group_members(pid)  # gone by the time the demo returned
    log = Path(re.search(r"its log: (\S+)\)", err[0]).group(1))
    assert log.is_file()  # kept for the user to read
    log.unlink()
    assert took < 1 + demo.STOP_GRACE_S + 10 + 10  # the wait, the stop's bound, start-up


def test_a_group_of_zombies_counts_as_stopped() -> None:
    """An engine orphaned by the stop goes to init or the nearest subreaper, which may reap it
    late: its zombie must not hold the demo's stop for the whole grace (it did, 40 s)."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while psutil.Process(dead.pid).status() != psutil.STATUS_ZOMBIE:  # ended, not reaped
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(dead.pid, 0)  # the group is still there for a signal ...
        assert demo.group_members(dead.pid) == []  # ... but nothing in it runs
        assert [p.pid for p in demo.group_members(live.pid)] == [live.pid]
    finally:
        live.kill()
        live.wait()
        dead.wait()
