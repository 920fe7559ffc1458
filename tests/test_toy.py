"""Fast tests of the toy task and of the shipped demo models (orca_serve/demo/model, and the
long one's checksums and generation config)."""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from pathlib import Path

import pytest

import orca_serve
from orca_demo.toy.tasks import (
    FAMILIES,
    FORCE_SUFFIX,
    STEP_DELIMITER,
    check_answer,
    extract_answer,
    make_problem,
    paragraph_candidate,
    trace,
    trace_paragraphs,
    trace_stats,
    write_prompts,
)
from orca_demo.toy.train import (
    CHAT_TEMPLATE,
    EOS,
    SAMPLING_TEMPERATURE,
    advise_sampling,
    make_example,
    render_prompt,
)

MODEL_DIR = Path(orca_serve.__file__).parent / "demo" / "model"
LONG_MODEL_DIR = MODEL_DIR.parent / "long" / "model"
SAMPLE_TEXTS = [
    render_prompt("Find the integer x with 7*x + 3 = 52.") + "<think>\nTry x = 5: 7*5 = 35, 35 + 3 = 38.",
    "Try x = 7: 7*7 = 49, 49 + 3 = 52. That matches.\n\nCheck: 7*7 = 49.\n</think>\nThe answer is \\boxed{7}.",
    "Solve for x: 16 = 9*x - 2." + FORCE_SUFFIX + "2}" + EOS,
    "Unseen text: héllo  wörld\n\n\n\t12345 don't 日本",
]


@pytest.mark.parametrize("family", FAMILIES)
def test_problems_in_range_and_consistent(family: str) -> None:
    rng = random.Random(0)
    for _ in range(2000):
        p = make_problem(rng, family)
        assert 2 <= p.a <= 9 and 1 <= p.x <= 9 and 0 <= p.b <= 20
        assert p.value(p.x) == p.c and p.c >= 0
        assert p.question.count(str(p.c)) >= 1


def test_unknown_family_rejected() -> None:
    with pytest.raises(ValueError):
        make_problem(random.Random(0), "ood")


@pytest.mark.parametrize("family", FAMILIES)
def test_traces_walk_to_x_then_check(family: str) -> None:
    """Tries step by 1 from within 5 of x; slips are followed by a Wait; 0-4 checks at the end."""
    rng = random.Random(1)
    for _ in range(2000):
        p = make_problem(rng, family)
        paras = trace_paragraphs(p, rng)
        tries = [paragraph_candidate(s) for s in paras if s.startswith("Try")]
        assert abs(tries[0] - p.x) <= 5 and tries[-1] == p.x
        assert all(abs(b - a) == 1 for a, b in itertools.pairwise(tries))
        for i, s in enumerate(paras):
            if s.startswith("Wait"):
                assert paras[i - 1].startswith("Try") and paragraph_candidate(paras[i - 1]) == paragraph_candidate(s)
        stats = trace_stats(trace(p, random.Random(2)), p)
        assert stats.well_formed and stats.correct and 0 <= stats.redundant <= 4


def test_answer_extraction() -> None:
    p = make_problem(random.Random(3), "in-dist")
    assert extract_answer("The answer is \\boxed{7}.") == 7
    assert extract_answer("\\boxed{3} then \\boxed{ -4 }") == -4
    assert extract_answer("\\boxed{" + "12}.") == 12  # forced continuation
    assert extract_answer("no answer") is None and extract_answer("\\boxed{x}") is None
    assert check_answer(f"</think>\nThe answer is \\boxed{{{p.x}}}.", p)
    assert not check_answer(f"The answer is \\boxed{{{p.x + 1}}}.", p)


def test_malformed_trace_detected() -> None:
    p = make_problem(random.Random(4), "in-dist")
    good = trace(p, random.Random(5))
    assert not trace_stats(good.replace("</think>", ""), p).well_formed
    assert not trace_stats(good.replace("Try x", "Guess x", 1), p).well_formed
    assert not trace_stats(good + " More.", p).well_formed


def test_prompts_jsonl(tmp_path: Path) -> None:
    out = tmp_path / "p.jsonl"
    write_prompts(out, "shifted", 20, seed=1)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 20 and len({r["id"] for r in rows}) == 20
    for r in rows:
        assert r["family"] == "shifted" and r["messages"][0]["role"] == "user"
        assert r["messages"][0]["content"].startswith("Solve for x:") and r["answer"] == str(r["problem"]["x"])
    write_prompts(tmp_path / "q.jsonl", "shifted", 20, seed=1)
    assert (tmp_path / "q.jsonl").read_text() == out.read_text()


@pytest.mark.parametrize("model_dir", [MODEL_DIR, LONG_MODEL_DIR], ids=["toy", "long"])
def test_shipped_model_checksums(model_dir: Path) -> None:
    lines = (model_dir / "SHA256SUMS").read_text().splitlines()
    names = {line.split("  ", 1)[1] for line in lines}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    for line in lines:
        digest, name = line.split("  ", 1)
        assert hashlib.sha256((model_dir / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.parametrize("model_dir", [MODEL_DIR, LONG_MODEL_DIR], ids=["toy", "long"])
def test_the_shipped_sampling_is_what_the_trainer_writes(model_dir: Path, tmp_path: Path) -> None:
    """The calibration's temperature came into the shipped generation configs through the
    trainer's own `advise_sampling` (tests/test_demo.py checks it is the jobs'), byte for byte,
    and nothing else of them changed: what it writes on the file as training saved it."""
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert (gen.pop("do_sample"), gen.pop("temperature")) == (True, SAMPLING_TEMPERATURE)
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    advise_sampling(tmp_path)
    assert (tmp_path / "generation_config.json").read_bytes() == (
        model_dir / "generation_config.json").read_bytes()


def test_tokenizer_loaders_agree() -> None:
    """The spike's trap: AutoTokenizer loads a qwen2 tokenizer as Qwen2Tokenizer."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    raw = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(MODEL_DIR)
    fast = PreTrainedTokenizerFast(tokenizer_file=str(MODEL_DIR / "tokenizer.json"))
    for text in SAMPLE_TEXTS:
        assert auto(text)["input_ids"] == fast(text)["input_ids"] == raw.encode(text).ids, text
    for token in ("<think>", "</think>", STEP_DELIMITER, "<|user|>", "<|assistant|>", EOS):
        assert len(raw.encode(token).ids) == 1, token
    assert auto.eos_token == EOS and auto.chat_template == CHAT_TEMPLATE
    chat = [{"role": "user", "content": "Q?"}]
    # the served template opens the reasoning (docs/SERVER.md); training texts write `<think>`
    # after render_prompt, so from `<think>` on a served prompt's token ids are the trained ones
    served = auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert served == render_prompt("Q?") + "<think>"
    trained = auto(render_prompt("Q?") + "<think>\nTry x")["input_ids"]
    assert trained[:len(auto(served)["input_ids"])] == auto(served)["input_ids"]


def test_forced_examples_train_only_the_answer() -> None:
    from tokenizers import Tokenizer

    from orca_demo.toy.train import encode

    raw = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    rng = random.Random(6)
    forced = [ex for ex in (make_example(rng) for _ in range(200)) if not ex[0].endswith(EOS)]
    assert 30 <= len(forced) <= 90
    for text, loss_from, skip in forced:
        assert skip is None
        ids, weights = encode(raw, text, loss_from)
        trained = raw.decode([i for i, w in zip(ids, weights) if w > 0])
        assert trained == text[loss_from:] and trained.endswith("}")


def test_verdicts_are_upweighted() -> None:
    from tokenizers import Tokenizer

    from orca_demo.toy.train import DECISION_WEIGHT, encode

    raw = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    text = render_prompt("Q") + "<think>\nTry x = 2: 3*2 = 6, 6 + 1 = 7, want 7. That matches.\n</think>"
    ids, weights = encode(raw, text, len(render_prompt("Q")))
    heavy = raw.decode([i for i, w in zip(ids, weights) if w == DECISION_WEIGHT])
    assert heavy.strip() == "That matches"


def test_packing_skips_examples_longer_than_a_row() -> None:
    """An over-long example once blocked the stream: every later row was empty (NaN loss)."""
    from tokenizers import Tokenizer

    from orca_demo.toy.train import packed_batch

    raw = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    rng = random.Random(0)
    for _ in range(5):
        batch = packed_batch(raw, rng, rows=4, seq_len=200, pad_id=0)
        assert ((batch["weights"] > 0).sum(dim=1) > 0).all()
        assert (batch["position_ids"][:, 0] == 0).all()


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval(), AutoTokenizer.from_pretrained(MODEL_DIR)


def test_greedy_generation_well_formed_and_mostly_right(hf_model) -> None:
    """The shipped model solves 97% of sampled problems (RESULTS.md); greedy, 8 of 8 expected,
    7 required, so a retrain that loses the arithmetic fails here. One left-padded batch: eight
    sequential generations made this the slowest test of the fast tier."""
    import torch

    model, tok = hf_model
    rng = random.Random(11)
    problems = [make_problem(rng, "in-dist") for _ in range(8)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": p.question}],
                                       add_generation_prompt=True, tokenize=False)
               for p in problems]
    tok.padding_side = "left"
    batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=600, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    right = 0
    for p, row in zip(problems, out[:, batch["input_ids"].shape[1]:]):
        ids = row.tolist()
        assert tok.eos_token_id in ids, tok.decode(row)
        text = tok.decode(ids[:ids.index(tok.eos_token_id) + 1], skip_special_tokens=True)
        stats = trace_stats(text, p)
        assert stats.well_formed, text
        right += stats.correct
    assert right >= 7
