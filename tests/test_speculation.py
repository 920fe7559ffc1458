"""Speculative decoding in the core (orca_serve/core/speculation.py), driven by a fake engine.

The fake engine of test_core, with drafts: every step a request proposes k draft tokens, each
right (the token the target would sample) with some probability, else a wrong one (often a
step delimiter, so that boundaries appear inside rejected drafts) whose hidden row is noise.
Its k + 1 logits rows go through `DraftSteps` as the V1 adapter sends them; then a greedy
rejection sampler keeps the drafts that equal the target's (possibly forced) token of the row
before, and adds the target's token at the first mismatch (or the bonus token).

The same requests run without drafts through the plain fake engine: scores, stop steps and
forced text must be the same, each forced token must be an output token, and a stop may land
at most k tokens after the plain run's.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import pytest
import torch

from orca_serve.settings.contract import DEFAULTS, XARG_GIVE_UP_MU, XARG_KEY, XARG_LAM
from orca_serve.core.speculation import DraftEntry, DraftSteps
from tests.core_sim import (
    DIM,
    EOS,
    FORCE,
    ID,
    POLICY_XA,
    TOKENS,
    DeviceTensor,
    SimRequest,
    gated_sim_bundle,
    join_due,
    logged,
    make_core,
    reference,
    run,
    sim_probe,
    to_device,
)

WRONG = [ID["\n\n"], ID[".\n\n"], ID["a"], ID["x"]]
Drafter = Callable[[SimRequest, int], list[int]]  # (request, output length n) -> its drafts


def run_speculative(core, sims: list[SimRequest], k: int, p_right: float, seed: int,
                    steps: int = 400, drafter: Drafter | None = None) -> int:
    """The fake engine with k drafts per request and step, and preemptions (a request leaves
    for two steps once its output reaches `preempt_at`); returns the drafts accepted.
    `drafter`: proposes the drafts of a request at output length n instead (k, p_right
    unused)."""
    rng = random.Random(seed)
    drafts = DraftSteps(core)
    batch: list[SimRequest] = []
    for t in range(steps):
        join_due(core, sims, batch, t)  # drafts accepted before a preemption still count
        for s in list(batch):
            if s.out and (s.out[-1] == EOS or len(s.out) >= s.max_tokens):
                drafts.finish(s.req, s.out)
                core.leave(s.req, True)
                batch.remove(s)
                s.done = True
            elif s.preempt_at is not None and len(s.out) >= s.preempt_at:
                core.leave(s.req, False)
                batch.remove(s)
                s.preempt_at, s.back_at = None, t + 2
        if not batch and all(s.done for s in sims):
            break
        rng.shuffle(batch)
        entries, proposals = [], []
        for s in batch:
            n = len(s.out)
            # a draft model that is right with probability p_right (it knows the forced text and
            # the greedy answer too)
            ks = 0 if n == 0 or drafter is not None else k
            props = [] if drafter is None else drafter(s, n)
            for i in range(ks):  # draft i + 1 sits at output position n + i
                want = s.req.plan.get(n + i, int(s.logits[n + i].argmax())
                                      if n + i in s.req.greedy else s.stream[n + i])
                props.append(want if rng.random() < p_right
                             else rng.choice([w for w in WRONG if w != want]))
            entries.append((s.req, 1 + len(props), s.out))
            proposals.append((s, props))
        # rows: row 0 of a request is its last token; a draft's row is its true state only
        # while every draft up to it is the stream's token, else noise
        hidden = []
        for s, props in proposals:
            n = len(s.out)
            hidden.append(s.hidden[n - 1] if n else torch.randn(DIM))
            ok = True
            for i, tok in enumerate(props):
                ok = ok and tok == s.stream[n + i]
                hidden.append(s.hidden[n + i] if ok else torch.randn(DIM))
        entries = [DraftEntry(req, sum(1 + len(p) for _, p in proposals[:j]), c, out)
                   for j, (req, c, out) in enumerate(entries)]
        h = torch.stack(hidden) if hidden else torch.zeros(0, DIM)
        logits = torch.stack([s.logits[len(s.out) + i] for s, props in proposals
                              for i in range(1 + len(props))]) if proposals else \
            torch.zeros(0, len(TOKENS))
        drafts.step(entries, h, logits)
        for (_, first, count, _), (s, props) in zip(entries, proposals):
            n = len(s.out)
            # the target's token per row: the forced one, else the stream's
            target = [int(torch.isfinite(r).nonzero()[0]) if int(torch.isfinite(r).sum()) == 1
                      else s.stream[n + i] for i, r in enumerate(logits[first:first + count])]
            new = []
            for i, tok in enumerate(props):
                if tok != target[i]:
                    break
                new.append(tok)
            new.append(target[len(new)])
            for tok in new:
                if s.out and (s.out[-1] == EOS or len(s.out) >= s.max_tokens):
                    break
                s.out.append(tok)
    core.settle()
    return core.stats["drafts_accepted"]


def draft_sims(seed: int) -> list[SimRequest]:
    """Nine requests, three per policy, joining in the first six steps, every second one
    preempted once (also the draft scenario of scripts/cuda_sync_check.py)."""
    rng = random.Random(seed)
    sims = []
    for i in range(9):
        policy = ["stop", "answer", "shadow"][i % 3]
        sims.append(SimRequest(f"r{i}", rng, xa={XARG_KEY: f"r{i}", **POLICY_XA[policy]},
                               max_tokens=rng.randrange(40, 90), join_at=rng.randrange(0, 6),
                               preempt_at=rng.randrange(5, 30) if i % 2 else None))
    return sims


def _first_forced(s: SimRequest, forced: list[int]) -> int | None:
    """Output position where the forced text starts (None: nothing was forced)."""
    if not forced:
        return None
    want = forced[:len(FORCE)] if forced[0] != EOS else [EOS]
    return next(i for i in range(len(s.out)) if s.out[i:i + len(want)] == want)


@pytest.mark.parametrize(("seed", "k", "p_right"), [(0, 3, 0.7), (1, 3, 0.9), (2, 5, 0.5),
                                                    (3, 1, 0.8), (4, 3, 1.0)])
def test_drafts_give_the_plain_runs_steps_scores_and_stops(bundle_path, seed,
                                                           k, p_right):
    plain_sims, spec_sims = draft_sims(seed), draft_sims(seed)
    plain, spec = make_core(bundle_path, max_num_seqs=9), make_core(bundle_path, max_num_seqs=9)
    run(plain, plain_sims, seed)
    accepted = run_speculative(spec, spec_sims, k, p_right, seed)
    assert accepted >= 50, "too few accepted drafts: the test would prove little"
    names = [s.name for s in plain_sims]
    want, got = plain.pop_results(names), spec.pop_results(names)
    table, probe = spec.dep.table, sim_probe()
    stops = late = 0
    for a, b in zip(plain_sims, spec_sims):
        ra, rb = want[a.name], got[a.name]
        assert "error" not in rb, rb.get("error")
        for f in ("steps_scored", "stop_step", "would_stop_step", "stopped_early",
                  "stop_reason"):
            assert ra[f] == rb[f], (a.name, f)
        assert rb["scores"] == pytest.approx(ra["scores"], abs=1e-5)
        # the scores are those of the offline replay of the tokens the speculative run output
        sm, _ = reference(table, b, probe, len(b.out) - 1)
        assert rb["scores"] == pytest.approx(sm[:rb["steps_scored"]], abs=1e-5)
        pa, pb = _first_forced(a, ra["forced_tokens"]), _first_forced(b, rb["forced_tokens"])
        if pa is None:
            assert pb is None and a.out == b.out, a.name
            continue
        stops += 1
        # the same tokens up to the plain run's stop; the forced text where it is forced, whole
        assert b.out[:pa] == a.out[:pa] and pa <= pb <= pa + k, (a.name, pa, pb)
        late += pb > pa
        forced = rb["forced_tokens"]
        if forced != ra["forced_tokens"]:  # a late answer whose EOS no longer fits max_tokens
            assert pb > pa and forced == ra["forced_tokens"][:-1]
            assert pb + len(forced) + DEFAULTS.answer_budget >= b.max_tokens
        n = len(forced) - (forced[-1] == EOS)
        assert b.out[pb:pb + n] == forced[:n]
        assert (b.out[-1] == EOS) == (forced[-1] == EOS)
        # the answer after the forced text is greedy: each token its row's argmax
        answer = range(pb + n, len(b.out) - (b.out[-1] == EOS))
        assert forced[0] == EOS or [b.out[q] for q in answer] == [
            int(b.logits[q].argmax()) for q in answer], (a.name, pb)
    assert stops >= 3, "no stops to compare: the test would prove little"
    if p_right == 1.0:  # every draft accepted: steps end inside the accepted drafts
        assert late >= 1, "no stop landed late: the replay-then-force path went untested"
    assert spec.pool.free_count == spec.capacity
    assert spec.get_stats()["resumed"] >= 3  # preempted requests came back with their drafts


def test_a_boundary_inside_rejected_drafts_does_not_count(bundle_path):
    """Every draft wrong and a delimiter: nothing but the accepted tokens is segmented."""
    plain_sims, spec_sims = draft_sims(7), draft_sims(7)
    plain, spec = make_core(bundle_path, max_num_seqs=9), make_core(bundle_path, max_num_seqs=9)
    run(plain, plain_sims, 7)
    assert run_speculative(spec, spec_sims, 4, 0.0, 7) == 0
    names = [s.name for s in plain_sims]
    want, got = plain.pop_results(names), spec.pop_results(names)
    for s in plain_sims:
        for f in ("steps_scored", "stop_step", "scores", "forced_tokens", "reasoning_tokens"):
            assert want[s.name][f] == got[s.name][f], (s.name, f)
    assert [s.out for s in plain_sims] == [s.out for s in spec_sims]


K_AT_STOP = 5  # drafts at the stop: past the forced text (3 tokens), into what follows it


@pytest.mark.parametrize(("two_sided", "xa", "cfg"), [
    (False, {"orca_policy": "answer", "orca_answer_budget": 4}, {}),
    (True, {XARG_LAM: "inf", XARG_GIVE_UP_MU: 0.2},  # gives up at its first step
     {"defaults": {"give_up_policy": "message", "give_up_message": "abc"}}),
], ids=["answer", "give-up-message"])
def test_drafts_of_the_forced_text_at_a_stop_on_row_0_give_the_plain_output(
        bundle_path, tmp_path, two_sided, xa, cfg):
    """A stop (or a give-up) decided on the device on row 0's token, in a step whose drafts are
    the plain run's next tokens: the forced text (an n-gram drafter proposes `</think>` text it
    saw in the prompt), then the greedy answer (or the give-up's message). The host learns of
    the stop after the step, so the device forces the plan on all the request's rows: every
    draft is accepted and the output is the plain run's. Before, the rows past the forced text
    were left to the request's sampling (here: its stream, not the answer's argmax) or got the
    stop's plan under a give-up."""
    path = gated_sim_bundle(tmp_path / "bundle.json", None) if two_sided else bundle_path

    def sim() -> SimRequest:
        return SimRequest("r", random.Random(0), xa={XARG_KEY: "r", **xa}, max_tokens=60,
                          join_at=0)

    plain, spec = sim(), sim()
    plain_core, spec_core = make_core(path, **cfg), make_core(path, **cfg)
    run(plain_core, [plain])
    want = plain_core.pop_results(["r"])["r"]
    pa = _first_forced(plain, want["forced_tokens"])
    assert pa is not None and len(plain.out) > pa + K_AT_STOP  # the bonus row is answer too
    accepted = run_speculative(spec_core, [spec], 0, 0.0, 0, drafter=lambda s, n: (
        plain.out[n:n + K_AT_STOP] if n == pa else []))
    got = spec_core.pop_results(["r"])["r"]
    assert "error" not in got, got.get("error")
    assert spec.out == plain.out, (pa, plain.out[pa:], spec.out[pa:])
    assert accepted == K_AT_STOP
    for f in ("stop_step", "stop_reason", "give_up_step", "forced_tokens"):
        assert got.get(f) == want.get(f), f


def test_a_step_with_drafts_never_waits_for_the_device(bundle_path, monkeypatch):
    """The core's sync check (tests/core_sim.py) on engine steps with drafts: parking the draft
    rows and replaying the accepted ones builds no host tensor on the device and reads no device
    value; each core call of the step stages in one copy and reads back in at most one (the
    replay's documented wait is that readback: docs/PLUGIN.md, "Speculative decoding")."""
    core = make_core(bundle_path, max_num_seqs=9)
    to_device(core)
    per_step: list[list[str]] = []
    step = logged(DraftSteps.step, per_step)
    monkeypatch.setattr(DraftSteps, "step", lambda self, entries, hidden, logits: step(
        self, entries, hidden.as_subclass(DeviceTensor), logits.as_subclass(DeviceTensor)))
    assert run_speculative(core, draft_sims(0), 3, 0.7, 0) >= 50
    assert any(log.count("h2d copy_") > 1 for log in per_step)  # accepted drafts were replayed
    for log in per_step:
        assert set(log) <= {"h2d copy_", "d2h copy_"}, log
        assert log.count("d2h copy_") <= log.count("h2d copy_"), log


def test_speculation_pins_the_v1_runner_or_refuses_model_runner_v2(monkeypatch):
    """The draft-row adapter is the V1 one: a speculative config pins VLLM_USE_V2_MODEL_RUNNER=0;
    asking for Model Runner V2 with it is refused in one line."""
    from orca_serve.vllm_plugin.config import ENV_V2_RUNNER, pin_runner_for_speculation

    monkeypatch.delenv(ENV_V2_RUNNER, raising=False)
    pin_runner_for_speculation(None)
    assert ENV_V2_RUNNER not in os.environ
    pin_runner_for_speculation('{"method": "ngram", "num_speculative_tokens": 3}')
    assert os.environ[ENV_V2_RUNNER] == "0"
    monkeypatch.setenv(ENV_V2_RUNNER, "1")
    with pytest.raises(RuntimeError, match="V1 model runner only") as e:
        pin_runner_for_speculation({"method": "draft_model", "model": "m"})
    assert "\n" not in str(e.value)
