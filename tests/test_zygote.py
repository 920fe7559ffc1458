"""The test servers' zygote (tests/zygote.py): a forked child runs as the exec'd command would
(its argv, environment, working directory, session, signal handlers, log and exit status),
checked against an exec'd run of the same small program; the zygote preloads nothing heavy here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.zygote import Zygote, forkable

# What the child reports of itself, then exits with the code its first argument names
PROG = """
import json, os, signal, sys, time
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "x": os.environ.get("ZYGOTE_X"),
                  "own_session": os.getsid(0) == os.getpid(),
                  "handlers": {s: str(signal.getsignal(getattr(signal, s)))
                               for s in ("SIGINT", "SIGTERM", "SIGPIPE", "SIGCHLD", "SIGHUP")},
                  "main": sys.modules["__main__"].__name__}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def zygote(tmp_path):
    z = Zygote(dict(os.environ), tmp_path / "status", preload=["json"])
    yield z
    z.close()


def report(log):
    lines = log.read_text().splitlines()
    return json.loads(lines[0]), lines[1:]


def test_import_time_variables_keep_a_child_on_exec():
    base = {"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert forkable({**base, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "ORCA_X": "y"}, base)
    assert not forkable({**base, "OMP_NUM_THREADS": "2"}, base)
    assert not forkable({**base, "HF_HUB_OFFLINE": "1"}, base)
    assert not forkable({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, base)  # one dropped


@pytest.mark.parametrize("as_module", [False, True], ids=["script", "module"])
def test_a_forked_child_runs_as_the_exec_d_command(zygote, tmp_path, monkeypatch, as_module):
    (tmp_path / "prog.py").write_text(PROG)
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "ZYGOTE_X": "forked"}
    cmd = [sys.executable, "-m", "prog"] if as_module else [str(tmp_path / "prog.py")]
    child = zygote.fork([*cmd, "3", "a b"], env, tmp_path / "forked.log")
    assert child.wait(60) == 3 and child.poll() == 3
    with open(tmp_path / "exec.log", "wb") as f:
        exec_d = subprocess.run([sys.executable, str(tmp_path / "prog.py"), "3", "a b"], stdout=f,
                                stderr=subprocess.STDOUT, env={**env, "ZYGOTE_X": "exec"},
                                start_new_session=True, timeout=60)
    assert exec_d.returncode == 3
    forked, forked_err = report(tmp_path / "forked.log")
    plain, plain_err = report(tmp_path / "exec.log")
    assert forked == {**plain, "x": "forked"}
    assert forked_err == plain_err == ["to stderr"]
    assert forked["argv"] == ["3", "a b"] and forked["cwd"] == str(tmp_path)
    assert forked["own_session"] and forked["main"] == "__main__"


def test_a_signal_ends_a_child_as_it_ends_a_popen(zygote, tmp_path):
    (tmp_path / "prog.py").write_text(PROG)
    child = zygote.fork([str(tmp_path / "prog.py"), "sleep"], dict(os.environ),
                        tmp_path / "forked.log")
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "forked.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)  # started: it printed its report
        assert child.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(0.1)
        os.killpg(child.pid, signal.SIGTERM)  # its own session, as Server.stop signals it
        assert child.wait(60) == -signal.SIGTERM
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
