"""Host time of the plugin's engine step, several code versions side by side.

Usage:
    python benchmarks/bench_step.py --rev pre-split=923cb8a --rev before=41684f8 --rev now=HEAD
                                    [--rounds 5] [--steps 150] [--rows 16] [--json FILE]
                                    [--policy shadow|answer]

Each `--rev NAME=COMMIT` is a version of this repository (`.`: the working tree; a commit is
unpacked with `git archive` into .cache/bench-step/). Every version runs in its own fresh
subprocess, the versions of a round in an order rotated by the round, so load changes on a
shared machine hit all versions alike. A subprocess builds the V1 logits processor of its
version the way vLLM does (`cls(vllm_config, device, is_pin_memory)`, a stand-in config naming
the tiny test model and that version's test bundle), adds `--rows` requests through vLLM's own
`BatchUpdate` (policy shadow at delta 0.2: scored every step, never stopped; `--policy answer`:
policy answer with lambda never, scored every step and what a stop would force planned on the
device every step, as the default policy's requests are, never stopped), then calls
`apply(logits)` for `--steps` steps with fresh random hidden rows (hidden 128) and a sampled
token appended to each request's output (a step delimiter every ~3 tokens). Measured: the
thread CPU time of each `apply()` (20 warm-up steps not counted), and the steps scored (the
same for every version, else they did not do the same work). Reported per version: median
and 25th percentile per round, and the ratio of medians to the first `--rev`, paired by round;
a version that scored no step, or another number of steps than the first `--rev` in a round,
gets no ratio (the table says why, and the command exits 1): its time is not of the same work.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "bench-step"
WARMUP = 20
SHADOW_DELTA = 0.2


def unpack(rev: str) -> Path:
    """The source tree of `rev` ('.': this working tree)."""
    if rev == ".":
        return ROOT
    sha = subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", rev], text=True).strip()
    dest = CACHE / sha[:12]
    if not (dest / "orca_serve").is_dir():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", sha], check=True,
                                 stdout=subprocess.PIPE).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def worker(a: argparse.Namespace) -> None:
    """One version: build its processor, run the steps, print the per-step times."""
    tree = Path(a.tree)
    sys.path[:0] = [str(tree), str(tree / "tests")]
    import torch
    from test_server import make_bundle
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    # the LM-head capture's module, where this version has it: chosen by the tree's files, not
    # by trying the import (an editable install of this checkout resolves a submodule the
    # version lacks to this checkout's, whose stash the version's processor never reads)
    if (tree / "orca_serve" / "vllm_compat" / "capture.py").is_file():
        from orca_serve.vllm_compat import capture
    else:
        from orca_serve.vllm_plugin import capture
    from orca_serve.vllm_plugin import processor
    from orca_serve.vllm_plugin.processor import OrcaLogitsProcessor

    for module in (capture, processor):
        if not Path(module.__file__).resolve().is_relative_to(tree.resolve()):
            raise RuntimeError(f"{module.__name__} came from {module.__file__}, not {tree}")

    torch.set_num_threads(1)
    bundle = make_bundle(Path(a.out_dir) / "bundle.json", Path(a.model))
    tok = AutoTokenizer.from_pretrained(a.model)
    hidden = 128
    mc = SimpleNamespace(model=a.model, tokenizer=a.model, tokenizer_revision=None,
                         trust_remote_code=False, get_hidden_size=lambda: hidden,
                         try_get_generation_config=dict)
    cfg = SimpleNamespace(additional_config={"orca": {"bundle": str(bundle)}}, model_config=mc,
                          scheduler_config=SimpleNamespace(max_num_seqs=a.rows))
    proc = OrcaLogitsProcessor(cfg, torch.device("cpu"), False)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Solve 3x+1=7"}],
                                     add_generation_prompt=True, tokenize=True)
    if isinstance(prompt, dict):
        prompt = prompt["input_ids"]
    words = [tok.encode(w, add_special_tokens=False)[0] for w in (" a", " b", " x", "1", "=")]
    delim = tok.encode("\n\n", add_special_tokens=False)[0]
    rng = random.Random(a.seed)
    outs: list[list[int]] = [[] for _ in range(a.rows)]
    # orca_enabled said, not left to the version's default: the server writes it into every
    # request, and a version's engine default need not be on
    policy = ({"orca_policy": "shadow", "orca_delta": SHADOW_DELTA} if a.policy == "shadow"
              else {"orca_policy": "answer", "orca_lam": "inf"})
    added = [(i, SamplingParams(max_tokens=10_000, extra_args={
        "orca_key": f"r{i}", "orca_enabled": 1, **policy}),
        list(prompt), outs[i]) for i in range(a.rows)]
    proc.update_state(BatchUpdate(batch_size=a.rows, removed=[], added=added, moved=[]))
    g = torch.Generator().manual_seed(a.seed)
    vocab = len(tok)
    times = []
    for step in range(WARMUP + a.steps):
        capture.STASH.rows = torch.randn(a.rows, hidden, generator=g)  # [rows, d]
        logits = torch.zeros(a.rows, vocab)  # [rows, vocab]
        proc.update_state(None)
        t0 = time.thread_time_ns()
        proc.apply(logits)
        dt = time.thread_time_ns() - t0
        if step >= WARMUP:
            times.append(dt)
        for out in outs:
            out.append(delim if rng.random() < 1 / 3 else rng.choice(words))
    stats = proc.get_stats() if hasattr(proc, "get_stats") else proc.stats  # pre-split: .stats
    print("RESULT " + json.dumps({"times_ns": times, "steps_scored": stats["steps_scored"]}),
          flush=True)


def run_worker(tree: Path, a: argparse.Namespace, model: Path, seed: int) -> dict:
    out_dir = CACHE / "work" / tree.name
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(tree))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--tree", str(tree),
           "--model", str(model), "--out-dir", str(out_dir), "--steps", str(a.steps),
           "--rows", str(a.rows), "--seed", str(seed), "--policy", a.policy]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree, check=False)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{tree} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", action="append", required=False, metavar="NAME=COMMIT")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--policy", choices=("shadow", "answer"), default="shadow")
    ap.add_argument("--json", type=Path, default=CACHE / "step.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    revs = [r.split("=", 1) for r in (a.rev or ["now=."])]
    trees = {name: unpack(rev) for name, rev in revs}
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_model import build_tiny_model

    model = build_tiny_model(CACHE / "tiny-model")
    names = list(trees)
    runs: list[dict] = []
    for rnd in range(a.rounds):
        k = rnd % len(names)
        for name in names[k:] + names[:k]:
            r = run_worker(trees[name], a, model, seed=rnd)
            runs.append({"round": rnd, "name": name, **r, "load": os.getloadavg()[0]})
            print(f"round {rnd + 1}/{a.rounds} {name:10s} median "
                  f"{statistics.median(r['times_ns']) / 1e3:7.1f} us, {r['steps_scored']} steps "
                  f"scored (load {os.getloadavg()[0]:.2f})", flush=True)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"argv": sys.argv, "revs": revs, "runs": runs}))
    print(report(runs, names))
    if same_work(runs, names):
        raise SystemExit(1)


def same_work(runs: list[dict], names: list[str]) -> dict[str, str]:
    """Why a version's ratio to the first would compare different work (no entry: it would
    not): it scored no step, or another number of steps than the first in some round."""
    scored = {(r["round"], r["name"]): r["steps_scored"] for r in runs}
    why = {}
    for n in names:
        counts = [scored[(rnd, n)] for rnd in sorted({r["round"] for r in runs})]
        base = [scored[(rnd, names[0])] for rnd in sorted({r["round"] for r in runs})]
        if not any(counts):
            why[n] = "scored no step: it did nothing"
        elif counts != base:
            why[n] = f"scored {counts} steps per round, {names[0]} {base}"
    return why


def report(runs: list[dict], names: list[str]) -> str:
    med = {(r["round"], r["name"]): statistics.median(r["times_ns"]) / 1e3 for r in runs}
    p25 = {(r["round"], r["name"]): statistics.quantiles(r["times_ns"], n=4)[0] / 1e3
           for r in runs}
    rounds = sorted({r["round"] for r in runs})
    base = names[0]
    refused = same_work(runs, names)
    out = [("| version | median us per step (per round) | p25 us (per round) | "
            f"median / {base} (paired, median (min-max)) |"), "| --- | --- | --- | --- |"]
    for n in names:
        ratios = [med[(r, n)] / med[(r, base)] for r in rounds]
        ratio = (f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
                 if not refused.get(n) and not refused.get(base) else "no ratio (below)")
        out.append(f"| {n} | {', '.join(f'{med[(r, n)]:.0f}' for r in rounds)} | "
                   f"{', '.join(f'{p25[(r, n)]:.0f}' for r in rounds)} | {ratio} |")
    loads = [r["load"] for r in runs]
    out.append(f"\n1-min load after each run: {min(loads):.2f}-{max(loads):.2f}")
    out += [f"no ratio for {n}: it {why}" for n, why in refused.items()]
    return "\n".join(out)


if __name__ == "__main__":
    main()
