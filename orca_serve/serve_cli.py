"""`orca-serve`: vLLM's OpenAI-compatible server with calibrated early stopping of reasoning.

    orca-serve --model M --calib bundle.json [--orca-delta D] [--orca-policy answer|stop|shadow]
               [--orca-answer-budget N] [any option of vLLM's OpenAI server]
    orca-serve --demo [vLLM options]
    orca-serve --check-vllm      # does the installed vLLM have what orca-serve needs?

Without --calib the server is plain vLLM (plus GET /v1/orca/bundle answering 404).

Start-up order, so that a wrong bundle is refused in seconds and in one line (exit code 2):
1. our options are read first (a small argparse pass that ignores vLLM's options);
2. the bundle is loaded and checked against the model's config.json hidden size and tokenizer
   (transformers' AutoConfig/AutoTokenizer: a local folder or a hub name), before vLLM is even
   imported and long before it loads weights;
3. vLLM's own parser (`make_arg_parser`) parses the full command line (our options included, so
   `--help` lists them), unsupported combinations are refused, the plugin's engine arguments are
   merged in, and vLLM's `run_server` (or, with --api-server-count N > 1, its
   `run_multi_api_server`) serves the app built by vLLM's `build_app` plus our additions.

Before all of it, a vLLM release outside `vllm_plugin.config.SUPPORTED_VLLM` is refused.
vLLM is reached through `orca_serve.vllm_compat.launch` (its parser, launchers and app hook).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from orca_method.errors import first_line
from orca_method.steps import token_bytes_from_tokenizer
from orca_serve.argtypes import effort_map, fraction, integer
from orca_serve.contract import DEFAULTS, GIVE_UP_MESSAGE, GIVE_UP_POLICIES, POLICIES
from orca_serve.effort import DEFAULT_EFFORT_MAP, check_effort_map, describe
from orca_serve.metrics_snapshots import ENV_SERVER
from orca_serve.server_log import log_like_vllm
from orca_serve.vllm_check import main as check_touch_points
from orca_serve.vllm_compat import launch
from orca_serve.vllm_plugin.config import (
    SUPPORTED_VLLM,
    check_engine_supported,
    check_vllm_version,
    engine_kwargs,
    installed_vllm_version,
    pin_runner_for_speculation,
    prepare_environment,
)

if TYPE_CHECKING:
    from orca_method.bundle import ConfigFingerprint

PROG = "orca-serve"
DEMO_REASONING_PARSER = "deepseek_r1"  # what --demo implies (unless the command line names one)


class StartupError(Exception):
    """Refuse to start: printed as one line on stderr, exit code 2."""


def fail(msg: str, code: int = 2) -> NoReturn:
    print(f"{PROG}: error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def add_orca_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("orca-serve", "Calibrated early stopping of reasoning (ORCA)")
    g.add_argument("--calib", default=None, metavar="BUNDLE",
                   help="Calibration bundle (bundle.json). Without it the server is plain vLLM.")
    g.add_argument("--demo", action="store_true", default=False,
                   help="Serve the embedded demo model and bundle (orca_serve/demo/).")
    g.add_argument("--check-vllm", action="store_true", default=False,
                   help="Check that every vLLM name orca-serve relies on beyond vLLM's extension "
                   "points resolves in the installed vLLM (one line each; exit 0 when all do), "
                   "without starting an engine, then exit. Works on any vLLM release.")
    g.add_argument("--orca-delta", type=fraction(open_interval=True), default=None, metavar="DELTA",
                   help="Default risk level delta for requests that do not set one; must have a "
                   "lambda* in the bundle. None: the bundle's default_delta.")
    g.add_argument("--orca-policy", choices=POLICIES, default=DEFAULTS["policy"],
                   help="Default policy: answer (close the reasoning and let the model answer), "
                   "stop (end the request), shadow (never stop; report where it would have).")
    g.add_argument("--orca-answer-budget", type=integer(0), default=None, metavar="N",
                   help="Default answer budget in tokens after the reasoning is closed by policy "
                   "answer. None: the plugin's default.")
    g.add_argument("--orca-give-up-delta", type=fraction(open_interval=True), default=None,
                   metavar="DELTA_2",
                   help="Give up by default on reasoning that will probably not end right, with "
                   "give-up risk DELTA_2 (a two-sided bundle's give-up table must have it; "
                   "requests turn it off with \"give_up\": {\"enabled\": false}). None: only "
                   "requests that set orca.give_up give up.")
    g.add_argument("--orca-give-up-policy", choices=GIVE_UP_POLICIES,
                   default=DEFAULTS["give_up_policy"],
                   help="What a given-up request returns: guess (its best current answer, as a "
                   "stop would, flagged ended: gave_up) or message (the end-of-thinking text and "
                   "--orca-give-up-message).")
    g.add_argument("--orca-give-up-message", default=None, metavar="TEXT",
                   help=f"The message of --orca-give-up-policy message (\"{GIVE_UP_MESSAGE}\").")
    g.add_argument("--orca-effort-map", type=effort_map, default=None, metavar="LEVEL=TARGET,...",
                   help="How a request's reasoning effort (chat reasoning_effort, Responses "
                   "reasoning.effort, Messages output_config.effort) chooses its delta, when the "
                   "request sets none: TARGET is a delta of the bundle, largest, default, "
                   "smallest or off (no early stop). Given levels replace these defaults: "
                   f"{describe(DEFAULT_EFFORT_MAP)}.")
    g.add_argument("--orca-force-model", action="store_true", default=False,
                   help="Serve the bundle although it names another model than --model (or "
                   "names no tokenizer): its lambda* were certified for that model only.")
    g.add_argument("--orca-admin-key-env", default=None, metavar="VAR",
                   help="Turn on POST /v1/orca/bundle (hot reload of the bundle) guarded by the "
                   "admin key in environment variable VAR (Authorization: Bearer <key>). Without "
                   "it the route does not exist; SIGHUP re-reads --calib either way.")
    # deferred: scipy (not needed by --check-vllm)
    from orca_serve.live_audit.options import add_audit_args

    add_audit_args(parser)
    return parser


# Options of vLLM's that matter before vLLM is imported (model identity for the bundle check).
_EARLY_VLLM = {"--model": None, "--tokenizer": None, "--revision": None,
               "--tokenizer-revision": None, "--hf-config-path": None}


class _OneLineParser(argparse.ArgumentParser):
    """A bad option is a StartupError (one line, exit code 2), not argparse's usage text."""

    def error(self, message: str) -> NoReturn:
        raise StartupError(f"{message} (orca-serve --help=orca-serve lists the orca options)")


def early_parse(argv: list[str]) -> argparse.Namespace:
    """Our options plus the model-identity options, ignoring everything else. A bad value of
    one of them is refused in one line here, before vLLM's parser (whose errors print its whole
    usage) sees it."""
    p = _OneLineParser(prog=PROG, add_help=False, allow_abbrev=False)
    add_orca_args(p)
    for opt in _EARLY_VLLM:
        p.add_argument(opt, default=None)
    p.add_argument("--trust-remote-code", action="store_true", default=False)
    p.add_argument("--speculative-config", "-sc", default=None)
    p.add_argument("--api-server-count", "-asc", type=int, default=None)
    p.add_argument("--served-model-name", nargs="+", default=None)
    norm = []
    for a in argv:  # vLLM accepts --snake_case spellings too
        if a.startswith("--") and "_" in a.split("=", 1)[0]:
            head, *rest = a.split("=", 1)
            a = "=".join([head.replace("_", "-"), *rest])
        norm.append(a)
    ns, _ = p.parse_known_args(norm)
    return ns


def demo_paths() -> tuple[Path, Path]:
    root = Path(str(resources.files("orca_serve"))) / "demo"
    model, bundle = root / "model", root / "bundle.json"
    missing = [str(p) for p in (model / "config.json", bundle) if not p.exists()]
    if missing:
        raise StartupError(f"--demo: the embedded demo is not installed ({', '.join(missing)} "
                           "missing); reinstall orca-serve or pass --model and --calib")
    return model, bundle


def demo_argv(argv: list[str], model_dir: Path) -> list[str]:
    """The command line --demo serves: the embedded model, and its reasoning parser unless the
    command line names one (the demo model opens <think> in its chat template and closes it with
    </think>: without the parser its reasoning would be returned as `content`)."""
    named = any(a.split("=", 1)[0] in ("--reasoning-parser", "--reasoning_parser") for a in argv)
    return ["--model", str(model_dir), *argv,
            *([] if named else ["--reasoning-parser", DEMO_REASONING_PARSER])]


@dataclass(frozen=True)
class ModelFacts:
    """What the bundle checks need of a model, read without loading its weights."""

    hidden_size: int  # config.json
    vocab: dict[str, int]  # the tokenizer's token -> id
    token_bytes: list[bytes]  # each token id's bytes (orca_method.steps)
    config: ConfigFingerprint | None = None  # of config.json (None: it lacks one of its fields)


def model_facts(model: str, *, tokenizer: str | None = None, revision: str | None = None,
                tokenizer_revision: str | None = None, hf_config_path: str | None = None,
                trust_remote_code: bool = False) -> ModelFacts:
    """Hidden size and config fingerprint (config.json) and tokenizer of a model, without
    loading its weights."""
    # deferred: transformers (only a bundle's check), torch (orca_method.bundle)
    from transformers import AutoConfig, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from orca_method.bundle import config_fingerprint

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        cfg = AutoConfig.from_pretrained(hf_config_path or model, revision=revision,
                                         trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any failure is one line for the user
        raise StartupError(f"cannot read the config of model {model!r}: "
                           f"{first_line(e)}") from None
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    hidden = getattr(text, "hidden_size", None)
    if not isinstance(hidden, int):
        raise StartupError(f"the config of model {model!r} has no hidden_size; cannot check the "
                           "bundle against it")
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer or model,
                                            revision=tokenizer_revision or revision,
                                            trust_remote_code=trust_remote_code)
        vocab = tok.get_vocab()
    except Exception as e:  # noqa: BLE001
        raise StartupError(f"cannot load the tokenizer of model {model!r}: "
                           f"{first_line(e)}") from None
    return ModelFacts(hidden, vocab, token_bytes_from_tokenizer(tok), config_fingerprint(cfg))


def check_served(bundle: Any, facts: ModelFacts, model: str, *,
                 served_names: list[str] | None = None, force: bool = False) -> str | None:
    """Every check of a bundle against the model it is about to serve (at start and on reload):
    orca_method.bundle_checks.check_bundle, the one the offline tools run against their data;
    raises BundleError. Returns a note to print when `force` (--orca-force-model) let an
    identity mismatch through (name, config fingerprint, a bundle naming no tokenizer); a
    different tokenizer, hidden size or a bad table is refused always.
    """
    # deferred: torch (not needed by --check-vllm)
    from orca_method.bundle_checks import Target, check_bundle

    target = Target(model=model, served_names=tuple(served_names or ()),
                    hidden_size=facts.hidden_size, vocab=facts.vocab,
                    token_bytes=facts.token_bytes, config_fingerprint=facts.config,
                    needs_tokenizer=True)
    note = check_bundle(bundle, target, force=force)
    return None if note is None else f"--orca-force-model: serving anyway although {note}"


def check_bundle(bundle: Any, model: str, *, served_names: list[str] | None = None,
                 force: bool = False, **kw: Any) -> ModelFacts:
    """`check_served` against `model`'s facts (returned, for the checks of later reloads)."""
    from orca_method.bundle import BundleError  # deferred: torch (not needed by --check-vllm)

    facts = model_facts(model, **kw)
    try:
        note = check_served(bundle, facts, model, served_names=served_names, force=force)
    except BundleError as e:
        raise StartupError(str(e)) from None
    if note:
        print(f"{PROG}: warning: {note}", file=sys.stderr, flush=True)
    return facts


def _model_kw(ns: argparse.Namespace) -> dict[str, Any]:
    return {"tokenizer": ns.tokenizer, "revision": ns.revision,
            "tokenizer_revision": ns.tokenizer_revision, "hf_config_path": ns.hf_config_path,
            "trust_remote_code": bool(ns.trust_remote_code)}


def _identity(ns: argparse.Namespace, bundle: Any) -> dict[str, Any]:
    """`check_served`'s served names and force flag from the options (--demo serves its model
    under its bundle's name)."""
    names = ns.served_model_name or ([bundle.model.name] if ns.demo else None)
    return {"served_names": names, "force": bool(ns.orca_force_model)}


def check_admin_key(ns: argparse.Namespace, has_bundle: bool) -> None:
    """--orca-admin-key-env VAR: a bundle to reload, a key in $VAR, one API server."""
    var = ns.orca_admin_key_env
    if var is None:
        return
    if not has_bundle:
        raise StartupError("--orca-admin-key-env turns on hot reload of the bundle, which needs "
                           "--calib (a bundle to start with)")
    if not os.environ.get(var, "").strip():
        raise StartupError(f"--orca-admin-key-env {var}: the environment variable {var} is not "
                           "set or empty; put the admin key in it")
    if (ns.api_server_count or 1) > 1:
        raise StartupError("hot reload (--orca-admin-key-env) needs one API server process (each "
                           "of several would hold its own bundle); use --api-server-count 1")


def refuse_unsupported(args: argparse.Namespace) -> None:
    """Combinations the plugin cannot serve, refused before the engine starts (speculative
    decoding: an untested method, or Model Runner V2; otherwise the V1 runner is pinned)."""
    if getattr(args, "headless", False):
        raise StartupError("--headless is not supported by orca-serve (it starts no API server, "
                           "and the orca fields live in the API server); run the engines with "
                           "orca-serve and several --api-server-count instead")
    if getattr(args, "grpc", False):
        raise StartupError("--grpc is not supported by orca-serve (the orca fields live in the "
                           "HTTP API)")
    try:
        check_engine_supported(args)
        pin_runner_for_speculation(getattr(args, "speculative_config", None))
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as e:
        raise StartupError(first_line(e)) from None


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
    why = ("on vLLM's CPU build a seeded request whose prompt is prefilled in chunks crashes the "
           "engine (CPU Generator does not use offset); orca-serve keeps prefills whole there")
    if getattr(args, "enable_chunked_prefill", None):
        raise StartupError(f"--enable-chunked-prefill is refused: {why}")
    if getattr(args, "long_prefill_token_threshold", 0):
        raise StartupError(f"--long-prefill-token-threshold is refused: {why}")
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
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_orca_args(parser)
    parser.print_help()
    print(f"\nvLLM's own options are not listed: vLLM cannot build its parser here "
          f"({first_line(error)})", flush=True)
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        _main(argv)
    except StartupError as e:
        fail(str(e))


def _main(argv: list[str]) -> None:
    if "--check-vllm" in argv:  # before the version check: it is how a new release is judged
        if len(argv) > 1:
            raise StartupError("--check-vllm takes no other option")
        raise SystemExit(check_touch_points(f"vLLM {installed_vllm_version() or 'not installed'}"
                                            f" (orca-serve supports vllm{SUPPORTED_VLLM})"))
    try:  # before any vLLM import: the launcher modules we use move between releases
        check_vllm_version()
    except RuntimeError as e:
        raise StartupError(str(e)) from None
    early = early_parse(argv)
    bundle = None
    bundle_path: str | None = early.calib
    if early.demo:
        if early.calib or early.model:
            raise StartupError("--demo serves the embedded model and bundle; do not combine it "
                               "with --model or --calib")
        model_dir, demo_bundle = demo_paths()
        argv = demo_argv(argv, model_dir)
        bundle_path = str(demo_bundle)
        early.model = str(model_dir)
    if bundle_path is None:
        for opt in ("orca_delta", "orca_answer_budget", "orca_effort_map", "orca_give_up_delta",
                    "orca_give_up_message"):
            if getattr(early, opt) is not None:
                raise StartupError(f"--{opt.replace('_', '-')} needs --calib (a bundle)")
    else:
        # deferred: torch (not needed by --check-vllm)
        from orca_method.bundle import BundleError, load_bundle

        try:
            bundle = load_bundle(bundle_path)
            if early.orca_delta is not None:
                bundle.lam(early.orca_delta)
            if early.orca_give_up_delta is not None:
                bundle.mu(early.orca_give_up_delta)
        except BundleError as e:
            raise StartupError(str(e)) from None
        try:
            check_effort_map(early.orca_effort_map or {}, bundle)
        except BundleError as e:
            raise StartupError(f"--orca-effort-map: {e}") from None
        if bundle.lambdas_from:
            print(f"{PROG}: note: lambda* in {bundle_path} {bundle.lambdas_from}", file=sys.stderr,
                  flush=True)
    # deferred: scipy (not needed by --check-vllm)
    from orca_serve.live_audit.options import check_audit_args

    try:
        check_audit_args(early, has_bundle=bundle is not None)
    except ValueError as e:
        raise StartupError(str(e)) from None
    check_admin_key(early, has_bundle=bundle is not None)
    if bundle is not None and early.speculative_config:
        refuse_unsupported(argparse.Namespace(speculative_config=early.speculative_config))
    checked = facts = None
    if bundle is not None and early.model:
        facts = check_bundle(bundle, early.model, **_identity(early, bundle), **_model_kw(early))
        checked = (early.model, tuple(sorted(_model_kw(early).items())))

    # -- vLLM from here on -----------------------------------------------------------------
    if bundle is not None:
        note = prepare_environment()  # the tested V1 model runner unless the environment chose
        if note:
            print(f"{PROG}: note: {note}", file=sys.stderr, flush=True)

    try:
        parser = launch.serve_parser(PROG, __doc__.split("\n\n")[0])
    except Exception as e:
        if "-h" in argv or "--help" in argv:
            help_without_vllm(e)
        raise  # vLLM's own error (e.g. no device it can run on), as vLLM's server shows it
    add_orca_args(parser)
    args = parser.parse_args(argv)
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    try:
        launch.validate_serve_args(args)
    except (ValueError, TypeError) as e:
        raise StartupError(str(e).removeprefix("Error: ")) from None
    if args.demo:
        args.calib = bundle_path
        if not args.served_model_name and bundle is not None:
            args.served_model_name = [bundle.model.name]  # not the install path
    keep_prefills_whole(args)

    # deferred: torch (not needed by --check-vllm)
    from orca_serve.assembly import build_server, orca_defaults
    from orca_serve.server import run

    if bundle is not None:
        model_kw = {"tokenizer": args.tokenizer, "revision": args.revision,
                    "tokenizer_revision": args.tokenizer_revision,
                    "hf_config_path": args.hf_config_path,
                    "trust_remote_code": bool(args.trust_remote_code)}
        if checked != (args.model, tuple(sorted(model_kw.items()))):
            facts = check_bundle(bundle, args.model, **_identity(args, bundle), **model_kw)
        refuse_unsupported(args)

        defaults = orca_defaults(args, bundle)
        # Off in the engine unless the request says otherwise: the server writes every setting
        # (orca_enabled included) into the requests of the routes whose responses report what
        # orca did (orca_serve.apis); requests on other routes (the batch route, ...) run
        # without it rather than being cut short silently.
        merge_engine_args(args, engine_kwargs(
            str(Path(bundle_path).absolute()),
            defaults={"enabled": 0, "delta": defaults.delta, "policy": defaults.policy,
                      "answer_budget": defaults.answer_budget,
                      "give_up_policy": defaults.give_up_policy,
                      "give_up_message": args.orca_give_up_message}))
        args.calib = str(Path(bundle_path).absolute())

    launch.configure_logging(args)

    log_like_vllm()
    os.environ[ENV_SERVER] = "1"  # our server exports the orca metrics, not the stat logger
    if bundle is None:
        return run(args, build_server(args))
    from orca_serve.live_audit.live import make_live_audit  # deferred: torch

    def make_audit(b: Any, registry: Any, model_name: str, store: bool) -> Any:
        return make_live_audit(args, b, registry, model_name, store=store)

    try:
        server = build_server(args, bundle, make_audit=make_audit,
                              check=lambda b: check_served(b, facts, args.model,
                                                           **_identity(args, b)))
    except (OSError, ValueError) as e:  # the audit directory cannot be written
        raise StartupError(f"--orca-audit-dir: {e}") from None
    run(args, server)

if __name__ == "__main__":
    main()
