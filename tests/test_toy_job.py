"""The calibration job end to end on the embedded toy reasoner, then early stops through orca-serve.

Real vLLM engine (collection in record mode, answer probes), real training, LTT and evaluation on
a small slice; then the bundle is served by a live `orca-serve` and held-out questions are asked
through the OpenAI client.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from orca_calibrate.job import run_job
from orca_demo.toy.tasks import write_prompts
from orca_method.bundle import load_bundle

pytestmark = pytest.mark.vllm

from tests.serving import Server, orca_serve_cmd

MODEL = Path(__file__).parents[1] / "orca_serve" / "demo" / "model"
N_PROMPTS = 120
DELTAS = [0.2, 0.3]  # 30 calibration problems can certify these (0.8^30 < 0.05)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("toyjob")
    write_prompts(d / "prompts.jsonl", "in-dist", N_PROMPTS, seed=11)
    write_prompts(d / "shifted.jsonl", "shifted", 20, seed=12)
    (d / "job.yaml").write_text(json.dumps({
        "model": str(MODEL), "prompts": "prompts.jsonl", "shifted_prompts": "shifted.jsonl",
        "out": "run",
        "collect": {"temperature": 0.7, "max_tokens": 320, "answer_tokens": 6, "batch": 64,
                    "suffix": "\n</think>\nThe answer is \\boxed{",
                    "think": {"force_text": "\n</think>\n"}},
        "split": {"fractions": [0.5, 0.3, 0.2], "seed": 0},
        # as orca_calibrate/jobs/toy.yaml: batch 32 would give 60 training problems 10 Adam steps
        # (an untrained probe, whose stops on held-out prompts came and went between runs)
        "train": {"probe": "ttt-noqk", "epochs": 5, "batch_size": 1},
        "calibrate": {"deltas": DELTAS, "window": 1},
    }))
    run_job(d / "job.yaml", progress=False)
    return d


def test_job_writes_every_stage(job: Path) -> None:
    run = job / "run"
    for name in ("probe.safetensors", "bundle.json", "evaluation.json", "evaluation.md",
                 "calibration-scores.jsonl", "collect-stats.json", "plots/error_vs_delta.png"):
        assert (run / name).exists(), name
    bundle = load_bundle(run / "bundle.json")
    assert bundle.deltas() == DELTAS and bundle.model.tokenizer_fingerprint
    assert bundle.think.force_text == "\n</think>\n"
    problems = [json.loads(x) for x in (run / "trajectories" / "problems.jsonl").open()]
    assert len(problems) == N_PROMPTS
    assert {p["split"] for p in problems} == {"train", "calibration", "test"}
    # labels come from real answer probes: most problems have a step whose forced answer is
    # right (96% on the full toy job) and start out wrong, so labels flip from 0 to 1
    flips = sum(0 in p["labels"]["supervised"] and 1 in p["labels"]["supervised"]
                for p in problems)
    assert flips > 0.35 * N_PROMPTS
    report = json.loads((run / "evaluation.json").read_text())
    assert set(report) == {"test", "shifted"}


def test_rerun_skips_finished_stages(job: Path) -> None:
    log = run_job(job / "job.yaml", progress=False)
    assert all("skipped" in line for line in log), log


def test_served_bundle_stops_early(job: Path) -> None:
    bundle = load_bundle(job / "run" / "bundle.json")
    lam = {d: bundle.lam(d) for d in DELTAS}
    assert any(v < float("inf") for v in lam.values()), f"LTT certified no threshold: {lam}"
    delta = max(d for d in DELTAS if lam[d] < float("inf"))
    srv = Server(orca_serve_cmd("--model", str(MODEL), "--calib", str(job / "run" / "bundle.json")),
                 job / "serve.log", ["--host", "127.0.0.1", "--enforce-eager", "--dtype", "float32",
                                     "--max-model-len", "1024", "--reasoning-parser", "deepseek_r1"])
    try:
        client = srv.wait().client()
        prompts = [json.loads(x) for x in (job / "prompts.jsonl").open()][:24]
        stopped = 0
        with ThreadPoolExecutor(8) as pool:  # batched by the engine, as a server's traffic is
            answers = list(pool.map(lambda p: client.chat.completions.create(
                model=str(MODEL), messages=p["messages"], temperature=0, max_tokens=320,
                extra_body={"orca": {"delta": delta, "policy": "answer"}}), prompts))
        for r in answers:
            orca = r.model_extra["orca"]
            assert orca["enabled"] and orca["delta"] == delta
            if orca["stopped_early"]:
                stopped += 1
                assert orca["stop_step"] >= 1 and r.choices[0].finish_reason == "stop"
                assert "boxed" in (r.choices[0].message.content or "")  # an answer follows
        assert stopped >= len(prompts) // 2  # 23 of 24 at delta 0.3 when measured
    finally:
        srv.stop()


def test_reweight_to_traffic_prompts(job: Path, capsys) -> None:
    """`orca-calibrate reweight --traffic-prompts`: fresh prompts run in record mode only to the
    gate's step (the server's own features), then the job's bundle recertified for them. Fresh
    in-distribution prompts: most pass the gate and a bundle is written; the shifted family: the
    gate flags it all, and there is nothing to reweight for (one line, exit 2)."""
    from orca_calibrate.calibrate_cli import main

    write_prompts(job / "traffic.jsonl", "in-dist", 40, seed=13)
    args = ["reweight", "--job", str(job / "run"), "--model", str(MODEL), "--max-tokens", "120"]
    assert main([*args, "--traffic-prompts", str(job / "traffic.jsonl"),
                 "--out", str(job / "reweighted.json")]) == 0
    facts = load_bundle(job / "reweighted.json").provenance["reweight"]
    assert facts["traffic"] == str(job / "traffic.jsonl")
    assert 30 <= facts["n_traffic_passed"] <= facts["n_traffic"] <= 40 and facts["n_kept"] > 0
    assert main([*args, "--traffic-prompts", str(job / "shifted.jsonl"),
                 "--out", str(job / "none.json")]) == 2
    assert "gate flags" in capsys.readouterr().err and not (job / "none.json").exists()
