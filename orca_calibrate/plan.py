"""`orca-calibrate plan --config JOB.yaml`: what a job will cost, from a short pilot of it.

The pilot runs the job's own collection (same engine arguments, sampling, labelling) on a few
dozen of its prompts, drawn at random, into a scratch folder, and one epoch of the job's
meta-training on what it collected. From those it measures tokens, steps and answer probes per
trace and the engine's time per trace, and scales them to the job: collection wall time on the
configured engines (one engine's start included once; `engines: N` collect at once, so the
time per trace is divided by N), device-hours (that time x the devices of all engines: N x
tensor_parallel_size x pipeline_parallel_size), training time (epochs x the training
split's share of the traces), disk for the step embeddings (steps x the model's hidden size
x the job's embedding dtype), and the device memory record mode holds while collecting: each
trace's step embeddings stay on the device, float32, until its record is fetched, so `batch`
traces of (at most) the pilot's longest steps, beyond what `gpu_memory_utilization` gives
vLLM. With `label_steps: selective` the estimate counts a probe at every step of the calibration
split too: an upper bound (how many the label stage saves depends on the trained probe). Time
per trace is measured at the pilot's batch: a pilot smaller than the job's `batch` runs fewer
traces at once than the job will, so its estimate errs high.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from orca_calibrate.collect import Collector, CollectSettings, read_prompts, trace_keys
from orca_calibrate.job import TRAIN_JOB_KEYS, job_split, label_modes, load_job
from orca_calibrate.job_options import split_options
from orca_calibrate.probe_variants import PROBES
from orca_calibrate.train_defaults import DEFAULT_D_H, DEFAULT_PROBE
from orca_method.trajectories import DTYPES, RECORDED_DTYPE, Split, TrajectorySet, set_splits

DEFAULT_PILOT = 48  # prompts


@dataclass
class Plan:
    """The pilot's measurements and the job's estimates (seconds, bytes)."""

    pilot_traces: int
    engine_start_s: float
    tokens_per_trace: float
    steps_per_trace: float
    probes_per_trace: float
    generate_s_per_trace: float
    probe_s_per_trace: float
    pipelined_s_per_trace: float  # generating and probing at once (`schedule: pipelined`)
    train_s_per_trace_epoch: float
    job_traces: int
    train_traces: int
    epochs: int
    engines: int
    devices_per_engine: int
    device: str
    hidden_size: int
    dtype: str
    collect_s: float
    train_s: float
    wall_s: float
    device_hours: float
    embeddings_bytes: float
    longest_steps: int  # the pilot's longest trace
    batch: int  # traces in flight on each engine
    record_device_bytes: float  # their step embeddings, float32, on the device

    def lines(self) -> list[str]:
        engine = (f"generation and probes at once {self.pipelined_s_per_trace:.3f} s"
                  if self.pipelined_s_per_trace else
                  f"generation {self.generate_s_per_trace:.3f} s + probes "
                  f"{self.probe_s_per_trace:.3f} s")
        per = (f"{self.tokens_per_trace:,.0f} tokens, {self.steps_per_trace:.1f} steps, "
               f"{self.probes_per_trace:.1f} answer probes; {engine}")
        return [
            f"pilot: {self.pilot_traces} traces; engine start {self.engine_start_s:.0f} s",
            f"per trace: {per}",
            f"job: {self.job_traces} traces ({self.train_traces} in the training split)",
            f"collection: {_duration(self.collect_s)} on {self.engines} engine(s) x "
            f"{self.devices_per_engine} {self.device}(s)",
            f"training: {_duration(self.train_s)} ({self.epochs} epochs)",
            f"wall time: {_duration(self.wall_s)} (collection + training; LTT and evaluation "
            "take seconds)",
            f"{self.device}-hours: {self.device_hours:.2f}",
            f"disk: {self.embeddings_bytes / 2**20:,.1f} MiB of step embeddings "
            f"({self.job_traces} x {self.steps_per_trace:.1f} steps x {self.hidden_size} x "
            f"{self.dtype})",
            f"device memory: up to {self.record_device_bytes / 2**20:,.1f} MiB of step embeddings "
            f"while collecting ({self.batch} traces x {self.longest_steps} steps, the pilot's "
            f"longest, x {self.hidden_size} x {RECORDED_DTYPE}), beyond what "
            "gpu_memory_utilization gives vLLM",
        ]


def _duration(s: float) -> str:
    return f"{s:,.0f} s ({s / 3600:.2f} h)" if s >= 3600 else f"{s:,.0f} s ({s / 60:.1f} min)"


def _device() -> str:
    from orca_serve.vllm_compat.launch import is_cpu_platform  # deferred: vllm

    return "CPU" if is_cpu_platform() else "GPU"


def plan_job(path: Path, pilot: int = DEFAULT_PILOT, seed: int = 0,
             scratch: Path | None = None) -> Plan:
    """Run the pilot of the job at `path` (into `scratch`, default `<out>/plan`, emptied
    first) and estimate the whole job; writes `plan.json` into the scratch folder."""
    from orca_calibrate.train import train_probe, training_settings  # deferred: torch
    from orca_method.probe import ProbeSpec  # deferred: torch

    job = load_job(path)
    settings = CollectSettings(**(job.get("collect") or {}))
    prompts = read_prompts(Path(job["prompts"]))
    shifted = read_prompts(Path(job["shifted_prompts"])) if job.get("shifted_prompts") else []
    every = prompts + shifted
    chosen = random.Random(seed).sample(every, min(pilot, len(every)))
    scratch = scratch or Path(job["out"]) / "plan"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    t0 = time.perf_counter()
    with Collector(job["model"], settings) as collector:
        start = time.perf_counter() - t0
        hidden = collector.llm.llm_engine.model_config.get_hidden_size()
        stats = collector.run(chosen, scratch / "trajectories", progress=False)
    ts = TrajectorySet.open(scratch / "trajectories")
    n = len(ts)
    if n == 0:
        raise ValueError(f"the pilot's {len(chosen)} prompts gave no trace with a step")
    # one epoch of the job's training on the pilot traces, all of them as training
    set_splits(ts.path, {p.id: Split.TRAIN for p in ts.problems})
    ts = TrajectorySet.open(ts.path)
    tr = job.get("train") or {}
    name, options = tr.get("probe", DEFAULT_PROBE), {k: v for k, v in tr.items()
                                                  if k not in TRAIN_JOB_KEYS}
    epochs = 1 if name == "static" else training_settings(
        ProbeSpec(dim=ts.dim, **PROBES[name]), options)["epochs"]
    t1 = time.perf_counter()
    train_probe(ts, name, label_modes(job)["train.label_mode"], d_h=tr.get("d_h", DEFAULT_D_H),
                seed=tr.get("seed", 0), checkpoints=None, progress=False,
                **{**options, "epochs": 1, "epoch_select": "last"})
    train_per = (time.perf_counter() - t1) / n
    keys = [key for key, _ in trace_keys(prompts, settings.samples)]
    split = job_split(keys, split_options(job.get("split")))
    n_train = sum(s == Split.TRAIN for s in split.values())
    total = len(every) * settings.samples
    engine = settings.engine
    devices = (int(engine.get("tensor_parallel_size", 1))
               * int(engine.get("pipeline_parallel_size", 1)))
    steps = sum(p.n_steps for p in ts.problems) / n
    longest = max(p.n_steps for p in ts.problems)
    collect_s = start + total * stats.engine_s / n / settings.engines
    train_s = train_per * n_train * epochs
    out = Plan(
        pilot_traces=n, engine_start_s=start,
        tokens_per_trace=sum(p.extra["completion_tokens"] for p in ts.problems) / n,
        steps_per_trace=steps, probes_per_trace=stats.answer_probes / n,
        generate_s_per_trace=stats.generate_s / n, probe_s_per_trace=stats.probe_s / n,
        pipelined_s_per_trace=stats.pipelined_s / n,
        train_s_per_trace_epoch=train_per, job_traces=total, train_traces=n_train,
        epochs=epochs, engines=settings.engines, devices_per_engine=devices, device=_device(),
        hidden_size=hidden,
        dtype=settings.dtype, collect_s=collect_s, train_s=train_s,
        wall_s=collect_s + train_s, device_hours=collect_s * devices * settings.engines / 3600,
        embeddings_bytes=total * steps * hidden * DTYPES[settings.dtype].itemsize,
        longest_steps=longest, batch=settings.batch,
        record_device_bytes=settings.batch * longest * hidden
        * DTYPES[RECORDED_DTYPE].itemsize)
    (scratch / "plan.json").write_text(json.dumps(asdict(out), indent=1))
    return out

