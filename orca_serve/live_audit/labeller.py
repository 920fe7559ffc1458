"""Labelling an audited request inside the server, exactly as `orca-calibrate collect` labels.

The audited request ran with the plugin in record mode, whose result carries the step embeddings,
the step token ids and the request's prompt and output token ids. The labeller sends one answer
probe per labelled step boundary through the server's own engine (`engine_client.generate`), built
by orca_method/answer_probes.py (the prompts, the sampling, the record: collect's code), with a low
priority when the engine schedules by priority. Prefix caching, when on, makes each probe cost
little more than its few answer tokens.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from orca_method.answer_probes import (
    ProbeSettings,
    probe_prompts,
    probe_sampling,
    trajectory_fields,
)
from orca_method.labels import extract_forced
from orca_serve.settings.contract import ORCA_OFF, OrcaResult
from orca_serve.vllm_compat.engine_client import generate_from_ids, tokenizer

# What a live audit can label by: agreement with the request's own final answer (live traffic
# has no reference answer for `supervised`, and the server calls no judge).
AUDIT_LABEL_MODE = "consistent"
LOW_PRIORITY = 10  # vLLM's priority scheduling serves lower values first


class Labeller(Protocol):
    """What labels a live audit (`AuditLabeller`; tests give their own)."""

    async def label(self, key: str, rec: dict[str, Any], result: OrcaResult,
                    finish_reason: str | None) -> dict[str, Any]:
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
                    finish_reason: str | None) -> dict[str, Any]:
        """The trajectory record (problems.jsonl fields) of one audited, recorded request.

        `rec` holds the request's `messages` or `prompt`; `result` is the plugin's record-mode
        result.
        """
        gen = list(result.output_token_ids or [])
        points = probe_prompts(result.prompt_token_ids or [], gen, result.to_dict(),
                               self.suffix_ids, self.settings.label_every)
        answers = await asyncio.gather(*(self._answer(f"{key}-probe-{t}", ids)
                                         for t, ids in points))
        text = self.tokenizer.decode(gen, skip_special_tokens=True)
        return trajectory_fields(key, rec, text=text, finish_reason=finish_reason,
                                 completion_tokens=len(gen), step_tokens=result.step_tokens,
                                 probed={t: a for (t, _), a in zip(points, answers)})
