"""Selective audit labelling end to end (`--orca-audit-label-steps selective`): the real
orca-serve on the embedded toy model labels its audits at the steps the guards read only, and
every loss the guards read equals the one `orca-calibrate collect`'s every-step labels give
for the same prompts (greedy, so the same trajectories): the guards' table is every-step
labelling's."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from orca_demo.toy.tasks import write_prompts
from orca_method.audit.guards import aligned_scores
from orca_method.bundle import load_bundle
from orca_method.risk import is_solvable, request_losses
from orca_method.trajectories import TrajectorySet
from tests.serving import Server, orca_serve_cmd
from tests.test_audit_server import COMMON, MODEL, _ask, _records, _settled, audit_env, collect

pytestmark = pytest.mark.vllm
N = 8


def _prompt_key(prompt: str) -> str:
    """A trace's prompt (its messages as JSON), written the same way by the audit and collect."""
    return json.dumps(json.loads(prompt), sort_keys=True)


def test_selective_audit_labels_give_every_step_losses(tmp_path) -> None:
    env = audit_env(tmp_path)
    write_prompts(tmp_path / "selective.jsonl", "in-dist", N, seed=23)
    bundle = load_bundle(env["bundle"])
    lams = [bundle.lam(d) for d in bundle.deltas()]
    s = Server(orca_serve_cmd("--model", str(MODEL), "--calib", str(env["bundle"]),
                              "--orca-audit-rate", "1.0", "--orca-audit-seed", "0",
                              "--orca-audit-dir", str(env["audits"]),
                              "--orca-audit-label-steps", "selective"),
               tmp_path / "server.log", COMMON)
    srv = s.wait()
    try:
        prompts = _records(tmp_path / "selective.jsonl")
        with ThreadPoolExecutor(N) as pool:  # at once: the engine batches them
            for r in pool.map(lambda p: _ask(srv, p["messages"]), prompts):
                assert r.model_extra["orca"]["audited"] is True
        table = _settled(srv)
    finally:
        s.stop()
    audited = TrajectorySet.open(env["audits"] / "audit-000001")
    collected = collect(tmp_path / "selective.jsonl", tmp_path / "collected", bundle.labelling)
    assert len(audited) == len(collected) == N
    # the audits in the order the requests ended; each with the trace collected for its prompt
    by_prompt = {_prompt_key(c.prompt): c for c in collected.problems}
    assert sorted(map(_prompt_key, (a.prompt for a in audited.problems))) == sorted(by_prompt)
    probes = steps = 0
    risk: dict[float, list[int]] = {d: [] for d in bundle.deltas()}
    for i, a in enumerate(audited.problems):
        c = by_prompt[_prompt_key(a.prompt)]
        assert a.step_tokens == c.step_tokens, i
        sel = a.extra["audit_labels"]
        assert sorted(sel["lambdas"]) == sorted(set(lams))
        assert set(sel["probed"]) <= set(range(a.n_steps))
        probes, steps = probes + len(sel["probed"]), steps + a.n_steps
        assert a.final_answer == c.final_answer, i
        part, full = a.labels["consistent"], c.labels["consistent"]
        assert is_solvable(part) == is_solvable(full), i
        scores = aligned_scores(a.extra["audit"]["scores"], a.n_steps)
        assert scores is not None
        got, want = request_losses(scores, part, lams), request_losses(scores, full, lams)
        assert got.tolist() == want.tolist(), (i, sel, part, full)
        if is_solvable(full):
            for d, x in zip(bundle.deltas(), want):
                risk[d].append(int(x))
    for row in table["deltas"]:  # the live table is every-step labelling's
        assert row["n"] == len(risk[row["delta"]]), row
        assert row["risk"] == pytest.approx(np.mean(risk[row["delta"]])), row
    assert probes <= steps
    print(f"selective: {probes} probes for {steps} steps over {N} audits")
