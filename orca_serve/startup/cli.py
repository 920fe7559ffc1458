"""`orca-serve`: vLLM's OpenAI-compatible server with calibrated early stopping of reasoning.

    orca-serve --model M --calib bundle.json [--orca-delta D] [--orca-policy answer|stop|shadow]
               [--orca-answer-budget N] [any option of vLLM's OpenAI server]
    orca-serve --demo [vLLM options]
    orca-serve --check-vllm      # does the installed vLLM have what orca-serve needs?

Without --calib the server is plain vLLM (plus GET /v1/orca/bundle answering 404).

Start-up order, so that a wrong bundle is refused in seconds and in one line (exit code 2):
1. pre-flight, no vLLM imported (`orca_serve.startup.preflight`): a vLLM release outside
   `vllm_plugin.config.SUPPORTED_VLLM` is refused; our options are read (a small argparse pass
   that ignores vLLM's options); the bundle is loaded and checked against the model's
   config.json and tokenizer (`orca_serve.checks.bundle`), long before vLLM loads weights;
2. vLLM's configuration (`orca_serve.startup.vllm_setup`): vLLM's own parser parses the full command
   line (our options included, so `--help` lists them), unsupported combinations are refused,
   the dtype and default sampling vLLM will serve are compared with the bundle's calibration's
   (a warning line each where they differ), the plugin's engine arguments are merged in;
3. serving: this process's orca parts built once (`orca_serve.api_server.assembly.build_server`), and
   vLLM's `run_server` (or, with --api-server-count N > 1, its `run_multi_api_server`) serves
   the app built by vLLM's `build_app` plus our additions (`orca_serve.api_server.server`).

vLLM is reached through `orca_serve.vllm_compat.launch` (its parser, launchers and app hook).

SIGTERM stops it at any point of start-up: `main` first makes SIGTERM raise SystemExit, which
unwinds through vLLM's clean-ups (its engine client stops the EngineCore it started) and which,
unlike vLLM's own start-up handler's KeyboardInterrupt, no part of vLLM's engine start swallows;
uvicorn's handler takes over once the server serves (`orca_serve.vllm_compat.launch.run_single`).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from orca_serve.metrics.snapshots import ENV_SERVER
from orca_serve.checks.bundle import reload_note
from orca_serve.startup.ipc_dir import use_own_rpc_dir
from orca_serve.startup.preflight import Preflight, identity, preflight
from orca_serve.api_server.log import log_like_vllm
from orca_serve.checks.errors import StartupError, exit_on_sigterm, fail
from orca_serve.startup.vllm_check import main as check_touch_points
from orca_serve.vllm_plugin.config import SUPPORTED_VLLM, installed_vllm_version
from orca_serve.startup.vllm_setup import vllm_args


def main(argv: list[str] | None = None) -> None:
    if argv is None:  # the program itself, not a caller's process (tests call main(argv))
        exit_on_sigterm()  # until the server's own handler replaces it
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        _main(argv)
    except StartupError as e:
        fail(str(e))


def _main(argv: list[str]) -> None:
    """Pre-flight (no vLLM), vLLM's configuration, then serving (the module docstring's order)."""
    if "--check-vllm" in argv:  # before the version check: it is how a new release is judged
        if len(argv) > 1:
            raise StartupError("--check-vllm takes no other option")
        raise SystemExit(check_touch_points(f"vLLM {installed_vllm_version() or 'not installed'}"
                                            f" (orca-serve supports vllm{SUPPORTED_VLLM})"))
    pre = preflight(argv)
    use_own_rpc_dir()  # before vLLM reads the variable; after pre-flight: a refusal makes none
    args = vllm_args(pre)
    log_like_vllm()
    os.environ[ENV_SERVER] = "1"  # our server exports the orca metrics, not the stat logger
    serve(args, pre)


def serve(args: Any, pre: Preflight) -> None:
    """Build this process's orca parts once (the bundle pre-flight loaded and checked) and
    serve them in vLLM's app."""
    # deferred: torch (not needed by --check-vllm)
    from orca_serve.api_server.assembly import build_server
    from orca_serve.api_server.server import run

    if pre.bundle is None:
        return run(args, build_server(args))
    from orca_serve.live_audit.journal import JournalRefused
    from orca_serve.live_audit.options import audit_config  # deferred: torch

    def check(bundle: Any) -> str | None:  # a reload's bundle, against the served model
        return reload_note(bundle, pre.facts, args.model, pre.served, **identity(args, bundle))

    try:
        server = build_server(args, pre.bundle, check=check,
                              audit_config=lambda bundle: audit_config(args, bundle))
    except JournalRefused as e:  # other guard flags in the fleet, a store key of another type
        raise StartupError(str(e)) from None
    except (OSError, ValueError) as e:  # the audit directory cannot be written
        raise StartupError(f"--orca-audit-dir: {e}") from None
    return run(args, server)


if __name__ == "__main__":
    main()
