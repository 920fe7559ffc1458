"""orca-serve's parts in vLLM's own app, without an engine.

The app is built by vLLM's `build_app` as vLLM's launcher calls it, through the hook orca-serve
installs (orca_serve/vllm_compat/launch.py), from a command line parsed by vLLM's parser plus
ours: what runs here is what `orca-serve` serves, up to the engine. Checked: the bundle route,
the order of the middleware (vLLM's API-key check before the orca validation, whose 400 comes
from inside), the `orca` field in vLLM's OpenAPI description. benchmarks/check_vllm_release.sh
runs this file on every supported vLLM release, 0.33 included (whose GPU wheel starts no engine
on a CPU machine).
"""

from __future__ import annotations

import importlib

import pytest
from starlette.testclient import TestClient

from orca_method.bundle import load_bundle
from orca_serve.apis import CHAT_PATH
from orca_serve.reload import BUNDLE_PATH
from orca_serve.preflight import add_orca_args, demo_paths
from orca_serve.server import ORCA_SCHEMA, install_own_state
from orca_serve.vllm_compat import launch

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
BAD_ORCA = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "orca": {"delta": "often"}}


@pytest.fixture(scope="module")
def client():
    model, bundle = demo_paths()
    parser = add_orca_args(launch.serve_parser("orca-serve", "test"))
    args = parser.parse_args(["--model", str(model), "--calib", str(bundle), "--api-key", KEY])
    entry = importlib.import_module(launch._ENTRY)
    vllm_build_app = entry.build_app
    try:
        launch._hook_build_app(install_own_state)
        app = entry.build_app(args, ("generate",), None)  # as vLLM's launcher calls it
    finally:
        entry.build_app = vllm_build_app
    return TestClient(app)  # no `with`: vLLM's lifespan wants an engine


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
