"""An imported authors' probe served by the real vLLM engine (tiny model, CPU).

The probe is made in the authors' format at the tiny model's hidden size (their released probes
are 5,120-8,192 wide); the bundle comes from `orca-calibrate import-probe` with a short maximum
step length so that cuts happen within a short generation. The engine must segment by their rule
(online == offline), pool like them (means of L2-normalised final-norm hidden states), score like
their probe
definition and stop where their smoothed scores first reach lambda*.
"""

from __future__ import annotations

import json
import math

import pytest

import numpy as np
import torch
import vllm  # noqa: F401

from orca_calibrate.calibrate_cli import main as calibrate_main
from orca_method.bundle import load_bundle
from orca_method.steps import TokenTable, segment
from orca_serve.vllm_plugin.config import engine_kwargs, prepare_environment
from tests.authors_format import AuthorsProbe, authors_state_dict, smooth
from tests.serving import records
from tests.tiny_model import HIDDEN

pytestmark = pytest.mark.vllm

MAX_STEP = 6
LAMBDAS = {str(k / 100): round(1 - k / 100, 2) for k in range(1, 100)}  # 0.01: 0.99, ...
QUESTION = "Find x: 7*x + 3 = 38"


@pytest.fixture(scope="module")
def setup(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("authors-probe")
    # seed and scale chosen so that on this prompt the smoothed scores rise to a new maximum a
    # few steps in (so a stop later than step 1 can be checked)
    sd = authors_state_dict(HIDDEN, no_kq=True, seed=4)
    sd["W0"] = sd["W0"] * -6
    # a small inner rate: scores still follow the embeddings (not only fall with every update)
    sd["log_eta"] = torch.tensor(math.log(0.003))
    torch.save(sd, d / "probe.pt")
    (d / "lambdas.json").write_text(json.dumps(LAMBDAS))
    (d / "config.json").write_text(json.dumps({"no_kq": True, "smooth_window": 3}))
    assert calibrate_main(["import-probe", str(d / "probe.pt"), "--lambdas",
                           str(d / "lambdas.json"), "--model", str(model), "--out",
                           str(d / "bundle.json"), "--max-step-tokens", str(MAX_STEP)]) == 0
    from transformers import AutoTokenizer
    from vllm import LLM

    prepare_environment()
    llm = LLM(str(model), enforce_eager=True, dtype="float32", max_model_len=512, seed=0,
              **engine_kwargs(d / "bundle.json"))
    tok = AutoTokenizer.from_pretrained(model)
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}],
                                     add_generation_prompt=True, tokenize=False)
    return {"model": model, "bundle": load_bundle(d / "bundle.json"), "llm": llm, "tok": tok,
            "prompt": prompt, "theirs": AuthorsProbe(sd)}


def _run(setup, key: str, **xa):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=100, temperature=1.0, seed=7,
                        extra_args={"orca_key": key, **xa})
    out = setup["llm"].generate([setup["prompt"]], [sp], use_tqdm=False)[0]
    res = records(setup["llm"].collective_rpc("orca_results", args=([key],)))[key]
    assert "error" not in res, res.get("error")
    return out, res


def test_imported_probe_segments_pools_scores_and_stops_like_theirs(setup):
    bundle, tok = setup["bundle"], setup["tok"]
    out, rec = _run(setup, "shadow", orca_policy="shadow", orca_delta=0.7, orca_record=1)
    prompt_ids, gen = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
    # their step rule with the length cut, online == offline
    table = TokenTable.from_tokenizer(tok, segmentation=bundle.segmentation, think=bundle.think)
    assert rec["step_token_ids"] == segment(table, gen[:-1], prompt_ids)
    sizes = rec["step_tokens"]
    assert max(sizes) == MAX_STEP and len(sizes) >= 5  # cuts happened
    # their pooling: the mean of the L2-normalised final-norm hidden states of each step's tokens
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(setup["model"], dtype=torch.float32).eval()
    with torch.no_grad():
        h = hf.model(input_ids=torch.tensor([prompt_ids + gen])).last_hidden_state[0]
    h = torch.nn.functional.normalize(h[len(prompt_ids):], dim=-1)
    ends = np.cumsum(sizes).tolist()
    ref = torch.stack([h[a:b].mean(0) for a, b in zip([0] + ends[:-1], ends)])
    emb = torch.from_numpy(rec["step_embeddings"])
    torch.testing.assert_close(emb, ref, atol=1e-4, rtol=1e-4)
    # their probe on the same embeddings: the served smoothed scores and the would-stop step
    their_sm = smooth(setup["theirs"].scores(rec["step_embeddings"]), bundle.window)
    assert rec["scores"] == pytest.approx(their_sm[:rec["steps_scored"]], abs=1e-5)
    first = {d: next((t + 1 for t, m in enumerate(their_sm) if m >= lam), None)
             for d, lam in LAMBDAS.items()}
    assert rec["would_stop_step"] == first["0.7"]
    # a delta whose lambda* their scores first reach after a few steps: policy stop ends there
    delta = next((d for d, t in first.items() if t is not None and t >= 3
                  and min(abs(m - LAMBDAS[d]) for m in their_sm) > 1e-4), None)
    assert delta is not None, (first, their_sm)
    out2, res = _run(setup, "stop", orca_policy="stop", orca_delta=float(delta))
    assert res["stopped_early"] and res["stop_step"] == first[delta]
    gen2 = list(out2.outputs[0].token_ids)
    assert gen2[:-1] == gen[:len(gen2) - 1]  # same tokens up to the stop (same seed)
    assert len(gen2) - 1 == sum(sizes[:first[delta]])
    assert gen2[-1] == tok.convert_tokens_to_ids("<|im_end|>")
