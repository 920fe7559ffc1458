"""orca-serve's directory for vLLM's IPC sockets (orca_serve/startup/ipc_dir.py): made when the
user set none, inherited by the processes started, removed by the server alone on its way out.
The whole server is checked in tests/test_startup_stop.py (its sockets there, gone after SIGTERM).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orca_serve.startup import ipc_dir
from tests.serving import SERVER_OWNS_IPC_DIR

# A process that takes the directory, forks a child that exits through the interpreter's own
# exit (atexit handlers run: a forked child has them too), then exits as SIGTERM makes it.
_PROGRAM = """
import os, sys
from pathlib import Path
from orca_serve.startup import ipc_dir
path = ipc_dir.use_own_rpc_dir()
print(path, flush=True)
Path(path, "socket-file").touch()
child = os.fork()
if child == 0:
    sys.exit(0)
os.waitpid(child, 0)
print(Path(path).is_dir(), flush=True)
raise SystemExit(143)
"""


def _run(env: dict[str, str]) -> list[str]:
    r = subprocess.run([sys.executable, "-c", _PROGRAM], env=env, capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 143, r.stderr
    return r.stdout.split()


@pytest.mark.skipif(not SERVER_OWNS_IPC_DIR,
                    reason="the temp dir's path is too long for a socket directory inside it")
def test_the_server_makes_the_directory_and_removes_it_on_its_way_out() -> None:
    path, after_child = _run({k: v for k, v in os.environ.items() if k != ipc_dir.VARIABLE})
    assert Path(path).name.startswith(ipc_dir.PREFIX)
    assert after_child == "True"  # the forked child's exit left it to the server
    assert not Path(path).exists()  # the server's removed it, its files with it


def test_a_directory_the_user_chose_is_left_alone(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(ipc_dir.VARIABLE, str(tmp_path))
    assert ipc_dir.use_own_rpc_dir() is None
    assert os.environ[ipc_dir.VARIABLE] == str(tmp_path)


def test_no_directory_where_a_socket_path_would_not_fit(tmp_path: Path, monkeypatch) -> None:
    deep = tmp_path / ("d" * 80)
    deep.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(deep))
    assert ipc_dir.own_rpc_dir() is None
    assert list(deep.iterdir()) == []  # the one it tried is gone
