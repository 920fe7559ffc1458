"""Rebuild the demo bundle (orca_serve/demo/bundle.json) from the toy job, in one command.

    python -m calibration.toy.demo_bundle    # from the repository root

(`--job calibration/jobs/toy.yaml`, `--out orca_serve/demo/bundle.json` by default.)

Runs (or resumes) `orca-calibrate run` on the job, which collects with the embedded model,
trains the probe and calibrates with the job's label mode, then writes the job's bundle as the
demo's: the model named `orca-toy-reasoner` (the name `orca-serve --demo` serves it under; the
job records the folder it loaded the model from, which differs per install) and the provenance's
paths relative to the repository, sealed again. Refused unless the bundle is what the demo
needs: consistency labels (what the live audit labels by, so `--orca-on-alarm` acts on it) and a
drift reference (so `orca-serve --demo --orca-audit-rate 1` exports the drift metrics).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from calibration.job import load_job, run_job
from orca_method.bundle import Bundle, load_bundle, save_bundle
from orca_serve.live_audit.labeller import AUDIT_LABEL_MODE

ROOT = Path(__file__).parents[2]
DEMO_MODEL_NAME = "orca-toy-reasoner"


def _relative(value: object) -> object:
    """A path inside the repository as a repository-relative path; anything else as it is."""
    if not isinstance(value, str) or "/" not in value:
        return value
    try:
        return str(Path(value).resolve().relative_to(ROOT.resolve()))
    except ValueError:
        return value


def demo_bundle(job_bundle: Bundle) -> Bundle:
    """The job's bundle as the demo ships it (see the module docstring); raises ValueError."""
    if job_bundle.label_mode != AUDIT_LABEL_MODE:
        raise ValueError(f"the job calibrated with {job_bundle.label_mode} labels; the demo "
                         f"bundle needs {AUDIT_LABEL_MODE} labels (train.label_mode in the job)")
    if job_bundle.drift is None:
        raise ValueError("the job's bundle has no drift reference")
    model = job_bundle.model.model_copy(update={"name": DEMO_MODEL_NAME})
    provenance = {k: _relative(v) for k, v in job_bundle.provenance.items()}
    return job_bundle.model_copy(update={"model": model, "provenance": provenance,
                                         "checksum": ""})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m calibration.toy.demo_bundle",
                                 description=__doc__.split("\n\n")[0])
    # relative, as the job was first run: the job's stage fingerprints hold its paths as spelled
    ap.add_argument("--job", default="calibration/jobs/toy.yaml")
    ap.add_argument("--out", default="orca_serve/demo/bundle.json")
    a = ap.parse_args(argv)

    job = Path(a.job)
    run_job(job)
    try:
        bundle = demo_bundle(load_bundle(Path(load_job(job)["out"]) / "bundle.json"))
    except ValueError as e:
        print(f"demo_bundle: error: {e}", file=sys.stderr)
        return 2
    sealed = save_bundle(bundle, a.out)
    print(f"wrote {a.out}: {sealed.label_mode} labels, n_cal {sealed.ltt.n_cal}, drift reference "
          f"of {len(sealed.drift.early_mean)}, checksum {sealed.checksum}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
