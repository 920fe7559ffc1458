"""The engine processes of the tests (a test server's, and those of the engines a pytest worker
runs in-process) forked from a copy of a zygote taken before it ran (a "forker"), with spawn's
semantics otherwise.

vLLM's CPU platform starts its engine core (and the workers, the DP coordinator and API servers
an engine or server starts) with multiprocessing's `spawn`: a fresh interpreter that spends ~9 s
of CPU importing vLLM and torch again, ~2/3 of an engine core's CPU in the suite
(benchmarks/RESULTS.md, "Test time"). A server forked from the zygote (tests/zygote.py) has
those modules already, and before it runs anything it is a single thread: there `start` forks
the forker, and redirects `spawn` to it. A pytest worker has threads, so nothing is forked
from it: its spawns go to a forker its zygote forks for it (`fork_spawns_of_test_process`, the
zygote for the environment of the start: `zygote_for`). The forker runs the loop of Python's
forkserver (`multiprocessing.forkserver.main`): for each start it forks a child, which runs the
process object as a spawned child does (`spawn._main`: the parent's preparation data, then the
pickled process), and tells the parent the child's pid and, once reaped, its exit status.

What a spawned child gets, a forked one gets too:
- the parent's environment (the C library's, which an exec passes: `process_environ`), stdout,
  stderr and process group *at `Process.start()`* (vLLM sets variables around a start, e.g.
  per DP rank, or each TP/PP rank's OpenMP places), sent with each start (`_launch`), plus what
  the zygote's imports set in the environment, as a spawned child's own imports would (torch
  and cv2 set some); its argv, sys.path, working directory, `__main__` and authkey through spawn's
  own preparation data; the fds the process object pickles (pipes, sockets), sent as Python's
  forkserver sends them;
- the signal handlers a fresh interpreter starts with (the forker's loop changes two and the
  child restores them), the parent's resource tracker, a parent sentinel (`parent_process()`);
- its end through `sys.exit`'s path: the process's own exit code, its atexit hooks run;
- for the parent: `pid`, `sentinel`, `exitcode` (negative: the signal that ended it), `join`,
  `is_alive`, `terminate`, `kill` of Python's forkserver Popen (the status comes over a pipe
  from the forker, the child's parent), the sentinel vLLM watches for an engine's death;
- being in the parent's process group and session (`Server.stop` signals a server's group): a
  server's forker is the server's child, so its children are too; a pytest worker's forker is
  its zygote's child, in the worker's group; a child of a forked engine (an engine core's
  worker) comes from the same forker.

What keeps it sound, as tests/zygote.py argues for the servers: a forker is forked while its
parent (the server, or the zygote) is one thread with nothing run but imports, and forks only
from its one-thread loop; a child comes from it only where the variables read at exec or import
(`IMPORT_TIME`) are at start what the zygote was started with, and spawn would exec the
interpreter itself (vLLM's NUMA binding swaps in a wrapper); otherwise it is spawned. vLLM's CPU
platform sets three such variables in a server before it starts an engine (`engine_env`); the
zygote is started with them set, so that its servers' engines qualify (see tests/serving.py
`start`). A pytest worker's start always finds its zygote (one per value of those variables:
the TP/PP ranks' `GOMP_CPU_AFFINITY`, read by libgomp when it is loaded at exec, gives each
rank a zygote of its own, pinned as the spawned rank would be). The DP server with
`--api-server-count 2` would set `PROMETHEUS_MULTIPROC_DIR` (read at import) before it starts
its five processes: its test sets that variable itself, so the server comes from a zygote
started with it and they qualify. cv2 prepends its directory to `LD_LIBRARY_PATH` at each
import, so a forked engine core starts its worker with that directory twice: the loader's
search is the same, so the paths are compared without repeats (tests/zygote.py `as_read`)
and that worker is forked too (test_plugin's multiprocess engine). Still spawned: a forked
engine's own spawns where it changed such a variable, and every process of the servers exec'd
on purpose: users' path.
"""

from __future__ import annotations

import atexit
import ctypes
import io
import itertools
import os
import pickle
import signal
import socket
import sys
from importlib.util import find_spec
from multiprocessing import context, forkserver, popen_forkserver, popen_spawn_posix, process
from multiprocessing import resource_tracker, spawn, util
from multiprocessing.context import reduction
from pathlib import Path
from typing import NoReturn

from tests.zygote import forkable, zygote_for

# The Python whose multiprocessing.forkserver internals this reuses (its loop `main`,
# `_serve_one`, the client's address and alive fd): private names, so checked against one version
FORKSERVER_AS_OF = (3, 11)
_start_env: dict[str, str] = {}  # the environment the zygote imported its modules in
_imports_set: dict[str, str | None] = {}  # what those imports set in it (None: removed)


def engine_env() -> dict[str, str]:
    """The variables read at exec or import that vLLM's CPU platform sets in a server before it
    starts an engine (vllm/platforms/cpu.py `check_and_update_config`: inductor's thread settings,
    and torch's OpenMP runtime preloaded, found where vLLM looks for it)."""
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "1"}
    torch_dir = Path(find_spec("torch").origin).parent  # type: ignore[union-attr, arg-type]
    gomp = [p for d in (torch_dir.parent / "torch.libs", torch_dir / "lib")
            for p in d.glob("libgomp*.so*")]
    if gomp:
        env["LD_PRELOAD"] = str(gomp[0])
    return env


def start(start_env: dict[str, str], imports_set: dict[str, str | None]) -> None:
    """In a zygote's child before it runs anything: fork its forker and send `spawn` there.
    `start_env`: the environment the zygote was started (and imported its modules) in;
    `imports_set`: the variables those imports set (torch, cv2, ... set some when imported)."""
    if sys.version_info[:2] != FORKSERVER_AS_OF:
        return  # its loop and fields may differ: engines are spawned, as an exec'd server's
    _forks_spawns(start_env, imports_set)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(f"\0orca-engine-fork-{os.getpid()}")  # abstract: no file to clean up
    listener.listen()
    alive_r, alive_w = os.pipe()  # held by the server and each child: EOF ends the forker
    if os.fork() == 0:
        os.close(alive_w)
        serve(listener, alive_r, start_env, imports_set)
    server = forkserver._forkserver  # type: ignore[attr-defined]
    server._forkserver_address = listener.getsockname()
    server._forkserver_alive_fd = alive_w
    listener.close()
    os.close(alive_r)


def serve(listener: socket.socket, alive_r: int, start_env: dict[str, str],
          imports_set: dict[str, str | None]) -> NoReturn:
    """Be a forker: Python's forkserver loop on `listener` until `alive_r` reads EOF, in a
    process forked from one thread with nothing run but a zygote's imports (`start_env`,
    `imports_set`: as for `start`); the processes it forks send their own spawns here too."""
    try:
        _forks_spawns(start_env, imports_set)
        import setproctitle

        setproctitle.setproctitle("orca-engine-forker")
        # a SIGTERM to the server's group: outlive the children, to tell how they ended
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        forkserver._serve_one = _serve_one  # type: ignore[attr-defined]
        forkserver.main(listener.fileno(), alive_r, [])
    finally:
        os._exit(0)


def _forks_spawns(start_env: dict[str, str], imports_set: dict[str, str | None]) -> None:
    """Send this process's spawns (and its forked children's) to its forker where sound."""
    global _start_env, _imports_set
    _start_env, _imports_set = dict(start_env), dict(imports_set)
    context.SpawnProcess._Popen = staticmethod(_popen)  # type: ignore[method-assign]


def fork_spawns_of_test_process() -> None:
    """In a pytest worker (multi-threaded: nothing is forked from it): each spawn from a forker
    forked by the zygote for the spawn's environment (tests/zygote.py `zygote_for`), so that its
    variables read at exec or import are the zygote's by construction: its in-process engines'
    engine cores and workers (executor "mp", TP/PP ranks, each rank's pinned OpenMP threads
    set in its environment at start). Spawned as before on another Python, or where spawn
    would exec another program than this Python."""
    if sys.version_info[:2] == FORKSERVER_AS_OF:
        context.SpawnProcess._Popen = staticmethod(_popen_in_test_process)  # type: ignore


def _spawn_execs_this_python() -> bool:
    """Whether spawn would exec this interpreter (vLLM's NUMA binding may swap in a wrapper,
    which a fork cannot stand for)."""
    return os.fsdecode(spawn.get_executable()) == sys.executable


def _popen_in_test_process(process_obj: process.BaseProcess):
    """`SpawnProcess._Popen` of a pytest worker: from the zygote for this environment."""
    if _spawn_execs_this_python():
        return Popen(process_obj, zygote_for(process_environ()).forker())
    return popen_spawn_posix.Popen(process_obj)


def _popen(process_obj: process.BaseProcess):
    """`SpawnProcess._Popen`: forked where that is sound, spawned otherwise."""
    if forkable(process_environ(), _start_env) and _spawn_execs_this_python():
        server = forkserver._forkserver  # type: ignore[attr-defined]
        return Popen(process_obj, (server._forkserver_address, server._forkserver_alive_fd))
    return popen_spawn_posix.Popen(process_obj)


class Popen(popen_forkserver.Popen):
    """Python's forkserver Popen against a forker (its address, and the fd that keeps it alive,
    which each child holds too); the start sends what spawn's exec would give the child besides
    the preparation data (`_serve_one` applies it)."""

    def __init__(self, process_obj: process.BaseProcess, forker: tuple[str | bytes, int]):
        self._forker = forker
        super().__init__(process_obj)

    def _launch(self, process_obj: process.BaseProcess) -> None:
        at_start = pickle.dumps({"env": process_environ(), "pgid": os.getpgid(0)})
        buf = io.BytesIO()
        buf.write(forkserver.SIGNED_STRUCT.pack(len(at_start)))
        buf.write(at_start)
        prep_data = spawn.get_preparation_data(process_obj._name)  # type: ignore[attr-defined]
        context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            context.set_spawning_popen(None)
        self.sentinel, w = _connect(self._forker, self._fds)
        _parent_w = os.dup(w)  # the child's parent sentinel, as Python's forkserver keeps it
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


def process_environ() -> dict[str, str]:
    """The environment an exec'd child gets from this process: the C library's `environ`, which
    is `os.environ` plus what native code set with `setenv` (readline sets LINES and COLUMNS in
    a pytest worker, which `os.environ` never sees)."""
    environ = ctypes.POINTER(ctypes.c_char_p).in_dll(ctypes.CDLL(None), "environ")
    env = {}
    for i in itertools.count():
        if environ[i] is None:
            return env
        key, _, value = os.fsdecode(environ[i]).partition("=")
        env[key] = value


def _connect(forker: tuple[str | bytes, int], fds: list[int]) -> tuple[int, int]:
    """`forkserver.connect_to_new_process` for a forker not started here (its address and
    alive fd), with this process's stdout and stderr among the fds: (status_r, data_w)."""
    address, alive_fd = forker
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(address)
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        try:
            reduction.sendfds(client, [child_r, child_w, alive_fd,
                                       resource_tracker.getfd(), 1, 2, *fds])
            return parent_r, parent_w
        except BaseException:
            os.close(parent_r)
            os.close(parent_w)
            raise
        finally:
            os.close(child_r)
            os.close(child_w)


def _read_exact(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError("the parent went away during a start")
        data += chunk
    return data


def _serve_one(child_r: int, fds: list[int], unused_fds: list[int],
               handlers: dict[int, object]) -> int:
    """`forkserver._serve_one` in the forker's child: also takes the parent's environment,
    stdio and process group at start, and runs its atexit hooks at the end (the forker's loop
    ends the child with `os._exit(code)`)."""
    signal.set_wakeup_fd(-1)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)  # type: ignore[arg-type]
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the one the forker ignores itself
    for fd in unused_fds:
        os.close(fd)
    server = forkserver._forkserver  # type: ignore[attr-defined]
    alive, tracker, out, err, *server._inherited_fds = fds
    server._forkserver_alive_fd = alive
    resource_tracker._resource_tracker._fd = tracker
    for fd, std in ((out, 1), (err, 2)):
        os.dup2(fd, std)
        os.close(fd)
    at_start = pickle.loads(_read_exact(child_r, forkserver.read_signed(child_r)))
    os.environ.clear()
    os.environ.update(at_start["env"])
    for key, value in _imports_set.items():  # what a spawned child's own imports would set
        if os.environ.get(key) == _start_env.get(key):
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value
    if os.getpgid(0) != at_start["pgid"]:
        os.setpgid(0, at_start["pgid"])
    code = spawn._main(child_r, os.dup(child_r))
    atexit._run_exitfuncs()
    util._flush_std_streams()
    return code
