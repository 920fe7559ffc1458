"""Labelling an audited request inside the server, exactly as `orca-calibrate collect` labels.

The audited request ran with the plugin in record mode, whose result carries the step embeddings,
the step token ids and the request's prompt and output token ids. The labeller sends one answer
probe per labelled step boundary through the server's own engine (`engine_client.generate`), built
by orca_method/answer_probes.py (the prompts, the sampling, the record: collect's code), with a low
priority when the engine schedules by priority. Prefix caching, when on, makes each probe cost
little more than its few answer tokens.

With `--orca-audit-label-steps selective` the audit gives the thresholds its guards will read
(`AuditState.label_needs`), and the labeller probes in rounds only the steps that settle their
losses (`orca_method.audit.labelling`): first those steps themselves and the last one, then,
where a stop step's own answer is not the final one, the steps before it until one is. The
record says which steps were probed (`extra.audit_labels`); its other steps carry the
pessimistic fill, so an offline LTT on such records is conservative, not every-step labelling.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from orca_method.answer_probes import (
    CONSISTENT,
    ProbeSettings,
    probe_prompts,
    probe_sampling,
    trajectory_fields,
)
from orca_method.audit.labelling import audit_points
from orca_method.labels import extract_forced
from orca_method.selective import next_round
from orca_method.thresholds import lam_to_json
from orca_serve.settings.contract import ORCA_OFF, OrcaResult
from orca_serve.vllm_compat.engine_client import generate_from_ids, tokenizer

# What a live audit can label by: agreement with the request's own final answer (live traffic
# has no reference answer for `supervised`, and the server calls no judge).
AUDIT_LABEL_MODE = CONSISTENT
LOW_PRIORITY = 10  # vLLM's priority scheduling serves lower values first
# what the thresholds an audit's labels must settle are: None, every step (a recalibration
# window may take it); else (stop thresholds, give-up thresholds): `AuditState.label_needs`
Needs = tuple[list[float], list[float]] | None


class Labeller(Protocol):
    """What labels a live audit (`AuditLabeller`; tests give their own)."""

    async def label(self, key: str, rec: dict[str, Any], result: OrcaResult,
                    finish_reason: str | None, needs: Needs = None,
                    give_up: list[float] | None = None) -> dict[str, Any]:
        """The trajectory record of one audited, recorded request (`AuditLabeller.label`)."""
        ...


class AuditLabeller:
    """Answer probes through an async vLLM engine client (AsyncLLM); see the module docstring."""

    def __init__(self, engine_client: Any, settings: ProbeSettings) -> None:
        self.engine = engine_client
        self.settings = settings
        self.tokenizer = tokenizer(engine_client)
        self.suffix_ids = self.tokenizer.encode(settings.suffix, add_special_tokens=False)
        sched = getattr(getattr(engine_client, "vllm_config", None), "scheduler_config", None)
        self.priority = LOW_PRIORITY if getattr(sched, "policy", "fcfs") == "priority" else 0
        self.probes = 0

    async def _answer(self, request_id: str, ids: list[int]) -> str | None:
        from vllm import SamplingParams  # deferred: vllm (offline tools import live_audit)

        params = SamplingParams(**probe_sampling(self.settings.answer_tokens),
                                extra_args=dict(ORCA_OFF))
        last = None
        async for out in generate_from_ids(self.engine, ids, params, request_id,
                                           priority=self.priority):
            last = out
        self.probes += 1
        return None if last is None else extract_forced(last.outputs[0].text)

    async def label(self, key: str, rec: dict[str, Any], result: OrcaResult,
                    finish_reason: str | None, needs: Needs = None,
                    give_up: list[float] | None = None) -> dict[str, Any]:
        """The trajectory record (problems.jsonl fields) of one audited, recorded request.

        `rec` holds the request's `messages` or `prompt`; `result` is the plugin's record-mode
        result; `needs`: the thresholds whose losses the labels must settle (None: every
        step), `give_up` the audit's give-up scores (the give-up thresholds' steps).
        """
        gen = list(result.output_token_ids or [])
        text = self.tokenizer.decode(gen, skip_special_tokens=True)
        prompt, record = result.prompt_token_ids or [], result.to_dict()
        points = None if needs is None else audit_points(
            result.scores, len(result.step_tokens), needs[0],
            label_every=self.settings.label_every, give_up_scores=give_up, mus=needs[1])
        probed: dict[int, str | None] = {}
        todo = None if points is None else points.first_round()
        while True:
            chosen = probe_prompts(prompt, gen, record, self.suffix_ids,
                                   self.settings.label_every, steps=todo)
            answers = await asyncio.gather(*(self._answer(f"{key}-probe-{t}", ids)
                                             for t, ids in chosen))
            probed.update((t, a) for (t, _), a in zip(chosen, answers))
            out = trajectory_fields(key, rec, text=text, finish_reason=finish_reason,
                                    completion_tokens=len(gen), step_tokens=result.step_tokens,
                                    probed=probed)
            todo = None if points is None else next_round(
                {AUDIT_LABEL_MODE: points}, out["labels"], probed)
            if not todo:
                break
        if points is not None:
            out["extra"]["audit_labels"] = {
                "probed": sorted(probed), "lambdas": [lam_to_json(x) for x in needs[0]],
                "mus": [lam_to_json(x) for x in needs[1]]}
        return out
