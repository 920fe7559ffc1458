"""Trace statistics of the long reasoner in vLLM (in-process, eager, float32), per task family.

    python -m orca_demo.long.evaluate --model runs/long/model --n 300 --out eval.json
    python -m orca_demo.long.evaluate --trajectories runs/long/trajectories [DIR ...]

The second form reads the same statistics off collected trajectory sets (`orca-calibrate
collect`), per family, where "right" is the forced answer of a step (the answer probes' labels)
rather than the answer a paragraph states; no model is loaded.

Per family, on fresh problems sampled at temperature 0.7 (`--temperature`): correct %, well-formed %, finished %,
steps per trace (median, p90), completion tokens (median, p90, min, max), the depth at which the
stated answer first becomes right (as a share of the trace: quartiles), the share of steps after
it (redundant), and the share of traces whose stated answer is never right. Then answer forcing
at every step boundary of some in-distribution traces: how often the forced answer is the one the
last paragraph states (so labels read off forced answers mean what the trace says).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from statistics import mean, median, quantiles

from orca_calibrate.progress import progress_bar
from orca_demo.long.tasks import FAMILIES, FORCE_SUFFIX, Problem, extract_answer, make_problem, paragraph_candidate, trace_stats
from orca_demo.toy.evaluate import emit, load_llm, step_ends, tokenizer_agrees
from orca_demo.toy.tasks import STEP_DELIMITER, THINK_CLOSE, THINK_OPEN

MAX_TOKENS = 5000


def _pct(xs: list[float], q: int) -> float:
    """The q-th percentile (inclusive method)."""
    return quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def family_report(problems: list[Problem], texts: list[str], tokens: list[int], finished: list[bool]) -> dict:
    """The trace statistics of one family's completions (see the module docstring)."""
    stats = [trace_stats(t, p) for t, p in zip(texts, problems)]
    steps = [s.paragraphs for s in stats]
    depth = [s.first_right / s.paragraphs for s in stats if s.first_right is not None]
    redundant = [s.redundant / s.paragraphs for s in stats if s.redundant is not None]
    return {
        "n": len(stats),
        "correct_pct": 100 * mean(s.correct for s in stats),
        "well_formed_pct": 100 * mean(s.well_formed for s in stats),
        "finished_pct": 100 * mean(finished),
        "steps_median": median(steps), "steps_p90": _pct(steps, 90),
        "tokens_median": median(tokens), "tokens_p90": _pct(tokens, 90),
        "tokens_min": min(tokens), "tokens_max": max(tokens),
        "first_right_depth_quartiles": [round(q, 3) for q in quantiles(depth, n=4)] if len(depth) > 1 else None,
        "redundant_share_mean": mean(redundant) if redundant else None,
        "never_right_pct": 100 * mean(s.first_right is None for s in stats),
    }


def trajectory_report(problems: list) -> dict:
    """The statistics of family_report from labelled trajectories (orca_method.trajectories
    Problem records): steps, tokens, first step whose forced answer is right, final answer."""
    steps = [p.n_steps for p in problems]
    tokens = [p.extra["completion_tokens"] for p in problems]
    first = [next((i for i, v in enumerate(p.labels["supervised"]) if v), None) for p in problems]
    depth = [f / n for f, n in zip(first, steps) if f is not None]
    redundant = [(n - f - 1) / n for f, n in zip(first, steps) if f is not None]
    return {
        "n": len(problems),
        "correct_pct": 100 * mean(bool(p.extra["final_correct"]) for p in problems),
        "finished_pct": 100 * mean(p.extra["finish_reason"] == "stop" for p in problems),
        "steps_median": median(steps), "steps_p90": _pct(steps, 90),
        "tokens_median": median(tokens), "tokens_p90": _pct(tokens, 90),
        "tokens_min": min(tokens), "tokens_max": max(tokens),
        "first_right_depth_quartiles": [round(q, 3) for q in quantiles(depth, n=4)] if len(depth) > 1 else None,
        "redundant_share_mean": mean(redundant) if redundant else None,
        "never_right_pct": 100 * mean(f is None for f in first),
    }


def sample_family(llm, family: str, n: int, seed: int, temperature: float = 0.7) -> tuple[dict, list[tuple[Problem, str, list[int], list[int]]]]:
    """One completion per fresh problem of a family: its report and the samples."""
    from vllm import SamplingParams  # deferred: vllm (the model is loaded once, in main)

    rng = random.Random(f"long-eval:{family}:{seed}")
    problems = [make_problem(rng, family) for _ in range(n)]
    outs = llm.chat([[{"role": "user", "content": p.question}] for p in problems],
                    SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS),
                    use_tqdm=progress_bar)  # vLLM's bar, as a log reads it (progress.py)
    texts = [o.outputs[0].text for o in outs]
    report = family_report(problems, texts, [len(o.outputs[0].token_ids) for o in outs],
                           [o.outputs[0].finish_reason == "stop" for o in outs])
    return report, [(p, t, list(o.prompt_token_ids), list(o.outputs[0].token_ids))
                    for p, t, o in zip(problems, texts, outs)]


def forcing_check(llm, samples: list, suffix: str = FORCE_SUFFIX) -> dict:
    """Greedy continuation after every step boundary of finished traces + the suffix."""
    from vllm import SamplingParams  # deferred: vllm
    from vllm.inputs import TokensPrompt  # deferred: vllm

    tok = llm.get_tokenizer()
    delimiter_id, close_id = tok.convert_tokens_to_ids([STEP_DELIMITER, THINK_CLOSE])
    suffix_ids = tok.encode(suffix, add_special_tokens=False)
    rows = []
    for problem, text, prompt_ids, gen_ids in samples:
        if close_id not in gen_ids:
            continue
        paras = text.split(THINK_CLOSE)[0].removeprefix(THINK_OPEN).strip("\n").split(STEP_DELIMITER)
        ends = step_ends(gen_ids, delimiter_id, close_id)
        rows += [(prompt_ids + gen_ids[:end] + suffix_ids, paragraph_candidate(para), problem.x)
                 for para, end in zip(paras, ends)]
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids, _, _ in rows],
                        SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    answers = [extract_answer("\\boxed{" + o.outputs[0].text) for o in outs]
    return {"boundaries": len(rows),
            "equals_stated_pct": 100 * mean(a == c for a, (_, c, _) in zip(answers, rows)),
            "right_pct": 100 * mean(a == x for a, (_, _, x) in zip(answers, rows))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=Path("runs/long/model"))
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--forcing-traces", type=int, default=20,
                    help="in-distribution traces the forcing check replays (0: no check)")
    ap.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    ap.add_argument("--trajectories", type=Path, nargs="+", default=None,
                    help="report on collected trajectory sets instead of sampling")
    ap.add_argument("--out", type=Path, default=None, help="also write the report here (vLLM logs to stdout)")
    args = ap.parse_args()
    if args.forcing_traces < 0:  # a negative slice would take all but the last few
        ap.error(f"--forcing-traces must be >= 0, got {args.forcing_traces}")
    if args.trajectories:
        from orca_method.trajectories import TrajectorySet

        by_family: dict[str, list] = {}
        for path in args.trajectories:
            for p in TrajectorySet.open(path).problems:
                by_family.setdefault(p.family or "unknown", []).append(p)
        emit({f: trajectory_report(ps) for f, ps in by_family.items()}, args.out)
        return
    llm = load_llm(args.model, max_model_len=MAX_TOKENS + 120)
    rng = random.Random(args.seed)
    report: dict = {"tokenizer_ids_match_vllm": tokenizer_agrees(
        llm, args.model, [make_problem(rng, f).question for f in FAMILIES])}
    samples = {}
    for family in args.families:
        report[family], samples[family] = sample_family(llm, family, args.n, args.seed, args.temperature)
    if "in-dist" in samples and args.forcing_traces > 0:
        report["forcing"] = forcing_check(llm, samples["in-dist"][: args.forcing_traces])
    emit(report, args.out)


if __name__ == "__main__":
    main()
