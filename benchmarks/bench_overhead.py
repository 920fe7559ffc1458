"""Overhead of the orca plugin in vLLM: plain vLLM vs plugin loaded but disabled vs shadow mode.

Usage:
    python benchmarks/bench_overhead.py [--rounds 5] [--models tiny,smollm2] [--conc 1,16,64]
                                        [--max-tokens 128] [--json FILE] [--resume]
    python benchmarks/bench_overhead.py --profile smollm2 [--profile-config shadow] --conc 16
                                        # one run under py-spy (collapsed stacks in .cache/)
    python benchmarks/bench_overhead.py --report FILE   # the tables of a saved --json file
    python benchmarks/bench_overhead.py --models long --conc 64 --max-tokens 1536 --rounds 2
                                        # 64 long requests (the embedded long reasoner)
Results and tables: benchmarks/overhead.md. SmolLM2 comes from scripts/prepare_smollm2.py.

Design (this machine is shared and noisy, +-10-15 % run to run):
- three configurations, each in its own fresh subprocess (offline `vllm.LLM`, in-process,
  eager, float32): `plain` (no plugin kwargs), `disabled` (plugin kwargs, every request
  `orca_enabled=0`), `shadow` (plugin kwargs, every request `orca_policy="shadow"`: scored at
  every step, never stopped, so the same tokens are generated; checked by a hash of the ids);
- a subprocess starts its engine, warms up once (not timed), then runs each concurrency c once:
  c prompts in one `generate` call, `max_tokens` tokens each, `ignore_eos`, greedy;
  tokens/s = generated tokens / wall time of that call; also tokens per CPU-second of the
  engine process (process_time), far less sensitive to other jobs on a shared machine;
- rounds: for r in 1..R, for each model, the three configurations in an order rotated by r;
  reported: median and min-max of tokens/s per (model, c, config), and the ratio to plain
  paired by round (same round = closest in time), median and min-max over rounds;
- in-engine plugin time (shadow process): `collective_rpc("orca_stats")` before and after each
  timed call; probe_ns / engine_steps vs engine step time = wall time / engine_steps.

Threads: engine processes get OMP_NUM_THREADS=1 (--omp-threads). vLLM computes on one thread
here anyway ("Reducing Torch threads from 2 to 1"), but without the variable a second OpenMP
thread spins beside it; when another job holds the other core, each parallel region then waits
for a descheduled thread and tokens/s swung 10-40x between identical runs (13.7 vs 170 tok/s,
tiny model, c=1). With 1 thread the same runs were stable enough to measure.

Bundles: `make_bundle` of tests/test_server.py (probe bias 3, lambda* table 0.05 -> 0.5,
0.1 -> never, 0.2 -> 0.99) with the model's hidden size; requests use delta 0.2 (a finite
lambda* the smoothed score does not reach, so every scored step takes shadow's snapshot path;
checked: no would-stop). SmolLM2 has no <think> token: its bundle has think disabled (the whole
completion is reasoning, every "\\n\\n" is a step).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "bench-overhead"
CONFIGS = ("plain", "disabled", "shadow")
SHADOW_DELTA = 0.2
TINY_QUESTIONS = ["Solve 3x+1=7", "What is 2+2?", "Find x: 7*x + 3 = 38", "Try x = 5",
                  "Find x with 3*x + 2 = 11.", "Why is 9 odd?", "Is 12 a multiple of 4?",
                  "What is 6*7?"]
SMOL_QUESTIONS = ["What is the capital of France?", "Explain how a rainbow forms.",
                  "Give three tips for learning a new language.", "What is 17 times 23?",
                  "Why is the sky blue?", "Write a short note about photosynthesis.",
                  "How do I boil an egg?", "What causes the seasons on Earth?"]
# The long reasoner's in-distribution problems (its traces run to thousands of tokens), fixed.
LONG_QUESTIONS = [f"Find the integer x with {a}*x + {b} = {a * x + b}. Start at x={s}, where "
                  f"{a}*{s} + {b} = {a * s + b}." for a, b, x, s in
                  [(7, 12, 140, 20), (3, 45, 96, 31), (9, 3, 170, 44), (5, 71, 60, 12),
                   (8, 20, 110, 9), (2, 88, 150, 40), (6, 5, 77, 15), (4, 60, 131, 27)]]
MODELS = {
    # name: (kvcache GiB, questions)
    "tiny": (1, TINY_QUESTIONS),
    "smollm2": (1, SMOL_QUESTIONS),
    "long": (2, LONG_QUESTIONS),  # the embedded long reasoner (orca_serve/demo/long/)
}


# -- preparation (parent process) ----------------------------------------------------------------
def prepare_models(names: list[str]) -> dict[str, dict[str, str]]:
    """Model folders and matching bundles (built once, cached in .cache/bench-overhead)."""
    sys.path.insert(0, str(ROOT))  # the tests package's helpers
    sys.path.insert(0, str(ROOT / "scripts"))  # prepare_smollm2, the model preparer
    from orca_method.bundle import ModelIdentity, ThinkTags, load_bundle, save_bundle
    from tests.bundles import make_bundle  # the tests' bundle helper
    from tests.tiny_model import HIDDEN, build_tiny_model

    CACHE.mkdir(parents=True, exist_ok=True)
    out: dict[str, dict[str, str]] = {}
    for name in names:
        if name == "tiny":
            model, hidden = build_tiny_model(CACHE / "tiny-model"), HIDDEN
        elif name == "long":
            model = ROOT / "orca_serve" / "demo" / "long" / "model"
            hidden = json.loads((model / "config.json").read_text())["hidden_size"]
        else:
            from prepare_smollm2 import prepare

            model = prepare()
            hidden = json.loads((model / "config.json").read_text())["hidden_size"]
        bundle = CACHE / f"bundle-{name}.json"
        make_bundle(bundle, model, hidden=hidden)
        if name == "smollm2":  # no <think> token: the whole completion is reasoning
            b = load_bundle(bundle)
            save_bundle(b.model_copy(update={
                "think": ThinkTags(enabled=False),
                "model": ModelIdentity(name=model.name, hidden_size=hidden,
                                       tokenizer_fingerprint=b.model.tokenizer_fingerprint),
                "checksum": ""}), bundle)
        out[name] = {"model": str(model), "bundle": str(bundle)}
    return out


# -- one configuration (child process) -----------------------------------------------------------
def worker(a: argparse.Namespace) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(MODELS[a.model][0])
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from orca_serve.vllm_plugin.config import engine_kwargs, prepare_environment

    prepare_environment()
    kw: dict = {"enforce_eager": True, "dtype": "float32", "max_model_len": max(512, a.max_tokens + 128),
                "seed": 0}
    if a.config != "plain":
        kw.update(engine_kwargs(a.bundle))
    t0 = time.perf_counter()
    llm = LLM(a.model_dir, **kw)
    start_s = time.perf_counter() - t0
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    questions = MODELS[a.model][1]
    conc = [int(c) for c in a.conc.split(",")]
    chat = [tok.apply_chat_template([{"role": "user", "content": questions[i % len(questions)]}],
                                    add_generation_prompt=True, tokenize=False)
            for i in range(max(conc))]
    n_req = 0

    def params(n: int, max_tokens: int) -> list:
        nonlocal n_req
        out = []
        for _ in range(n):
            n_req += 1
            xa = None
            if a.config == "disabled":
                xa = {"orca_key": f"r{n_req}", "orca_enabled": 0}
            elif a.config == "shadow":
                xa = {"orca_key": f"r{n_req}", "orca_policy": "shadow",
                      "orca_delta": SHADOW_DELTA}
            out.append(SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                      extra_args=xa))
        return out

    def stats() -> dict:
        if a.config == "plain":
            return {}
        return llm.collective_rpc("orca_stats")[0]

    def results(first: int, n: int) -> list:
        if a.config != "shadow":
            return []
        from orca_serve.settings.contract import merge_results

        keys = [f"r{i}" for i in range(first, first + n)]
        res = merge_results(llm.collective_rpc("orca_results", args=(keys,)))
        return [res.get(k) for k in keys]

    # warm-up (not timed): the largest batch, a few tokens, and one request
    llm.generate(chat[:max(conc)], params(max(conc), 8), use_tqdm=False)
    llm.generate(chat[:1], params(1, 8), use_tqdm=False)
    results(1, n_req)
    rows = []
    for c in conc:
        s0 = stats()
        first = n_req + 1
        sps = params(c, a.max_tokens)
        t, cpu, tcpu = time.perf_counter(), time.process_time(), time.thread_time()
        outs = llm.generate(chat[:c], sps, use_tqdm=False)
        wall = time.perf_counter() - t
        cpu, tcpu = time.process_time() - cpu, time.thread_time() - tcpu
        s1 = stats()
        ids = [list(o.outputs[0].token_ids) for o in outs]
        n_tok = sum(len(x) for x in ids)
        row = {"c": c, "tokens": n_tok, "wall_s": wall, "tok_s": n_tok / wall, "cpu_s": cpu,
               "thread_cpu_s": tcpu, "tok_cpu_s": n_tok / cpu,
               "ids_hash": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:12]}
        if s1:
            row.update({k: s1[k] - s0.get(k, 0) for k in
                        ("probe_ns", "engine_steps", "active_steps", "rows_captured",
                         "steps_scored")})
            row["max_step_ns"] = s1["max_step_ns"]
        res = results(first, c)
        if res:
            row["would_stop"] = sum(1 for r in res if r and r.would_stop_step is not None)
            row["stopped"] = sum(1 for r in res if r and r.stopped_early)
            row["errors"] = sum(1 for r in res if not r or r.error)
            row["scored_per_req"] = statistics.mean(r["steps_scored"] for r in res if r)
        rows.append(row)
    print("RESULT " + json.dumps({"model": a.model, "config": a.config, "start_s": start_s,
                                  "rows": rows}), flush=True)


def run_worker(model: str, config: str, prep: dict, a: argparse.Namespace,
               log: Path, prefix: list[str] | None = None) -> dict:
    cmd = [*(prefix or []), sys.executable, str(Path(__file__).resolve()), "--worker",
           "--model", model, "--config", config, "--model-dir", prep[model]["model"],
           "--bundle", prep[model]["bundle"], "--conc", a.conc, "--max-tokens", str(a.max_tokens)]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(a.omp_threads))
    with open(log, "ab") as f:
        f.write(f"\n===== {model} {config} =====\n".encode())
        f.flush()
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, env=env, cwd=ROOT, check=False)
        f.write(p.stdout)
    lines = [ln for ln in p.stdout.decode().splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{model}/{config} failed (exit {p.returncode}); see {log}")
    return json.loads(lines[-1][len("RESULT "):])


# -- report ------------------------------------------------------------------------------------
def fmt_range(xs: list[float], f: str) -> str:
    return f"{format(statistics.median(xs), f)} ({format(min(xs), f)}-{format(max(xs), f)})"


def report(runs: list[dict], models: list[str], conc: list[int]) -> str:
    """Markdown tables from the list of {round, model, config, rows} records."""
    def get(model, config, c):  # {round: row}
        return {r["round"]: row for r in runs if r["model"] == model and r["config"] == config
                for row in r["rows"] if row["c"] == c}

    n_rounds = len({r["round"] for r in runs})
    out = [f"### End-to-end tokens/s (median (min-max) over {n_rounds} rounds)", "",
           ("| model | c | plain tok/s | disabled tok/s | shadow tok/s | disabled/plain "
            "(paired, median (min-max)) | shadow/plain (paired, median (min-max)) | same tokens |"),
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for m in models:
        for c in conc:
            per = {cfg: get(m, cfg, c) for cfg in CONFIGS}
            if not all(per.values()):
                continue
            cells = [fmt_range([row["tok_s"] for row in per[cfg].values()], ".1f")
                     for cfg in CONFIGS]
            ratios = []
            for cfg in ("disabled", "shadow"):
                rs = [per[cfg][k]["tok_s"] / per["plain"][k]["tok_s"]
                      for k in per["plain"] if k in per[cfg]]
                ratios.append(fmt_range(rs, ".3f"))
            hashes = {row["ids_hash"] for cfg in CONFIGS for row in per[cfg].values()}
            same = "yes" if len(hashes) == 1 else f"NO ({len(hashes)} distinct)"
            out.append(f"| {m} | {c} | {' | '.join(cells)} | {' | '.join(ratios)} | {same} |")
    cpu_rows = [(m, c) for m in models for c in conc
                if all("tok_cpu_s" in row for cfg in CONFIGS for row in get(m, cfg, c).values())
                and all(get(m, cfg, c) for cfg in CONFIGS)]
    if cpu_rows:
        out += ["", (f"### Tokens per CPU-second of the engine process (median (min-max) over "
                     f"{n_rounds} rounds)"), "",
                ("| model | c | plain | disabled | shadow | disabled/plain (paired) | "
                 "shadow/plain (paired) |"),
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for m, c in cpu_rows:
            per = {cfg: get(m, cfg, c) for cfg in CONFIGS}
            cells = [fmt_range([row["tok_cpu_s"] for row in per[cfg].values()], ".1f")
                     for cfg in CONFIGS]
            ratios = [fmt_range([per[cfg][k]["tok_cpu_s"] / per["plain"][k]["tok_cpu_s"]
                                 for k in per["plain"] if k in per[cfg]], ".3f")
                      for cfg in ("disabled", "shadow")]
            out.append(f"| {m} | {c} | {' | '.join(cells)} | {' | '.join(ratios)} |")
    out += ["", "### In-engine plugin time, shadow process (median (min-max) over rounds)", "",
            ("| model | c | engine steps / call | step time ms (wall/steps) | plugin us / step "
             "(probe_ns/engine_steps) | plugin % of step | longest apply() so far, ms | "
             "steps scored / req | would-stop / stopped / errors |"),
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for m in models:
        for c in conc:
            rows = list(get(m, "shadow", c).values())
            if not rows:
                continue
            steps = [r["engine_steps"] for r in rows]
            step_ms = [r["wall_s"] / r["engine_steps"] * 1e3 for r in rows]
            us = [r["probe_ns"] / r["engine_steps"] / 1e3 for r in rows]
            pct = [r["probe_ns"] / 1e9 / r["wall_s"] * 100 for r in rows]
            mx = [r["max_step_ns"] / 1e6 for r in rows]
            flags = (f"{sum(r.get('would_stop', 0) for r in rows)} / "
                     f"{sum(r.get('stopped', 0) for r in rows)} / "
                     f"{sum(r.get('errors', 0) for r in rows)}")
            out.append(f"| {m} | {c} | {statistics.median(steps):.0f} | {fmt_range(step_ms, '.2f')} "
                       f"| {fmt_range(us, '.0f')} | {fmt_range(pct, '.2f')} | "
                       f"{fmt_range(mx, '.2f')} | "
                       f"{statistics.median(r.get('scored_per_req', 0) for r in rows):.1f} | "
                       f"{flags} |")
    loads = [r["loadavg"][0] for r in runs if "loadavg" in r]
    if loads:
        out += ["", (f"1-min load average after each run: median {statistics.median(loads):.2f}, "
                     f"range {min(loads):.2f}-{max(loads):.2f} (2 cores)")]
    starts = {}
    for r in runs:
        starts.setdefault((r["model"], r["config"]), []).append(r["start_s"])
    out += ["", "Engine start (excluded from the timing), median s: " + ", ".join(
        f"{m}/{cfg} {statistics.median(v):.1f}" for (m, cfg), v in sorted(starts.items()))]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--conc", default="1,16,64")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--omp-threads", type=int, default=1,
                    help="OMP_NUM_THREADS of the engine processes (see the module docstring)")
    ap.add_argument("--json", type=Path, default=CACHE / "overhead.json")
    ap.add_argument("--log", type=Path, default=CACHE / "overhead.log")
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs already in --json and do only the missing ones")
    ap.add_argument("--profile", metavar="MODEL",
                    help="instead of the benchmark: one run of MODEL (--profile-config) under py-spy")
    ap.add_argument("--profile-config", choices=CONFIGS, default="shadow")
    ap.add_argument("--spy-rate", type=int, default=100, help="py-spy samples/s (--profile)")
    ap.add_argument("--report", type=Path, help="only print the tables of a saved --json file")
    # child process
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--config", choices=CONFIGS, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--bundle", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    conc = [int(c) for c in a.conc.split(",")]
    if a.report:
        d = json.loads(a.report.read_text())
        print(report(d["runs"], d["models"], d["conc"]))
        return
    models = a.models.split(",")
    if a.profile:
        models = [a.profile]
    print(f"preparing {models}", flush=True)
    prep = prepare_models(models)
    a.log.parent.mkdir(parents=True, exist_ok=True)
    if a.profile:
        out = CACHE / f"pyspy-{a.profile}-{a.profile_config}-c{a.conc.replace(',', '_')}"
        prefix = ["py-spy", "record", "--rate", str(a.spy_rate), "--nonblocking", "--format",
                  "raw", "--output", str(out) + ".txt", "--"]
        py_spy = Path(sys.executable).parent / "py-spy"
        prefix[0] = str(py_spy) if py_spy.exists() else "py-spy"
        r = run_worker(a.profile, a.profile_config, prep, a, a.log, prefix)
        print(json.dumps(r, indent=1))
        print(f"py-spy raw (collapsed) stacks: {out}.txt")
        return
    runs: list[dict] = []
    old: dict = {}
    if a.resume and a.json.is_file():  # continue an interrupted run (same --json)
        old = json.loads(a.json.read_text())
        runs = old["runs"]
        print(f"resuming: {len(runs)} runs already in {a.json}", flush=True)
    done = {(r["round"], r["model"], r["config"]) for r in runs}
    t_start = time.time()
    meta = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "nproc": os.cpu_count(), "machine": platform.machine(),
            "loadavg_start": os.getloadavg(), "argv": sys.argv, "models": models, "conc": conc}
    if old:
        meta = {**meta, "date": old["date"], "loadavg_start": old["loadavg_start"],
                "argv": old["argv"], "resumed": [*old.get("resumed", []), meta["date"]]}
    for rnd in range(a.rounds):
        for mi, m in enumerate(models):
            k = (rnd + mi) % len(CONFIGS)
            for cfg in CONFIGS[k:] + CONFIGS[:k]:
                if (rnd, m, cfg) in done:
                    continue
                t = time.time()
                try:
                    r = run_worker(m, cfg, prep, a, a.log)
                except RuntimeError as e:  # e.g. the shared venv changed under us: retry once
                    print(f"{e}; retrying once", flush=True)
                    r = run_worker(m, cfg, prep, a, a.log)
                r["round"] = rnd
                r["loadavg"] = os.getloadavg()
                runs.append(r)
                tps = " ".join(f"c{row['c']}={row['tok_s']:.0f}" for row in r["rows"])
                print(f"[{time.time() - t_start:6.0f}s] round {rnd + 1}/{a.rounds} {m:8s} "
                      f"{cfg:8s} {tps} tok/s ({time.time() - t:.0f}s, load "
                      f"{os.getloadavg()[0]:.2f})", flush=True)
                meta["loadavg_end"] = os.getloadavg()
                a.json.parent.mkdir(parents=True, exist_ok=True)
                a.json.write_text(json.dumps({**meta, "runs": runs}, indent=1))
    print(f"\ntotal {time.time() - t_start:.0f}s; raw results in {a.json}\n")
    print(report(runs, models, conc))


if __name__ == "__main__":
    main()
