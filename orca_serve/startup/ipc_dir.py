"""A directory of the server's own for vLLM's ZMQ IPC sockets, removed when the server exits.

vLLM names each IPC socket `$VLLM_RPC_BASE_PATH/<uuid4>`, the temp dir by default, and never
removes the files: libzmq leaves a named socket's file when it closes it. Measured: a clean
`orca-serve --demo` start and SIGTERM left 7 in /tmp, as vLLM's own server does, so a host that
restarts its server, or a benchmark that starts dozens, piles up thousands. orca-serve gives
them a directory of their own and removes it on the way out (a normal exit, SystemExit, SIGTERM
through `exit_on_sigterm`); a kill -9 still leaves it, as it leaves vLLM's processes. A
`VLLM_RPC_BASE_PATH` the user set is theirs: left as it is.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

VARIABLE = "VLLM_RPC_BASE_PATH"
PREFIX = "orca-ipc-"
SOCKET_PATH_MAX = 107  # bytes in a unix socket's path (sockaddr_un.sun_path, less its NUL)
SOCKET_NAME_LEN = 36  # vLLM's name for each socket: a uuid4


def fits(directory: str) -> bool:
    """Whether vLLM's socket paths inside `directory` fit a unix socket's path."""
    return len(os.fsencode(directory)) + len("/") + SOCKET_NAME_LEN <= SOCKET_PATH_MAX


def own_rpc_dir() -> str | None:
    """A new directory in the temp dir for the sockets, or None where the temp dir's path is too
    long for a socket's path inside it (vLLM would fail to bind there: keep its default)."""
    path = tempfile.mkdtemp(prefix=PREFIX)
    if fits(path):
        return path
    os.rmdir(path)
    return None


def use_own_rpc_dir() -> str | None:
    """Point vLLM's sockets (this process's and every process it starts, which inherit the
    variable) at a directory of their own, removed when this process exits; the directory, or
    None where the user chose one or none fits."""
    if VARIABLE in os.environ:
        return None
    path = own_rpc_dir()
    if path is None:
        return None
    os.environ[VARIABLE] = path
    creator = os.getpid()

    def remove() -> None:  # not in a forked child that runs the handlers: the server's, not its
        if os.getpid() == creator:
            shutil.rmtree(path, ignore_errors=True)

    atexit.register(remove)
    return path
