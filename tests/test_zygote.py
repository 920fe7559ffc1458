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
    # the library path as the loader searches it: a directory again adds nothing, a new one does
    lib = {**base, "LD_LIBRARY_PATH": "/cv2/lib64:/usr/lib:"}
    assert forkable({**base, "LD_LIBRARY_PATH": "/cv2/lib64:/cv2/lib64:/usr/lib:"}, lib)
    assert not forkable({**base, "LD_LIBRARY_PATH": "/usr/lib:/cv2/lib64:"}, lib)
    assert not forkable({**base, "LD_LIBRARY_PATH": "/other:/cv2/lib64:/usr/lib:"}, lib)


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


# What a process started by the test process itself (a pytest worker, as an in-process engine
# starts its core or ranks) reports, as `report` above; `sets_env` imported first, as above
MP_REPORT = """
import atexit, json, multiprocessing as mp, os, signal, sys
import sets_env

def report(out, code):
    atexit.register(lambda: open(out + ".atexit", "w").close())
    with open(out, "w") as f:
        json.dump({"env": dict(os.environ), "argv": sys.argv, "path": sys.path, "cwd": os.getcwd(),
                   "pgid": os.getpgid(0), "sid": os.getsid(0),
                   "main": sys.modules["__main__"].__name__,
                   "handlers": {s: str(signal.getsignal(getattr(signal, s)))
                                for s in ("SIGINT", "SIGTERM", "SIGPIPE", "SIGCHLD", "SIGHUP")},
                   "parent": mp.parent_process().pid,
                   "forked": os.getppid() != mp.parent_process().pid}, f)
    sys.exit(code)
"""


@pytest.mark.skipif(sys.version_info[:2] != FORKSERVER_AS_OF,
                    reason="engine_fork forks only on the Python whose forkserver it reuses")
def test_a_spawn_child_of_the_test_process_from_its_zygote_runs_as_a_spawned_one(tmp_path,
                                                                                 monkeypatch):
    """tests/engine_fork.py `fork_spawns_of_test_process`: the test process's spawns come from
    a forker its zygote forks (`Zygote.forker`), as spawned ones otherwise."""
    import importlib
    import multiprocessing as mp
    from multiprocessing import context, popen_spawn_posix

    from tests import engine_fork

    (tmp_path / "mp_report.py").write_text(MP_REPORT)
    (tmp_path / "sets_env.py").write_text(SETS_ENV)
    before = dict(os.environ)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path),
                                                      os.environ.get("PYTHONPATH", "")]))
    mp_report = importlib.import_module("mp_report")  # sets this process's variables, as torch
    zygote = Zygote(dict(os.environ), tmp_path / "status", preload=["mp_report"])
    ctx = mp.get_context("spawn")
    ends = {}
    try:
        for tag, popen in (("forked", lambda obj: engine_fork.Popen(obj, zygote.forker())),
                           ("spawned", popen_spawn_posix.Popen)):
            monkeypatch.setattr(context.SpawnProcess, "_Popen", staticmethod(popen))
            monkeypatch.setenv("AT_START", tag)  # the child's, not the process's
            p = ctx.Process(target=mp_report.report, args=(str(tmp_path / tag), 3))
            p.start()
            sleeper = ctx.Process(target=time.sleep, args=(60,))
            sleeper.start()
            monkeypatch.delenv("AT_START")
            p.join(60)
            alive = sleeper.is_alive()
            sleeper.kill()
            seen = mp.connection.wait([sleeper.sentinel], 60) == [sleeper.sentinel]
            sleeper.join(60)
            ends[tag] = {"exit": p.exitcode, "sleeper": [alive, seen, sleeper.exitcode],
                         "atexit": (tmp_path / f"{tag}.atexit").exists()}
    finally:
        zygote.close()
        os.environ.clear()
        os.environ.update(before)
        for name in ("mp_report", "sets_env"):
            sys.modules.pop(name, None)
    forked, spawned = (json.loads((tmp_path / tag).read_text()) for tag in ("forked", "spawned"))
    assert forked["forked"] and not spawned["forked"]
    assert forked["env"]["AT_START"] == "forked" and spawned["env"]["AT_START"] == "spawned"
    assert forked["env"]["ZYGOTE_APPENDED"] == spawned["env"]["ZYGOTE_APPENDED"] == "a:a:"
    for r in (forked, spawned):
        del r["env"]["AT_START"]
    env = {k: (forked["env"].get(k), spawned["env"].get(k))
           for k in forked["env"].keys() | spawned["env"].keys()}
    assert {k: v for k, v in env.items() if v[0] != v[1]} == {}
    assert forked == {**spawned, "forked": True}
    assert forked["parent"] == os.getpid() and forked["pgid"] == os.getpgid(0)
    assert ends["forked"] == ends["spawned"] == {
        "exit": 3, "sleeper": [True, True, -signal.SIGKILL], "atexit": True}
