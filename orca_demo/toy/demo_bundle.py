"""Rebuild a demo bundle (orca_serve/demo/bundle.json) from its job, in one command.

    python -m orca_demo.toy.demo_bundle    # from the repository root
    python -m orca_demo.toy.demo_bundle --reasoner long    # orca_serve/demo/long/bundle.json

(`--job orca_calibrate/jobs/<reasoner>.yaml`, `--out` the reasoner's demo folder by default.)

Runs (or resumes) `orca-calibrate run` on the job, which collects with the embedded model,
trains the probe and calibrates with the job's label mode, then writes the job's bundle as the
demo's: the model named `orca-toy-reasoner` (the name `orca-serve --demo` serves it under; the
job records the folder it loaded the model from, which differs per install) and the provenance's
paths relative to the repository, sealed again. Refused unless the bundle is what the demo
needs: consistency labels (what the live audit labels by, so `--orca-on-alarm` acts on it) and a
drift reference (so `orca-serve --demo --orca-audit-rate 1` exports the drift metrics). The long
reasoner's is served as `orca-long-reasoner`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from orca_calibrate.job import load_job, run_job
from orca_method.bundle import Bundle, load_bundle, save_bundle
from orca_serve.live_audit.labeller import AUDIT_LABEL_MODE
from orca_serve.startup.preflight import DEMOS

ROOT = Path(__file__).parents[2]
# reasoner (orca-serve --demo NAME; its folder: orca_serve.startup.preflight.DEMOS): (job, served name)
JOBS = {"toy": ("orca_calibrate/jobs/toy.yaml", "orca-toy-reasoner"),
        "long": ("orca_calibrate/jobs/long.yaml", "orca-long-reasoner")}


def demo_folder(name: str) -> Path:
    """The demo's folder in this checkout (model/ and bundle.json)."""
    return ROOT / "orca_serve" / "demo" / DEMOS[name]


def _relative(value: object) -> object:
    """A path inside the repository as a repository-relative path, also within lists and
    mappings (the groups' `group_data`); anything else as it is."""
    if isinstance(value, list):
        return [_relative(v) for v in value]
    if isinstance(value, dict):
        return {k: _relative(v) for k, v in value.items()}
    if not isinstance(value, str) or "/" not in value:
        return value
    try:
        return str(Path(value).resolve().relative_to(ROOT.resolve()))
    except ValueError:
        return value


def demo_bundle(job_bundle: Bundle, name: str = JOBS["toy"][1]) -> Bundle:
    """The job's bundle as the demo ships it (see the module docstring); raises ValueError."""
    if job_bundle.label_mode != AUDIT_LABEL_MODE:
        raise ValueError(f"the job calibrated with {job_bundle.label_mode} labels; the demo "
                         f"bundle needs {AUDIT_LABEL_MODE} labels (train.label_mode in the job)")
    if job_bundle.drift is None:
        raise ValueError("the job's bundle has no drift reference")
    model = job_bundle.model.model_copy(update={"name": name})
    provenance = {k: _relative(v) for k, v in job_bundle.provenance.items()}
    return job_bundle.model_copy(update={"model": model, "provenance": provenance,
                                         "checksum": ""})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orca_demo.toy.demo_bundle",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--reasoner", choices=sorted(JOBS), default="toy")
    # relative, as the job was first run: the job's stage fingerprints hold its paths as spelled
    ap.add_argument("--job", default=None, help="default: the reasoner's job")
    ap.add_argument("--out", default=None, help="default: bundle.json in the reasoner's demo folder")
    a = ap.parse_args(argv)
    default_job, name = JOBS[a.reasoner]
    job = Path(a.job or default_job)
    out = a.out or str((demo_folder(a.reasoner) / "bundle.json").relative_to(ROOT))
    run_job(job)
    try:
        bundle = demo_bundle(load_bundle(Path(load_job(job)["out"]) / "bundle.json"), name)
    except ValueError as e:
        print(f"demo_bundle: error: {e}", file=sys.stderr)
        return 2
    sealed = save_bundle(bundle, out)
    print(f"wrote {out}: {sealed.label_mode} labels, n_cal {sealed.ltt.n_cal}, drift reference "
          f"of {len(sealed.drift.early_mean)}, checksum {sealed.checksum}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
