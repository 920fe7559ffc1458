"""A fleet on one audit store, end to end: two real orca-serve processes on the embedded toy model,
one real redis-server, the real OpenAI client.

Both servers run `--orca-audit-store` at the same Redis (no audit directory), every request
audited and every voted group too (`--orca-audit-rate 1 --orca-vote-audit-rate 1`),
`--orca-on-alarm fallback`, on test_audit_server's bundle (the demo's plus delta 0.3 at lambda 0,
which alarms after a few audits, and a consensus block: t* = 0). The stop audit's sequence is
checked first, then the vote's (and a replica started later resumes it), then the store is
killed under them. One fleet for both audits: a fleet serves both at once, and two more
orca-serve processes would cost a minute of the suite.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from tests.redis_server import RedisServer
from tests.serving import START_TIMEOUT, Server, orca_of, orca_serve_cmd
from tests.test_audit_server import (
    BAD_DELTA,
    BATCH,
    COMMON,
    MODEL,
    _ask,
    _records,
    _row,
    _settled,
    _table,
    audit_env,
)
from tests.test_server_samples import K, ask, questions

pytestmark = pytest.mark.vllm

KEYS = ("n", "censored", "lower", "upper", "alarm", "engaged", "lambda_source")
GROUPS = 4  # voted requests, alternately to each replica


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    return audit_env(tmp_path_factory.mktemp("fleet"))


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Iterator[RedisServer]:
    """The `redis_store` fixture's server, for the whole module (its servers share it)."""
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


def replica(env: dict, store: RedisServer, name: str, seed: int,
            on_alarm: str = "fallback") -> Server:
    """A replica of the fleet (started, not waited for), logging to `name`.log."""
    return Server(orca_serve_cmd("--model", str(MODEL), "--calib", str(env["bundle"]),
                                 "--orca-audit-rate", "1.0", "--orca-vote-audit-rate", "1.0",
                                 "--orca-audit-seed", str(seed), "--orca-audit-store", store.url,
                                 "--orca-on-alarm", on_alarm),
                  env["dir"] / f"{name}.log", COMMON)


@pytest.fixture(scope="module")
def fleet(env, store) -> Iterator[list[Server]]:
    servers = [replica(env, store, f"replica{i}", i) for i in range(2)]
    try:
        yield [s.wait(2 * START_TIMEOUT) for s in servers]  # two start at once
    finally:
        for s in servers:
            s.stop()


def _store_up(server: Server) -> float:
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    m = re.search(r"^orca_audit_store_up\{.*\} (\S+)$", metrics, re.MULTILINE)
    assert m, metrics[-2000:]
    return float(m.group(1))


def test_two_replicas_on_one_store_keep_one_sequence_and_one_decision(fleet, env) -> None:
    """Requests at the failing delta spread over both replicas: their audits enter one sequence
    (each replica's table counts both's), the alarm that one of them folds first is the
    other's too, and both then serve that delta with the fallback."""
    a, b = fleet
    prompts = _records(env["dir"] / "more.jsonl")
    fell_back = False
    with ThreadPoolExecutor(BATCH) as pool:  # half of each batch to each replica, at once
        for start in range(0, len(prompts), BATCH):
            list(pool.map(lambda ip: _ask(fleet[ip[0] % 2], ip[1]["messages"], delta=BAD_DELTA),
                          enumerate(prompts[start:start + BATCH])))
            _settled(a)
            _settled(b)
            if _row(_table(a), BAD_DELTA)["engaged"]:
                fell_back = True
                break
    assert fell_back, _table(a)
    ta, tb = _settled(a), _settled(b)
    assert ta["admitted"] == tb["admitted"] == ta["picked"] + tb["picked"]
    for ra, rb in zip(ta["deltas"], tb["deltas"]):
        assert {k: ra[k] for k in KEYS} == {k: rb[k] for k in KEYS}, (ra, rb)
    in_risk = sum(t["labelled"] - t["unsolvable"] - t["unaligned"] + t["length"] + t["aborted"]
                  for t in (ta, tb))
    assert _row(ta, BAD_DELTA)["n"] == in_risk and ta["labelled"] > 0 and tb["labelled"] > 0
    for s in fleet:  # one decision: both fall back at that delta
        orca = _ask(s, [{"role": "user", "content": "Find the integer x with 3*x = 12."}],
                    delta=BAD_DELTA).model_extra["orca"]
        assert orca["lambda_source"] == "fallback" and orca["lambda"] is None
        assert _store_up(s) == 1.0 and _table(s)["store"]["up"]


def test_a_replica_started_with_other_guard_flags_exits_naming_them(fleet, store, env) -> None:
    """A third replica with `--orca-on-alarm report` beside the fleet's `fallback` would fold
    the shared events into other decisions (it would serve the lambda the fleet fell back
    from): it exits before its engine starts, with one line naming the flag and both values;
    the fleet serves on."""
    odd = replica(env, store, "odd", 3, on_alarm="report")
    try:
        assert odd.proc.wait(START_TIMEOUT) == 2
    finally:
        odd.stop()
    errors = [line for line in (env["dir"] / "odd.log").read_text().splitlines()
              if line.startswith("orca-serve: error:")]
    assert len(errors) == 1 and "--orca-on-alarm fallback there, report here" in errors[0]
    assert store.url in errors[0]
    assert all(_table(s)["store"]["up"] for s in fleet)


def vote_rows(server: Server) -> list[dict]:
    """The vote rows of the server's GET /v1/orca/audit that hold audited groups."""
    return [r for r in _table(server)["vote"]["rows"] if r["n"]]


def test_two_replicas_count_each_others_voted_groups_and_a_restart_resumes(fleet, store,
                                                                           env) -> None:
    """Voted requests alternately to each replica, every group audited: each replica's vote
    row counts the groups of both (one sequence), what each picked stays its own, the second
    leaves the store as it stops (its owner key), and a replica started after it resumes the
    row from the store."""
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
        assert _table(s)["vote"]["picked"] == GROUPS // 2  # what this replica picked is its own
    fleet[1].stop()
    owners = redis.Redis.from_url(store.url).keys("orca:guard-owner:*")
    assert len(owners) == 1, owners  # the stopped one left as it exited, not its key's TTL later
    late = replica(env, store, "late", 2)  # a restart: resumes from the store
    try:
        assert vote_rows(late.wait()) == rows[0]
    finally:
        late.stop()


def test_a_replica_keeps_serving_on_its_own_guard_when_the_store_dies(fleet, store, env) -> None:
    """The store is killed: the next request is served and audited all the same, its audit
    enters the replica's own guard (which goes on from the state folded so far: the alarmed
    delta still falls back), and the log and /metrics say the store is gone."""
    a = fleet[0]
    before = _settled(a)
    store.stop()
    r = _ask(a, [{"role": "user", "content": "Find the integer x with 2*x + 1 = 7."}])
    assert r.choices[0].message.content and r.model_extra["orca"]["audited"]
    after = _settled(a)
    assert after["store"]["up"] is False and _store_up(a) == 0.0
    assert after["picked"] == before["picked"] + 1
    assert _row(after, 0.1)["n"] + after["unsolvable"] == (
        _row(before, 0.1)["n"] + before["unsolvable"] + 1)
    assert _row(after, BAD_DELTA)["lambda_source"] == "fallback"
    log = (env["dir"] / "replica0.log").read_text()
    assert log.count("is unreachable while serving") == 1 and "own local guard" in log
