"""Evaluate the toy reasoning model in vLLM (in-process, eager, float32), as shipped.

    python -m orca_demo.toy.evaluate --model orca_serve/demo/model --n 300 --out eval.json

Reports, per task family, well-formed %, correct %, mean paragraphs per trace and mean
redundant checks after the right try (sampled at temperature 0.7 through `llm.chat`), then
answer forcing at every step boundary of some in-distribution traces (token level, greedy,
4 tokens) with three suffixes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path
from statistics import mean

from tokenizers import Tokenizer

from orca_demo.toy.tasks import (
    ALT_FORCE_SUFFIX,
    FAMILIES,
    FORCE_SUFFIX,
    STEP_DELIMITER,
    THINK_CLOSE,
    THINK_OPEN,
    Problem,
    extract_answer,
    make_problem,
    paragraph_candidate,
    trace_stats,
)
from orca_demo.toy.train import render_prompt

# The trained suffix, the alternative one, and orca_calibrate/collect.py's default (never trained on).
FORCING_SUFFIXES = (FORCE_SUFFIX, ALT_FORCE_SUFFIX, "\n</think>\n\nThe answer is \\boxed{")


def load_llm(model_dir: Path, max_model_len: int | None = None):
    """The fast test configuration of docs/VLLM-CPU.md."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM  # deferred: vllm (the model is loaded once, in main)

    return LLM(model=str(model_dir), dtype="float32", enforce_eager=True, seed=0, max_model_len=max_model_len)


def tokenizer_agrees(llm, model_dir: Path, questions: list[str]) -> bool:
    """vLLM's tokenizer must give the raw tokenizer.json ids (the spike's trap)."""
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vt = llm.get_tokenizer()
    texts = [render_prompt(q) + THINK_OPEN + "\nTry x = 5: 7*5 = 35.\n\n" + FORCE_SUFFIX for q in questions]
    return all(vt.encode(t) == raw.encode(t).ids for t in texts)


Sample = tuple[Problem, str, list[int], list[int]]  # problem, text, prompt ids, generated ids


def sample_family(llm, family: str, n: int, seed: int) -> tuple[dict, list[Sample]]:
    """Sample one completion per fresh problem; return summary figures and the completions."""
    from vllm import SamplingParams  # deferred: vllm (the model is loaded once, in main)

    rng = random.Random(f"eval:{family}:{seed}")
    problems = [make_problem(rng, family) for _ in range(n)]
    chats = [[{"role": "user", "content": p.question}] for p in problems]
    # No per-request seed: vLLM's CPU sampler rejects it ("CPU Generator does not use offset");
    # the engine seed (load_llm) makes runs repeatable instead.
    params = SamplingParams(temperature=0.7, max_tokens=900)
    outs = llm.chat(chats, params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    stats = [trace_stats(t, p) for t, p in zip(texts, problems)]
    redundant = [s.redundant for s in stats if s.redundant is not None]
    summary = {
        "family": family,
        "n": n,
        "well_formed_pct": 100 * mean(s.well_formed for s in stats),
        "correct_pct": 100 * mean(s.correct for s in stats),
        "mean_paragraphs": mean(s.paragraphs for s in stats),
        "mean_redundant_checks": mean(redundant) if redundant else None,
        "with_wait_pct": 100 * mean("\n\nWait" in t for t in texts),
        "finished_pct": 100 * mean(o.outputs[0].finish_reason == "stop" for o in outs),
        "mean_tokens": mean(len(o.outputs[0].token_ids) for o in outs),
        "max_tokens": max(len(o.outputs[0].token_ids) for o in outs),
    }
    samples = [(p, t, list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for p, t, o in zip(problems, texts, outs)]
    return summary, samples


def step_ends(gen_ids: list[int], delimiter_id: int, close_id: int) -> list[int]:
    """Exclusive ends of the reasoning steps in generated ids, as the collector cuts them:
    after every delimiter token before `</think>`, and at `</think>` for the last step."""
    close = gen_ids.index(close_id)
    return [i + 1 for i in range(close) if gen_ids[i] == delimiter_id] + [close]


def forcing_rows(sample: Sample, delimiter_id: int, close_id: int) -> list[tuple[list[int], int, bool]]:
    """(prefix ids at a step boundary, last tried candidate, right try already seen) per step."""
    problem, text, prompt_ids, gen_ids = sample
    paras = text.split(THINK_CLOSE)[0].removeprefix(THINK_OPEN).strip("\n").split(STEP_DELIMITER)
    rows, seen = [], False
    for para, end in zip(paras, step_ends(gen_ids, delimiter_id, close_id), strict=True):
        seen = seen or (paragraph_candidate(para) == problem.x and para.endswith("That matches."))
        rows.append((prompt_ids + gen_ids[:end], paragraph_candidate(para), seen))
    return rows


def forcing_check(llm, samples: list[Sample], suffix: str) -> dict:
    """Greedy 4-token continuation after prefix + suffix ids at every step of well-formed traces
    (token level, like orca_calibrate/collect.py)."""
    from vllm import SamplingParams  # deferred: vllm (the model is loaded once, in main)
    from vllm.inputs import TokensPrompt  # deferred: vllm

    tok = llm.get_tokenizer()
    delimiter_id, close_id = tok.convert_tokens_to_ids([STEP_DELIMITER, THINK_CLOSE])
    suffix_ids = tok.encode(suffix, add_special_tokens=False)
    rows = [
        (ids, cand, seen, s[0])
        for s in samples
        if trace_stats(s[1], s[0]).well_formed
        for ids, cand, seen in forcing_rows(s, delimiter_id, close_id)
    ]
    prompts = [TokensPrompt(prompt_token_ids=ids + suffix_ids) for ids, *_ in rows]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    answers = [extract_answer("\\boxed{" + o.outputs[0].text) for o in outs]
    before = [a == p.x for a, (_, _, seen, p) in zip(answers, rows) if not seen]
    after = [a == p.x for a, (_, _, seen, p) in zip(answers, rows) if seen]
    return {
        "suffix": suffix,
        "boundaries": len(rows),
        "equals_last_candidate_pct": 100 * mean(a == r[1] for a, r in zip(answers, rows)),
        "correct_before_right_try_pct": 100 * mean(before) if before else None,
        "correct_at_or_after_right_try_pct": 100 * mean(after) if after else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=Path("orca_serve/demo/model"))
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--forcing-traces", type=int, default=50,
                    help="in-distribution traces the forcing check replays (0: no check)")
    ap.add_argument("--out", type=Path, default=None, help="also write the report here (vLLM logs to stdout)")
    args = ap.parse_args()
    if args.forcing_traces < 0:  # a negative slice would take all but the last few
        ap.error(f"--forcing-traces must be >= 0, got {args.forcing_traces}")
    llm = load_llm(args.model)
    rng = random.Random(args.seed)
    report = {"tokenizer_ids_match_vllm": tokenizer_agrees(llm, args.model, [make_problem(rng, f).question for f in FAMILIES])}
    samples = {}
    for family in FAMILIES:
        report[family], samples[family] = sample_family(llm, family, args.n, args.seed)
    head = samples["in-dist"][: args.forcing_traces]
    report["forcing"] = [forcing_check(llm, head, s) for s in FORCING_SUFFIXES] if head else []
    emit(report, args.out)


def emit(report: dict, out: Path | None) -> None:
    """Print a report as JSON, and write it to `out` too (vLLM logs to stdout as well)."""
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        out.write_text(text + "\n")


if __name__ == "__main__":
    main()
