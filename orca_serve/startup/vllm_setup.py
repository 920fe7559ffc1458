"""orca-serve's vLLM configuration: vLLM's own parser over the whole command line, the
combinations the plugin cannot serve refused, the CPU build's prefill rule, a warning where the
dtype or default sampling served are not the bundle's calibration's, the plugin's engine
arguments merged in. vLLM is reached through `orca_serve.vllm_compat.launch`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from orca_method.errors import first_line
from orca_serve.api_server import endpoint_plugin
from orca_serve.settings.contract import DEFAULTS, ShiftAction
from orca_serve.checks.bundle import check_bundle, serving_warnings
from orca_serve.startup.preflight import (
    Preflight,
    add_orca_args,
    identity,
    model_key,
    model_kw,
    refuse_unsupported,
)
from orca_serve.checks.errors import PROG, StartupError
from orca_serve.vllm_compat import launch
from orca_serve.vllm_plugin.config import engine_kwargs, prepare_environment

DESCRIPTION = "vLLM's OpenAI-compatible server with calibrated early stopping of reasoning."


def vllm_max_model_len(args: argparse.Namespace) -> int | None:
    """The context length vLLM derives for the model when --max-model-len is not given (its own
    ModelConfig, from the model's config.json); None if it cannot be derived here (vLLM then
    reports the problem itself)."""
    try:
        return launch.derived_max_model_len(args)
    except Exception:  # noqa: BLE001 - vLLM's own start reports what is wrong
        return None


def keep_prefills_whole(args: argparse.Namespace,
                        derive_max_len: Callable[[argparse.Namespace], int | None] =
                        vllm_max_model_len) -> None:
    """On vLLM's CPU build, never chunk a prompt's prefill, so that no request can crash the engine.

    vLLM 0.32's model runner (`_bookkeeping_sync` in v1/worker/gpu_model_runner.py, which the CPU
    runner inherits) rewinds, after each step, the per-request random generator of every request
    whose sampled token it discards, i.e. every request whose prompt was only partly prefilled
    in that step: `gen.set_offset(gen.get_offset() - 4)`. Only seeded requests have their own
    generator, and CPU generators do not implement offsets ("CPU Generator does not use offset"):
    the worker raises, the engine dies, every request fails. A prompt gets chunked whenever the
    step's token budget runs out in the middle of it, which happens as soon as a few long prompts
    arrive together, whatever `--max-num-batched-tokens` is.

    With chunked prefill off and no long-prefill threshold, the scheduler admits a waiting request
    only if its whole remaining prompt fits in the step's budget (it waits otherwise), and a
    running request is always scheduled to its last token, so no step ends a request short of its
    end and nothing is rewound. vLLM then needs `--max-num-batched-tokens` >= `--max-model-len`
    (its default on CPU when the option is not given); without --max-model-len, the length vLLM
    derives from the model's config is checked the same way (`derive_max_len`).
    """
    if not launch.is_cpu_platform():
        return
    why = f"{launch.SEEDED_CHUNKS_CRASH}; orca-serve keeps prefills whole there"
    chunking = launch.chunking_option(vars(args))
    if chunking:
        raise StartupError(f"--{chunking.replace('_', '-')} is refused: {why}")
    budget = getattr(args, "max_num_batched_tokens", None)
    max_len = getattr(args, "max_model_len", None)
    given = "--max-model-len"
    if budget is not None and max_len is None:
        max_len, given = derive_max_len(args), "the model's context length"
    if budget is not None and isinstance(max_len, int) and budget < max_len:
        raise StartupError(f"--max-num-batched-tokens {budget} is below {given} {max_len}: "
                           f"{why}, so a step must fit a whole prompt (raise "
                           "--max-num-batched-tokens or lower --max-model-len)")
    args.enable_chunked_prefill = False


def merge_engine_args(args: argparse.Namespace, extra: dict[str, Any]) -> None:
    """Add the plugin's engine arguments to vLLM's parsed args (keeping the user's own)."""
    for name, value in extra.items():
        cur = getattr(args, name, None)
        if name == "logits_processors":
            cur = list(cur or [])
            args.logits_processors = cur + [v for v in value if v not in cur]
        elif name == "additional_config":
            merged = dict(cur or {})
            for k, v in value.items():
                if k in merged and isinstance(merged[k], dict) and isinstance(v, dict):
                    merged[k] = {**merged[k], **v}
                else:
                    merged[k] = v
            args.additional_config = merged
        elif name == "worker_extension_cls":
            if cur and cur != value:
                raise StartupError(f"--worker-extension-cls {cur} conflicts with the orca plugin's "
                                   f"worker extension ({value})")
            args.worker_extension_cls = value
        else:
            setattr(args, name, value)


def help_without_vllm(error: BaseException) -> NoReturn:
    """--help where vLLM cannot build its own parser (the GPU wheel on a machine without a
    GPU: vLLM's option defaults need the device): our options, and why vLLM's are missing."""
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    add_orca_args(parser)
    parser.print_help()
    print(f"\nvLLM's own options are not listed: vLLM cannot build its parser here "
          f"({first_line(error)})", flush=True)
    raise SystemExit(0)


def vllm_args(pre: Preflight) -> argparse.Namespace:
    """The parsed command line vLLM serves, with the plugin's engine arguments (a bundle's
    checks repeated when vLLM's options name another model than the early pass saw)."""
    notes = [endpoint_plugin.allow()]  # before vLLM is imported: it reads VLLM_PLUGINS once
    if pre.bundle is not None:
        notes.append(prepare_environment())  # the tested V1 runner unless the environment chose
    for note in filter(None, notes):
        print(f"{PROG}: note: {note}", file=sys.stderr, flush=True)
    try:
        parser = launch.serve_parser(PROG, DESCRIPTION)
    except Exception as e:
        if "-h" in pre.argv or "--help" in pre.argv:
            help_without_vllm(e)
        raise  # vLLM's own error (e.g. no device it can run on), as vLLM's server shows it
    add_orca_args(parser)
    args = parser.parse_args(pre.argv)
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    try:
        launch.validate_serve_args(args)
    except (ValueError, TypeError) as e:
        raise StartupError(str(e).removeprefix("Error: ")) from None
    bundle = pre.bundle
    if args.demo:
        args.calib = pre.bundle_path
        if not args.served_model_name and bundle is not None:
            args.served_model_name = [bundle.model.name]  # not the install path
    keep_prefills_whole(args)
    if bundle is not None:
        if pre.checked != model_key(args):
            pre.facts = check_bundle(bundle, args.model, **identity(args, bundle),
                                     **model_kw(args))
        refuse_unsupported(args)
        pre.served = launch.served_generation(args)
        for line in serving_warnings(bundle, pre.served):
            print(f"{PROG}: warning: {line}", file=sys.stderr, flush=True)
        args.calib = str(Path(pre.bundle_path).absolute())  # type: ignore[arg-type]
        # deferred: torch (not needed by --check-vllm)
        from orca_serve.api_server.assembly import orca_defaults

        defaults = orca_defaults(args, bundle)
        # Off in the engine unless the request says otherwise: the server writes every setting
        # (orca_enabled included) into the requests of the routes whose responses report what
        # orca did (orca_serve.api_server.apis); requests on other routes (the batch route, ...) run
        # without it rather than being cut short silently.
        budget = defaults.answer_budget
        merge_engine_args(args, engine_kwargs(args.calib, defaults=replace(
            DEFAULTS, enabled=False, delta=defaults.delta, policy=defaults.policy,
            answer_budget=DEFAULTS.answer_budget if budget is None else budget,
            give_up_policy=defaults.give_up_policy, give_up_message=args.orca_give_up_message,
            shift_alpha=args.orca_shift_alpha,
            shift_give_up_alpha=args.orca_shift_give_up_alpha,
            shift_action=ShiftAction(args.orca_shift_action),
            gate_alarm=args.orca_gate_alarm)))
    launch.configure_logging(args)
    return args
