"""Hot reload of the bundle end to end: a real orca-serve on the tiny model, real HTTP, the real
`openai` client. One server for the module, started with bundle A and an admin key.

Bundle A's probe fires at once (bias 3: score ~0.95, delta 0.2 -> lambda 0.5 stops at step 1);
bundle B is the same model's with bias -3 (score ~0.05: never stops). Which bundle served a
request is thus visible twice: in `orca.bundle_checksum`, and in whether it could stop early.
The tests run in file order: refusals (A serving), the reload under 64 concurrent requests (to
B), SIGHUP (back to A, the --calib file).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.vllm

from tests.bundles import make_bundle
from tests.serving import COMMON, MSG, Server, orca_serve_cmd
from tests.tiny_model import HIDDEN

KEY_ENV = "ORCA_TEST_ADMIN_KEY"
KEY = "test-admin-key"
N = 64


@pytest.fixture(scope="module")
def env(model, tmp_path_factory):
    """Bundles A and B of the session's tiny model (conftest builds it once per run)."""
    d = tmp_path_factory.mktemp("hot_reload")
    a = make_bundle(d / "a.json", model, bias=3.0)
    b = make_bundle(d / "b.json", model, bias=-3.0)
    calib = d / "calib.json"  # what --calib names: SIGHUP re-reads it
    shutil.copy(a, calib)
    return {"dir": d, "model": model, "a": a, "b": b, "calib": calib,
            "sum_a": json.loads(a.read_text())["checksum"],
            "sum_b": json.loads(b.read_text())["checksum"]}


@pytest.fixture(scope="module")
def srv(env):
    os.environ[KEY_ENV] = KEY  # the server process inherits it
    server = Server(orca_serve_cmd("--model", str(env["model"]), "--calib", str(env["calib"]),
                                   "--orca-admin-key-env", KEY_ENV, "--orca-answer-budget", "8"),
                    env["dir"] / "orca.log", COMMON)
    try:
        yield server.wait()
    finally:
        server.stop()
        os.environ.pop(KEY_ENV, None)


def post_bundle(srv: Server, body, key: str | None = KEY) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.post(srv.url + "/v1/orca/bundle", json=body, headers=headers, timeout=180)


def serving(srv: Server) -> str:
    return httpx.get(srv.url + "/v1/orca/bundle", timeout=10).json()["checksum"]


def test_the_route_needs_the_admin_key(srv, env):
    r = post_bundle(srv, {"path": str(env["b"])}, key=None)
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert r.headers["www-authenticate"] == "Bearer"
    r = post_bundle(srv, {"path": str(env["b"])}, key="wrong")
    assert r.status_code == 403 and r.json()["error"]["type"] == "PermissionDeniedError"
    r = post_bundle(srv, {"bundle": str(env["b"])})
    assert r.status_code == 400 and r.json()["error"]["param"] == "path"
    assert serving(srv) == env["sum_a"]


def test_refused_bundles_leave_the_old_one_serving(srv, env):
    """Refused by the server (checksum, missing file) or by the engine (another model): one line,
    HTTP 400 in OpenAI's error format, and bundle A still serves."""
    wrong = make_bundle(env["dir"] / "wrong_model.json", env["model"], hidden=HIDDEN // 2)
    data = json.loads(env["b"].read_text())
    data["ltt"]["rows"][0]["lam"] = 0.01
    edited = env["dir"] / "edited.json"
    edited.write_text(json.dumps(data))
    for path, why in ((wrong, "hidden size"), (edited, "checksum"),
                      (env["dir"] / "missing.json", "not found")):
        r = post_bundle(srv, {"path": str(path)})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert why in err["message"] and "\n" not in err["message"] and err["param"] == "path"
        assert serving(srv) == env["sum_a"]
    o = srv.client().chat.completions.create(
        model=srv.client().models.list().data[0].id, messages=MSG, max_tokens=24,
        temperature=0).model_extra["orca"]
    assert o["bundle_checksum"] == env["sum_a"] and "error" not in o
    last = httpx.get(srv.url + "/v1/orca/bundle", timeout=10).json()["last_reload"]
    assert "refused" in last and last["source"] == "POST"


async def _one(client, model: str, i: int, stream: bool) -> dict:
    """One request; returns its orca object and when it was sent and finished."""
    t0 = time.monotonic()
    kw = {"model": model, "messages": MSG, "max_tokens": 48, "temperature": 1.0, "seed": i,
          "extra_body": {"orca": {"delta": 0.2, "policy": "answer"}}}
    first = None
    if stream:
        orca = None
        async for chunk in await client.chat.completions.create(stream=True, **kw):
            first = first or time.monotonic()
            extra = chunk.model_extra or {}
            if "orca" in extra:
                orca = extra["orca"]
    else:
        orca = (await client.chat.completions.create(**kw)).model_extra["orca"]
    return {"i": i, "stream": stream, "sent": t0, "first": first, "done": time.monotonic(),
            "orca": orca}


async def _reload_under_load(srv: Server, path: Path) -> tuple[list, dict]:
    client = srv.aclient()
    model = (await client.models.list()).data[0].id
    first_half = [asyncio.ensure_future(_one(client, model, i, i % 2 == 0))
                  for i in range(N // 2)]
    await asyncio.sleep(1.0)  # the first half is running
    async with httpx.AsyncClient(timeout=180) as http:
        t0 = time.monotonic()
        reload = asyncio.ensure_future(http.post(
            srv.url + "/v1/orca/bundle", json={"path": str(path)},
            headers={"Authorization": f"Bearer {KEY}"}))
        await asyncio.sleep(0)
        second_half = [asyncio.ensure_future(_one(client, model, i, i % 2 == 0))
                       for i in range(N // 2, N)]  # sent while the reload runs
        resp = await reload
        t1 = time.monotonic()
        after = [asyncio.ensure_future(_one(client, model, N + i, i % 2 == 0))
                 for i in range(8)]  # sent after it returned
        results = await asyncio.gather(*first_half, *second_half, *after, return_exceptions=True)
    return results, {"status": resp.status_code, "body": resp.json(), "started": t0,
                     "returned": t1}


def test_reload_under_64_concurrent_requests(srv, env):
    """No request fails; each names bundle A or B; those sent after the reload returned name B,
    and stop early never (B's probe), while A's stop at once; streams that were running before
    the reload began finish on A."""
    results, reload = asyncio.run(_reload_under_load(srv, env["b"]))
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, failed[:3]
    assert reload["status"] == 200, reload["body"]
    assert reload["body"]["checksum"] == env["sum_b"] and reload["body"]["changed"] is True
    assert reload["body"]["previous"] == env["sum_a"]
    by = {env["sum_a"]: [], env["sum_b"]: []}
    for r in results:
        o = r["orca"]
        assert o is not None and "error" not in o, o
        by[o["bundle_checksum"]].append(r)
        if r["sent"] > reload["returned"]:
            assert o["bundle_checksum"] == env["sum_b"], r
        if r["stream"] and r["first"] is not None and r["first"] < reload["started"]:
            assert o["bundle_checksum"] == env["sum_a"], r
    assert len(by[env["sum_a"]]) >= 8 and len(by[env["sum_b"]]) >= 8, {
        k: len(v) for k, v in by.items()}
    assert not any(r["orca"]["stopped_early"] for r in by[env["sum_b"]])
    assert any(r["orca"]["stopped_early"] for r in by[env["sum_a"]])
    assert serving(srv) == env["sum_b"]
    # the engine lets bundle A go once its last request has left
    deadline = time.time() + 30
    while time.time() < deadline and metric(srv, "orca_engine_bundles_loaded") != 1.0:
        time.sleep(1)
    assert metric(srv, "orca_engine_bundles_loaded") == 1.0
    assert metric(srv, "orca_bundle_info", checksum=env["sum_b"]) == 1.0
    assert metric(srv, "orca_bundle_info", checksum=env["sum_a"]) is None
    assert metric(srv, "orca_bundle_reloads_total", outcome="loaded") == 1.0
    assert metric(srv, "orca_bundle_reloads_total", outcome="refused") == 3.0


def metric(srv: Server, name: str, **labels: str) -> float | None:
    """A sample of /metrics by name and (some of) its labels; None when absent."""
    for line in httpx.get(srv.url + "/metrics", timeout=10).text.splitlines():
        m = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    return None


def test_sighup_rereads_the_calib_file(srv, env):
    assert serving(srv) == env["sum_b"]
    os.kill(srv.proc.pid, signal.SIGHUP)  # the API server process (not its engine)
    deadline = time.time() + 60
    while time.time() < deadline and serving(srv) != env["sum_a"]:
        time.sleep(0.5)
    assert serving(srv) == env["sum_a"]
    assert srv.proc.poll() is None  # SIGHUP did not end it
    last = httpx.get(srv.url + "/v1/orca/bundle", timeout=10).json()["last_reload"]
    assert last["source"] == "SIGHUP" and last["changed"] is True
    o = srv.client().chat.completions.create(
        model=srv.client().models.list().data[0].id, messages=MSG, max_tokens=200,
        temperature=0, extra_body={"orca": {"delta": 0.2, "policy": "stop"}}).model_extra["orca"]
    assert o["bundle_checksum"] == env["sum_a"] and o["stopped_early"] is True


def test_reload_outcomes_are_lines_of_the_server_log(srv, env):
    """Each reload outcome is one line in the server's own output (vLLM's log format)."""
    log = (env["dir"] / "orca.log").read_text()
    lines = [ln for ln in log.splitlines() if "orca_serve" in ln or "orca: " in ln]
    refused = [ln for ln in lines if "refused (POST)" in ln]
    assert len(refused) == 3 and all("WARNING" in ln for ln in refused), lines
    assert any(f"(POST): now serving {env['sum_b']}" in ln and "INFO" in ln for ln in lines), lines
    assert any(f"(SIGHUP): now serving {env['sum_a']}" in ln for ln in lines), lines
