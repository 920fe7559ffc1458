"""Data-parallel collection: N engines, each collecting a shard of the job's traces into a folder
of its own, then one merge into the job's trajectory directory (`collect.engines: N`).

Each engine is an independent vLLM `LLM` in its own process, on devices of its own (GPUs
`tensor_parallel_size x pipeline_parallel_size` apiece; on the CPU build, a share of the cores),
so a node's devices all work and none waits for another's batch. Trace k of the job's order
(`trace_keys`) goes to shard k mod N. A shard's folder is a trajectory directory per set
(`shards/shard-I/set-S`), so each shard resumes on its own after a kill; once every shard has
written its completion marker the merge appends every shard's problems to the job's directory
in the job's order (itself resumable: ids already there are skipped); the job removes the shard
folders once the merge is recorded.

The engines are the processes of one machine (`collect_shards`, the job's collect stage) or the
workers of a cluster, each running `orca-calibrate collect --config JOB --shard I` against one
shared job folder, merged by `orca-calibrate merge` (orca_calibrate/job.py; docs/CALIBRATE.md,
"Beyond one node"): the same spec (`write_spec`), worker (`run_shard`) and merge
(`merge_shards`) either way, so a collection started on one can be finished on the other.

The traces are those of a one-engine run with the same seed, sampled ones too: each trace draws
from its own generator, seeded by the job's seed and its id (`collect.trace_seed`), whatever
engine and batch it runs in; only floating-point differences between batch shapes could flip a
near-tie (none in tests/test_shards_engine.py at temperature 0.7).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from orca_calibrate.collect import PENDING_FILE, Collector, CollectSettings, Stats, trace_keys
from orca_calibrate.judge import JudgeSettings
from orca_method.files import write_atomic
from orca_method.trajectories import INFO_DEFAULTS, TrajectorySet, TrajectoryWriter
from orca_serve.checks.errors import Stopped, exit_on_sigterm


# the shards' folder in a job's `out`: spec, log, completion marker and trajectory folders per shard
SHARDS = "shards"
PR_SET_PDEATHSIG = 1  # prctl(2)'s option: the signal a process gets when its parent dies
STOP_WAIT_S = 120  # how long a stopped shard may take to shut its engine down before a SIGKILL
REAP_POLL_S = 0.2  # how often `reap_groups` looks whether an ended shard's group is empty


class ShardError(ValueError):
    """Shards that cannot be collected into or merged as asked; the message says which."""


def shard_of(ids: list[str], engines: int) -> dict[str, int]:
    """Prompt id -> its shard: the k-th prompt of the job's order goes to shard k mod `engines`
    (every sample of a prompt in one shard; shards of equal size, long and short prompts
    alike spread)."""
    return {pid: k % engines for k, pid in enumerate(ids)}


def device_env(shard: int, engines: int, settings: CollectSettings,
               environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment that gives shard `shard` its own devices: a slice of the visible GPUs
    (`CUDA_VISIBLE_DEVICES`) or, on the CPU build, of the cores vLLM binds its threads to
    (`VLLM_CPU_OMP_THREADS_BIND`). Refuses more engines than devices."""
    from orca_serve.vllm_compat.launch import is_cpu_platform  # deferred: vllm

    env = dict(os.environ if environ is None else environ)
    if is_cpu_platform():
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < engines:
            raise ValueError(f"collect.engines {engines} on {len(cores)} cores: one engine "
                             "needs a core at least")
        part = cores[shard * len(cores) // engines:(shard + 1) * len(cores) // engines]
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, part))
        return env
    import torch  # deferred: torch

    engine = settings.engine
    per = int(engine.get("tensor_parallel_size", 1)) * int(engine.get("pipeline_parallel_size", 1))
    visible = env.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if len(gpus) < engines * per:
        raise ValueError(f"collect.engines {engines} x {per} device(s) per engine, but "
                         f"{len(gpus)} GPUs are visible")
    env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[shard * per:(shard + 1) * per])
    return env


def _spec_settings(settings: CollectSettings) -> dict[str, Any]:
    """The settings as a shard's spec holds them (JSON's types)."""
    return json.loads(json.dumps(asdict(settings)))


def write_spec(model: str, settings: CollectSettings,
               sets: list[tuple[list[dict], Path, set[str]]], work: Path, shard: int) -> Path:
    """Write what shard `shard` of `settings.engines` collects (its prompts of every set, not yet
    in the set's merged directory) to `work/shard-I.json`, the file `run_shard` reads. The one
    definition of a shard, for the engine processes of one machine (`collect_shards`) and for the
    workers of a cluster (`orca-calibrate collect --shard I`, orca_calibrate/job.py) alike.
    Refuses a folder whose shards were started with another model or other collection settings
    (a shard resumes what is in its folder: a mix would corrupt the set), and removes the
    shard's completion marker: it is collecting again, so it is not complete until it ends."""
    n = settings.engines
    work.mkdir(parents=True, exist_ok=True)
    spec: dict[str, Any] = {"model": model, "settings": _spec_settings(settings),
                            "prompts": prompts_digest(sets), "shard": shard, "sets": []}
    for i, old in started(work).items():
        _same_collection(old, spec, work / f"shard-{i}.json")
    for s, (prompts, directory, defer) in enumerate(sets):
        done = {p.id for p in TrajectorySet.open(directory).problems} \
            if (directory / "problems.jsonl").exists() else set()  # a merge before a kill
        part = shard_of([str(p["id"]) for p in prompts], n)
        spec["sets"].append({"out": str(work / f"shard-{shard}" / f"set-{s}"),
                             "defer": sorted(defer), "prompts": [
            p for p in prompts if part[str(p["id"])] == shard
            and not {k for k, _ in trace_keys([p], settings.samples)} <= done]})
    (work / f"shard-{shard}.stats.json").unlink(missing_ok=True)
    path = work / f"shard-{shard}.json"
    write_atomic(path, json.dumps(spec))  # other workers read the shards' files meanwhile
    return path


def started(work: Path) -> dict[int, dict]:
    """The specs of the shards started in `work`, by shard."""
    out = {}
    for f in work.glob("shard-*.json") if work.is_dir() else ():
        m = re.fullmatch(r"shard-(\d+)\.json", f.name)
        if m:
            out[int(m.group(1))] = json.loads(f.read_text())
    return out


def prompts_digest(sets: list[tuple[list[dict], Path, set[str]]]) -> str:
    """A digest of every set's prompt ids in order: which shard a prompt goes to follows from its
    position, so prompts added, removed or reordered between two shards' starts would leave some
    in no shard (lost without a word: the merge takes what the shards hold)."""
    ids = [[str(p["id"]) for p in prompts] for prompts, _, _ in sets]
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


def _same_collection(old: dict, new: dict, where: Path) -> None:
    """Refuse a shard `where` started with another model, settings or prompts than `new`'s (a
    spec of a version that did not record its prompts is taken as theirs, one of a version
    before a setting existed as having its default: top_k and min_p, which it sampled without)."""
    settings = {**_spec_settings(CollectSettings()), **old["settings"]}
    if (old["model"], settings) != (new["model"], new["settings"]):
        raise ShardError(f"{where} was started with another model or other collection settings "
                         "(collect.engines included): finish it with those, or delete "
                         f"{where.parent} to collect again")
    if old.get("prompts", new["prompts"]) != new["prompts"]:
        raise ShardError(f"{where} was started with other prompts (the job's prompt files were "
                         "edited since: added, removed or reordered prompts would land in no "
                         "shard): restore them to finish, or delete "
                         f"{where.parent} to collect again")


def claim_shard(work: Path, shard: int) -> AbstractContextManager[None]:
    """Hold shard `shard`'s lock in `work` while it is collected. A second worker on the same
    shard (a Kubernetes retry racing the pod it replaced, a shard process a killed `run` left
    running) would append the same traces to its folder again: duplicate ids, each line's offset
    counted by its own writer, and the shard marked complete. It is refused in one line instead.
    The lock ends with its process, a killed one's too, so the retry that follows resumes."""
    return _claim(work / f"shard-{shard}.lock", f"shard {shard} of {work} is being collected",
                  "its traces")


def claim_merge(work: Path) -> AbstractContextManager[None]:
    """Hold the merge's lock in `work`: two merges at once (a merge pod retried while the first
    still runs) would append the same shards' traces to the job's directory twice."""
    return _claim(work / "merge.lock", f"the shards of {work} are being merged", "the traces")


@contextmanager
def _claim(lock: Path, busy: str, what: str) -> Iterator[None]:
    """Hold `lock` (flock) for one process at a time, or refuse in one line naming its holder
    (`busy`: what it is doing). A volume that has no locks goes on unguarded, with a warning."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise ShardError(f"{busy} by another process ({f.read().strip() or 'unknown'}); "
                             f"two at once would duplicate {what}: rerun once that one has "
                             "ended") from None
        except OSError as e:
            print(f"warning: {f.name}: no lock ({e.strerror}); make sure no other process "
                  "does the same at once", file=sys.stderr)
        f.truncate(0)
        f.write(f"{socket.gethostname()}, pid {os.getpid()}\n")
        f.flush()
        yield


def run_shard(spec_file: Path) -> Stats:
    """Collect the shard `spec_file` describes (resuming what its folder holds), then write its
    statistics beside it: the marker that says the shard is complete."""
    spec = json.loads(spec_file.read_text())
    raw = spec["settings"]
    settings = CollectSettings(**{**raw, "judge": None if raw["judge"] is None
                                  else JudgeSettings(**raw["judge"])})
    with Collector(spec["model"], settings) as collector:
        for s in spec["sets"]:
            if s["prompts"]:
                defer = set(s["defer"])
                collector.run(s["prompts"], Path(s["out"]), progress=False,
                              defer=lambda key, defer=defer: key in defer)
        stats = collector.stats
    write_atomic(spec_file.with_name(spec_file.stem + ".stats.json"), json.dumps(stats.as_dict()))
    return stats


def start_shard(cmd: list[str], env: dict[str, str], log: IO[str]) -> subprocess.Popen:
    """One shard's engine process: `cmd` in `env`, its output to `log`, in a session of its own:
    its process group then holds the vLLM engine it starts too (`reap_groups`). A function of
    its own so that the tests can start the same command another way (from a pre-imported
    interpreter, in a session of its own as well)."""
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop_shards(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every shard process still running and wait for it: each unwinds as Ctrl-C does
    (`main`), shutting its vLLM engine down and keeping what it collected. Left running, they
    collected on, orphaned, holding their devices and racing a rerun's shards."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def reap_groups(pgids: Iterable[int]) -> None:
    """End what is left in the process groups of shards that have ended. A shard killed outright
    (SIGKILL: the kernel's OOM killer, an operator's `kill -9`) cannot shut its engine down:
    vLLM's engine core and its workers run on, orphaned, holding the shard's devices (the engine
    core does not watch the process that started it), and a rerun's shard on those devices
    fails for memory. They are in the shard's group: SIGTERM (the engine shuts down as on a
    Ctrl-C), then SIGKILL to whatever is left after STOP_WAIT_S. A shard that ended as it should
    left its group empty: nothing to do."""
    left = []
    for pgid in pgids:
        with suppress(ProcessLookupError):  # empty (or not a group of its own)
            os.killpg(pgid, signal.SIGTERM)
            left.append(pgid)
    deadline = time.monotonic() + STOP_WAIT_S
    while left and time.monotonic() < deadline:
        time.sleep(REAP_POLL_S)
        left = [g for g in left if group_alive(g)]
    for pgid in left:
        with suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs. A zombie does not count: it holds nothing
    (its devices went when it exited), and `killpg(pgid, 0)` answers for zombies too, so where
    the process that adopts orphans does not reap them (a container's init may not) the group
    would look alive until STOP_WAIT_S had passed. Linux's /proc tells; elsewhere, `killpg`."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:  # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


def die_with_parent() -> None:
    """SIGTERM this process when the one that started it dies, a SIGKILLed `run` included,
    whose shard processes otherwise collected on (Linux's PR_SET_PDEATHSIG; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # it died before the line above: nothing would signal us
        raise Stopped(128 + signal.SIGTERM)


def collect_shards(model: str, settings: CollectSettings,
                   sets: list[tuple[list[dict], Path, set[str]]], work: Path) -> Stats:
    """Collect each (prompts, trajectory directory, ids to collect unprobed) of `sets` with
    `settings.engines` engine processes at once, then merge into each directory (`merge_shards`;
    `work` stays: the caller removes it once the merge is recorded)."""
    n = settings.engines
    procs = []
    for i in range(n):
        spec = write_spec(model, settings, sets, work, i)
        log = open(work / f"shard-{i}.log", "a")  # noqa: SIM115 - closed after wait
        procs.append((start_shard([sys.executable, "-m", "orca_calibrate.shards", str(spec)],
                                  device_env(i, n, settings), log), log))
    try:
        for proc, _ in procs:
            proc.wait()
    except BaseException:  # Ctrl-C, SIGTERM (`Stopped`): the shards stop too, engines and all
        stop_shards([proc for proc, _ in procs])
        raise
    finally:  # every shard has ended here: what a killed one left of its engine goes too
        reap_groups([proc.pid for proc, _ in procs])
        for _, log in procs:
            log.close()
    failed = [i for i, (proc, _) in enumerate(procs) if proc.returncode != 0]
    if failed:
        tail = (work / f"shard-{failed[0]}.log").read_text().splitlines()[-5:]
        raise RuntimeError(f"collection shard(s) {failed} failed (their folders keep what they "
                           f"collected; rerun to resume); {work}/shard-{failed[0]}.log ends: "
                           + " | ".join(tail))
    return merge_shards(model, settings, sets, work)


def merge_shards(model: str, settings: CollectSettings,
                 sets: list[tuple[list[dict], Path, set[str]]], work: Path) -> Stats:
    """`_merge_shards` under the merge's lock (`claim_merge`): one merge at a time."""
    with claim_merge(work):
        return _merge_shards(model, settings, sets, work)


def _merge_shards(model: str, settings: CollectSettings,
                  sets: list[tuple[list[dict], Path, set[str]]], work: Path) -> Stats:
    """Merge the `settings.engines` shards in `work` into each set's directory, in the job's
    order, once every one is complete (collected with this model and these settings, and its
    completion marker written); otherwise refuse, naming the shards that are missing or
    unfinished. Returns the shards' statistics, summed (seconds: the slowest shard's, as the
    shards collect at once; a shard resumed after a kill counts its last run only)."""
    n = settings.engines
    specs = started(work)
    new = {"model": model, "settings": _spec_settings(settings),
           "prompts": prompts_digest(sets)}
    missing = []
    for i in range(n):
        if i not in specs:
            missing.append(f"shard {i} never started")
            continue
        _same_collection(specs[i], new, work / f"shard-{i}.json")
        if not (work / f"shard-{i}.stats.json").exists():
            missing.append(f"shard {i} started but did not finish")
        elif lost := _lost_sets(specs[i], work, i):
            missing.append(f"shard {i} is marked complete but its {', '.join(lost)} are gone")
    if missing:
        raise ShardError(f"{work}: {len(missing)} of the {n} shards are not complete: "
                         f"{'; '.join(missing)}. Run each again (it resumes what it collected): "
                         "`orca-calibrate collect --config JOB.yaml --shard I`")
    for s, (prompts, directory, _) in enumerate(sets):
        order = [k for k, _ in trace_keys(prompts, settings.samples)]
        merge([work / f"shard-{i}" / f"set-{s}" for i in range(n)], directory, order)
    stats = Stats()
    for i in range(n):
        d = json.loads((work / f"shard-{i}.stats.json").read_text())
        stats.trajectories += d["trajectories"]
        stats.answer_probes += d["answer_probes"]
        stats.generated_tokens += d["generated_tokens"]
        # the slowest engine's seconds: the engines run at once, so that is the wall time
        stats.generate_s = max(stats.generate_s, d["generate_s"])
        stats.probe_s = max(stats.probe_s, d["probe_s"])
        stats.pipelined_s = max(stats.pipelined_s, d["pipelined_s"])
    return stats


def _lost_sets(spec: dict, work: Path, shard: int) -> list[str]:
    """The folders of a complete shard that its spec gave prompts and that hold no trajectory
    file (its collector writes one for every set it is given): removed after the shard ended,
    e.g. to collect it again. The merge skipped them, so their traces were lost for good once
    the collection was recorded and the shards removed."""
    return [f"set-{s}" for s, part in enumerate(spec["sets"]) if part["prompts"]
            and not (work / f"shard-{shard}" / f"set-{s}" / "problems.jsonl").exists()]


def merge(shards: list[Path], into: Path, order: list[str]) -> None:
    """Append the shards' problems to `into` in the job's `order` (ids already there are
    skipped: a killed merge resumes), and their deferred traces' probe data."""
    sets = [TrajectorySet.open(d) for d in shards if (d / "problems.jsonl").exists()]
    if not sets:  # nothing left to collect: a resumed job's merged set is complete
        return
    where = {p.id: (ts, i) for ts in sets for i, p in enumerate(ts.problems)}
    info = sets[0].info
    with TrajectoryWriter(into, dim=info["dim"], dtype=info["dtype"],
                          **{k: info[k] for k in INFO_DEFAULTS}) as writer:
        for key in order:
            if key in where and key not in writer.ids:
                ts, i = where[key]
                fields = {k: v for k, v in ts.problems[i].to_dict().items()
                          if k not in ("offset", "n_steps")}
                writer.append(fields, ts.embeddings(i))
    lines = [line for d in shards if (d / PENDING_FILE).exists()
             for line in (d / PENDING_FILE).read_text().splitlines()]
    if lines:
        (into / PENDING_FILE).write_text("\n".join(lines) + "\n")


def main(spec_file: Path) -> None:
    """An engine process of `collect_shards`: its shard, under the shard's lock; a SIGTERM (its
    parent's `stop_shards`, or the parent's death) unwinds it, its engine shut down."""
    exit_on_sigterm()
    die_with_parent()
    with claim_shard(spec_file.parent, json.loads(spec_file.read_text())["shard"]):
        run_shard(spec_file)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
