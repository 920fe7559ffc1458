"""Test servers forked from a process that imported vLLM's API server stack once (a "zygote").

A test server's own process spends ~9 s of CPU importing vLLM, torch, transformers and our
server before it parses its first option (benchmarks/RESULTS.md, "Test time"): the same
imports in each of the suite's 17 test servers. Each pytest worker starts a zygote when its
first test server starts (`zygote_for`: one per value of the variables read at import, which a
fork cannot change; the usual servers share one); the zygote imports what a server imports
(`PRELOAD`) and then forks a child per server. The child takes the server's environment, working directory, command
line and log, in a session of its own (as `Popen(start_new_session=True)`), and runs the very
console script (or `-m` module) the exec'd command would have run, as `__main__`: the same
code from the options on (real HTTP, a real engine). Before it runs that, the child forks its
engine forker (tests/engine_fork.py): the processes vLLM spawns (its CPU platform forces
`spawn`: the engine core, a TP/PP engine's workers, DP's coordinator and API servers) come from
there instead of a fresh interpreter, with spawn's semantics otherwise (that module says which
and why); the zygote starts with the variables vLLM sets for its engine (tests/serving.py).
The engines a pytest worker runs in-process spawn too (their cores, workers, TP/PP ranks); the
worker has threads and is never forked: a zygote forks an engine forker for it (`forker`), and
the worker sends its spawns there (tests/engine_fork.py `fork_spawns_of_test_process`).

What keeps a fork sound here:
- no thread in the zygote when it forks (checked after the imports: `Zygote` refuses to start
  otherwise) and no torch op run, so no OpenMP pool to lose;
- only modules are imported, nothing else run: vLLM's `envs` are read when used, not at import;
  the few variables read at import (`IMPORT_TIME`: OpenMP, logging, Python's own, Hugging
  Face's) must equal the zygote's (`forkable`): a server whose values differ gets a zygote of
  its own, started with them (`zygote_for`);
- the child's signal handlers are those a fresh interpreter starts with (the zygote changes
  only SIGCHLD's, and the child restores it), its stdio is its log, and it ends through the
  interpreter's own exit (atexit hooks, `SystemExit` codes), as the exec'd one;
- the imports' objects are frozen (`gc.freeze`) before the first fork: a child's cyclic
  collections skip them, which changes when garbage among them would be freed, not what runs
  (imported modules, alive to the end; vLLM freezes an engine's start-up heap the same way);
- the zygote reaps its children and writes each one's exit status (`Popen.returncode`'s form)
  to a file the test side reads (`ForkedServer`): the server is the zygote's child, not the
  test's. A zygote whose test process is gone sees its stdin close and exits.

Besides the servers, what tests/serving.py `start` is given: the cluster workers of
test_shards_cluster (`python -m orca_calibrate.calibrate_cli collect`, each in its shard's
environment) and the engine processes of test_shards_engine's one-machine job
(`python -m orca_calibrate.shards SPEC`, through orca_calibrate/shards.py `start_shard`). The
tests whose subject is the console script or the start-up path (test_startup_stop,
test_deploy, test_demo, the refusals in tests/serving.py `refusals`) exec a fresh interpreter
as before, and so do the processes their servers spawn: users' path stays covered.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import select
import shutil
import signal
import subprocess
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

# What a server's own process imports before it serves (orca_serve.startup.cli's deferred
# imports included); vLLM's own API server for the tests that run it plain
PRELOAD = ["orca_serve.startup.cli", "orca_serve.api_server.assembly",
           "orca_serve.api_server.server", "orca_serve.live_audit.options",
           "vllm.entrypoints.openai.api_server", "uvloop"]
# Variables read when a module is imported, not when used: a child cannot change them
IMPORT_TIME = ("OMP_", "KMP_", "MKL_", "GOMP_", "PYTHON", "LD_", "MALLOC_", "TORCH", "CUDA",
               "HF_", "TRANSFORMERS_", "TOKENIZERS_", "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING",
               "PROMETHEUS_MULTIPROC_DIR")


def import_time(env: dict[str, str]) -> dict[str, str]:
    """The variables of `env` read at exec or import (`IMPORT_TIME`)."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME)}


def as_read(env: dict[str, str]) -> frozenset[tuple[str, str]]:
    """`import_time(env)` as the process reads it: the library path without its repeated
    entries. cv2 prepends its directory at each import, so a process whose parent imported it
    starts with that directory twice, and the dynamic loader, searching the directories in
    order, finds each library where it would with it once."""
    read = import_time(env)
    if "LD_LIBRARY_PATH" in read:
        read["LD_LIBRARY_PATH"] = ":".join(dict.fromkeys(read["LD_LIBRARY_PATH"].split(":")))
    return frozenset(read.items())


def forkable(env: dict[str, str], zygote_env: dict[str, str]) -> bool:
    """Whether a process with `env` may come from a zygote started with `zygote_env`."""
    return as_read(env) == as_read(zygote_env)


class ForkedServer:
    """What the tests use of a `subprocess.Popen`, for a zygote's child: `pid`, `poll()`,
    `wait(timeout)`, `send_signal(sig)`, `returncode` (negative: the signal that ended it)."""

    def __init__(self, pid: int, status: Path, argv: list[str]) -> None:
        self.pid = pid
        self.args = argv
        self.returncode: int | None = None
        self._status = status

    def poll(self) -> int | None:
        if self.returncode is None and self._status.exists():
            self.returncode = int(self._status.read_text())
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode  # type: ignore[return-value]


class Zygote:
    """The test side of one zygote process (started by `zygote_for`: one per pytest worker and
    value of the variables read at import)."""

    def __init__(self, env: dict[str, str], status_dir: Path,
                 preload: list[str] = PRELOAD) -> None:
        self.env = env
        self.status_dir = status_dir
        self._lock = threading.RLock()  # one request and its answer at a time
        self._forker: tuple[str, int] | None = None
        status_dir.mkdir(parents=True, exist_ok=True)
        log = status_dir / "zygote.log"  # what its imports print
        # the zygote's forker (`forker`) ends when this end closes, and its children are gone
        alive_r, self._alive_w = os.pipe()
        with open(log, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.zygote", str(status_dir),
                                          str(alive_r), *preload],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, env=env, text=True, bufsize=1,
                                         pass_fds=(alive_r,))
        os.close(alive_r)
        ready = self.proc.stdout.readline()  # type: ignore[union-attr]
        if ready.strip() != "ready":
            self.proc.wait(10)
            raise RuntimeError(f"zygote did not start (exit {self.proc.returncode}):\n"
                               + log.read_text()[-4000:])

    def fork(self, cmd: list[str], env: dict[str, str], log: Path) -> ForkedServer:
        """Start `cmd` (a console script, or `python -m module ...`) as a child of the zygote."""
        if cmd[:2] == [sys.executable, "-m"]:
            target, argv = {"module": cmd[2]}, [cmd[2], *cmd[3:]]
        else:
            target, argv = {"script": cmd[0]}, cmd
        request = {**target, "argv": argv, "cmd": cmd, "env": env, "cwd": os.getcwd(),
                   "log": str(log)}
        log.write_bytes(b"")  # there on return, as a Popen's log is
        pid = int(self._ask(request))
        return ForkedServer(pid, self.status_dir / str(pid), cmd)

    def forker(self) -> tuple[str, int]:
        """The address of the zygote's engine forker (tests/engine_fork.py) and the fd that keeps
        it alive, for the processes this (multi-threaded) test process would spawn: forked at
        the first call, from the zygote's one thread."""
        with self._lock:
            if self._forker is None:
                self._forker = ("\0" + self._ask({"forker": True}), self._alive_w)
            return self._forker

    def _ask(self, request: dict) -> str:
        """Send one request line, return the zygote's answer line."""
        with self._lock:
            self.proc.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
            answer = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not answer:
            raise RuntimeError(f"zygote ended (exit {self.proc.wait(10)})")
        return answer.strip()

    def close(self) -> None:
        os.close(self._alive_w)
        self.proc.stdin.close()  # type: ignore[union-attr]
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


_zygotes: dict[frozenset, Zygote] = {}
_zygotes_lock = threading.Lock()


def zygote_for(env: dict[str, str]) -> Zygote:
    """This process's zygote for processes started in `env`: one per value of its variables read
    at exec or import, as the process reads them (`as_read`), started with `env` at the first
    call for that value, so that what comes from it is `forkable`; closed when this process
    exits."""
    key = as_read(env)
    with _zygotes_lock:
        if key not in _zygotes:
            zygote = Zygote(dict(env), Path(tempfile.mkdtemp(prefix="orca-zygote-")))
            atexit.register(zygote.close)
            _zygotes[key] = zygote
        return _zygotes[key]


def _serve_child(request: dict, own_fds: tuple[int, ...], start_env: dict[str, str],
                 imports_set: dict[str, str | None]) -> None:
    """In the forked child: become the server the request describes; ends the process.
    `start_env`, `imports_set`: the zygote's environment before its imports, and what they set
    in it (tests/engine_fork.py `start` uses both)."""
    os.setsid()
    for fd in (*own_fds, 0):
        os.close(fd)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the only handler the zygote changed
    os.open(os.devnull, os.O_RDONLY)  # fd 0
    log = os.open(request["log"], os.O_WRONLY)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    import setproctitle  # vLLM's dependency: `ps` shows the command the child runs

    setproctitle.setproctitle(" ".join(request["cmd"]))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])
    from tests import engine_fork

    engine_fork.start(start_env, imports_set)  # while this is one thread with nothing run
    import runpy

    if "script" in request:
        sys.path[0] = os.path.dirname(request["script"])
        runpy.run_path(request["script"], run_name="__main__")
    else:
        sys.path[0] = os.getcwd()
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    raise SystemExit(0)


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _serve_forker(listener: socket.socket, alive_r: int, own_fds: tuple[int, ...],
                  start_env: dict[str, str], imports_set: dict[str, str | None]) -> None:
    """In the forked child: become the engine forker of the test process (tests/engine_fork.py
    `serve`); ends the process. Its stdin is closed by the forker's loop; stdout and stderr are
    the zygote's log (each process it forks takes its parent's at start)."""
    for fd in own_fds:
        os.close(fd)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the only handler the zygote changed
    from tests import engine_fork

    engine_fork.serve(listener, alive_r, start_env, imports_set)


def main(status_dir: Path, alive_r: int, preload: list[str]) -> None:
    """The zygote: import `preload`, then fork a child per request line on stdin, answering
    its pid on stdout (or, for `{"forker": true}`, the abstract address of the engine forker it
    forked, which ends when `alive_r` reads EOF); write each child's exit status to
    `status_dir/<pid>` when reaped; remove `status_dir` and exit when stdin closes."""
    import importlib

    answers = os.fdopen(os.dup(1), "w", buffering=1)  # the pids; what imports print goes to stderr
    os.dup2(2, 1)
    start_env = dict(os.environ)
    for name in [*preload, "tests.engine_fork"]:
        importlib.import_module(name)
    imports_set = {k: os.environ.get(k) for k in os.environ.keys() | start_env.keys()
                   if os.environ.get(k) != start_env.get(k)}
    if threading.active_count() != 1 or _native_threads() != 1:
        sys.exit(f"zygote: threads after the imports ({threading.enumerate()}, "
                 f"{_native_threads()} native): forking would be unsound")
    # the imports' objects out of the cyclic collector's sight in every child, as an engine
    # puts its start-up heap (vLLM's `freeze_gc_heap`): a child's full collections scanned
    # them all (test_audit_server with test_server_give_up: 62 -> 55 s of CPU)
    gc.collect()
    gc.freeze()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    print("ready", file=answers)
    forkers = 0
    stdin = sys.stdin.buffer.raw  # type: ignore[attr-defined]
    pending = b""
    while True:
        ready, _, _ = select.select([stdin, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        while True:  # every child that ended: its status, as Popen's returncode
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            tmp = status_dir / f".{pid}"
            tmp.write_text(str(os.waitstatus_to_exitcode(status)))
            tmp.rename(status_dir / str(pid))
        if stdin in ready:
            chunk = os.read(stdin.fileno(), 1 << 20)
            if not chunk:  # the test process is done (or gone): so is what it could read
                shutil.rmtree(status_dir, ignore_errors=True)
                sys.stderr.flush()
                # nothing of its own to finish: the interpreter's exit, tearing down vLLM's
                # server stack, would be ~2 s of CPU (a test process run without xdist waits
                # for it in `Zygote.close`)
                os._exit(0)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                own_fds = (wake_r, wake_w, answers.fileno(), alive_r)
                sys.stdout.flush()
                sys.stderr.flush()
                if request.get("forker"):
                    forkers += 1
                    name = f"orca-zygote-forker-{os.getpid()}-{forkers}"
                    listener = socket.socket(socket.AF_UNIX)
                    listener.bind("\0" + name)  # abstract: no file; bound before the fork
                    listener.listen()
                    if os.fork() == 0:
                        _serve_forker(listener, alive_r, own_fds[:3], start_env, imports_set)
                    listener.close()
                    print(name, file=answers)
                    continue
                pid = os.fork()
                if pid == 0:
                    _serve_child(request, own_fds, start_env, imports_set)
                (status_dir / str(pid)).unlink(missing_ok=True)  # an earlier child's, same pid
                print(pid, file=answers)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
