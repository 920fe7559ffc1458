"""Speculative decoding on the real engine (offline `LLM`, V1 runner, tiny model).

The same greedy requests run on three engines serving one bundle: plain decoding, n-gram
speculation and draft-model speculation (the tiny model drafts for itself); all run in this
process but the n-gram engine's worker (`_engine`). Greedy decoding with a small frequency
penalty: the output of a speculative engine is the plain engine's, token for token (the drafter
proposes without the penalty, so some drafts are rejected and some accepted).

The bundle carries a grid of (delta, lambda*) rows; the plain engine's shadow scores pick, per
prompt, a delta whose lambda* is first crossed at a later step, and the stop requests use it.
Stop steps, scores and step embeddings must equal the plain engine's; forced text must be
output tokens, at most k tokens after the plain engine's (k = num_speculative_tokens).
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys

import pytest

import torch
import vllm  # noqa: F401

from orca_method.probe import Probe, ProbeSpec
from orca_serve.vllm_plugin.config import engine_kwargs, prepare_environment
from tests.bundles import tiny_bundle, write_bundle
from tests.serving import Server, orca_serve_cmd, records
from tests.tiny_model import HIDDEN, chat_prompts

pytestmark = pytest.mark.vllm

QUESTIONS = ["Solve 3x+1=7", "What is 2+2?", "hi", "Find x: 7*x + 3 = 38", "Try x = 5", "Why?"]
MAX_TOKENS = 120
K = 3  # num_speculative_tokens
PENALTY = 0.1
GRID = [(round(0.005 * (i + 1), 3), round(0.99 - 0.01 * i, 2)) for i in range(99)]
COMMON = {"enforce_eager": True, "dtype": "float32", "max_model_len": 512, "seed": 0}
SERVE = ["--host", "127.0.0.1", "--enforce-eager", "--dtype", "float32", "--max-model-len", "512",
         "--seed", "0", "--disable-uvicorn-access-log"]
SPECULATION = {
    "ngram": lambda model: {"method": "ngram", "num_speculative_tokens": K,
                            "prompt_lookup_max": 3, "prompt_lookup_min": 2},
    "draft_model": lambda model: {"method": "draft_model", "model": str(model),
                                  "num_speculative_tokens": K},
}


def _probe() -> Probe:
    probe = Probe(ProbeSpec(dim=HIDDEN), seed=0)
    g = torch.Generator().manual_seed(0)
    probe.params["w"].data = -torch.randn(HIDDEN, generator=g) * 4  # scores rise over steps
    return probe.requires_grad_(False)


@pytest.fixture(scope="module")
def bundle(model, tok, tmp_path_factory):
    """n_cal large enough that every delta of the grid passes the server's table check."""
    return write_bundle(tiny_bundle(_probe(), GRID, vocab=tok.get_vocab(), window=3,
                                    n_cal=2000, name=model.name, default_delta=GRID[0][0]),
                        tmp_path_factory.mktemp("bundle") / "bundle.json")


def _sp(key: str, **xa):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, frequency_penalty=PENALTY,
                          extra_args={"orca_key": key, **xa})


@contextlib.contextmanager
def _engine(model, bundle, speculation=None):
    """An offline engine serving `bundle`, plain or with `speculation`; shut down on exit.

    The engine core runs in this process. So does the worker, except under n-gram speculation:
    its proposer imports numba, and once llvmlite is loaded every later vLLM CPU engine of the
    process fails at start (vLLM 0.32's kernel-override scan over sys.modules trips on
    llvmlite's `ffi.lib`), which would break the in-process engines of the modules that run
    after this one in the same pytest(-xdist) process. The n-gram engine's worker is a process
    of its own (executor "mp": one spawn; VLLM_ENABLE_V1_MULTIPROCESSING=1 would spawn two on
    the CPU build, the engine core and then its worker).
    """
    from vllm import LLM

    prepare_environment()
    spec = None if speculation is None else SPECULATION[speculation](model)
    backend = "mp" if speculation == "ngram" else None
    llm = LLM(str(model), speculative_config=spec, distributed_executor_backend=backend,
              **COMMON, **engine_kwargs(bundle))
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()  # and its worker process, if any
        del llm
        gc.collect()


def _generate(llm, prompts, requests):
    """Run `requests` ({key: (prompt index, extra args)}) on `llm`; return
    ({key: token ids}, {key: result}, stats)."""
    keys = list(requests)
    outs = llm.generate([prompts[requests[k][0]] for k in keys],
                        [_sp(k, **requests[k][1]) for k in keys], use_tqdm=False)
    res = records(llm.collective_rpc("orca_results", args=(keys,)))
    (stats,) = llm.collective_rpc("orca_stats")
    return {k: list(o.outputs[0].token_ids) for k, o in zip(keys, outs)}, res, stats


def _first_cross(sm, lam):
    return next((t + 1 for t, v in enumerate(sm) if v >= lam), None)


def _pick(prompts, res):
    """Per prompt, a delta of the grid whose lambda* the plain run first crosses at step >= 3,
    early enough that the budget guard of policy answer does not close the thinking first."""
    deltas = {}
    for i in range(len(prompts)):
        sm, steps = res[f"s{i}"]["scores"], res[f"s{i}"]["step_tokens"]
        for delta, lam in GRID:
            t = _first_cross(sm, lam)
            if t is not None and t >= 3 and sum(steps[:t]) <= MAX_TOKENS - 40:
                deltas[i] = delta
                break
    assert len(deltas) >= 3, "too few prompts with a later crossing: the test would prove little"
    return deltas


@pytest.fixture(scope="module")
def plain_runs(model, bundle, tok):
    """One plain engine, two runs: shadow requests pick the deltas (`_pick`), then the requests
    of `_requests` with them."""
    prompts = chat_prompts(tok, QUESTIONS)
    shadow = {f"s{i}": (i, {"orca_policy": "shadow", "orca_record": 1})
              for i in range(len(prompts))}
    with _engine(model, bundle) as llm:
        _, res, _ = _generate(llm, prompts, shadow)
        deltas = _pick(prompts, res)
        return (prompts, deltas), _generate(llm, prompts, _requests(deltas))


@pytest.fixture(scope="module")
def picked(plain_runs):
    """(prompts, {prompt index: delta}), from the plain engine's shadow scores."""
    return plain_runs[0]


@pytest.fixture(scope="module")
def plain(plain_runs):
    """The plain engine's ({key: token ids}, {key: result}, stats) for `_requests(deltas)`."""
    return plain_runs[1]


def _requests(deltas):
    reqs = {}
    for i, delta in deltas.items():
        reqs[f"shadow{i}"] = (i, {"orca_policy": "shadow", "orca_delta": delta,
                                  "orca_record": 1})
        reqs[f"stop{i}"] = (i, {"orca_policy": "stop", "orca_delta": delta, "orca_record": 1})
        reqs[f"answer{i}"] = (i, {"orca_policy": "answer", "orca_delta": delta,
                                  "orca_answer_budget": 16})
    return reqs


@pytest.mark.parametrize("speculation", ["ngram", "draft_model"])
def test_speculation_stops_where_plain_decoding_stops(model, bundle, tok, picked, plain,
                                                      speculation):
    prompts, deltas = picked
    want_out, want, _ = plain
    with _engine(model, bundle, speculation) as llm:
        got_out, got, stats = _generate(llm, prompts, _requests(deltas))
    assert "llvmlite" not in sys.modules  # later in-process engines would fail (see `_engine`)
    assert stats["drafts_accepted"] >= 20, stats  # speculation did happen
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    force = tok.encode("\n</think>\n\n", add_special_tokens=False)
    for i in deltas:
        # shadow: the same output, steps, scores and embeddings
        a, b = want[f"shadow{i}"], got[f"shadow{i}"]
        assert "error" not in b, b.get("error")
        assert got_out[f"shadow{i}"] == want_out[f"shadow{i}"]
        for f in ("steps_scored", "would_stop_step", "step_tokens", "reasoning_tokens"):
            assert a[f] == b[f], (i, f)
        assert b["scores"] == pytest.approx(a["scores"], abs=1e-5)
        torch.testing.assert_close(torch.from_numpy(b["step_embeddings"]),
                                   torch.from_numpy(a["step_embeddings"]), atol=1e-5, rtol=1e-5)
        assert a["would_stop_step"] is not None
        for policy, text in (("stop", [eos]), ("answer", force)):
            key = f"{policy}{i}"
            a, b = want[key], got[key]
            assert "error" not in b, b.get("error")
            assert b["stopped_early"] and b["stop_reason"] == "probe"
            assert b["stop_step"] == a["stop_step"] == want[f"shadow{i}"]["would_stop_step"]
            assert b["scores"] == pytest.approx(a["scores"], abs=1e-5)
            assert b["forced_tokens"][:len(text)] == a["forced_tokens"][:len(text)] == text
            # plain: the forced text right after the stop step's last token
            ends = sum(want[f"shadow{i}"]["step_tokens"][:a["stop_step"]])
            pa, pb = (next(p for p in range(len(o)) if o[p:p + len(text)] == text)
                      for o in (want_out[key], got_out[key]))
            assert pa == ends, (key, pa, ends)
            # speculative: the same tokens up to there, then at most K more of the model's own
            assert got_out[key][:pa] == want_out[key][:pa]
            assert pa <= pb <= pa + K, (key, pa, pb)
            assert got_out[key][pb:pb + len(text)] == text
            if policy == "stop":
                assert len(got_out[key]) == pb + 1 and b["forced_tokens"] == [eos]
            else:  # the answer budget, then EOS
                assert got_out[key][-1] == eos and len(got_out[key]) == pb + len(text) + 16 + 1


def test_orca_serve_with_ngram_speculation_reports_the_plain_stop(model, bundle, picked, plain,
                                                                  tmp_path):
    """Real HTTP, the real openai client: orca-serve with --speculative-config (n-gram) stops
    each request at the plain engine's stop step and says so in the `orca` object."""
    prompts, deltas = picked
    want_out, want, _ = plain
    srv = Server(orca_serve_cmd("--model", str(model), "--calib", str(bundle),
                                "--speculative-config", json.dumps(SPECULATION["ngram"](model))),
                 tmp_path / "orca.log", SERVE)
    try:
        client = srv.wait().client()
        name = client.models.list().data[0].id
        for i, delta in deltas.items():
            r = client.completions.create(model=name, prompt=prompts[i], max_tokens=MAX_TOKENS,
                                          temperature=0, frequency_penalty=PENALTY,
                                          extra_body={"orca": {"policy": "stop",
                                                               "delta": delta}})
            orca = r.model_extra["orca"]
            assert orca["stopped_early"] and orca["stop_step"] == want[f"stop{i}"]["stop_step"]
            # plain decoding ended with the forced EOS; speculation at most K tokens later
            n = len(want_out[f"stop{i}"])
            assert r.choices[0].finish_reason == "stop"
            assert n <= r.usage.completion_tokens <= n + K
        log = srv.log.read_text()
    finally:
        srv.stop()
    assert "speculative_config=SpeculativeConfig(method='ngram'" in log
