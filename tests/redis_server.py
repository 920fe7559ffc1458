"""A real redis-server for the fleet tests, on a free loopback port in a temporary directory.

`make setup` installs redis-server (scripts/setup-test-store.sh); a test that needs one fails,
never skips, when it is missing, so CI cannot pass without exercising the store.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis

from tests.serving import free_port


class RedisServer:
    """redis-server, without persistence unless `config` says otherwise (the tests' stores live
    as long as the test); `config`: more redis-server options, e.g. ("--appendonly", "yes")."""

    def __init__(self, directory: Path, *config: str) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: run `make setup` (it installs it with "
                        "apt-get) or `apt-get install redis-server`")
        self.directory = directory
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._log = open(directory / "redis.log", "wb")  # noqa: SIM115 - until stop()
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(directory),
             "--save", "", "--appendonly", "no", "--daemonize", "no", *config],
            stdout=self._log, stderr=subprocess.STDOUT)
        client = redis.Redis.from_url(self.url)
        deadline = time.time() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("redis-server did not start:\n"
                                       + (directory / "redis.log").read_text()[-2000:]) from None
                time.sleep(0.05)
        client.close()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop it (SIGKILL: a store that goes away at once, as a crashed or cut-off one)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()
