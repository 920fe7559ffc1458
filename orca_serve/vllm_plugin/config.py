"""How a caller turns the plugin on: engine kwargs, environment, supported-engine checks, logs.

    from orca_serve.vllm_plugin.config import engine_kwargs, prepare_environment
    prepare_environment()
    llm = vllm.LLM(model, **engine_kwargs("bundle.json"))

`additional_config["orca"]` (VllmConfig.additional_config reaches every worker, and the processor
reads it from the `vllm_config` its constructor gets) is the wire form of one
`orca_serve.settings.engine_config.EngineConfig`: the bundle, the record-mode settings, the
request defaults (`RequestDefaults`: the server's --orca-* options) and the bookkeeping of
unfetched results.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orca_method.errors import first_line, shown
from orca_serve.settings.contract import DEFAULTS, RequestDefaults
from orca_serve.settings.engine_config import KEY, EngineConfig

# The vLLM releases the plugin is written and tested for (PEP 440). One definition: orca-serve's
# start, the plugin's load in every vLLM process and pyproject's `gpu` extra follow it.
SUPPORTED_VLLM = ">=0.31,<0.34"
ENV_ANY_VLLM = "ORCA_ANY_VLLM"  # "1": skip the check (scripts/check_vllm_version.sh)
# vLLM calls a worker extension's `init_worker_extension(self)` once the model runner exists from
# this release on (0.33's `WorkerWrapperBase.init_device`); before it, the processors find the
# runner on their call stack (orca_serve/vllm_compat/runner.py)
WORKER_HOOK_SINCE = "0.33"

PROCESSOR_FQCN = "orca_serve.vllm_plugin.processor:OrcaLogitsProcessor"
WORKER_EXTENSION = "orca_serve.vllm_plugin.worker.OrcaWorkerExtension"
ENV_BUNDLE = "ORCA_BUNDLE"  # fallback when a front end drops additional_config
# speculative methods tested with the plugin (V1 runner; docs/PLUGIN.md, "Speculative decoding")
SPEC_METHODS = ("ngram", "draft_model")
ENV_V2_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"
MRV2_SPEC_REFUSAL = ("speculative decoding with orca runs on vLLM's V1 model runner only (the "
                     "Model Runner V2 adapter does not read draft rows yet); unset "
                     f"{ENV_V2_RUNNER} or set it to 0")
V1_DEFAULT_NOTE = ("orca keeps vLLM on its V1 model runner, the one it is tested on inside an "
                   "engine (its Model Runner V2 adapter has run at vLLM's processor interface "
                   f"only); set {ENV_V2_RUNNER}=1 to opt in to Model Runner V2")



def orca_settings(bundle_path: str | os.PathLike | None, *, record: bool = False,
                  segmentation: Mapping[str, Any] | None = None,
                  think: Mapping[str, Any] | None = None,
                  normalization: str | None = None,
                  defaults: RequestDefaults = DEFAULTS) -> EngineConfig:
    """The engine config; the record-mode settings are checked as, and default to, Bundle's."""
    # deferred: torch (the plugin package stays light)
    from orca_method.bundle import Segmentation, ThinkTags

    def as_dict(x: Any) -> dict[str, Any]:
        return x.model_dump() if hasattr(x, "model_dump") else dict(x or {})

    return EngineConfig(
        bundle=str(Path(bundle_path).absolute()) if bundle_path is not None else None,
        record=bool(record),
        segmentation=Segmentation(**as_dict(segmentation)).model_dump(),
        think=ThinkTags(**as_dict(think)).model_dump(),
        **({} if normalization is None else {"normalization": normalization}),
        defaults=defaults)


def engine_kwargs(bundle_path: str | os.PathLike | None, *, record: bool = False,
                  **settings: Any) -> dict[str, Any]:
    """kwargs to add to `vllm.LLM(...)` / `AsyncEngineArgs(...)` to run the plugin.

    `bundle_path=None` with `record=True`: capture and segmentation only (no probe), for
    calibration's collect step; extra keyword arguments (segmentation=, think=,
    normalization=) set how that record mode segments and pools.
    """
    if bundle_path is not None and not Path(bundle_path).is_file():
        raise FileNotFoundError(f"bundle {bundle_path} not found")
    return {
        "logits_processors": [PROCESSOR_FQCN],
        "worker_extension_cls": WORKER_EXTENSION,
        "additional_config": {KEY: orca_settings(bundle_path, record=record,
                                                 **settings).to_dict()},
    }


CPU_KVCACHE_GIB = "4"


def prepare_environment() -> str | None:
    """Call before creating the engine; returns a note for the log, or None.

    The model runner: vLLM 0.32/0.33 picks Model Runner V2 on GPUs unless
    `VLLM_USE_V2_MODEL_RUNNER` says otherwise (`VllmConfig.use_v2_model_runner`), and our MRV2
    adapter has not yet run inside a real engine. So unless the environment chose a runner,
    this sets the variable to 0 (the tested V1 runner) and returns `V1_DEFAULT_NOTE` (how to
    opt in); `VLLM_USE_V2_MODEL_RUNNER=1` is left alone. vLLM's CPU build runs V1 either way
    (no Triton CPU backend). On the CPU build an unset VLLM_CPU_KVCACHE_SPACE makes engine
    start fail whenever the NUMA node reports less free memory than the utilisation target
    (docs/VLLM-CPU.md); we default it to 4 GiB of KV cache. GPU builds ignore the variable.
    """
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)
    if os.environ.get(ENV_V2_RUNNER, "").strip():
        return None
    os.environ[ENV_V2_RUNNER] = "0"
    return V1_DEFAULT_NOTE


def installed_vllm_version() -> str | None:
    """vLLM's version: from the imported module if any, else from the installed distribution
    (`vllm`, or the CPU build's `vllm-cpu`), without importing vLLM (that takes seconds)."""
    # deferred: importlib.metadata (~20 ms; the plugin package stays light)
    from importlib import metadata

    mod = sys.modules.get("vllm")
    if mod is not None and getattr(mod, "__version__", None):
        return str(mod.__version__)
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version(version: str | None = None) -> None:
    """Refuse a vLLM outside SUPPORTED_VLLM with a one-line RuntimeError.

    The plugin reaches into vLLM internals (the LM-head layer, the model runner's batch, the V1
    logits-processor interface, the server's launcher modules) that move between minor releases;
    on another release it could start and compute wrong stops silently. Development builds count
    as their release (0.32.1.dev3+g1234 is 0.32.1). `ORCA_ANY_VLLM=1` skips the check (for
    trying another release: scripts/check_vllm_version.sh).
    """
    if os.environ.get(ENV_ANY_VLLM, "").strip() == "1":
        return
    # deferred: packaging (~4 ms; the plugin package stays light)
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion

    v = version if version is not None else installed_vllm_version()
    if v is None:
        raise RuntimeError(f"vLLM is not installed; orca-serve needs vllm{SUPPORTED_VLLM}")
    try:
        release = _release(v)
    except InvalidVersion:
        raise RuntimeError(f"cannot read vLLM's version {v!r}; orca-serve needs "
                           f"vllm{SUPPORTED_VLLM} (set {ENV_ANY_VLLM}=1 to try anyway)") from None
    if release not in SpecifierSet(SUPPORTED_VLLM):
        raise RuntimeError(f"vLLM {v} is not supported: orca-serve needs vllm{SUPPORTED_VLLM} "
                           f"(set {ENV_ANY_VLLM}=1 to try anyway, at your own risk)")


def _release(version: str) -> Any:
    """The release a version string names (`packaging.version.Version`): development builds
    count as their release (0.32.1.dev3+g1234 is 0.32.1). InvalidVersion when unreadable."""
    from packaging.version import Version  # deferred: packaging (the plugin package stays light)

    return Version(Version(version).base_version)


def calls_worker_extension_hook(version: str | None = None) -> bool:
    """Whether the installed vLLM (or `version`) calls a worker extension's
    `init_worker_extension` once the model runner exists: from WORKER_HOOK_SINCE on."""
    from packaging.version import InvalidVersion  # deferred: packaging

    v = version if version is not None else installed_vllm_version()
    try:
        return v is not None and _release(v) >= _release(WORKER_HOOK_SINCE)
    except InvalidVersion:
        return False


def _get(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def check_engine_supported(engine_args: Any = None) -> None:
    """Refuse engine setups the plugin cannot serve correctly, with a clear reason.

    `engine_args`: a dict of engine kwargs, an `EngineArgs`, parsed CLI arguments or a
    `VllmConfig` (None: nothing to check). Both model runners are served (Model Runner V2
    through `mrv2.py`, tested at vLLM's processor interface only; see docs/PLUGIN.md).
    """
    if engine_args is None:
        return
    refusal = speculation_refusal(speculative_method(_get(engine_args, "speculative_config")))
    if refusal:
        raise RuntimeError(refusal)
    sharded = _get(engine_args, "enable_batch_sharded_sampling")
    if sharded is None:
        sharded = _get(_get(engine_args, "parallel_config"), "enable_batch_sharded_sampling")
    if sharded:
        raise RuntimeError("orca-serve cannot run with batch-sharded sampling: Model Runner V2 "
                           "then computes logits without the LM-head layer the plugin reads "
                           "hidden states from; remove --enable-batch-sharded-sampling")


def speculative_method(spec: Any) -> str | None:
    """The method of a speculative config (a JSON string, a dict or vLLM's SpeculativeConfig);
    "" when there is none. vLLM's own inference: model "ngram" is n-gram, and a config that
    names neither method nor model has none we can tell (None). A string that is not JSON (as
    vLLM parses --speculative-config) is a ValueError saying so."""
    if not spec:
        return ""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise ValueError(f"--speculative-config {shown(spec)} is not valid JSON "
                             f"({first_line(e)}); e.g. '{{\"method\": \"ngram\", "
                             f"\"num_speculative_tokens\": 3}}'") from None
    method, model = _get(spec, "method"), _get(spec, "model")
    if method in ("ngram", "[ngram]") or (method is None and model in ("ngram", "[ngram]")):
        return "ngram"
    return None if method is None else str(method)


def speculation_refusal(method: str | None) -> str | None:
    """One line refusing a speculative method the plugin is not tested with; None when the
    method is served ("" = no speculation)."""
    if method == "" or method in SPEC_METHODS:
        return None
    named = "a config that names no method" if method is None else f"method {method!r}"
    return (f"speculative decoding with {named} is not supported with orca (tested: "
            f"{', '.join(SPEC_METHODS)}; set \"method\" in the speculative config)")


def pin_runner_for_speculation(speculative_config: Any) -> None:
    """With speculative decoding, make vLLM pick the V1 model runner (the adapter that handles
    draft rows): set VLLM_USE_V2_MODEL_RUNNER=0, or refuse when the caller asked for Model
    Runner V2. Nothing without a speculative config. Call before the engine starts."""
    if speculative_method(speculative_config) == "":
        return
    if os.environ.get(ENV_V2_RUNNER, "").strip().lower() in ("1", "true"):
        raise RuntimeError(MRV2_SPEC_REFUSAL)
    os.environ[ENV_V2_RUNNER] = "0"


# vLLM configures logging for its `vllm` logger only (a handler on it, `propagate` off); the root
# logger keeps Python's defaults, so a line logged under `orca_serve.*` below WARNING is dropped
# and one at WARNING or above reaches stderr only through Python's last-resort handler,
# unformatted. Reload outcomes, the audit's and the gate's alarms are lines operators must see,
# from the API server and from the engine process alike.
ORCA_LOGGER = "orca_serve"
VLLM_LOGGER = "vllm"


def log_with_vllm() -> None:
    """Give the `orca_serve` logger vLLM's handlers and level (once vLLM configured logging:
    importing vLLM does). With vLLM's configuration off (VLLM_CONFIGURE_LOGGING=0) its logger has
    no handler and this does nothing: whoever configured logging decides."""
    vllm = logging.getLogger(VLLM_LOGGER)
    if not vllm.handlers:
        return
    orca = logging.getLogger(ORCA_LOGGER)
    for h in vllm.handlers:
        if h not in orca.handlers:
            orca.addHandler(h)
    orca.setLevel(vllm.level)
    orca.propagate = False
