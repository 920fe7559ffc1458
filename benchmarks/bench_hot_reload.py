"""Hot reload of the bundle under load: no failed request, every response names its bundle.

`--streams` clients (64 by default) each send requests back to back, half of them streaming,
for the whole run; meanwhile the bundle is swapped `--reloads` times (A -> B -> A -> ...) with
`POST /v1/orca/bundle`, `--interval` seconds apart. Printed at the end (and written to
`--out` as JSON): requests, failures (an HTTP error, a missing `orca` object or an `error` in
it), per-bundle counts, requests sent while no reload ran that name another bundle than the one
then serving (must be 0), and the reload latency (POST round trip, and the server's own `seconds`).

Without `--url`, it starts `orca-serve` on the embedded demo model itself: bundle A is the demo
bundle, bundle B a copy of it sealed with another provenance (another checksum, the same probe:
what matters here is the swap, not what the probe says).

    python benchmarks/bench_hot_reload.py [--streams 64] [--reloads 4] [--interval 4]
    python benchmarks/bench_hot_reload.py --url http://host:8000 --bundle-a A.json \
        --bundle-b B.json   # the server's admin key in $ORCA_ADMIN_KEY
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from serving import Server, orca_serve_cmd

KEY_ENV = "ORCA_ADMIN_KEY"
QUESTION = "Find the integer x with 7*x + 3 = 52."
SERVE = ["--host", "127.0.0.1", "--enforce-eager", "--reasoning-parser", "deepseek_r1",
         "--disable-uvicorn-access-log"]


def second_bundle(src: Path, dst: Path) -> Path:
    """`src` re-sealed with another provenance: a valid bundle with another checksum."""
    from orca_serve.bundle import load_bundle, save_bundle

    b = load_bundle(src)
    b.provenance = {**(b.provenance or {}), "bench_hot_reload": "copy B"}
    save_bundle(b, dst)
    return dst


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
            path = paths[(n + 1) % 2]
            s = time.monotonic()
            r = await http.post(url + "/v1/orca/bundle", json={"path": path},
                                headers={"Authorization": f"Bearer {key}"})
            e = time.monotonic()
            body = r.json()
            swaps.append({"status": r.status_code, "started": s, "returned": e,
                          "round_trip_s": e - s, "server_s": body.get("seconds"),
                          "checksum": body.get("checksum"),
                          "in_flight": sum(1 for t in tasks if not t.done())})
        await asyncio.gather(*tasks)
    ok = [r for r in out if "error" not in r]
    wrong = 0  # sent while no reload ran, naming another bundle than the one then serving
    for r in ok:
        if any(w["started"] <= r["sent"] <= w["returned"] for w in swaps):
            continue  # sent during a reload: either bundle is right
        done = [w for w in swaps if w["returned"] < r["sent"] and w["status"] == 200]
        if r["bundle"] != (done[-1]["checksum"] if done else first):
            wrong += 1
    lat = [w["round_trip_s"] for w in swaps]
    return {
        "requests": len(out), "failures": len(out) - len(ok),
        "failure_examples": [r["error"] for r in out if "error" in r][:5],
        "per_bundle": dict(Counter(r["bundle"] for r in ok)),
        "named_the_wrong_bundle": wrong,
        "reloads": len(swaps), "reloads_ok": sum(w["status"] == 200 for w in swaps),
        "reload_round_trip_s": {"median": statistics.median(lat) if lat else None,
                                "max": max(lat) if lat else None},
        "reload_server_s": [w["server_s"] for w in swaps],
        "in_flight_at_reload": [w["in_flight"] for w in swaps],
        "wall_s": round(time.monotonic() - t0, 1),
        "latency_s_median": statistics.median(r["done"] - r["sent"] for r in ok) if ok else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running orca-serve (else one is started)")
    ap.add_argument("--bundle-a", default=None, help="with --url: the bundle it serves now")
    ap.add_argument("--bundle-b", default=None, help="with --url: the bundle to swap in")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--reloads", type=int, default=4)
    ap.add_argument("--interval", type=float, default=4.0, help="seconds between reloads")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="write the result here as JSON")
    args = ap.parse_args()
    server = None
    if args.url is None:
        tmp = Path(tempfile.mkdtemp(prefix="bench-hot-reload-"))
        a = tmp / "a.json"
        shutil.copy(ROOT / "orca_serve" / "demo" / "bundle.json", a)
        b = second_bundle(a, tmp / "b.json")
        os.environ.setdefault(KEY_ENV, "bench-admin-key")
        server = Server(orca_serve_cmd("--model", str(ROOT / "orca_serve" / "demo" / "model"),
                                       "--calib", str(a), "--orca-admin-key-env", KEY_ENV),
                        tmp / "server.log", SERVE)
        url, paths = server.wait().url, [str(a), str(b)]
        print(f"server up at {url} (log {tmp / 'server.log'})", file=sys.stderr)
    else:
        if not (args.bundle_a and args.bundle_b and os.environ.get(KEY_ENV)):
            ap.error(f"--url needs --bundle-a, --bundle-b and the admin key in ${KEY_ENV}")
        url, paths = args.url.rstrip("/"), [args.bundle_a, args.bundle_b]
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
