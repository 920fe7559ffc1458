"""How often the shift gate flags each family of prompts, on the embedded reasoners.

    python benchmarks/bench_shift_gate.py --reasoner toy  --bundle B.json \\
        --family in-dist=held.jsonl --family shifted=shifted.jsonl
    python benchmarks/bench_shift_gate.py --reasoner long --bundle B.json --max-tokens 160 \\
        --family in-dist=held.jsonl --family shifted=shifted.jsonl --family hard=hard.jsonl

One record-mode engine runs every prompt as far as the gate reads (the plugin's own step
embeddings: the features the server gates on), then the bundle's gate scores them. Per family
and alpha: the share flagged with its 95% Clopper-Pearson interval. In-distribution prompts must
be fresh (none of those the gate was fitted or scored on): there the share is at most alpha
(the conformal guarantee); on a shifted family it is the gate's power, and 1 - power bounds the
share of that family served with the bundle's lambda* although it is not like the calibration set.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from scipy.stats import binomtest

from orca_calibrate.collect import read_prompts
from orca_calibrate.gate import gate_collector, gate_features_of
from orca_method.bundle import load_bundle

ROOT = Path(__file__).parents[1]
MODELS = {"toy": ROOT / "orca_serve/demo/model", "long": ROOT / "orca_serve/demo/long/model"}
ALPHAS = (0.01, 0.05, 0.1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reasoner", choices=sorted(MODELS), required=True)
    ap.add_argument("--bundle", required=True, help="a bundle with a shift_gate block")
    ap.add_argument("--family", action="append", required=True, metavar="NAME=PROMPTS.jsonl")
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", help="write the table here too")
    ap.add_argument("--save", help="also save each family's step embeddings here (.npz)")
    a = ap.parse_args(argv)
    bundle = load_bundle(a.bundle)
    gate = bundle.load_gate()
    if gate is None:
        ap.error(f"{a.bundle} has no shift_gate block (orca-calibrate gate adds one)")
    families = dict(f.split("=", 1) for f in a.family)
    engine = {"max_model_len": 5120} if a.reasoner == "long" else {}
    rows = []
    with gate_collector(str(MODELS[a.reasoner]), bundle, max_tokens=a.max_tokens,
                        temperature=0.7, seed=a.seed, engine=engine) as collector:
        records = {name: collector.record(read_prompts(Path(p))) for name, p in families.items()}
    embs = {name: [np.asarray(r["step_embeddings"]) for r in recs
                   if r.get("step_embeddings") is not None] for name, recs in records.items()}
    if a.save:
        np.savez(a.save, **{f"{name}/{i}": e for name, es in embs.items()
                            for i, e in enumerate(es)})
    feats = {name: gate_features_of(es, gate.steps) for name, es in embs.items()}
    import torch  # deferred: after the engine is gone

    for name, x in feats.items():
        scores = gate.score(torch.from_numpy(x)).tolist()
        for alpha in ALPHAS:
            k = sum(s > gate.threshold(alpha) for s in scores)
            ci = binomtest(k, len(scores)).proportion_ci(0.95, method="exact")
            rows.append({"family": name, "alpha": alpha, "n": len(scores), "flagged": k,
                         "share": round(k / len(scores), 4),
                         "ci95": [round(ci.low, 4), round(ci.high, 4)]})
    print("| family | alpha | n | flagged | share (95% interval) |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} | {r['alpha']} | {r['n']} | {r['flagged']} | {r['share']:.3f} "
              f"({r['ci95'][0]:.3f}-{r['ci95'][1]:.3f}) |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
