"""`orca-serve --demo long`: the embedded long reasoner and its bundle, served for real.

One greedy request of an in-distribution problem whose walk is 46 steps long, once with ORCA off
and once at the bundle's strictest delta (a looser one may stop before the answer: that is the
risk it allows): the full trace is as long as the design says and right;
the early stop happens after the walk has reached the answer (the step that says `equals C`)
and before the end of the verification, the answer after the stop is still right, and the
response says how the reasoning ended. Then one sampled request (temperature 0.7, the
calibration's) that stops: the answer after its stop is the greedy one, token for token what a
temperature-0 completion of the same prefix writes (docs/SERVER.md, "The answer after a stop").
Beside them, a shifted problem tagged `orca.group: shifted` runs with that group's own lambda*
and says so, where the untagged ones run with the main (in-distribution) table. Last, a request
that sets no temperature is sampled at the calibration's (the model's generation_config.json
names it): the server reports logprobs after the temperature (`--logprobs-mode
processed_logprobs`), and that request's are those of one at the job's temperature, not at 1.0.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from orca_calibrate.collect import CollectSettings
from orca_calibrate.job import load_job
from orca_demo.long.tasks import CHECKS, Problem, check_answer, trace_stats
from orca_method.bundle import load_bundle

from .serving import Server, orca_of, orca_serve_cmd

ROOT = Path(__file__).parents[1]
DEMO = ROOT / "orca_serve" / "demo" / "long"
# The first in-distribution problem with a walk of 40+ steps among bench_parity's held-out
# prompts that the shipped model solves greedily (not the four before it).
PROBLEM = Problem(a=3, b=46, c=3 * 71 + 46, x=71, start=25, family="in-dist")
SAMPLED_SEED = 1  # a sampled run of PROBLEM that the loosest delta stops early
SHIFTED = Problem(a=4, b=96, c=4 * 20 + 96, x=20, start=59, family="shifted")  # walks down
# The bundle's calibration data is gone; what the groups stage added to it is `groups` and
# provenance's `group_data`: without them the bundle is the one shipped before, by its checksum
# (the gate's two levels, 0.035 / 0.05, sealed just before the groups were added).
BEFORE_GROUPS = "f721ec56caea12a18af17e4e131222452bca9a297df89bbd4dffb0cceaaa7c2d"


def test_long_demo_bundle_matches_its_model() -> None:
    """The shipped bundle loads (checksum valid), names the model portably and is two-sided."""
    bundle = load_bundle(DEMO / "bundle.json")
    assert bundle.model.name == "orca-long-reasoner"
    assert bundle.give_up is not None and bundle.deltas()
    config = (DEMO / "model" / "config.json").read_text()
    assert f'"hidden_size": {bundle.model.hidden_size}' in config


def test_long_demo_bundle_carries_its_families_as_groups_and_means_what_it_meant() -> None:
    """The shifted and hard families are groups with tables of their own (certified on their
    own calibration-only traces: at least min_n 30 each, the bundle's deltas, a give-up table
    each); everything else of the bundle is what it was before they were added, value for
    value: its body without them hashes to the earlier bundle's checksum (the job's path
    as it was then, and without provenance's `collected_under`, added later)."""
    import hashlib
    import json

    bundle = load_bundle(DEMO / "bundle.json")
    assert sorted(bundle.groups or {}) == ["hard", "shifted"]
    for g in bundle.groups.values():
        assert g.ltt.n_cal >= 30 and [r.delta for r in g.ltt.rows] == bundle.deltas()
        assert g.give_up is not None and g.ltt.epsilon == bundle.ltt.epsilon
    data = json.loads((DEMO / "bundle.json").read_text())
    assert [d["data"] for d in data["provenance"].pop("group_data")] == [
        "runs/long/trajectories-groups/shifted-cal", "runs/long/trajectories-groups/hard-cal"]
    assert data["provenance"]["job"] == "orca_calibrate/jobs/long.yaml"
    data["provenance"]["job"] = "calibration/jobs/long.yaml"  # its path before the rename
    assert data["provenance"].pop("collected_under")["dtype"] == "float32"  # recorded later
    body = {k: v for k, v in data.items() if k not in ("groups", "checksum")}
    assert hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest() == BEFORE_GROUPS


@pytest.mark.vllm
def test_long_demo_stops_after_the_answer_and_before_the_end(tmp_path: Path) -> None:
    srv = Server(orca_serve_cmd("--demo", "long"), tmp_path / "serve.log",
                 ["--host", "127.0.0.1", "--seed", "0", "--enforce-eager",
                  "--disable-uvicorn-access-log", "--logprobs-mode", "processed_logprobs"])
    try:
        client = srv.wait().client(timeout=600)
        model = client.models.list().data[0].id
        msg = [{"role": "user", "content": PROBLEM.question}]
        bundle = load_bundle(DEMO / "bundle.json")
        assert model == bundle.model.name and "/" not in model  # --demo: not its install path
        delta = min(bundle.deltas())

        def ask(orca: dict, messages: list = msg, **sampling) -> Any:
            return client.chat.completions.create(
                model=model, messages=messages, max_tokens=5000,
                extra_body={"orca": orca, "return_token_ids": True}, **sampling)

        def text(r: Any) -> str:
            m = r.choices[0].message
            reasoning = (m.model_extra or {}).get("reasoning") or (m.model_extra or {}).get(
                "reasoning_content") or ""
            return reasoning + "\n</think>\n" + (m.content or "")

        # independent requests, sent together: one engine batch instead of three in a row
        with ThreadPoolExecutor(4) as pool:
            full_r, early_r, sampled, tagged = pool.map(lambda a: ask(*a[:2], **a[2]), [
                ({"enabled": False}, msg, {"temperature": 0}),
                ({"delta": delta, "policy": "answer"}, msg, {"temperature": 0}),
                ({"delta": max(bundle.deltas()), "policy": "answer"}, msg,
                 {"temperature": 0.7, "seed": SAMPLED_SEED}),
                ({"delta": 0.1, "group": "shifted"},
                 [{"role": "user", "content": SHIFTED.question}], {"temperature": 0})])

        got = orca_of(tagged)
        assert (got["group"], got["group_known"], got["lambda_source"]) == (
            "shifted", True, "group"), got
        assert got["lambda"] == bundle.lam(0.1, "shifted") != bundle.lam(0.1)
        assert orca_of(early_r)["lambda"] == bundle.lam(delta) and "group" not in orca_of(early_r)

        full_text, early_text, early = text(full_r), text(early_r), orca_of(early_r)
        stats = trace_stats(full_text, PROBLEM)
        assert stats.correct, full_text[-600:]
        assert stats.paragraphs >= 40 + CHECKS  # the walk, the checks, the conclusion
        assert early["ended"] == "early", early
        assert stats.first_right is not None
        assert stats.first_right < early["stop_step"] < stats.paragraphs, (early, stats)
        assert check_answer(early_text, PROBLEM), early_text[-600:]

        force = AutoTokenizer.from_pretrained(DEMO / "model").encode(
            bundle.think.force_text, add_special_tokens=False)
        assert orca_of(sampled)["ended"] == "early", orca_of(sampled)
        ids = sampled.choices[0].model_extra["token_ids"]
        at = next(i for i in range(len(ids)) if ids[i:i + len(force)] == force)
        head, answer = ids[:at + len(force)], ids[at + len(force):-1]  # the last: the EOS
        assert len(answer) >= 3, answer
        greedy = client.completions.create(
            model=model, prompt=sampled.model_extra["prompt_token_ids"] + head, temperature=0,
            max_tokens=len(answer), extra_body={"orca": {"enabled": False},
                                                "return_token_ids": True})
        assert greedy.choices[0].model_extra["token_ids"] == answer

        def first_logprobs(**sampling: float) -> list[float]:
            r = client.chat.completions.create(
                model=model, messages=msg, max_tokens=1, logprobs=True, top_logprobs=5,
                extra_body={"orca": {"enabled": False}}, **sampling)
            return [t.logprob for t in r.choices[0].logprobs.content[0].top_logprobs]

        calibrated = CollectSettings(**load_job(ROOT / bundle.provenance["job"])["collect"])
        assert calibrated.temperature != 1.0
        unset = first_logprobs()
        assert unset == first_logprobs(temperature=calibrated.temperature)
        assert unset != first_logprobs(temperature=1.0)
    finally:
        srv.stop()
