"""orca-serve's start-up before vLLM is imported: our options, the demo, the bundle and its
checks against the model (config.json and tokenizer), the live audit's and hot reload's options.
A wrong bundle or option is refused here in seconds and in one line (exit code 2), long before
vLLM loads weights. Nothing here imports vLLM (`--check-vllm` and the version check run first).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orca_method.errors import first_line
from orca_method.gate_alarm import DEFAULT_ALARM_LEVEL
from orca_method.outcomes import GIVE_UP_POLICIES
from orca_serve.checks.argtypes import (OneLineParser, OptionError, effort_map, fraction, integer,
                                       level, waves)
from orca_serve.settings.contract import (
    DEFAULTS,
    GIVE_UP_MESSAGE,
    POLICIES,
    SHIFT_ACTIONS,
)
from orca_serve.settings.effort import DEFAULT_EFFORT_MAP, describe
from orca_serve.checks.bundle import ModelFacts, check_bundle
from orca_serve.checks.errors import PROG, StartupError
from orca_serve.vllm_plugin.config import (
    check_engine_supported,
    check_vllm_version,
    pin_runner_for_speculation,
)

if TYPE_CHECKING:
    from orca_method.bundle import Bundle, Generation

DEMO_REASONING_PARSER = "deepseek_r1"  # what --demo implies (unless the command line names one)
# --demo NAME: the embedded reasoners, by their folder under orca_serve/demo/ (model/, bundle.json)
DEMOS = {"toy": "", "long": "long"}
# --orca-* options that mean nothing without a bundle
NEED_BUNDLE = ("orca_delta", "orca_answer_budget", "orca_effort_map", "orca_give_up_delta",
               "orca_give_up_message", "orca_vote_waves")


def add_orca_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("orca-serve", "Calibrated early stopping of reasoning (ORCA)")
    g.add_argument("--calib", default=None, metavar="BUNDLE",
                   help="Calibration bundle (bundle.json). Without it the server is plain vLLM.")
    g.add_argument("--demo", nargs="?", const="toy", default=None, choices=sorted(DEMOS),
                   metavar="NAME", help="Serve an embedded demo model and its bundle "
                   "(orca_serve/demo/): `toy` (the default, ~5 steps per trace) or `long` "
                   "(tens to hundreds of steps, up to 5,000 tokens).")
    g.add_argument("--check-vllm", action="store_true", default=False,
                   help="Check that every vLLM name orca-serve relies on beyond vLLM's extension "
                   "points resolves in the installed vLLM (one line each; exit 0 when all do), "
                   "without starting an engine, then exit. Works on any vLLM release.")
    g.add_argument("--orca-delta", type=fraction(open_interval=True), default=None, metavar="DELTA",
                   help="Default risk level delta for requests that do not set one; must have a "
                   "lambda* in the bundle. None: the bundle's default_delta.")
    g.add_argument("--orca-policy", choices=POLICIES, default=DEFAULTS.policy,
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
                   default=DEFAULTS.give_up_policy,
                   help="What a given-up request returns: guess (its best current answer, as a "
                   "stop would, flagged ended: gave_up) or message (the end-of-thinking text and "
                   "--orca-give-up-message).")
    g.add_argument("--orca-give-up-message", default=None, metavar="TEXT",
                   help=f"The message of --orca-give-up-policy message (\"{GIVE_UP_MESSAGE}\").")
    g.add_argument("--orca-shift-alpha", type=fraction(open_interval=False), default=None,
                   metavar="ALPHA",
                   help="The shift gate's level for requests that set no orca.shift_alpha: at "
                   "most ALPHA of requests like the calibration set are flagged (0: no gate). "
                   "None: the bundle's. Only for bundles with a shift_gate block.")
    g.add_argument("--orca-shift-give-up-alpha", type=fraction(open_interval=False), default=None,
                   metavar="ALPHA",
                   help="The give-up side's gate level for requests that set no "
                   "orca.shift_give_up_alpha, at least the stop side's: a request whose p-value is "
                   "at most ALPHA never gives up (at most ALPHA of requests like the calibration "
                   "set). None: the bundle's (its alpha when its gate block has no give_up_alpha).")
    g.add_argument("--orca-shift-action", choices=SHIFT_ACTIONS,
                   default=DEFAULTS.shift_action,
                   help="What a request the shift gate flags gets: strict (the default: the "
                   "bundle's most conservative lambda*, never gives up), full (full reasoning, "
                   "never gives up), or off (no gate).")
    g.add_argument("--orca-gate-alarm", type=level, default=DEFAULT_ALARM_LEVEL,
                   metavar="LEVEL",
                   help="The gate alarm: a sequential test on the shift gate's flags that, once "
                   "the flag rate is clearly above what traffic like the calibration set allows, "
                   "serves every request as a flagged one until the rate is back down. LEVEL: "
                   "its chance of ever being raised on such traffic (0: no alarm). Each engine "
                   "core runs its own, fed at each request's gate step. Only for bundles with "
                   "a shift_gate block, with the gate on.")
    g.add_argument("--orca-vote-waves", type=waves, default=None, metavar="A+B+...",
                   help="Launch the samples of orca.samples in waves of these sizes (e.g. "
                   "1+1+2+4), each once the ones before have finished without settling the "
                   "vote: fewer tokens, more latency. The bundle's consensus block must be "
                   "certified for this schedule. None: all at once.")
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

    add_audit_args(g)  # in the group --help=orca-serve shows (and every error points to)
    return parser


# Options of vLLM's that matter before vLLM is imported (model identity for the bundle check).
_EARLY_VLLM = {"--model": None, "--tokenizer": None, "--revision": None,
               "--tokenizer-revision": None, "--hf-config-path": None}


class _EarlyParser(OneLineParser):
    """A bad option is one line (a StartupError: exit code 2), not argparse's usage text."""

    hint = "--help=orca-serve lists the orca options"


def early_parse(argv: list[str]) -> argparse.Namespace:
    """Our options plus the model-identity options, ignoring everything else. A bad value of
    one of them is refused in one line here, before vLLM's parser (whose errors print its whole
    usage) sees it."""
    p = _EarlyParser(prog=PROG, add_help=False, allow_abbrev=False)
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
    try:
        ns, _ = p.parse_known_args(norm)
    except OptionError as e:
        raise StartupError(str(e)) from None
    return ns


def demo_paths(name: str = "toy") -> tuple[Path, Path]:
    """The model folder and bundle of an embedded demo (DEMOS)."""
    root = Path(str(resources.files("orca_serve"))) / "demo" / DEMOS[name]
    model, bundle = root / "model", root / "bundle.json"
    missing = [str(p) for p in (model / "config.json", bundle) if not p.exists()]
    if missing:
        raise StartupError(f"--demo: the embedded demo is not installed ({', '.join(missing)} "
                           "missing); reinstall orca-serve or pass --model and --calib")
    return model, bundle


def _named(argv: list[str], *options: str) -> bool:
    """Whether the command line sets one of `options` (`--opt value` or `--opt=value`)."""
    return any(a.split("=", 1)[0] in options for a in argv)


def demo_argv(argv: list[str], model_dir: Path) -> list[str]:
    """The command line --demo serves: the embedded model, and its reasoning parser unless the
    command line names one (the demo model opens <think> in its chat template and closes it
    with </think>: without the parser its reasoning would be returned as `content`)."""
    return ["--model", str(model_dir), *argv,
            *([] if _named(argv, "--reasoning-parser", "--reasoning_parser")
              else ["--reasoning-parser", DEMO_REASONING_PARSER])]


def bundle_dtype_argv(argv: list[str], dtype: str | None) -> list[str]:
    """The command line with `--dtype` the bundle's (`Bundle.collected_under`: the dtype its
    hidden states were computed in), unless it names a dtype or a vLLM config file (which may):
    vLLM's `auto` may compute in another (its CPU build computes a float32 model in bfloat16),
    hidden states the probe was not calibrated on. None (a bundle that records none): as given."""
    if dtype is None or _named(argv, "--dtype", "--config"):
        return argv
    return [*argv, "--dtype", dtype]


ModelOption = str | bool | None
# the served model and the options its facts were read with, sorted: a later read with the same
# key reads the same facts (`Preflight.checked`)
ModelKey = tuple[str, tuple[tuple[str, ModelOption], ...]]


def model_kw(ns: argparse.Namespace) -> dict[str, ModelOption]:
    return {"tokenizer": ns.tokenizer, "revision": ns.revision,
            "tokenizer_revision": ns.tokenizer_revision, "hf_config_path": ns.hf_config_path,
            "trust_remote_code": bool(ns.trust_remote_code)}


def model_key(ns: argparse.Namespace) -> ModelKey:
    return ns.model, tuple(sorted(model_kw(ns).items()))


def identity(ns: argparse.Namespace, bundle: Any) -> dict[str, Any]:
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


@dataclass
class Preflight:
    """What start-up knows before vLLM: the command line vLLM will parse (the demo's added),
    the bundle (None: plain vLLM) and what the checks against the model found."""

    argv: list[str]
    early: argparse.Namespace
    bundle: Bundle | None = None
    bundle_path: str | None = None
    facts: ModelFacts | None = None  # the model the bundle was checked against
    checked: ModelKey | None = None  # the model and options `facts` were read with
    # what vLLM serves (dtype, default sampling: `launch.served_generation`), read once at start
    # for the start's and every reload's `serving_warnings`; None: unknown
    served: tuple[Generation, dict[str, float]] | None = None


def preflight(argv: list[str]) -> Preflight:
    """Every check that needs no vLLM, in the order that refuses a wrong start fastest."""
    try:  # before any vLLM import: the launcher modules we use move between releases
        check_vllm_version()
    except RuntimeError as e:
        raise StartupError(str(e)) from None
    early = early_parse(argv)
    if early.calib is not None and not early.calib.strip():  # Path("") is the working directory
        raise StartupError("--calib is empty: give a bundle file (bundle.json)")
    pre = Preflight(argv, early, bundle_path=early.calib)
    if early.demo:
        if early.calib or early.model:
            raise StartupError("--demo serves the embedded model and bundle; do not combine it "
                               "with --model or --calib")
        model_dir, demo_bundle = demo_paths(early.demo)
        pre.argv, pre.bundle_path, early.model = (demo_argv(argv, model_dir), str(demo_bundle),
                                                   str(model_dir))
    if pre.bundle_path is None:
        for opt in NEED_BUNDLE:
            if getattr(early, opt) is not None:
                raise StartupError(f"--{opt.replace('_', '-')} needs --calib (a bundle)")
    else:
        pre.bundle = load_checked(pre.bundle_path, early)
        under = pre.bundle.collected_under()
        pre.argv = bundle_dtype_argv(pre.argv, None if under is None else under.dtype)
    # deferred: scipy (not needed by --check-vllm)
    from orca_serve.live_audit.options import audit_labelling, check_audit_args

    try:
        check_audit_args(early, has_bundle=pre.bundle is not None)
        if pre.bundle is not None:
            audit_labelling(early, pre.bundle)  # a flag that contradicts the bundle's labelling
    except ValueError as e:
        raise StartupError(str(e)) from None
    check_admin_key(early, has_bundle=pre.bundle is not None)
    if pre.bundle is not None and early.speculative_config:
        refuse_unsupported(argparse.Namespace(speculative_config=early.speculative_config))
    if pre.bundle is not None and early.model:
        pre.facts = check_bundle(pre.bundle, early.model, **identity(early, pre.bundle),
                                 **model_kw(early))
        pre.checked = model_key(early)
    return pre


def load_checked(path: str, early: argparse.Namespace) -> Bundle:
    """The bundle at `path`, satisfying the options (`check_options`, as on every reload)."""
    # deferred: torch (not needed by --check-vllm)
    from orca_method.bundle import BundleError, load_bundle
    from orca_serve.checks.bundle import check_options

    try:
        bundle = load_bundle(path)
        check_options(bundle, delta=early.orca_delta, give_up_delta=early.orca_give_up_delta,
                      give_up_policy=early.orca_give_up_policy,
                      effort_map=early.orca_effort_map or {}, shift_alpha=early.orca_shift_alpha,
                      shift_give_up_alpha=early.orca_shift_give_up_alpha,
                      vote_waves=early.orca_vote_waves)
    except BundleError as e:
        raise StartupError(str(e)) from None
    if bundle.lambdas_from:
        print(f"{PROG}: note: lambda* in {path} {bundle.lambdas_from}", file=sys.stderr,
              flush=True)
    return bundle
