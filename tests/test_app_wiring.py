"""orca-serve's parts in vLLM's own app, without an engine.

The app is built by vLLM's `build_app` as vLLM's launcher calls it, with orca-serve's endpoint
plugin allowed as orca-serve allows it (orca_serve/api_server/endpoint_plugin.py), from a command line
parsed by vLLM's parser plus ours, and the plugins' state initialised as vLLM's `init_app_state`
does: what runs here is what `orca-serve` serves, up to the engine. Checked: the bundle route,
the order of the middleware (vLLM's API-key check before the orca validation, whose 400 comes
from inside; the admin route's own key before vLLM's), the `orca` field in vLLM's OpenAPI
description. scripts/check_vllm_release.sh
runs this file on every supported vLLM release, 0.33 included (whose GPU wheel starts no engine
on a CPU machine).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from starlette.testclient import TestClient

from orca_method.bundle import load_bundle
from orca_serve.api_server import endpoint_plugin
from orca_serve.api_server.apis import CHAT_PATH
from orca_serve.api_server.assembly import build_server
from orca_serve.live_audit.options import audit_config
from orca_serve.startup.preflight import add_orca_args, demo_paths
from orca_serve.api_server.reload import BUNDLE_PATH
from orca_serve.api_server.server import ORCA_SCHEMA, SERVER_ARG
from orca_serve.vllm_compat import launch

KEY = "sk-test"
ADMIN = "admin-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
BAD_ORCA = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "orca": {"delta": "often"}}


@pytest.fixture(scope="module")
def client():
    app, _ = _app(lambda args: args)
    return TestClient(app)  # no `with`: vLLM's lifespan wants an engine


def _app(hand: Callable[[argparse.Namespace], argparse.Namespace],
         *extra: str) -> tuple[Any, argparse.Namespace]:
    """vLLM's app as vLLM builds it, with our endpoint plugin, from orca-serve's parsed options
    plus `extra`, passed through `hand` (the arguments `orca_serve.api_server.server.run` gives vLLM)."""
    model, bundle = demo_paths()
    before = os.environ.get(endpoint_plugin.ENV)
    os.environ.pop(endpoint_plugin.ENV, None)
    try:
        assert endpoint_plugin.allow() is None  # unset: ours and every other group's plugins
        assert endpoint_plugin.NAME in os.environ[endpoint_plugin.ENV].split(",")
        parser = add_orca_args(launch.serve_parser("orca-serve", "test"))
        args = parser.parse_args(["--model", str(model), "--calib", str(bundle),
                                  "--api-key", KEY, "--orca-admin-key-env", "ORCA_TEST_ADMIN",
                                  *extra])
        os.environ["ORCA_TEST_ADMIN"] = ADMIN
        args = hand(args)
        app = importlib.import_module(launch._ENTRY).build_app(args, ("generate",), None)
        for plugin in app.state.endpoint_plugins:  # as vLLM's init_app_state does
            asyncio.run(plugin.init_state(None, app.state, args))
    finally:
        os.environ.pop("ORCA_TEST_ADMIN", None)
        if before is None:
            os.environ.pop(endpoint_plugin.ENV, None)
        else:
            os.environ[endpoint_plugin.ENV] = before
    assert [p.name for p in app.state.endpoint_plugins] == [endpoint_plugin.NAME]
    return app, args


def test_the_server_run_built_reaches_the_plugin_in_vllms_arguments(monkeypatch):
    """One API server: the server `orca_serve.api_server.server.run` built (its live audit included) is the
    one the endpoint plugin installs, handed over in the parsed arguments vLLM gives every
    plugin; its audit labels through that app's engine client, and its metrics are the audit's
    that serves."""
    monkeypatch.setattr("orca_serve.metrics.prometheus.REGISTRY", CollectorRegistry())  # not the fixture's
    built = []

    def hand(args: argparse.Namespace) -> argparse.Namespace:  # as `run` does
        built.append(build_server(args, load_bundle(args.calib),
                                  audit_config=lambda b: audit_config(args, b)))
        return argparse.Namespace(**vars(args), **{SERVER_ARG: built[0]})

    app, _ = _app(hand, "--orca-audit-rate", "0.5")
    (server,) = built
    audit = server.serving.now.audit
    assert audit is not None and audit.engine_client() is None  # vLLM makes it after the app
    app.state.engine_client = engine = object()
    assert audit.engine_client() is engine  # the app's: this server was installed
    r = TestClient(app).get("/v1/orca/audit", headers=AUTH)
    assert r.status_code == 200 and r.json()["rate"] == 0.5
    metrics = generate_latest(server.metrics.registry).decode()
    assert 'orca_audit_requests_total{model_name=' in metrics


def test_allow_keeps_a_users_list_and_adds_ours(monkeypatch):
    monkeypatch.setenv(endpoint_plugin.ENV, "theirs")
    assert "orca-serve added" in endpoint_plugin.allow()
    assert os.environ[endpoint_plugin.ENV] == "theirs,orca-serve"
    assert endpoint_plugin.allow() is None  # named already: left as it is


def test_admin_route_is_checked_before_vllms_api_key(client):
    """The admin key alone reaches the reload route (vLLM's --api-key would answer 401)."""
    r = client.post(BUNDLE_PATH, json={"path": "/nowhere.json"},
                    headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "path"
    assert client.post(BUNDLE_PATH, json={"path": "/x"}, headers=AUTH).status_code == 403


def test_bundle_route_behind_vllms_api_key(client):
    assert client.get(BUNDLE_PATH).status_code == 401
    r = client.get(BUNDLE_PATH, headers=AUTH)
    assert r.status_code == 200
    assert r.json()["checksum"] == load_bundle(demo_paths()[1]).checksum


def test_api_key_is_checked_before_the_orca_field(client):
    r = client.post(CHAT_PATH, json=BAD_ORCA)
    assert r.status_code == 401 and "orca" not in r.text
    r = client.post(CHAT_PATH, json=BAD_ORCA, headers=AUTH)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "orca.delta" and "\n" not in err["message"]


def test_openapi_documents_the_orca_field(client):
    schema = client.get("/openapi.json", headers=AUTH).json()
    op = schema["paths"][CHAT_PATH]["post"]
    ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
    assert "orca" in schema["components"]["schemas"][ref]["properties"]
    assert ORCA_SCHEMA in schema["components"]["schemas"]
    # the nested `give_up` object resolves where its reference points
    give_up = schema["components"]["schemas"][ORCA_SCHEMA]["properties"]["give_up"]
    target = next(x["$ref"] for x in give_up["anyOf"] if "$ref" in x).rsplit("/", 1)[-1]
    assert "delta" in schema["components"]["schemas"][target]["properties"]


def test_served_generation_is_what_vllm_resolves_for_the_options(tmp_path):
    """The dtype vLLM resolves (`auto` of a float32 model is bfloat16 on the CPU build) and the
    default temperature, top_p, top_k and min_p: the model's generation_config.json, unless
    --generation-config vllm, then --override-generation-config (start-up compares them with the
    bundle's `collected_under`)."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(demo_paths()[0], model, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((model / "generation_config.json").read_text())
    config.update(temperature=0.6, top_p=0.95)
    (model / "generation_config.json").write_text(json.dumps(config))
    parser = add_orca_args(launch.serve_parser("orca-serve", "test"))

    def served(*extra: str) -> tuple[str, float, float]:
        g, other = launch.served_generation(parser.parse_args(["--model", str(model), *extra]))
        assert other == {}
        return g.dtype, g.temperature, g.top_p

    assert served("--dtype", "float32") == ("float32", 0.6, 0.95)
    # top_k and min_p (QwQ's file names top_k 40), compared with the bundle's like the two above:
    # top_k <= 0 is none, as SamplingParams' 0; the penalties the collector never uses apart
    for top_k, min_p, want in ((40, 0.0, 40), (-1, 0.05, 0), (0, 0.0, 0)):
        override = json.dumps({"top_k": top_k, "min_p": min_p, "repetition_penalty": 1.05})
        g, other = launch.served_generation(parser.parse_args(
            ["--model", str(model), "--override-generation-config", override]))
        assert (g.top_k, g.min_p, other) == (want, min_p, {"repetition_penalty": 1.05})
    if launch.is_cpu_platform():
        assert served()[0] == "bfloat16"
    assert served("--dtype", "bfloat16", "--generation-config", "vllm") == ("bfloat16", 1.0, 1.0)
    assert served("--override-generation-config", '{"temperature": 0.5}')[1:] == (0.5, 0.95)
    assert launch.served_generation(parser.parse_args(["--model", str(tmp_path / "none")])) is None
    # defaults no request could be sampled with (vLLM refuses them per request, not at start):
    # nothing to compare, rather than a traceback at start-up
    for bad in ({"top_p": 0}, {"temperature": -1}, {"top_k": "forty"}, {"min_p": 2}):
        assert launch.served_generation(parser.parse_args(
            ["--model", str(model), "--override-generation-config", json.dumps(bad)])) is None
