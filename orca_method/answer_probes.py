"""Answer probes at step boundaries and the labelled record they give: ONE procedure for offline
collection (`orca_calibrate/collect.py`, vLLM's `LLM`) and live audits (`orca_serve/live_audit/`, the
server's async engine client).

A recorded trajectory (the plugin's record-mode result: `step_tokens`, `step_token_ids`) is probed
by continuing ``prompt + generated tokens through step t + suffix`` greedily for a few tokens and
reading the answer after the suffix (`orca_method.labels.extract_forced`). The probed answers give
every step an answer (pessimistic fill) and the step labels (`trajectory_fields`). Both callers
build their probe prompts, sampling parameters and records here, so an audited request is labelled
exactly as `orca-calibrate collect` labels a collected one; only the engine call differs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from orca_method.labels import extract_final, fill_pessimistic, labelled_steps, step_labels

DEFAULT_SUFFIX = "\n</think>\n\nThe answer is \\boxed{"
DEFAULT_ANSWER_TOKENS = 16
# the label mode a prompt's reference `answer` gives its traces (a prompt without one: none)
SUPERVISED = "supervised"
CONSISTENT = "consistent"  # agreement with the trace's own final answer: every trace has it
JUDGE = "judge"  # an LLM judge's verdict (orca_calibrate/judge.py), with collect.judge
COLLECTED_MODES = (SUPERVISED, CONSISTENT, JUDGE)  # the label modes a collection can write


@dataclass(frozen=True)
class ProbeSettings:
    """How intermediate answers are read: the forcing text, its answer budget, the label stride."""

    suffix: str = DEFAULT_SUFFIX  # appended to a reasoning prefix; ends inside `\boxed{`
    answer_tokens: int = DEFAULT_ANSWER_TOKENS  # greedy tokens generated after the suffix
    label_every: int = 1  # probe every k-th step (and always the last one)

    def labelling(self) -> dict[str, Any]:
        """What the labels depend on, as a trajectory set's info records it (`labelling`) and a
        bundle's `labelling` block holds it (the stride only makes labels pessimistic)."""
        return {"suffix": self.suffix, "answer_tokens": self.answer_tokens}


def step_ends(gen_ids: Sequence[int], step_ids: Sequence[Sequence[int]]) -> list[int]:
    """Exclusive end offsets (in generated tokens) of each recorded step, found in order.

    Steps are the generated tokens in order, but not one run: tokens the segmenter does not
    count come before them (a generated `<think>`), between them (an answer between a
    `</think>` and a reopened `<think>`) and inside one (a `<think>` the model writes again in
    the middle of a step: orca_method/steps.py skips it). So a step is matched at its first
    occurrence after the previous one's end, where only tokens that are in no step may come
    between its own: any other token there means capture and generation disagree.
    """
    gen = list(gen_ids)
    counted = {t for step in step_ids for t in step}
    ends, pos = [], 0
    for k, step in enumerate(step_ids):
        end = _step_end(gen, pos, list(step), counted)
        if end is None:
            raise RuntimeError(f"recorded step {k} is not a run of the generated tokens after "
                               "the steps before it; capture and generation disagree")
        pos = end
        ends.append(pos)
    return ends


def _step_end(gen: list[int], pos: int, step: list[int], counted: set[int]) -> int | None:
    """The end of `step`'s first occurrence in `gen` from `pos` on, tokens of no step (`counted`
    holds every step's) skipped inside it; None when it does not occur."""
    for start in range(pos, len(gen)) if step else ():
        j = start
        for n, t in enumerate(step):
            while n and j < len(gen) and gen[j] not in counted:
                j += 1  # an uncounted token inside the step
            if j >= len(gen) or gen[j] != t:
                break
            j += 1
        else:
            return j
    return pos if not step else None


def probe_prompts(prompt_ids: Sequence[int], gen_ids: Sequence[int], record: dict[str, Any],
                  suffix_ids: Sequence[int], label_every: int,
                  steps: Iterable[int] | None = None) -> list[tuple[int, list[int]]]:
    """(step t, prompt token ids) of every answer probe of one recorded trajectory: at its
    labelled steps (`labelled_steps`), or at `steps` (selective labelling,
    orca_method/selective.py). `record` needs `step_token_ids`, or `step_ends` (`step_ends`'
    result, as a deferred trajectory keeps it)."""
    gen = list(gen_ids)
    ends = record.get("step_ends") or step_ends(gen, record["step_token_ids"])
    chosen = labelled_steps(len(ends), label_every) if steps is None else sorted(steps)
    return [(t, list(prompt_ids) + gen[:ends[t]] + list(suffix_ids)) for t in chosen]


def probe_sampling(answer_tokens: int) -> dict[str, Any]:
    """The answer probe's sampling as `vllm.SamplingParams` keyword arguments (the method package
    imports nothing of vLLM): greedy, `answer_tokens` long. Callers add the xarg that turns the
    orca probe off (`orca_serve.settings.contract.ORCA_OFF`)."""
    return {"temperature": 0.0, "max_tokens": answer_tokens}


def answer_after(text: str, end: str = "</think>") -> str | None:
    """The answer a response writes after its reasoning: `extract_final` of what follows the
    last `end` tag (all of `text` without one: a server's reasoning parser split it off). The one
    definition of a sample's answer for the vote, offline (`final_answer`) and served
    (orca_serve/api_server/voting.py), so the served vote counts what the consensus was
    certified on."""
    return extract_final(text.split(end)[-1])


def final_answer(text: str, step_answers: Sequence[str | None]) -> str | None:
    """ans(y_T): the answer written after the reasoning, else the last step's probed answer."""
    final = answer_after(text) if "</think>" in text else None
    return final if final is not None else step_answers[-1]


def trajectory_fields(key: str, rec: dict[str, Any], *, text: str, finish_reason: str | None,
                      completion_tokens: int, step_tokens: Sequence[int],
                      probed: dict[int, str | None]) -> dict[str, Any]:
    """The problems.jsonl record (docs/TRAJECTORIES.md) of one probed trajectory.

    `rec` holds `messages` or `prompt`, and optionally `answer` (adds supervised labels) and
    `family`; `text` is the complete generated text (for the final answer).
    """
    n = len(step_tokens)
    step_answers = fill_pessimistic(probed, n)
    final = final_answer(text, step_answers)
    labels = {CONSISTENT: step_labels(step_answers, final)}
    if rec.get("answer") is not None:
        labels[SUPERVISED] = step_labels(step_answers, str(rec["answer"]))
    return {"id": key, "prompt": json.dumps(rec.get("messages") or rec.get("prompt")),
            "answer": None if rec.get("answer") is None else str(rec["answer"]),
            "family": rec.get("family"), "step_tokens": list(step_tokens),
            "step_answers": step_answers, "final_answer": final, "labels": labels,
            "extra": {"finish_reason": finish_reason, "completion_tokens": completion_tokens,
                      "final_correct": None if rec.get("answer") is None
                      else bool(labels[SUPERVISED][-1])}}
