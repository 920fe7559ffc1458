"""The vLLM adapter on a real engine (offline `LLM`, in-process, eager, float32, tiny model).

Flow, like production: a record-mode engine without a bundle collects step embeddings (this is
calibration's collect step), a bundle is calibrated from them (lambda* chosen so that the probe
crosses it at a known step), then an engine serving that bundle must stop exactly there.
"""

from __future__ import annotations

import gc

import pytest

# Plain imports, not importorskip: vllm is a declared dependency, and a broken install must fail
# CI rather than skip the engine tests and pass.
import torch
import vllm  # noqa: F401

from orca_method.probe import Probe, ProbeSpec
from orca_method.procedure import replay
from orca_serve.vllm_plugin.config import (
    check_engine_supported,
    engine_kwargs,
    prepare_environment,
)
from tests.bundles import tiny_bundle, write_bundle
from tests.serving import records
from tests.tiny_model import HIDDEN, chat_prompts

pytestmark = pytest.mark.vllm

QUESTIONS = ["Solve 3x+1=7", "What is 2+2?", "hi", "Find x: 7*x + 3 = 38", "Try x = 5", "Why?"]
MAX_TOKENS = 120
WINDOW = 3
COMMON = {"enforce_eager": True, "dtype": "float32", "max_model_len": 512, "seed": 0}


def _llm(model, **kw):
    from vllm import LLM

    prepare_environment()
    return LLM(str(model), **{**COMMON, **kw})


def _sp(seed, key=None, max_tokens=MAX_TOKENS, n=1, temperature=1.0, penalty=0.0, **xa):
    from vllm import SamplingParams

    extra = dict(xa)
    if key is not None:
        extra["orca_key"] = key
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, n=n,
                          frequency_penalty=penalty, extra_args=extra or None)


def _results(llm, keys):
    return records(llm.collective_rpc("orca_results", args=(list(keys),)))


# -- engines and the calibrated bundle --------------------------------------------------------
@pytest.fixture(scope="module")
def prompts(tok):
    return chat_prompts(tok, QUESTIONS)


@pytest.fixture(scope="module")
def recorder(model):
    """Record mode without a bundle (capture + segmentation only)."""
    return _llm(model, **engine_kwargs(None, record=True))


@pytest.fixture(scope="module")
def recorded(recorder, prompts):
    """Six concurrent requests of different lengths, recorded."""
    sps = [_sp(i, f"rec{i}", max_tokens=MAX_TOKENS - 7 * i) for i in range(len(prompts))]
    outs = recorder.generate(prompts, sps, use_tqdm=False)
    raw = recorder.collective_rpc("orca_results", args=([f"rec{i}" for i in range(len(prompts))],))
    # arrays travel as bytes whatever the process layout; merge_results restores them
    import numpy as np

    assert not isinstance(raw[0]["rec0"]["step_embeddings"], np.ndarray)
    res = records(raw)
    assert isinstance(res["rec0"]["step_embeddings"], np.ndarray)
    return outs, [res[f"rec{i}"] for i in range(len(prompts))]


def _probe() -> Probe:
    probe = Probe(ProbeSpec(dim=HIDDEN), seed=0)
    g = torch.Generator().manual_seed(0)
    probe.params["w"].data = torch.randn(HIDDEN, generator=g) * 4
    return probe.requires_grad_(False)


@pytest.fixture(scope="module")
def calib(recorded, tok, tmp_path_factory):
    """A bundle whose lambda*(0.1) is first crossed at a known step t* >= 3 of one request and
    lambda*(0.2) at its step 1; lambda*(0.05) = never."""
    _, res = recorded
    probe = _probe()
    sms = [sm.tolist() for _, sm in replay(probe, [r["step_embeddings"] for r in res], WINDOW)]
    pick = None
    for i, sm in enumerate(sms):
        for t in range(2, len(sm) - 2):
            if sm[t] > max(sm[:t]) + 2e-3:
                pick = (i, t, (sm[t] + max(sm[:t])) / 2)
                break
        if pick:
            break
    assert pick, "no usable crossing in the recorded trajectories"
    i_star, t_star, lam1 = pick
    lam2 = sms[i_star][0] - 1e-3
    path = write_bundle(tiny_bundle(probe, [(0.05, None), (0.1, lam1), (0.2, lam2)],
                                    vocab=tok.get_vocab(), window=WINDOW, n_cal=6,
                                    default_delta=0.1),
                        tmp_path_factory.mktemp("bundle") / "bundle.json")
    return {"path": path, "i": i_star, "stop_step": t_star + 1, "lam1": lam1, "lam2": lam2,
            "sms": sms, "probe": probe}


@pytest.fixture(scope="module")
def served(model, calib):
    return _llm(model, **engine_kwargs(calib["path"]))


@pytest.fixture(scope="module")
def plain(model):
    return _llm(model)


def _first_cross(sm, lam):
    return next((t + 1 for t, v in enumerate(sm) if v >= lam), None)


# -- capture ------------------------------------------------------------------------------------
def _check_against_transformers(outs, res, model, table, n_children=1):
    """Step embeddings from the engine == token-l2 means of transformers' final-norm states over
    the steps that the offline segmenter finds in the same tokens."""
    from transformers import AutoModelForCausalLM

    from orca_method.steps import segment

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    for o, rs in zip(outs, res):
        for c, r in zip(o.outputs, rs if isinstance(rs, list) else [rs]):
            assert "error" not in r, r.get("error")
            prompt, gen = list(o.prompt_token_ids), list(c.token_ids)
            # the engine saw every token but the last (its hidden state is never computed)
            assert r["step_token_ids"] == segment(table, gen[:-1], prompt)
            assert sum(r["step_tokens"]) == r["reasoning_tokens"] == len(gen) - 1
            assert [len(s) for s in r["step_token_ids"]] == r["step_tokens"]
            assert len(r["step_tokens"]) >= 2
            with torch.no_grad():
                h = hf.model(input_ids=torch.tensor([prompt + gen])).last_hidden_state[0]
            h = torch.nn.functional.normalize(h[len(prompt):], dim=-1)
            ends = torch.tensor(r["step_tokens"]).cumsum(0).tolist()
            ref = torch.stack([h[a:b].mean(0) for a, b in zip([0] + ends[:-1], ends)])
            got = torch.from_numpy(r["step_embeddings"])
            assert got.dtype == torch.float32 and got.shape == (len(ends), HIDDEN)
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_record_mode_embeddings_equal_transformers(recorded, model, tok):
    from orca_method.steps import TokenTable

    outs, res = recorded
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert len({len(o.outputs[0].token_ids) for o in outs}) == len(outs)  # different lengths
    _check_against_transformers(outs, res, model, TokenTable.from_tokenizer(tok))
    for r in res:
        assert r["enabled"] is False and r["steps_scored"] == 0 and r["scores"] == []
        assert len(r["step_tokens"]) >= 3


def test_tiny_tokenizer_same_ids_everywhere(recorder, tok, model, prompts):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_file=str(model / "tokenizer.json"))
    text = prompts[3] + "Try x = 5: 7*5 + 3 = 38.\n\nWait, but\n\n\n</think>\n\nThe answer"
    ids = tok.encode(text, add_special_tokens=False)
    assert recorder.get_tokenizer().encode(text, add_special_tokens=False) == ids
    assert fast.encode(text, add_special_tokens=False) == ids
    assert tok.convert_tokens_to_ids("ĊĊ") in ids


def test_multiprocess_engine_keywords_and_n2(model, tok, prompts, monkeypatch):
    """The default multiprocess engine (engine core and worker in other processes): results
    cross process boundaries intact, n>1 children are told apart, and the keyword rule's
    merged steps equal transformers too."""
    import vllm.envs

    from orca_method.bundle import Segmentation
    from orca_method.steps import TokenTable

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    vllm.envs.disable_envs_cache()  # vLLM caches env vars after the first engine started
    seg = Segmentation(keywords=["wait", "but"])
    llm = _llm(model, **engine_kwargs(None, record=True, segmentation=seg))
    try:
        assert type(llm.llm_engine.engine_core).__name__ != "InprocClient"
        sps = [_sp(21, "mp0", max_tokens=100), _sp(22, "mp1", max_tokens=80, n=2)]
        outs = llm.generate(prompts[:2], sps, use_tqdm=False)
        res = records(llm.collective_rpc("orca_results", args=(["mp0", "mp1", "mp1/1"],)))
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        monkeypatch.undo()
        vllm.envs.disable_envs_cache()
    assert res["mp1/1"]["index"] == 1
    table = TokenTable.from_tokenizer(tok, segmentation=seg)
    _check_against_transformers(outs, [res["mp0"], [res["mp1"], res["mp1/1"]]], model, table)
    # the keyword rule merged sections: fewer steps than delimiter sections
    plain = TokenTable.from_tokenizer(tok)
    from orca_method.steps import segment

    gen = list(outs[0].outputs[0].token_ids)[:-1]
    assert len(res["mp0"]["step_tokens"]) < len(segment(plain, gen, outs[0].prompt_token_ids))


# -- early stop -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mixed(served, prompts, calib):
    """One batch: policies, deltas, record, n=2 and a closed-think prompt side by side."""
    i = calib["i"]
    p = prompts[i]
    closed = prompts[0].replace("<think>\n", "<think>\n\n</think>\n\n")
    reqs = {
        "stop": (p, _sp(i, "stop", orca_policy="stop", orca_record=1)),
        "answer": (p, _sp(i, "answer", orca_policy="answer", orca_record=1)),
        "shadow": (p, _sp(i, "shadow", orca_policy="shadow", orca_delta=0.1, orca_record=1)),
        "off": (p, _sp(i, "off", orca_enabled=0)),
        "never": (p, _sp(i, "never", orca_delta=0.05, orca_policy="answer")),
        "d02": (p, _sp(i, "d02", orca_delta=0.2, orca_policy="stop")),
        "n2": (prompts[3], _sp(11, "n2", n=2, orca_policy="shadow", orca_record=1)),
        "closed": (closed, _sp(3, "closed", orca_policy="stop")),
        "short": (p, _sp(i, "short", max_tokens=30, orca_delta=0.05, orca_policy="answer",
                         orca_answer_budget=4)),
    }
    names = list(reqs)
    outs = served.generate([reqs[k][0] for k in names], [reqs[k][1] for k in names],
                           use_tqdm=False)
    res = _results(served, names + ["n2/1"])
    return {k: o for k, o in zip(names, outs)}, res


def test_stop_step_is_where_replay_crosses_lambda(mixed, calib, tok):
    outs, res = mixed
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    r = res["stop"]
    assert r["enabled"] and r["policy"] == "stop" and r["lam"] == pytest.approx(calib["lam1"])
    assert r["stopped_early"] and r["stop_reason"] == "probe"
    # the recorded embeddings, replayed offline through the same procedure, cross lambda* there
    (_, sm), = replay(calib["probe"], [r["step_embeddings"]], WINDOW)
    assert r["stop_step"] == _first_cross(sm.tolist(), calib["lam1"]) == calib["stop_step"]
    assert r["scores"] == pytest.approx(sm.tolist(), abs=1e-6)
    assert r["steps_scored"] == r["stop_step"] == len(r["step_tokens"])
    assert r["last_score"] == r["scores"][-1] >= calib["lam1"]
    # policy stop: EOS right after the stop step's last token
    gen = list(outs["stop"].outputs[0].token_ids)
    assert gen[-1] == eos and len(gen) == sum(r["step_tokens"]) + 1
    assert outs["stop"].outputs[0].finish_reason == "stop"
    assert r["forced_tokens"] == [eos]
    # identical to the unforced run up to the stop
    off = list(outs["off"].outputs[0].token_ids)
    assert gen[:-1] == off[:len(gen) - 1]
    # a larger delta (lower lambda*) stops earlier
    assert res["d02"]["stop_step"] == _first_cross(calib["sms"][calib["i"]], calib["lam2"]) == 1


def test_policy_answer_forces_end_of_thinking_then_answer(mixed, calib, tok):
    outs, res = mixed
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    force = tok.encode("\n</think>\n\n", add_special_tokens=False)
    r = res["answer"]
    assert r["stopped_early"] and r["stop_step"] == calib["stop_step"]
    gen = list(outs["answer"].outputs[0].token_ids)
    n = sum(r["step_tokens"])
    assert gen[n:n + len(force)] == force
    answer = gen[n + len(force):]
    assert answer[-1] == eos and len(answer) == 64 + 1  # default answer budget, then EOS
    assert r["forced_tokens"] == force + [eos]
    assert "</think>" in outs["answer"].outputs[0].text or "</think>" in tok.decode(gen)
    assert len(gen) <= MAX_TOKENS


def test_budget_reserve_keeps_room_for_an_answer(mixed, tok):
    """lambda*(0.05) = never: no probe stop, but policy answer closes the thinking early enough
    to answer within max_tokens (reserve = forced text + min(budget, 8) tokens)."""
    outs, res = mixed
    force = tok.encode("\n</think>\n\n", add_special_tokens=False)
    off = list(outs["off"].outputs[0].token_ids)
    for name, max_tokens, budget in (("never", MAX_TOKENS, 64), ("short", 30, 4)):
        r, gen = res[name], list(outs[name].outputs[0].token_ids)
        assert r["lam"] is None and not r["stopped_early"] and r["stop_step"] is None
        assert r["stop_reason"] == "budget"
        at = max_tokens - len(force) - min(budget, 8)
        assert gen[:at] == off[:at] and gen[at:at + len(force)] == force
        assert len(gen) <= max_tokens
        assert r["steps_scored"] >= 1 and r["would_stop_step"] is None


def test_shadow_scores_but_never_changes_output(mixed, calib):
    outs, res = mixed
    r = res["shadow"]
    assert outs["shadow"].outputs[0].token_ids == outs["off"].outputs[0].token_ids
    assert r["forced_tokens"] == [] and not r["stopped_early"] and r["stop_step"] is None
    assert r["would_stop_step"] == calib["stop_step"]
    # it keeps scoring after the would-stop step, exactly like a never-stopping replay
    (_, sm), = replay(calib["probe"], [r["step_embeddings"]], WINDOW)
    assert r["steps_scored"] > r["would_stop_step"]
    assert r["scores"] == pytest.approx(sm.tolist()[:r["steps_scored"]], abs=1e-6)
    assert "off" not in res  # disabled and not recording: not tracked, no result


def test_n2_children_are_separate_probes(mixed, tok):
    outs, res = mixed
    from orca_method.steps import TokenTable, segment

    table = TokenTable.from_tokenizer(tok)
    o = outs["n2"]
    assert len(o.outputs) == 2
    r0, r1 = res["n2"], res["n2/1"]
    assert (r0["index"], r1["index"]) == (0, 1)
    for r, c in ((r0, o.outputs[0]), (r1, o.outputs[1])):
        gen = list(c.token_ids)
        assert r["step_token_ids"] == segment(table, gen[:-1], o.prompt_token_ids)
        (_, sm), = replay(_probe(), [r["step_embeddings"]], WINDOW)
        assert r["scores"] == pytest.approx(sm.tolist()[:r["steps_scored"]], abs=1e-6)
    assert o.outputs[0].token_ids != o.outputs[1].token_ids


def test_prompt_with_closed_think_has_no_reasoning(mixed):
    outs, res = mixed
    r = res["closed"]
    assert r["steps_scored"] == 0 and r["reasoning_tokens"] == 0 and not r["stopped_early"]
    assert len(outs["closed"].outputs[0].token_ids) == MAX_TOKENS


def test_results_are_popped_once(served):
    assert _results(served, ["stop", "nope"]) == {}


# -- no side effects ------------------------------------------------------------------------------
def test_disabled_requests_identical_to_engine_without_plugin(served, plain, prompts):
    greedy = [_sp(None, f"g{i}", temperature=0.0, orca_enabled=0) for i in range(3)]
    seeded = [_sp(40 + i, f"s{i}", orca_enabled=0) for i in range(3)]
    ps = prompts[:3] * 2
    a = served.generate(ps, greedy + seeded, use_tqdm=False)
    b = plain.generate(ps, [_sp(None, temperature=0.0) for _ in range(3)]
                       + [_sp(40 + i) for i in range(3)], use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].text == y.outputs[0].text
    # disabled rows are not tracked and leave no results
    assert _results(served, [f"g{i}" for i in range(3)]) == {}


def test_invalid_arguments_are_rejected(served, prompts):
    for bad in ({"orca_policy": "later"}, {"orca_enabled": 2}, {"orca_delta": "x"},
                {"orca_answer_budget": -1}, {"orca_key": 3}):
        with pytest.raises(Exception, match="orca_"):
            served.generate(prompts[:1], _sp(0, **bad), use_tqdm=False)


def test_stats_report_probe_time(served):
    (s,) = served.collective_rpc("orca_stats")
    assert s["probe_ns"] > 0 and s["engine_steps"] >= s["active_steps"] > 0
    assert s["steps_scored"] > 0 and s["rows_captured"] > 0


def test_check_engine_supported(monkeypatch):
    check_engine_supported({"max_model_len": 10})
    check_engine_supported({"speculative_config": {"method": "ngram"}})
    check_engine_supported({"speculative_config": '{"model": "ngram"}'})  # the CLI's JSON
    check_engine_supported({"speculative_config": {"method": "draft_model", "model": "m"}})
    for spec in ({"method": "eagle"}, {"method": "mtp"}, {"model": "some/drafter"}):
        with pytest.raises(RuntimeError, match="^speculative decoding with .* not supported"):
            check_engine_supported({"speculative_config": spec})
    with pytest.raises(RuntimeError, match="batch-sharded"):
        check_engine_supported({"enable_batch_sharded_sampling": True})
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # Model Runner V2: its own adapter
    check_engine_supported({"max_model_len": 10})


def test_state_is_freed_whatever_ends_a_request(served, prompts, tok):
    """max_tokens, a stop string, a stop token id (how a generation-config EOS ends a request),
    an abort; keyed and unkeyed: once vLLM drops the request, its slot and probe row are free
    and only keyed requests leave a (small) result."""
    from vllm import SamplingParams

    def flush():  # removals reach the plugin on the engine's next step
        served.generate(prompts[:1], _sp(0, max_tokens=2, orca_enabled=0), use_tqdm=False)
        (s,) = served.collective_rpc("orca_stats")
        return s

    before = flush()
    nl2 = tok.convert_tokens_to_ids(tok.tokenize("\n\n"))[0]
    endings = {"max_tokens": {}, "stop_string": {"stop": ["\n\n"]},
               "stop_token": {"stop_token_ids": [nl2]}}
    sps, keys = [], []
    for name, kw in endings.items():
        for keyed in (True, False):
            extra = {"orca_policy": "shadow", **({"orca_key": f"end-{name}"} if keyed else {})}
            sps.append(SamplingParams(max_tokens=40, temperature=1.0, seed=7, extra_args=extra,
                                      **kw))
            keys += [f"end-{name}"] if keyed else []
    outs = served.generate(prompts[:1] * len(sps), sps, use_tqdm=False)
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert reasons.count("length") == 2 and reasons.count("stop") == 4, reasons
    engine = served.llm_engine
    for i, keyed in enumerate((True, False)):
        xa = {"orca_policy": "shadow", **({"orca_key": "end-abort"} if keyed else {})}
        engine.add_request(f"abort-{i}", prompts[0], SamplingParams(max_tokens=200, seed=1,
                                                                    extra_args=xa))
    for _ in range(40):
        engine.step()
    assert served.collective_rpc("orca_stats")[0]["slots_in_use"] == 2
    engine.abort_request(["abort-0", "abort-1"])
    after = flush()
    assert after["slots_in_use"] == 0 and after["tracked_requests"] == 0
    assert after["parked_requests"] == 0
    assert after["stored_results"] - before["stored_results"] == len(keys) + 1
    res = _results(served, keys + ["end-abort"])
    assert set(res) == set(keys) | {"end-abort"}
    # (a stop at the first "\n\n" ends before that step's last row arrives: nothing scored)
    assert res["end-max_tokens"]["steps_scored"] > 0 and res["end-abort"]["steps_scored"] > 0


# -- preemption -----------------------------------------------------------------------------------
def test_preemption_gives_same_steps_and_scores(model, calib, served, prompts):
    """A KV cache of 10 blocks x 32 tokens cannot hold six requests: vLLM preempts them and
    recomputes in 32-token prefill chunks; scores, stop steps and embeddings must not change.

    Greedy (with a frequency penalty, so the tiny model does not repeat one token): on CPU,
    vLLM 0.32 crashes on seeded requests whose prefill is chunked (`gen.set_offset`, "CPU
    Generator does not use offset", gpu_model_runner.py:3502).
    """
    def batch():
        sps = [_sp(None, "p-stop", temperature=0.0, penalty=0.7, orca_policy="stop",
                   orca_delta=0.2, orca_record=1)]
        sps += [_sp(None, f"p{k}", temperature=0.0, penalty=0.7, orca_policy="shadow",
                    orca_record=1) for k in range(5)]
        return [prompts[calib["i"]]] + prompts[:5], sps

    keys = ["p-stop"] + [f"p{k}" for k in range(5)]
    ps, sps = batch()
    ref_out = served.generate(ps, sps, use_tqdm=False)
    ref = _results(served, keys)
    small = _llm(model, **engine_kwargs(calib["path"]), num_gpu_blocks_override=10, block_size=32,
                 max_num_seqs=6, max_model_len=256, max_num_batched_tokens=32)
    try:
        ps, sps = batch()
        out = small.generate(ps, sps, use_tqdm=False)
        got = _results(small, keys)
        (stats,) = small.collective_rpc("orca_stats")
    finally:
        del small
        gc.collect()
    assert stats["resumed"] > 0, "no preemption happened; shrink the cache"
    assert stats["recompute_chunks"] > 0  # rows of partial recompute chunks were skipped
    for k, a, b in zip(keys, ref_out, out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, k
        ra, rb = ref[k], got[k]
        assert "error" not in rb, rb.get("error")
        for f in ("steps_scored", "stop_step", "would_stop_step", "step_tokens", "forced_tokens",
                  "reasoning_tokens"):
            assert ra[f] == rb[f], (k, f)
        assert rb["scores"] == pytest.approx(ra["scores"], abs=1e-5)
        torch.testing.assert_close(torch.from_numpy(rb["step_embeddings"]),
                                   torch.from_numpy(ra["step_embeddings"]), atol=1e-5, rtol=1e-5)
