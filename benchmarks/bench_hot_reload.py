"""Hot reload of the bundle under load: no failed request, every response names its bundle.

`--streams` clients (64 by default) each send requests back to back, half of them streaming,
for the whole run; meanwhile the bundle is swapped `--reloads` times (each time to another bundle) with
`POST /v1/orca/bundle`, `--interval` seconds apart. Printed at the end (and written to
`--out` as JSON): requests, failures (an HTTP error, a missing `orca` object or an `error` in
it), per-bundle counts, responses naming a bundle that had been replaced before the request was
sent (must be 0; a request sent just before a swap may be resolved after it, so the bundles of
later swaps count as right), and the reload latency (POST round trip; the server's own
`seconds`, and `waited_s` for an earlier reload or release to finish).

Without `--url`, it starts `orca-serve` on the embedded demo model itself, with the demo bundle
and one copy of it per reload, each sealed with another provenance (the same probe, distinct
checksums: what is measured is the swap, not what the probe says).

    python benchmarks/bench_hot_reload.py [--streams 64] [--reloads 4] [--interval 4]
    python benchmarks/bench_hot_reload.py --url http://host:8000 --bundles A.json B.json \
        [C.json ...]   # the server's admin key in $ORCA_ADMIN_KEY
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests package's helpers

from orca_demo.toy.demo_bundle import JOBS
from tests.serving import Server, orca_serve_cmd

KEY_ENV = "ORCA_ADMIN_KEY"
QUESTION = "Find the integer x with 7*x + 3 = 52."
SERVE = ["--host", "127.0.0.1", "--enforce-eager", "--reasoning-parser", "deepseek_r1",
         "--disable-uvicorn-access-log"]


def copies(src: Path, n: int, tmp: Path) -> list[Path]:
    """`n` copies of bundle `src`, each sealed with another provenance: valid bundles of the same
    probe with distinct checksums (each reload swaps in a bundle never served before, so that a
    response naming a replaced one can be told apart)."""
    from orca_method.bundle import load_bundle, save_bundle

    b = load_bundle(src)
    out = []
    for i in range(n):
        dst = tmp / f"bundle-{i + 1}.json"
        save_bundle(b.model_copy(update={"provenance": {**(b.provenance or {}),
                                                        "bench_hot_reload": f"copy {i + 1}"}}),
                    dst)
        out.append(dst)
    return out


async def client_loop(http: httpx.AsyncClient, url: str, model: str, i: int, stop: float,
                      max_tokens: int, out: list) -> None:
    """One stream of requests, back to back until `stop`; every outcome lands in `out`."""
    k = 0
    while time.monotonic() < stop:
        stream = (i + k) % 2 == 0
        body = {"model": model, "messages": [{"role": "user", "content": QUESTION}],
                "max_tokens": max_tokens, "temperature": 0.7, "stream": stream,
                "orca": {"policy": "answer"}}
        rec = {"client": i, "stream": stream, "sent": time.monotonic()}
        k += 1
        try:
            orca = None
            if stream:
                async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            orca = chunk.get("orca", orca)
            else:
                r = await http.post(url + "/v1/chat/completions", json=body)
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                orca = r.json().get("orca")
            if orca is None:
                raise RuntimeError("no orca object")
            if orca.get("error"):
                raise RuntimeError(f"orca error: {orca['error']}")
            rec["bundle"] = orca.get("bundle_checksum")
        except Exception as e:  # noqa: BLE001 - a failure is a result here
            rec["error"] = str(e)[:300]
        rec["done"] = time.monotonic()
        out.append(rec)


async def run(url: str, paths: list[str], key: str, streams: int, reloads: int,
              interval: float, max_tokens: int) -> dict:
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        model = (await http.get(url + "/v1/models")).json()["data"][0]["id"]
        first = (await http.get(url + "/v1/orca/bundle")).json()["checksum"]
        out: list = []
        t0 = time.monotonic()
        stop = t0 + interval * (reloads + 1)
        tasks = [asyncio.ensure_future(client_loop(http, url, model, i, stop, max_tokens, out))
                 for i in range(streams)]
        swaps = []
        for n in range(reloads):
            await asyncio.sleep(max(0.0, t0 + interval * (n + 1) - time.monotonic()))
            path = paths[(n + 1) % len(paths)]
            s = time.monotonic()
            r = await http.post(url + "/v1/orca/bundle", json={"path": path},
                                headers={"Authorization": f"Bearer {key}"})
            e = time.monotonic()
            body = r.json()
            swaps.append({"status": r.status_code, "started": s, "returned": e,
                          "round_trip_s": e - s, "server_s": body.get("seconds"),
                          "waited_s": body.get("waited_s"),
                          "checksum": body.get("checksum"),
                          "in_flight": sum(1 for t in tasks if not t.done())})
        await asyncio.gather(*tasks)
        loaded = None  # bundles the engine holds once every request is done (replaced: let go)
        for _ in range(30):
            text = (await http.get(url + "/metrics")).text
            m = re.search(r"^orca_engine_bundles_loaded\{[^}]*\} (\S+)$", text, re.MULTILINE)
            loaded = float(m.group(1)) if m else None
            if loaded == 1.0:
                break
            await asyncio.sleep(1)
    ok = [r for r in out if "error" not in r]
    # generation g serves from the end of reload g (0: the first bundle) until the next swap; a
    # request sent during generation g is resolved then or later: generations >= g are right
    gens = [first] + [w["checksum"] for w in swaps if w["status"] == 200]
    ends = [w["returned"] for w in swaps if w["status"] == 200]
    wrong = late = 0
    for r in ok:
        g = sum(1 for t in ends if t < r["sent"])
        if r["bundle"] not in gens[g:]:
            wrong += 1
        elif r["bundle"] != gens[g]:
            late += 1
    lat = [w["round_trip_s"] for w in swaps]
    return {
        "requests": len(out), "failures": len(out) - len(ok),
        "failure_examples": [r["error"] for r in out if "error" in r][:5],
        "per_bundle": dict(Counter(r["bundle"] for r in ok)),
        "named_a_replaced_bundle": wrong,
        "resolved_after_a_later_swap": late,
        "reloads": len(swaps), "reloads_ok": sum(w["status"] == 200 for w in swaps),
        "reload_round_trip_s": {"median": statistics.median(lat) if lat else None,
                                "max": max(lat) if lat else None},
        "reload_server_s": [w["server_s"] for w in swaps],
        "reload_waited_s": [w["waited_s"] for w in swaps],
        "in_flight_at_reload": [w["in_flight"] for w in swaps],
        "engine_bundles_loaded_after": loaded,
        "wall_s": round(time.monotonic() - t0, 1),
        "latency_s_median": statistics.median(r["done"] - r["sent"] for r in ok) if ok else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running orca-serve (else one is started)")
    ap.add_argument("--bundles", nargs="+", default=None, metavar="PATH",
                    help="with --url: the bundle it serves now, then those to swap in, in turn "
                    "(paths on the server; distinct ones make the check exact)")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--reloads", type=int, default=4)
    ap.add_argument("--interval", type=float, default=4.0, help="seconds between reloads")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="write the result here as JSON")
    args = ap.parse_args()
    server = None
    if args.url is None:
        tmp = Path(tempfile.mkdtemp(prefix="bench-hot-reload-"))
        bundles = copies(ROOT / "orca_serve" / "demo" / "bundle.json", args.reloads + 1, tmp)
        os.environ.setdefault(KEY_ENV, "bench-admin-key")
        server = Server(orca_serve_cmd("--model", str(ROOT / "orca_serve" / "demo" / "model"),
                                       "--calib", str(bundles[0]), "--orca-admin-key-env",
                                       KEY_ENV, "--served-model-name", JOBS["toy"][1]),
                        tmp / "server.log", SERVE)
        url, paths = server.wait().url, [str(p) for p in bundles]
        print(f"server up at {url} (log {tmp / 'server.log'})", file=sys.stderr)
    else:
        if not (args.bundles and len(args.bundles) >= 2 and os.environ.get(KEY_ENV)):
            ap.error(f"--url needs --bundles (two or more) and the admin key in ${KEY_ENV}")
        url, paths = args.url.rstrip("/"), list(args.bundles)
    try:
        res = asyncio.run(run(url, paths, os.environ[KEY_ENV], args.streams, args.reloads,
                              args.interval, args.max_tokens))
    finally:
        if server is not None:
            server.stop()
    res.update({"streams": args.streams, "interval_s": args.interval,
                "max_tokens": args.max_tokens})
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
