"""Starting and stopping real server processes for tests and benchmarks."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

from orca_serve.settings.contract import merge_results
from orca_serve.startup import ipc_dir
from tests.engine_fork import engine_env
from tests.zygote import IMPORT_TIME, ForkedServer, import_time, zygote_for

# Whether a server started without VLLM_RPC_BASE_PATH makes a socket directory of its own
# (orca_serve/startup/ipc_dir.py): where the temp dir leaves room for one (mkdtemp's name, the
# prefix and 8 characters); else it keeps vLLM's default.
SERVER_OWNS_IPC_DIR = ipc_dir.fits(os.path.join(tempfile.gettempdir(), ipc_dir.PREFIX + "x" * 8))

VENV_BIN = Path(sys.executable).parent
START_TIMEOUT = 300
# how often a starting server's /health is asked: a start takes 15 s to minutes, so a second
# between asks made each start end on average half a second after the server was up
POLL_S = 0.25


# Ports for the servers the tests start, below Linux's ephemeral range (32768-60999 by default).
# A port the OS hands out for "any free port" (bind to 0) is one any process may be handed next,
# and a server binds its port only seconds after it is chosen (its imports come first): an engine
# starting meanwhile in the other worker (torch.distributed's rendezvous port, vLLM's ZMQ
# sockets) took one such port once, and that server died with "Address already in use".
PORTS = range(20000, 32000)
_ports = random.Random(os.getpid())


def free_port() -> int:
    """A port free now, drawn outside the ephemeral range (`PORTS`)."""
    while True:
        port = _ports.choice(PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def orca_serve_cmd(*args: str) -> list[str]:
    return [str(VENV_BIN / "orca-serve"), *args]


# orca-serve's entry function on each command line in turn, in one process
_CASES = """
import contextlib, io, json, sys
from orca_serve.startup.cli import main
out = {}
for name, argv in json.loads(sys.argv[1]).items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    out[name] = [code, err.getvalue()]
print(json.dumps({"cases": out, "vllm imported": "vllm" in sys.modules}))
"""


def refusals(cases: dict[str, list[str]]) -> tuple[dict[str, tuple[int, str]], bool]:
    """Each command line's exit code and stderr through orca-serve's real entry function, and
    whether vLLM was imported by the end: one process for all (a process each costs 2-10 s).
    For command lines that stop before serving: one that starts a server does not return."""
    r = subprocess.run([sys.executable, "-c", _CASES, json.dumps(cases)], check=True,
                       capture_output=True, text=True, timeout=600, env=server_env())
    report = json.loads(r.stdout.strip().splitlines()[-1])
    return {k: (v[0], v[1]) for k, v in report["cases"].items()}, report["vllm imported"]


# How the tests' engines are laid out unless a test says otherwise (`server_env` and the suite's
# conftest): the engine core runs its one worker inside itself, with the smallest KV cache (GiB)
ENGINE_LAYOUT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
# This process's variables read at exec or import when this module was first imported: the
# suite's conftest imports it before any test module, so before any engine ran in this process
BEFORE_TESTS = import_time(dict(os.environ))


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every server and CLI the tests start: `base` (this process's
    environment by default) with the changes below.

    The layout is pinned, not inherited by accident: with `VLLM_ENABLE_V1_MULTIPROCESSING=0`
    the engine core runs its single worker inside itself (executor "uni"), as vLLM lays out a
    server on one GPU, the product's usual deployment; vLLM's CPU build would otherwise add a
    worker process (executor "mp", ~9 s more CPU per start). The suite's conftest sets the same
    for the tests' own engines; here it also holds for the benchmarks that start servers
    through this module. Workers in processes of their own are what the 2-rank engines
    (tests/test_parallel.py) and the multiprocess engine (tests/test_plugin.py) run; a test
    that sets the variable keeps its value.

    The variables read at exec or import (tests/zygote.py `IMPORT_TIME`) are this process's
    before any test ran (`BEFORE_TESTS`), not as an engine run in this process left them: its
    imports set some (cv2 `LD_LIBRARY_PATH`, torch `TORCHINDUCTOR_CACHE_DIR`), as a server's
    own imports do, and vLLM sets others before it starts an engine (tests/engine_fork.py
    `engine_env`). No test sets one for a server; one that must passes its own environment to
    `start`."""
    base = dict(os.environ) if base is None else base
    env = {k: BEFORE_TESTS.get(k, v) for k, v in base.items()  # in the order they were
           if not k.startswith(IMPORT_TIME) or k in BEFORE_TESTS}
    env.update(BEFORE_TESTS)  # and any the process dropped since
    for name, value in ENGINE_LAYOUT.items():  # after the inherited ones, as they were
        env.setdefault(name, value)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return env


def start(cmd: list[str], log: Path,
          env: dict[str, str] | None = None) -> subprocess.Popen | ForkedServer:
    """`cmd` started in a session of its own, stdout and stderr to `log`, in `env` (by default
    `server_env()`):
    forked from this process's zygote (tests/zygote.py) where `ORCA_TEST_ZYGOTE=1` (the suite's
    conftest sets it) and `cmd` runs a console script of the venv or a `python -m` module;
    exec'd otherwise (and always in the benchmarks, which time server starts). A forked server
    starts with the variables vLLM sets for its engine (tests/engine_fork.py `engine_env`), as
    its zygote does, so that its engines are forked too; a server whose variables read at
    import differ from the usual ones gets a zygote of its own (`zygote_for`)."""
    env = server_env() if env is None else env
    runs_python = cmd[:2] == [sys.executable, "-m"] or Path(cmd[0]).parent == VENV_BIN
    if os.environ.get("ORCA_TEST_ZYGOTE") == "1" and runs_python:
        # so its engines may come from it too; last, as vLLM would add them: setproctitle finds
        # a process's argv from its first variable, which must stay as exec left it
        forked_env = {**env, **{k: v for k, v in engine_env().items() if k not in env}}
        return zygote_for(forked_env).fork(cmd, forked_env, log)
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


class Server:
    def __init__(self, cmd: list[str], log: Path, args: list[str],
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.log = log
        self.proc = start([*cmd, "--port", str(self.port), *args], log, env)
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready = False

    def wait(self, timeout: float = START_TIMEOUT) -> Server:
        deadline = time.time() + timeout
        while not self.ready:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   + self.log.read_text()[-4000:])
            try:
                self.ready = httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError("server did not start:\n" + self.log.read_text()[-4000:])
            if not self.ready:
                time.sleep(POLL_S)
        return self

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0,
                             **{"timeout": 120, **kw})

    def aclient(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0,
                                  timeout=300)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # our own session: the server and its workers
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


# The tiny model's server options and a question, shared by the live-server tests.
COMMON = ["--host", "127.0.0.1", "--enforce-eager", "--dtype", "float32", "--max-model-len", "512",
          "--reasoning-parser", "deepseek_r1", "--seed", "0", "--disable-uvicorn-access-log"]
MSG = [{"role": "user", "content": "Find x with 3*x + 2 = 11."}]


def orca_of(resp) -> dict:
    """The `orca` object of an openai-client response (fails the test when it is missing)."""
    extra = resp.model_extra or {}
    assert "orca" in extra, f"no orca object in {resp}"
    return extra["orca"]


def chat(server: Server, orca: dict, **kw):
    """One greedy chat request with these `orca` settings (48 tokens unless `max_tokens`)."""
    return server.client().chat.completions.create(
        model=str(server_model(server)), messages=MSG, extra_body={"orca": orca},
        max_tokens=kw.pop("max_tokens", 48), temperature=0, **kw)


_MODELS: dict[str, str] = {}


def server_model(server: Server) -> str:
    """The id the server serves its model under (asked once per server)."""
    if server.url not in _MODELS:
        _MODELS[server.url] = server.client().models.list().data[0].id
    return _MODELS[server.url]


def records(per_worker: list[dict] | None) -> dict[str, dict]:
    """An `orca_results` RPC answer as {key: the result's trajectory-record fields}
    (`OrcaResult.to_dict`, arrays restored): what the engine tests compare."""
    return {k: r.to_dict() for k, r in merge_results(per_worker).items()}
