"""The vote's audit of a fleet, end to end: two real orca-serve processes on the toy reasoner
(test_server_samples' bundle: t* = 0), one real redis-server, the real OpenAI client. Both run
`--orca-vote-audit-rate 1 --orca-audit-store` at the same Redis (no audit directory), so every
voted group is audited and its loss journalled to the store: each replica's vote row counts the
groups of both (one sequence), and a replica started afterwards resumes it."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

pytestmark = pytest.mark.vllm

from tests.redis_server import RedisServer
from tests.serving import START_TIMEOUT, Server, orca_of
from tests.test_server_samples import K, ask, questions, start_samples_server

GROUPS = 4  # voted requests, alternately to each replica


def vote_rows(server: Server) -> list[dict]:
    """The vote rows of the server's GET /v1/orca/audit that hold audited groups."""
    table = httpx.get(server.url + "/v1/orca/audit", timeout=10).json()["vote"]
    return [r for r in table["rows"] if r["n"]]


def replica(d, *flags: str) -> Server:
    d.mkdir()
    return start_samples_server(d, *flags)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


def test_two_replicas_count_each_others_voted_groups_and_a_restart_resumes(tmp_path, store):
    flags = ("--orca-vote-audit-rate", "1.0", "--orca-audit-store", store.url,
             "--orca-audit-seed", "0")
    fleet = [replica(tmp_path / f"r{i}", *flags) for i in range(2)]
    servers = list(fleet)
    try:
        for s in fleet:
            s.wait(2 * START_TIMEOUT)  # two start at once
        for i, q in enumerate(questions(GROUPS)):
            o = orca_of(ask(fleet[i % 2], q, {"samples": K}, seed=700 + i))
            assert o["vote"]["audited"], o["vote"]
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # audited groups end after their responses
            rows = [vote_rows(s) for s in fleet]  # the table reads the other's events first
            if all(len(r) == 1 and r[0]["n"] == GROUPS for r in rows):
                break
            time.sleep(1)
        assert rows[0] == rows[1] and rows[0][0]["n"] == GROUPS, rows  # one sequence
        for s in fleet:
            table = httpx.get(s.url + "/v1/orca/audit", timeout=10).json()["vote"]
            assert table["picked"] == GROUPS // 2  # what this replica picked is its own
        fleet[1].stop()
        late = replica(tmp_path / "late", *flags)  # a restart: resumes from the store
        servers.append(late)
        assert vote_rows(late.wait()) == rows[0]
    finally:
        for s in servers:
            s.stop()
