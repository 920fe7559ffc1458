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

from tests.engine_fork import FORKSERVER_AS_OF
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


# A zygote's child that starts processes through multiprocessing's spawn context, as vLLM starts
# its engine: one that reports itself and exits with 3, then one killed by a signal; first as
# they come from the server's forker (tests/engine_fork.py), then with a variable read at import
# changed just before start, so they are spawned (a fresh interpreter) instead. `sets_env`, which
# the zygote imported, sets variables when imported, as torch and cv2 do.
SETS_ENV = """
import os
os.environ.setdefault("ZYGOTE_IMPORTED", "yes")
os.environ["ZYGOTE_APPENDED"] = "a:" + os.environ.get("ZYGOTE_APPENDED", "")
"""
MP_PROG = """
import atexit, json, multiprocessing as mp, os, signal, sys, time
import sets_env

def report(tag):
    atexit.register(print, tag, "atexit", flush=True)
    print(json.dumps({"tag": tag, "env": dict(os.environ), "argv": sys.argv, "path": sys.path,
                      "cwd": os.getcwd(), "pgid": os.getpgid(0), "sid": os.getsid(0),
                      "main": sys.modules["__main__"].__name__,
                      "handlers": {s: str(signal.getsignal(getattr(signal, s)))
                                   for s in ("SIGINT", "SIGTERM", "SIGPIPE", "SIGCHLD", "SIGHUP")},
                      "parent": mp.parent_process().pid,
                      "forked": os.getppid() != mp.parent_process().pid}), flush=True)
    sys.exit(3)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    ends = {}
    for tag, extra in (("forked", {}), ("spawned", {"OMP_ZYGOTE_TEST": "1"})):
        os.environ.update({"AT_START": tag, **extra})  # the child's, not the process's
        p = ctx.Process(target=report, args=(tag,))
        p.start()
        sleeper = ctx.Process(target=time.sleep, args=(60,))
        sleeper.start()
        for k in ("AT_START", *extra):
            del os.environ[k]
        p.join(60)
        alive = sleeper.is_alive()
        os.kill(sleeper.pid, signal.SIGKILL)
        seen = mp.connection.wait([sleeper.sentinel], 60) == [sleeper.sentinel]
        sleeper.join(60)
        ends[tag] = {"exit": p.exitcode, "sleeper": [alive, seen, sleeper.exitcode]}
    print(json.dumps({"ends": ends, "pid": os.getpid(), "pgid": os.getpgid(0)}), flush=True)
"""


@pytest.mark.skipif(sys.version_info[:2] != FORKSERVER_AS_OF,
                    reason="engine_fork forks only on the Python whose forkserver it reuses")
def test_a_spawn_child_forked_for_a_zygote_s_child_runs_as_a_spawned_one(tmp_path, monkeypatch):
    (tmp_path / "prog.py").write_text(MP_PROG)
    (tmp_path / "sets_env.py").write_text(SETS_ENV)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path),
                                                         os.environ.get("PYTHONPATH", "")])}
    zygote = Zygote(env, tmp_path / "status", preload=["sets_env"])
    monkeypatch.chdir(tmp_path)
    try:
        server = zygote.fork([str(tmp_path / "prog.py"), "an arg"], env, tmp_path / "forked.log")
        assert server.wait(120) == 0, (tmp_path / "forked.log").read_text()
    finally:
        zygote.close()
    lines = (tmp_path / "forked.log").read_text().splitlines()
    reports = {r["tag"]: r for r in map(json.loads, [ln for ln in lines if ln.startswith("{")])
               if "tag" in r}
    summary = json.loads(next(ln for ln in lines if ln.startswith('{"ends"')))
    forked, spawned = reports["forked"], reports["spawned"]
    assert forked["forked"] and not spawned["forked"]  # from the forker; fresh, as the fallback
    assert forked["env"]["AT_START"] == "forked" and spawned["env"]["OMP_ZYGOTE_TEST"] == "1"
    assert forked["env"]["ZYGOTE_IMPORTED"] == "yes" and forked["env"]["ZYGOTE_APPENDED"] == "a:"
    drop = ("AT_START", "OMP_ZYGOTE_TEST")
    assert ({k: v for k, v in forked["env"].items() if k not in drop}
            == {k: v for k, v in spawned["env"].items() if k not in drop})
    same = ("argv", "path", "cwd", "pgid", "sid", "main", "handlers", "parent")
    assert {k: forked[k] for k in same} == {k: spawned[k] for k in same}
    assert forked["argv"] == [str(tmp_path / "prog.py"), "an arg"] and forked["cwd"] == str(tmp_path)
    assert forked["main"] == "__mp_main__" and forked["parent"] == summary["pid"]
    assert forked["pgid"] == summary["pgid"] == summary["pid"]  # the server's own group
    assert "forked atexit" in lines and "spawned atexit" in lines
    assert summary["ends"]["forked"] == summary["ends"]["spawned"] == {
        "exit": 3, "sleeper": [True, True, -signal.SIGKILL]}
