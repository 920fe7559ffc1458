"""The engine-step core (orca_serve.core) driven by a simulated engine: no vLLM needed.

A small fake engine runs several requests through `OrcaCore` the way the adapters do: requests
join at different steps, rows are shuffled every step, some are preempted and resumed, some run
with async-scheduling placeholders, and each request's next token is the forced one when the
core forced it, else the next token of its own scripted stream. Every request is then checked
against an offline reference built from the same tokens and hidden rows: the segmentation, the
token-l2 mean per step and `procedure.replay` (the calibration replay).
"""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest
import torch

from orca_method.bundle import BundleError, ThinkTags, load_bundle
from orca_serve.settings.contract import XARG_BUNDLE, XARG_GIVE_UP_MU, XARG_KEY, XARG_LAM
from orca_serve.core import engine
from orca_serve.core.pooling import Fence, Staging
from orca_serve.core.registry import open_reasoning_tokens
from tests.core_sim import (
    DIM,
    EOS,
    FORCE,
    ID,
    POLICY_XA,
    PROMPT,
    SimRequest,
    count_copies,
    count_join_copies,
    first_cross,
    gated_sim_bundle,
    logged,
    make_core,
    reference,
    run,
    run_requests,
    sim_bundle,
    sim_probe,
    sync_sims,
    to_device,
)
from tests.bundles import far_gate, write_bundle


@pytest.mark.parametrize(("seed", "keywords"), [(0, False), (1, False), (2, False), (3, True)])
def test_core_matches_offline_replay_with_moves_preemption_and_lag(bundle_path,
                                                                   keyword_bundle_path, seed,
                                                                   keywords):
    rng = random.Random(seed)
    core = make_core(keyword_bundle_path if keywords else bundle_path, max_num_seqs=4)
    sims = []
    for i in range(8):
        policy = ["stop", "answer", "shadow"][i % 3]
        xa = {XARG_KEY: f"r{i}", **POLICY_XA[policy]}
        if i == 7:
            xa[XARG_LAM] = "inf"  # the server's resolution wins: never stops early
        sims.append(SimRequest(f"r{i}", rng, xa=xa, max_tokens=rng.randrange(40, 90),
                               join_at=rng.randrange(0, 6),
                               preempt_at=rng.randrange(5, 30) if i % 2 else None,
                               lag_from={4: 3, 5: 12}.get(i)))
    run(core, sims, seed)
    res = core.pop_results([s.name for s in sims])
    table, probe = core.dep.table, sim_probe()
    stops = answered = 0
    for s in sims:
        r = res[s.name]
        assert "error" not in r, r.get("error")
        policy = s.xa["orca_policy"]
        lagged = s.lag_from is not None and len(s.out) > s.lag_from
        sm, ends = reference(table, s, probe, len(s.out) - 1 - lagged)
        lam = float("inf") if s.name == "r7" else 0.75
        cross = first_cross(sm, lam)
        n_scored = r["steps_scored"]
        assert r["scores"] == pytest.approx(sm[:n_scored], abs=1e-5), s.name
        if policy == "shadow":
            assert r["would_stop_step"] == cross and r["forced_tokens"] == []
            assert n_scored == len(sm)
            continue
        if r["stop_reason"] == "budget":
            assert cross is None or cross > n_scored
            continue
        if cross is None:
            assert not r["stopped_early"] and n_scored == len(sm)
            continue
        stops += 1
        assert r["stopped_early"] and r["stop_step"] == n_scored == cross, s.name
        # the token right after the stop step's last one (one later when that one was lagged)
        at = ends[cross - 1] + 1
        at += s.lag_from is not None and at >= s.lag_from
        want = [EOS] if policy == "stop" else FORCE
        assert s.out[at:at + len(want)] == want, s.name
        assert r["forced_tokens"][:len(want)] == want
        if policy == "answer":  # the answer after the forced text: the argmax at every position
            start = at + len(FORCE)
            answer = [t for t in s.out[start:] if t != EOS]
            answered += len(answer)
            assert answer == [int(s.logits[q].argmax()) for q in range(start, start + len(answer))]
    # (keyword steps are long and few: there the point is the merge path's scores)
    assert stops >= (0 if keywords else 2), "no probe stop happened: the test would prove little"
    assert answered >= (0 if keywords else 1), "no answer after a stop: the test would prove little"
    assert sum(res[s.name]["steps_scored"] for s in sims) >= 5
    assert core.pool.free_count == core.capacity  # every slot came back
    st = core.get_stats()
    assert st["resumed"] >= 3 and st["lagged_tokens"] >= 2


def test_an_answer_without_forced_text_is_greedy_from_the_stop_on(tmp_path_factory):
    """Think tags off, no end-of-thinking text: the answer starts at the stop's own token, which
    the device forces to its row's argmax in the step that decides the stop (the host forces
    the rest). Before, nothing was forced there: the answer's first token was the request's
    own sample (its stream's token here)."""
    path = sim_bundle(tmp_path_factory, think=ThinkTags(enabled=False, force_text=""))
    sims, res = run_requests(path, {"r": {"orca_policy": "answer", "orca_answer_budget": 4}})
    s, r = sims["r"], res["r"]
    assert r["stop_reason"] == "probe" and r["forced_tokens"] == [EOS] and s.out[-1] == EOS
    answer = range(len(s.out) - 5, len(s.out) - 1)  # the budget's 4 tokens, then EOS
    assert [s.out[q] for q in answer] == [int(s.logits[q].argmax()) for q in answer]


def test_state_is_freed_when_a_request_leaves_for_good(bundle_path):
    core = make_core(bundle_path, max_num_seqs=2)
    keyed = core.join("k", core.settings({XARG_KEY: "k", "orca_record": 1}), prompt=PROMPT,
                      n_out=0, index=0, max_tokens=50, eos=None, ignore_eos=False,
                      structured=False)
    unkeyed = core.join("u", core.settings({}), prompt=PROMPT, n_out=0, index=0, max_tokens=50,
                        eos=None, ignore_eos=False, structured=False)
    assert core.pool.free_count == core.capacity - 2
    core.leave(unkeyed, False)  # preempted: keeps its slot
    assert core.pool.free_count == core.capacity - 2 and "u" in core.live
    core.leave(keyed, True)
    core.leave(core.join("u", core.settings({}), prompt=PROMPT, n_out=0, index=0,
                         max_tokens=50, eos=None, ignore_eos=False, structured=False), True)
    assert core.pool.free_count == core.capacity and not core.live
    st = core.get_stats()
    assert st["stored_results"] == 1 and st["tracked_requests"] == 0
    assert core.pop_results(["k", "u"]).keys() == {"k"}
    assert core.get_stats()["stored_results"] == 0


def test_results_expire_and_are_bounded(bundle_path):
    core = make_core(bundle_path, max_results=2)
    for i in range(3):
        r = core.join(f"k{i}", core.settings({XARG_KEY: f"k{i}"}), prompt=PROMPT, n_out=0,
                      index=0, max_tokens=9, eos=None, ignore_eos=False, structured=False)
        core.leave(r, True)
    assert set(core.pop_results(["k0", "k1", "k2"])) == {"k1", "k2"}
    core = make_core(bundle_path, result_ttl_s=0.0)
    core.leave(core.join("k", core.settings({XARG_KEY: "k"}), prompt=PROMPT, n_out=0, index=0,
                         max_tokens=9, eos=None, ignore_eos=False, structured=False), True)
    assert core.pop_results(["k"]) == {}


def test_parked_requests_are_evicted_into_snapshots_when_slots_run_out(bundle_path):
    """max_num_seqs=1 gives 2 slots: a third request evicts the parked one, whose state comes
    back bit for bit when it resumes."""
    rng = random.Random(5)
    ref_core, core = make_core(bundle_path, max_num_seqs=1), make_core(bundle_path,
                                                                       max_num_seqs=1)
    a = SimRequest("a", rng, xa={XARG_KEY: "a", "orca_policy": "shadow"}, max_tokens=40,
                   join_at=0)
    run(ref_core, [a])
    ref = ref_core.pop_results(["a"])["a"]
    b = SimRequest("a", random.Random(5), xa=a.xa, max_tokens=40, join_at=0, preempt_at=15)

    def crowd() -> None:  # two new requests take both slots while "a" is parked, then end
        others = [core.join(f"c{i}", core.settings({}), prompt=PROMPT, n_out=0, index=0,
                            max_tokens=9, eos=None, ignore_eos=False, structured=False)
                  for i in range(2)]
        assert core.pool.free_count == 0 and b.req.slot is None  # "a" was evicted
        for r in others:
            core.leave(r, True)

    run(core, [b], on_park=crowd)
    assert core.get_stats()["evictions"] == 1
    got = core.pop_results(["a"])["a"]
    assert got["scores"] == pytest.approx(ref["scores"], abs=1e-6)
    assert got["steps_scored"] == ref["steps_scored"] > 0


@pytest.fixture(scope="module")
def gated_bundle_path(tmp_path_factory):
    """The sim bundle with a two-step shift gate that flags every request."""
    b = load_bundle(sim_bundle(tmp_path_factory))
    b = b.model_copy(update={"shift_gate": far_gate(DIM).model_copy(update={"steps": 2})})
    return write_bundle(b, tmp_path_factory.mktemp("gated") / "bundle.json")


@pytest.mark.parametrize("two_deployments, gated", [(False, False), (True, False), (True, True)])
def test_engine_step_makes_at_most_one_device_to_host_copy(bundle_path, other_bundle_path,
                                                            gated_bundle_path, two_deployments,
                                                            gated):
    """Steps with joins, scoring, stops, forcing, lag and preemption: per step at most one
    device-to-host copy (the readback) and one host-to-device copy (the staging), never a
    `.item()`/`.tolist()`/`bool()` of a device value or a tensor built from a list on a device.
    With two deployments live (hot reload), half the requests score through each bank; `gated`:
    the first bank has a shift gate (it holds, gathers, decides and flags on the device) and
    its gate alarm is raised (fed and applied on the host from values read back)."""
    core = make_core(gated_bundle_path if gated else bundle_path, max_num_seqs=4)
    other = core.load_bundle(str(other_bundle_path)).checksum if two_deployments else None
    to_device(core)
    if gated:  # the gate alarm raised: it serves gated requests as flagged ones, on the host
        alarm = core.dep.alarm.alarm
        while not alarm.alarmed:
            alarm.observe(1 / (alarm.n_cal + 1))
    sims = sync_sims(60, lambda i: {**({XARG_BUNDLE: other} if other and i % 2 else {}),
                                    # ungated (the gate flags all): the stop path runs
                                    **({"orca_shift_alpha": 0} if i == 0 else {})})
    per_step, per_join = count_copies(core), count_join_copies(core)
    run(core, sims)
    res = core.pop_results([s.name for s in sims])
    assert len(per_join) >= len(sims) and not any(per_join), per_join  # joins wait for nothing
    assert any(r["stopped_early"] for r in res.values())  # the stop path ran
    assert sum(r["steps_scored"] for r in res.values()) > 10
    worst = max(per_step, key=len)
    for log in per_step:
        d2h = [e for e in log if e.startswith("d2h")]
        h2d = [e for e in log if e.startswith("h2d")]
        assert d2h in ([], ["d2h copy_"]) and h2d in ([], ["h2d copy_"]), worst
    assert sum("d2h copy_" in log for log in per_step) > 5  # the readback is seen
    if two_deployments:
        assert {r["bundle_checksum"] for r in res.values()} == {core.dep.checksum, other}
    if gated:  # the gate decided on the device, and the host learned it from the readback
        assert any(r.get("shift_flagged") for r in res.values())


@pytest.fixture(scope="module")
def two_sided_bundle_path(tmp_path_factory):
    """The sim bundle made two-sided: a give-up score of 0.12 at every step (mu 0.2 gives up)."""
    return gated_sim_bundle(tmp_path_factory.mktemp("two") / "bundle.json", None)


@pytest.mark.parametrize("kind", ["keywords", "give_up"])
def test_keyword_and_give_up_steps_wait_no_more(keyword_bundle_path, two_sided_bundle_path,
                                                 kind):
    """The sync check above on the two paths its bundles leave out: a keyword table (sections
    merge: the A sums are read and rewritten on the device) and a give-up probe (a second bank
    scored each step, its give-up forcing the stop's first token on the device)."""
    keywords = kind == "keywords"
    core = make_core(keyword_bundle_path if keywords else two_sided_bundle_path, max_num_seqs=4)
    to_device(core)
    xa = {} if keywords else {XARG_LAM: "inf", XARG_GIVE_UP_MU: 0.2}
    sims = sync_sims(90, lambda i: xa)
    per_step, per_join = count_copies(core), count_join_copies(core)
    run(core, sims)
    res = core.pop_results([s.name for s in sims])
    assert len(per_join) >= len(sims) and not any(per_join), per_join
    if keywords:
        assert core.dep.table.keyword_re is not None
        assert sum(r["steps_scored"] for r in res.values()) >= 4
    else:
        assert sum(r["stop_reason"] == "give_up" for r in res.values()) == 3  # not the shadow
    for log in per_step:
        assert set(log) <= {"h2d copy_", "d2h copy_"} and len(log) <= 2, log
    assert sum("d2h copy_" in log for log in per_step) >= 4  # the readback is seen


def test_a_record_mode_request_ends_without_waiting_for_the_device(bundle_path):
    """A record-mode request that ends mid-step has its result built, with the unfinished
    step's embedding, when it leaves: in the engine step's path (a batch update, or the settle
    of a deferred leave at the next step). Building it makes no host tensor on the device and
    reads no device value (the embeddings reach the host when the result is fetched)."""
    core = make_core(bundle_path, max_num_seqs=4)
    to_device(core)
    per_step = count_copies(core)
    leaves: list[list[str]] = []
    core.leave = logged(core.leave, leaves)
    rng = random.Random(4)
    sims = [SimRequest(f"r{i}", rng, xa={XARG_KEY: f"r{i}", "orca_record": 1,
                                         "orca_policy": "shadow"},
                       max_tokens=30 + 7 * i, join_at=i) for i in range(3)]
    run(core, sims)
    res = core.pop_results([s.name for s in sims])
    # most ended inside a step: their results hold the unfinished step
    assert sum(len(r["step_tokens"]) == r["steps_scored"] + 1 for r in res.values()) >= 2
    assert len(leaves) == 3 and all(log == [] for log in leaves), leaves
    for log in per_step:  # the deferred leaves settle inside the step
        assert set(log) <= {"h2d copy_", "d2h copy_"} and len(log) <= 2, log


def test_a_step_that_stages_more_than_the_buffer_holds_grows_it():
    """Under speculative decoding the forcing vectors hold 1 + k values per request that stops,
    so a step may stage more than the buffers' usual room: they grow (the step failed its
    requests before), and every vector reads back as staged, in this step and the next."""
    staging = Staging(4, torch.device("cpu"), False, Fence(torch.device("cpu")))
    for step in ([[1, 2, 3], [4.5, 5, 6], []], [[7], [8, 9]]):
        staged = staging.upload(step)
        staging._fence.mark()
        assert [staged.exact(i).tolist() for i in range(len(step))] == step
    assert len(staging._dev) == 8  # twice the old room, at least the step's six


def test_a_step_that_fails_to_stage_still_marks_its_end(bundle_path, monkeypatch):
    """A step whose staging fails (here: the buffers cannot grow) fails its requests, never the
    engine, and still marks its end on the fence. Unmarked, the next step that reused its
    staging buffer took it for finished and recorded a step as done that had not been marked
    yet: that step's readback was then read without waiting for the device."""
    core = make_core(bundle_path, max_num_seqs=2)
    monkeypatch.setattr(core.device_step.staging, "_grow", lambda n: 1 / 0)
    plan_step, steps = engine.plan_step, [0]

    def oversized_once(entries, n_rows, stats):
        plan = plan_step(entries, n_rows, stats)
        steps[0] += 1
        if steps[0] == 5:
            plan.forced_rows += [0] * core.device_step.staging._dev.numel()
        return plan

    monkeypatch.setattr(engine, "plan_step", oversized_once)
    fence, wait = core.device_step.fence, core.device_step.fence.wait
    claimed: list[tuple[int, int]] = []  # (steps known done, steps marked) after each wait

    def checked_wait(step: int) -> None:
        wait(step)
        claimed.append((fence._done, fence.marked))

    fence.wait = checked_wait
    rng = random.Random(0)
    sims = [SimRequest(n, rng, xa={XARG_KEY: n}, max_tokens=20, join_at=0) for n in "ab"]
    run(core, sims)
    assert "internal error" in core.pop_results(["a"])["a"]["error"]
    assert len(claimed) > 10 and all(done <= marked for done, marked in claimed), claimed


# -- hot reload: several deployments live at once ---------------------------------------------------
def test_hot_reload_mixes_deployments_in_one_step_and_frees_the_old_one(bundle_path,
                                                                       other_bundle_path):
    """Requests of the old bundle keep its probe to their end while new ones (named by checksum,
    or naming none once the new bundle is current) run the new probe in the same steps; each
    request's scores equal the offline replay of its own probe. The old deployment is dropped
    when its last request leaves, not before."""
    rng = random.Random(11)
    core = make_core(bundle_path, max_num_seqs=8)
    old = core.dep.checksum
    reload_at = 12
    sims = []
    for i in range(8):
        late = i >= 4  # joins after the reload
        xa = {XARG_KEY: f"r{i}", "orca_policy": ["stop", "answer", "shadow"][i % 3]}
        if i == 5:
            xa[XARG_BUNDLE] = "will-be-set"  # names the new bundle explicitly
        elif not late:
            xa[XARG_BUNDLE] = old
        sims.append(SimRequest(f"r{i}", rng, xa=xa, max_tokens=rng.randrange(50, 90),
                               join_at=reload_at + 1 + i if late else i,
                               preempt_at=8 if i in (1, 6) else None))
    seen: dict[str, list] = {}

    def reload(t: int) -> None:
        if t == reload_at:
            new = core.load_bundle(str(other_bundle_path)).checksum
            assert new != old and core.dep.checksum == old  # staged, not current yet
            sims[5].xa[XARG_BUNDLE] = new
            core.use_bundle(new)
            assert core.retire_bundles() == [old, new]  # old requests still run on it
        seen.setdefault("deps", []).append(len(core.deps))

    run(core, sims, seed=11, on_step=reload)
    new = core.dep.checksum
    assert seen["deps"][reload_at - 1] == 1 and 2 in seen["deps"][reload_at:]
    assert list(core.deps) == [new]  # the old one went with its last request
    res = core.pop_results([s.name for s in sims])
    probes = {old: sim_probe(1), new: sim_probe(7)}
    for i, s in enumerate(sims):
        r = res[s.name]
        assert "error" not in r, r.get("error")
        want = new if i >= 4 else old
        assert r["bundle_checksum"] == want, s.name
        sm, _ = reference(core.dep.table, s, probes[want], len(s.out) - 1)
        assert r["steps_scored"] > 0
        assert r["scores"] == pytest.approx(sm[:r["steps_scored"]], abs=1e-5), s.name
    # the two probes really differ on these requests (else the test proves nothing)
    s0 = sims[0]
    a, _ = reference(core.dep.table, s0, probes[old], len(s0.out) - 1)
    b, _ = reference(core.dep.table, s0, probes[new], len(s0.out) - 1)
    assert a != pytest.approx(b, abs=1e-3)


def test_refused_bundles_leave_the_running_deployment(bundle_path, tmp_path_factory):
    core = make_core(bundle_path)
    before = dict(core.deps)
    wrong_model = sim_bundle(tmp_path_factory, seed=3, hidden=DIM + 1)
    with pytest.raises(BundleError, match="hidden size"):
        core.load_bundle(str(wrong_model))
    edited = tmp_path_factory.mktemp("edited") / "bundle.json"
    data = json.loads(other := sim_bundle(tmp_path_factory, seed=4).read_text())
    data["window"] += 1
    edited.write_text(json.dumps(data))
    with pytest.raises(BundleError, match="checksum"):
        core.load_bundle(str(edited))
    with pytest.raises(BundleError, match="normalises"):
        core.load_bundle(str(sim_bundle(tmp_path_factory, seed=5, normalization="step-l2")))
    with pytest.raises(BundleError, match="not loaded"):
        core.use_bundle("0" * 64)
    assert core.deps == before and core.dep is before[core.dep.checksum]
    # the same bundle again is the same deployment, and unknown files are one-line errors
    assert core.load_bundle(str(bundle_path)) is core.dep
    with pytest.raises(BundleError):
        core.load_bundle(str(other) + ".missing")


def test_a_request_naming_an_unloaded_bundle_runs_without_early_stopping(bundle_path):
    """lambda* of one probe is never applied to another: a request whose bundle is gone gets
    an error in its result instead of the current probe."""
    core = make_core(bundle_path)
    req = core.join("g", core.settings({XARG_KEY: "g", XARG_BUNDLE: "f" * 64, XARG_LAM: 0.1}),
                    prompt=PROMPT, n_out=0, index=0, max_tokens=9, eos=None, ignore_eos=False,
                    structured=False)
    assert req is not None and not req.enabled
    core.leave(req, True)
    r = core.pop_results(["g"])["g"]
    assert "not loaded" in r["error"] and r["bundle_checksum"] is None
    assert not r["enabled"] and r["steps_scored"] == 0


def test_a_delta_outside_the_table_is_refused_as_the_server_refuses_it(bundle_path, caplog):
    """Without the server's orca_lam (a stock vLLM server) the engine cannot answer 400: it
    refuses the delta in the server's words (the bundle's), runs the request without early
    stopping, says so in the result's error and, once per delta, in the log (the only place a
    stock server's operator sees it)."""
    core = make_core(bundle_path)
    with caplog.at_level(logging.WARNING, logger="orca_serve.core"):
        for name in ("a", "b"):
            req = core.join(name, core.settings({"orca_delta": 0.3}), prompt=PROMPT, n_out=0,
                            index=0, max_tokens=20, eos=None, ignore_eos=False,
                            structured=False)
            r = req.result()
            assert not r.enabled and r.lam is None and "delta 0.3" in r.error
            assert r.error.endswith("it ran without early stopping")
    warned = [r for r in caplog.records if "0.3" in r.getMessage()]
    assert len(warned) == 1 and "available deltas: 0.05, 0.1" in warned[0].getMessage()



def test_a_score_a_float32_rounding_of_lambda_below_it_does_not_stop(bundle_path):
    """The engine scores in float32 and the calibration compares those scores with lambda* in
    float64 (orca_method.risk.stop_indices). The engine compares them the same way: a lambda*
    whose nearest float32 is a step's score, but which lies above it, does not stop there."""
    sims, res = run_requests(bundle_path, {"s": {"orca_policy": "shadow"}})
    scores = res["s"]["scores"]
    top = max(scores)
    assert np.float32(top) == top  # read back from float32
    above = top + float(np.spacing(np.float32(top))) / 4  # rounds to `top` in float32
    assert np.float32(above) == top and above > top
    # one request a run: each then gets the first request's stream, and the scores above
    at, above = (run_requests(bundle_path, {"s": {"orca_policy": "stop", XARG_LAM: lam}})[1]["s"]
                 for lam in (top, above))
    assert at["stopped_early"] and at["stop_step"] == scores.index(top) + 1
    assert not above["stopped_early"] and above["scores"] == scores


def test_open_reasoning_tokens_of_a_prompt(bundle_path):
    """What vLLM's thinking budget has counted before the output starts: tokens after an open
    <think> (the server tells vLLM's budget stop from the model's own end by it)."""
    table = make_core(bundle_path).dep.table
    t, e = ID["<think>"], ID["</think>"]
    assert open_reasoning_tokens(table, PROMPT) == 0
    assert open_reasoning_tokens(table, [ID["a"], t, ID["\n"], ID["b"]]) == 2
    assert open_reasoning_tokens(table, [t, ID["a"], e, ID["b"]]) == 0  # closed in the prompt
