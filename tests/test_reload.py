"""The hot-reload protocol (orca_serve.api_server.reload) against real cores, without vLLM.

Each fake "worker" is our worker extension whose processors are thin wrappers around a real
`OrcaCore` (the fake tokenizer model of test_core), reached through the same RPC method names the
server calls with collective_rpc. So the two phases, the roll-back after a refusal, and the
release of an old bundle after its last in-flight request run the real code on both sides.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client import CollectorRegistry

from orca_method.bundle import Bundle, Labelling, _checksum, load_bundle, save_bundle
from orca_method.outcomes import GiveUpPolicy
from orca_serve.api_server.admin import AdminMiddleware
from orca_serve.settings.contract import XARG_KEY
from orca_serve.settings.effort import parse_effort_map
from orca_serve.live_audit.factory import make_live_audit
from orca_serve.live_audit.handover import successor
from orca_serve.live_audit.journal import OWNERS, journal_path
from orca_serve.live_audit.live import LiveAudit
from orca_serve.live_audit.options import AuditConfig, add_audit_args, audit_config
from orca_serve.metrics.prometheus import OrcaMetrics
from orca_serve.api_server.reload import ReloadRefused
from orca_serve.settings.resolve import OrcaDefaults, resolve
from orca_serve.vllm_plugin.worker import OrcaWorkerExtension
from tests.bundles import with_consensus, with_give_up, with_saturated_give_up
from tests.core_sim import PROMPT, make_core, sim_bundle
from tests.servers import orca_result, orca_server
from tests.serving import free_port


class Proc:
    """What the worker extension calls on a processor, on a real core; `refuse`: paths this
    worker refuses (a worker whose check fails where the others' pass)."""

    def __init__(self, core, refuse=()):
        self.core, self.refuse = core, set(refuse)

    def load_bundle(self, path):
        if path in self.refuse:
            raise ValueError(f"bundle {path} refused by this worker")
        return self.core.load_bundle(path).checksum

    def use_bundle(self, checksum):
        self.core.use_bundle(checksum)

    def retire_bundles(self, keep):
        return self.core.retire_bundles(keep)


class Worker(OrcaWorkerExtension):
    def __init__(self, proc):
        self.proc = proc

    def _orca_processors(self):
        return [self.proc]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return {"a": sim_bundle(tmp_path_factory, seed=1), "b": sim_bundle(tmp_path_factory, seed=7),
            "wrong": sim_bundle(tmp_path_factory, seed=2, hidden=17)}


def setup(paths, refuse=(), *, audit=None, audit_config=None):
    a = load_bundle(paths["a"])
    workers = [Worker(Proc(make_core(paths["a"]))), Worker(Proc(make_core(paths["a"]), refuse))]
    calls = []

    async def rpc(method, args=()):
        calls.append(method)
        return [getattr(w, method)(*args) for w in workers]

    server = orca_server(a, OrcaDefaults(delta=0.1), rpc=rpc,
                         metrics=OrcaMetrics(CollectorRegistry(), model_name="m"),
                         audit=None if audit is None else audit(a),
                         reloader={"calib_path": str(paths["a"]), "admin_key": "k",
                                   "audit_config": audit_config})
    return server, [w.proc.core for w in workers], calls


def test_a_refusal_by_one_worker_rolls_every_worker_back(paths):
    server, cores, calls = setup(paths, refuse={str(paths["b"])})
    a = server.serving.now.bundle.checksum
    with pytest.raises(ReloadRefused, match="refused by this worker"):
        asyncio.run(server.reloader.reload(str(paths["b"]), source="test"))
    assert calls == ["orca_load_bundle", "orca_use_bundle", "orca_retire_bundles"]
    assert server.serving.now.bundle.checksum == a
    for core in cores:  # the first worker had staged it: let go again
        assert list(core.deps) == [a] and core.dep.checksum == a
    with pytest.raises(ReloadRefused, match="hidden size"):  # refused by every engine
        asyncio.run(server.reloader.reload(str(paths["wrong"]), source="test"))
    assert server.reloader.last["refused"] and server.serving.now.bundle.checksum == a


def test_the_old_bundle_goes_after_its_last_request(paths):
    """A request resolved with A before the reload joins A in the engine even after the swap;
    A is let go only when the server has finished it and the engine's request has left."""
    server, cores, _ = setup(paths)
    a = server.serving.now.bundle.checksum
    body, old = resolve({"messages": []}, server.serving.now.defaults, server.serving.now.bundle)
    server.reloader.started(old)

    async def go():
        out = await server.reloader.reload(str(paths["b"]), source="test")
        await asyncio.sleep(0)
        return out

    out = asyncio.run(go())
    b = out["checksum"]
    assert out["changed"] and out["previous"] == a and server.serving.now.bundle.checksum == b != a
    assert server.serving.now.defaults.delta == server.serving.now.bundle.default_delta
    for core in cores:
        assert list(core.deps) == [a, b] and core.dep.checksum == b
    # the engine sees the request only now (it waited in vLLM's queue): it joins A
    xa = body["vllm_xargs"]
    req = cores[0].join("r", cores[0].settings(xa), prompt=PROMPT, n_out=0, index=0,
                        max_tokens=9, eos=None, ignore_eos=False, structured=False)
    assert req.dep.checksum == a and req.enabled
    _, new = resolve({"messages": []}, server.serving.now.defaults, server.serving.now.bundle)
    assert new.bundle == b

    async def finish():
        server.reloader.finished(old)  # the server fetched its result
        await asyncio.gather(*server.reloader._tasks)

    asyncio.run(finish())
    assert list(cores[1].deps) == [b]  # no request of A there
    assert list(cores[0].deps) == [a, b]  # its request of A has not left yet
    cores[0].leave(req, True)
    assert list(cores[0].deps) == [b]
    assert cores[0].pop_results([xa[XARG_KEY]])[xa[XARG_KEY]]["bundle_checksum"] == a
    # reloading the bundle that serves is a no-op
    again = asyncio.run(server.reloader.reload(str(paths["b"]), source="test"))
    assert again["changed"] is False


def test_the_live_audit_restarts_with_the_new_bundle(paths):
    config = AuditConfig(rate=1.0, seed=0)
    server, _, _ = setup(paths, audit=lambda b: LiveAudit(b, config),
                         audit_config=lambda b: config)
    old = server.serving.now
    _, settings = resolve({"messages": [{"role": "user", "content": "q"}]}, old.defaults,
                          old.bundle, thresholds=old.thresholds)
    assert settings.audited
    asyncio.run(server.reloader.reload(str(paths["b"]), source="test"))
    new = server.serving.now
    assert new.audit is not old.audit and new.audit.bundle.checksum == new.bundle.checksum
    assert new.audit.counts["superseded"] == 1 and new.audit.counts["picked"] == 0
    assert new.audit.table()["bundle_checksum"] == new.bundle.checksum
    old.audit.finished(settings, {0: orca_result(scores=[0.5], step_tokens=[3])},
                       {0: "stop"})  # dropped
    assert old.audit._queue is None and new.audit._queue is None
    assert old.defaults is not new.defaults and old.bundle is not new.bundle  # swapped whole


def test_a_bundle_whose_fleet_runs_other_guard_flags_is_refused(paths, redis_store):
    """A reload to a bundle whose journal on the fleet's store a running replica folds under
    other guard flags is refused before any engine is asked, naming the flag with both values
    (the audit would decide otherwise on the same events); the old bundle and audit serve on.
    Once that replica stopped, the same reload goes through and its audit joins the store."""
    config = AuditConfig(rate=1.0, store=redis_store.url)
    running = make_live_audit(load_bundle(paths["b"]), replace(config, on_alarm="fallback"))
    server, _, calls = setup(paths, audit=lambda b: make_live_audit(b, config),
                             audit_config=lambda b: config)
    now = server.serving.now
    with pytest.raises(ReloadRefused, match="live audit cannot follow.*orca:guard:.*"
                       "--orca-on-alarm fallback there, report here"):
        asyncio.run(server.reloader.reload(str(paths["b"]), source="test"))
    assert calls == [] and server.serving.now.audit is now.audit
    assert now.audit.state.journal.up
    running.state.journal.close()
    asyncio.run(server.reloader.reload(str(paths["b"]), source="test"))
    new = server.serving.now.audit
    assert new is not now.audit and new.state.journal.up
    new.state.journal.close()


def test_a_bundle_whose_store_key_holds_another_type_is_refused(paths, redis_store):
    """A reload to a bundle whose journal on the store has a key of another Redis type (its
    events key a hash: another program's data, a store half migrated) is refused before any
    engine is asked, naming the key; the old bundle and audit serve on, on the store, and the
    key is kept. Before, the new audit took the key's WRONGTYPE for an unreachable store and
    served the new bundle on a guard of its own, apart from the fleet. Renamed away, the same
    reload goes through on the store."""
    config = AuditConfig(rate=1.0, store=redis_store.url)
    events = f"orca:guard:{load_bundle(paths['b']).checksum}:events"
    client = redis.Redis.from_url(redis_store.url)
    client.hset(events, "x", "1")
    server, _, calls = setup(paths, audit=lambda b: make_live_audit(b, config),
                             audit_config=lambda b: config)
    now = server.serving.now
    with pytest.raises(ReloadRefused, match=f"live audit cannot follow the new bundle: "
                       f"{redis_store.url}: {events} is a Redis hash, where the audit journal "
                       "keeps its events"):
        asyncio.run(server.reloader.reload(str(paths["b"]), source="test"))
    assert calls == [] and server.serving.now.audit is now.audit and now.audit.state.journal.up
    assert client.type(events) == b"hash"
    client.rename(events, f"{events}:moved")
    asyncio.run(server.reloader.reload(str(paths["b"]), source="test"))
    new = server.serving.now.audit
    assert new is not now.audit and new.state.journal.up
    new.state.journal.close()


@pytest.mark.parametrize("on", ["directory", "store"])
def test_a_reload_to_a_bundle_whose_fold_record_is_not_one_is_this_servers_alone(
        on, paths, tmp_path, request):
    """The new bundle's fold record is not one (cut short) and no other process runs: the
    reload writes it anew, as a start would. Before, the serving audit's own owner lock (key),
    held until the swap, counted as another process's, so every such reload was refused with
    'stop them all' on a server that ran alone. Another server (of any bundle) still refuses."""
    b = load_bundle(paths["b"])
    if on == "store":
        url = request.getfixturevalue("redis_store").url
        config = AuditConfig(rate=1.0, store=url)
        client = redis.Redis.from_url(url)

        def cut() -> None:
            client.set(f"orca:guard:{b.checksum}:fold", b'{"settings": {"--orca-on-al')
    else:
        config = AuditConfig(rate=1.0, directory=tmp_path)

        def cut() -> None:
            journal_path(tmp_path, b.checksum).with_suffix(".fold.json").write_bytes(b"{")
    cut()
    other = make_live_audit(b.model_copy(update={"checksum": "0" * 64}), config)
    server, _, calls = setup(paths, audit=lambda a: make_live_audit(a, config),
                             audit_config=lambda a: config)
    with pytest.raises(ReloadRefused, match="not a fold record"):
        asyncio.run(server.reloader.reload(str(paths["b"]), source="test"))
    other.close()
    asyncio.run(server.reloader.reload(str(paths["b"]), source="test"))
    assert server.serving.now.bundle.checksum == b.checksum and calls[0] == "orca_load_bundle"
    server.serving.now.audit.close()


def test_a_reload_cancelled_while_its_audit_is_built_leaves_the_new_journal(paths, tmp_path,
                                                                           monkeypatch):
    """The reload is cancelled (the server stopping) while the new audit is built in its
    thread: once built, it leaves the journal it joined. Before, it stayed joined for the
    process's life (its owner lock held; on a fleet's store its key renewed, then left to
    expire), and the next reload to that bundle added a second member of this process."""
    config = AuditConfig(rate=1.0, directory=tmp_path)
    server, _, calls = setup(paths, audit=lambda a: make_live_audit(a, config),
                             audit_config=lambda a: config)
    started, built = threading.Event(), threading.Event()

    def slow_successor(*args):
        started.set()
        time.sleep(0.3)  # still building when the reload is cancelled
        try:
            return successor(*args)
        finally:
            built.set()

    monkeypatch.setattr("orca_serve.api_server.reload.successor", slow_successor)

    async def cancelled() -> None:
        task = asyncio.ensure_future(server.reloader.reload(str(paths["b"]), source="test"))
        await asyncio.to_thread(started.wait)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled())
    assert built.wait(10) and calls == []
    serving = server.serving.now.audit.state.journal.owner
    deadline = time.monotonic() + 10
    while [p.stem for p in (tmp_path / OWNERS).glob("*.lock")] != [serving]:
        assert time.monotonic() < deadline, list((tmp_path / OWNERS).glob("*.lock"))
        time.sleep(0.01)
    server.serving.now.audit.close()


def test_a_reload_opens_the_new_bundles_journal_once(paths, tmp_path, caplog):
    """The store is down: a reload goes through, the new audit on its own local guard, and the
    store's unreachability is said once for it. Before, the reload opened the new journal twice
    (its flag check, then the swap), and so logged the warning twice."""
    config = AuditConfig(rate=1.0, store=f"redis://127.0.0.1:{free_port()}/0",
                         directory=tmp_path)
    server, _, _ = setup(paths, audit=lambda b: make_live_audit(b, config),
                         audit_config=lambda b: config)
    caplog.clear()  # the first bundle's audit said it
    with caplog.at_level(logging.WARNING, logger="orca_serve.live_audit"):
        asyncio.run(server.reloader.reload(str(paths["b"]), source="test"))
    new = server.serving.now.audit
    assert new.bundle.checksum == server.serving.now.bundle.checksum
    assert not new.state.journal.up
    assert caplog.text.count("is unreachable at start") == 1, caplog.text
    new.close()


def test_a_reload_answers_the_note_its_checks_let_it_through_with(paths):
    """A bundle the checks pass with a note (a forced model mismatch, a dtype or sampling other
    than this server serves): the reload answers it, besides logging it."""
    server, _, _ = setup(paths)
    server.reloader.check = lambda bundle: "served otherwise"
    out = asyncio.run(server.reloader.reload(str(paths["b"]), source="test"))
    assert out["changed"] and out["note"] == "served otherwise"


def test_admin_route(paths):
    server, _, _ = setup(paths)
    seen = []

    async def app(scope, receive, send):  # everything else reaches vLLM's app
        seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def go(reloader):
        client = httpx.AsyncClient(transport=httpx.ASGITransport(
            app=AdminMiddleware(app, reloader)), base_url="http://t")
        url = "/v1/orca/bundle"
        out = [await client.post(url, json={"path": str(paths["b"])}),
               await client.post(url, json={"path": str(paths["b"])},
                                 headers={"Authorization": "Bearer x"}),
               await client.post(url, content=b"{", headers={"Authorization": "Bearer k"}),
               await client.post(url, json={"path": str(paths["wrong"])},
                                 headers={"Authorization": "Bearer k"}),
               await client.post(url, json={"path": str(paths["b"])},
                                 headers={"Authorization": "Bearer k"}),
               await client.get(url)]
        await client.aclose()
        return out

    r = asyncio.run(go(server.reloader))
    assert [x.status_code for x in r] == [401, 403, 400, 400, 200, 204]
    assert "hidden size" in r[3].json()["error"]["message"]
    assert r[4].json()["checksum"] == server.serving.now.bundle.checksum == r[4].json()["bundle"]["checksum"]
    server.reloader.admin_key = None
    r = asyncio.run(go(server.reloader))
    assert {x.status_code for x in r[:5]} == {404}
    assert seen == ["/v1/orca/bundle"] * 2  # only the GET passed through


def _effort_map(server, text):
    """The server started with --orca-effort-map `text`."""
    now = server.serving.now
    server.serving.swap(replace(now, defaults=replace(now.defaults,
                                                      effort_map=parse_effort_map(text))))


def test_a_bundle_without_an_effort_maps_delta_is_refused(paths):
    """--orca-effort-map low=0.3: a new bundle must calibrate 0.3 too, or low-effort requests
    would fail; refused before any engine is asked."""
    server, _cores, calls = setup(paths)
    _effort_map(server, "low=0.3")
    with pytest.raises(ReloadRefused, match="--orca-effort-map: delta 0.3 has no calibrated"):
        asyncio.run(server.reloader.reload(str(paths["b"]), source="test"))
    assert calls == [] and server.serving.now.bundle.checksum == load_bundle(paths["a"]).checksum
    _effort_map(server, "low=0.05")
    assert asyncio.run(server.reloader.reload(str(paths["b"]), source="test"))["changed"]


def test_a_bundle_certified_for_another_give_up_policy_is_refused(paths, tmp_path):
    """--orca-give-up-policy is fixed for the server's life, and a two-sided bundle's mu* holds
    only under the policy it was certified for (docs/METHOD.md section 9): a reload to one
    certified for the other policy is refused before any engine is asked, by the rule start-up
    applies (orca_serve.checks.bundle), in one line naming the fix; the bundle certified for
    the served policy reloads."""
    two = with_give_up(load_bundle(paths["b"]), [(0.05, 0.1)])
    certified = {}
    for policy in GiveUpPolicy:  # model_copy does not validate: members, as a load gives
        certified[policy] = tmp_path / f"{policy}.json"
        save_bundle(two.model_copy(update={"give_up": two.give_up.model_copy(
            update={"policy": policy})}), certified[policy])
    for served, other in (("message", "guess"), ("guess", "message")):
        server, _cores, calls = setup(paths)
        now = server.serving.now
        server.serving.swap(replace(now, defaults=replace(now.defaults, give_up_policy=served)))
        with pytest.raises(ReloadRefused) as e:
            asyncio.run(server.reloader.reload(str(certified[other]), source="test"))
        assert str(e.value).startswith(f"--orca-give-up-policy {served}: the bundle's give-up "
                                       f"threshold mu* was certified for give-up policy "
                                       f"'{other}'") and "\n" not in str(e.value)
        assert calls == [] and server.serving.now.bundle.checksum == now.bundle.checksum
        assert asyncio.run(server.reloader.reload(str(certified[served]), source="test"))[
            "changed"]
        assert server.serving.now.bundle.give_up.policy == served



def _rising(data: dict) -> None:
    data["ltt"]["rows"][0]["lam"] = 0.1  # delta 0.05 below delta 0.1's 0.75


def _saturated_give_up(data: dict) -> None:
    damaged = with_saturated_give_up(Bundle.model_validate(data)).model_dump()
    data.clear()
    data.update(damaged)


@pytest.mark.parametrize("damage, why", [(_rising, "rises with delta"),
                                         (_saturated_give_up, "give-up probe's scores are all "
                                                              "saturated")])
def test_a_bundle_the_start_up_checks_refuse_is_refused_with_one_logged_line(paths, tmp_path,
                                                                            caplog, damage, why):
    """The checks made at start run on reload too: a table whose lambda* rises with delta, or a
    give-up probe whose weights are x 1e30 (re-sealed), is refused before any engine is asked,
    and the refusal is one WARNING line of the log."""
    data = json.loads(Path(paths["b"]).read_text())
    damage(data)
    data["checksum"] = _checksum(data)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    load_bundle(bad)  # it loads: only the check can refuse it
    server, _, calls = setup(paths)
    with caplog.at_level(logging.INFO, logger="orca_serve"), \
            pytest.raises(ReloadRefused, match=why):
        asyncio.run(server.reloader.reload(str(bad), source="test"))
    assert calls == []
    (line,) = [r for r in caplog.records if r.name == "orca_serve.api_server.reload"]
    assert line.levelno == logging.WARNING and why in line.getMessage()
    assert "\n" not in line.getMessage()


def test_orca_lines_take_vllms_handler_once_vllm_configured_logging():
    """Under vLLM's logging configuration (its handler on `vllm` only) an INFO line of
    orca_serve reaches vLLM's handler after `log_like_vllm`, and nothing before it."""
    from vllm.logger import _configure_vllm_root_logger  # what vLLM runs at import

    from orca_serve.api_server.log import log_like_vllm

    _configure_vllm_root_logger()
    (handler,) = logging.getLogger("vllm").handlers
    seen: list[str] = []
    handler.addFilter(lambda r: seen.append(r.getMessage()) or False)  # record, print nothing
    orca = logging.getLogger("orca_serve")
    before = (list(orca.handlers), orca.level, orca.propagate)
    try:
        logging.getLogger("orca_serve.api_server.reload").info("before")
        log_like_vllm()
        logging.getLogger("orca_serve.api_server.reload").info("after")
    finally:
        orca.handlers[:], orca.level, orca.propagate = before[0], before[1], before[2]
        handler.filters.clear()
    assert seen == ["after"]



def test_a_bundle_whose_labelling_contradicts_the_audit_flags_is_refused(paths, tmp_path):
    """--orca-audit-suffix given (for a bundle without a labelling block): a new bundle that
    records another suffix is refused before any engine is asked; the old one serves on."""
    p = argparse.ArgumentParser()
    add_audit_args(p)
    ns = p.parse_args(["--orca-audit-rate", "1.0", "--orca-audit-suffix", "S{"])
    labelled = tmp_path / "labelled.json"
    save_bundle(load_bundle(paths["b"]).model_copy(
        update={"labelling": Labelling(suffix="T{", answer_tokens=4)}), labelled)
    server, _, calls = setup(paths, audit=lambda b: make_live_audit(b, audit_config(ns, b)),
                             audit_config=lambda b: audit_config(ns, b))
    now = server.serving.now
    with pytest.raises(ReloadRefused, match="live audit cannot follow.*'S\\{' contradicts"):
        asyncio.run(server.reloader.reload(str(labelled), source="test"))
    assert calls == [] and server.serving.now.bundle.checksum == now.bundle.checksum
    assert server.serving.now.audit.config.probe.suffix == "S{"


def test_a_bundle_certified_for_another_vote_schedule_is_refused(paths, tmp_path):
    """--orca-vote-waves is fixed for the server's life, and a consensus t holds only for the
    launch schedule it was certified for (docs/METHOD.md section 14, "Waves"): a reload to a
    block certified for waves is refused under all-at-once, by the rule start-up applies; the
    same bundle reloads once the server runs its schedule."""
    waved = tmp_path / "waved.json"
    save_bundle(with_consensus(load_bundle(paths["b"]), waves=[1, 1, 2]), waved)
    server, _cores, calls = setup(paths)
    now = server.serving.now
    with pytest.raises(ReloadRefused) as e:
        asyncio.run(server.reloader.reload(str(waved), source="test"))
    assert str(e.value).startswith("--orca-vote-waves all at once: the bundle's consensus "
                                   "margin t was certified for samples launched in waves 1+1+2")
    assert calls == [] and server.serving.now.bundle.checksum == now.bundle.checksum
    server.serving.swap(replace(now, defaults=replace(now.defaults, vote_waves=(1, 1, 2))))
    assert asyncio.run(server.reloader.reload(str(waved), source="test"))["changed"]
