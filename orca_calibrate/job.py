"""`orca-calibrate run --config JOB.yaml`: collect, split, train, calibrate, evaluate, in one job.

Every stage writes a file into the job's output directory and is skipped on a rerun when its
output exists and the settings it depends on are unchanged, so a killed job resumes where it
stopped (collection itself resumes per problem, training per epoch) and an edited job reruns what the edit affects.
Changed collection settings are refused instead: the trajectories on disk were made with the old
ones, and mixing would corrupt the set. Paths in the YAML are relative to the YAML file.

With `collect: {label_steps: selective}` the calibration split is known before collection (the
split is then a collection setting) and its trajectories are collected unprobed; the `label`
stage, after training, probes only the steps that decide LTT (orca_method/selective.py), on the
engine the collection started when the job runs straight through.

With `group_prompts` the `groups` stage collects those prompt files apart (calibration-only
traces of groups, docs/CALIBRATE.md "Groups collected apart"), and the calibrate stage certifies
each group on its own set.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from collections import Counter
from dataclasses import asdict, fields, is_dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

import yaml

from orca_calibrate.collect import (
    Collector,
    CollectSettings,
    Stats,
    label_deferred,
    read_prompts,
    trace_keys,
)
from orca_calibrate.group_options import GroupOptions
from orca_calibrate.job_options import (
    SplitOptions,
    check_whole,
    gate_options,
    ltt_options,
    split_options,
)
from orca_calibrate.judge import JudgeError, JudgeSettings
from orca_calibrate.probe_variants import PROBES
from orca_calibrate.shards import (
    SHARDS,
    claim_shard,
    collect_shards,
    merge_shards,
    run_shard,
    write_spec,
)
from orca_calibrate.train_defaults import (
    DEFAULT_D_H,
    DEFAULT_PROBE,
    DEFAULTS,
    MIN_TRAIN_PROBLEMS,
    check_training,
)
from orca_method.answer_probes import COLLECTED_MODES, JUDGE, SUPERVISED
from orca_method.consensus import prompt_of
from orca_method.errors import first_line
from orca_method.outcomes import GIVE_UP_POLICIES, GiveUpPolicy, LabelSteps, Side
from orca_method.trajectories import ALL, Split, TrajectorySet, set_splits, split_ids
from orca_serve.checks.bundle import check_model_folder

T = TypeVar("T")

# the trajectory directories of a job's `out`: its prompts, its shifted prompts, and (one
# folder per prompt file, named by its stem) its groups' calibration-only prompts
TRAJECTORIES, SHIFTED, GROUP_SETS = "trajectories", "trajectories-shifted", "trajectories-groups"


class Stage(StrEnum):
    """A job's stages, in the order they run (each resumable: its `.done-<stage>` marker)."""

    COLLECT = "collect"
    SPLIT = "split"
    TRAIN = "train"
    LABEL = "label"
    GROUPS = "groups"
    CALIBRATE = "calibrate"
    EVALUATE = "evaluate"


STAGES = tuple(Stage)
# `train:` keys of a job besides the `meta_train` settings (orca_calibrate.train_defaults.DEFAULTS)
TRAIN_JOB_KEYS = {"probe", "label_mode", "seed", "d_h"}


class JobError(ValueError):
    """A job file that cannot run; the message names the key."""


def load_job(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise JobError(f"job file {path} not found")
    try:
        job = yaml.safe_load(path.read_text())
    except UnicodeDecodeError:
        raise JobError(f"{path} is not a text file (UTF-8)") from None
    except yaml.YAMLError as e:  # one line: what went wrong, and where
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise JobError(f"{path} is not valid YAML{where}: "
                       f"{getattr(e, 'problem', None) or first_line(str(e))}") from None
    if not isinstance(job, dict):
        raise JobError(f"{path}: a job is a mapping with keys model, prompts, out, …")
    for key in ("model", "prompts", "out"):
        if key not in job:
            raise JobError(f"{path}: missing required key '{key}'")
    unknown = set(job) - {"model", "prompts", "shifted_prompts", "group_prompts", "out",
                          "collect", "split", "train", "calibrate", "description"}
    if unknown:
        raise JobError(f"{path}: unknown keys {sorted(unknown)}")
    for key in ("model", "prompts", "shifted_prompts", "out"):
        if key in job and not (isinstance(job[key], str) and job[key]):
            raise JobError(f"{path}: {key} is a path (text), got {job[key]!r:.40}")
    for key in ("collect", "split", "train", "calibrate"):
        if not isinstance(job.get(key) or {}, dict):
            raise JobError(f"{path}: {key} is a mapping of settings, got {job[key]!r:.40}")
    base = path.parent
    for key in ("prompts", "shifted_prompts", "out"):
        if key in job and not Path(job[key]).is_absolute():
            job[key] = str(base / job[key])
    if "group_prompts" in job:
        files = job["group_prompts"]
        if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
            raise JobError(f"{path}: group_prompts is a list of prompt files (JSON lines, each "
                           "prompt tagged with its group)")
        if len({Path(f).stem for f in files}) < len(files):
            raise JobError(f"{path}: group_prompts' files are collected into folders named by "
                           "their stems: give them distinct names")
        if (job.get("calibrate") or {}).get("groups") is None:
            raise JobError(f"{path}: group_prompts calibrates groups: add calibrate.groups "
                           "(e.g. {field: family, min_n: 30}) to name them")
        job["group_prompts"] = [f if Path(f).is_absolute() else str(base / f) for f in files]
    if str(job["model"]).startswith((".", "/")) and not Path(job["model"]).is_absolute():
        job["model"] = str((base / job["model"]).resolve())
    if job["model"].startswith("/") and not Path(job["model"]).is_dir():  # a hub id is not a path
        raise JobError(f"{path}: model {job['model']} is not a folder (a local model, or a hub "
                       "id such as Qwen/QwQ-32B)")
    if Path(job["out"]).exists() and not Path(job["out"]).is_dir():
        raise JobError(f"{path}: out {job['out']} is a file, not a folder")
    try:  # the split's, LTT's and the gate's settings (the calibrate block's others below)
        split_options(job.get("split"))
        ltt_options(job.get("calibrate"))
        gate_options((job.get("calibrate") or {}).get("gate"))
    except ValueError as e:
        raise JobError(f"{path}: {e}") from None
    tr = job.get("train") or {}
    bad = set(tr) - TRAIN_JOB_KEYS - set(DEFAULTS)
    if bad:
        raise JobError(f"{path}: unknown train settings {sorted(bad)} "
                       f"(known: {sorted(TRAIN_JOB_KEYS | set(DEFAULTS))})")
    try:  # checked now, not after the collection
        check_training(**{**DEFAULTS, **{k: v for k, v in tr.items() if k in DEFAULTS}})
        if tr.get("probe", DEFAULT_PROBE) not in PROBES:
            raise ValueError(f"probe is one of {', '.join(sorted(PROBES))}, "
                             f"not {tr['probe']!r:.40}")
        check_whole("d_h", tr.get("d_h", DEFAULT_D_H), 1)
        check_whole("seed", tr.get("seed", 0), 0)
    except ValueError as e:
        raise JobError(f"{path}: train.{e}") from None
    known = {f.name for f in fields(CollectSettings)}
    bad = set(job.get("collect") or {}) - known
    if bad:
        raise JobError(f"{path}: unknown collect settings {sorted(bad)} (known: {sorted(known)})")
    if (job.get("collect") or {}).get("judge") is not None:
        try:
            job["collect"]["judge"] = JudgeSettings.from_dict(job["collect"]["judge"],
                                                              f"{path}: collect")
        except JudgeError as e:
            raise JobError(str(e)) from None
    try:  # types and ranges, and the model's folder, before a stage starts an engine
        settings = CollectSettings(**(job.get("collect") or {}))
        check_model_folder(job["model"], settings.engine.get("hf_config_path"))
    except ValueError as e:
        raise JobError(f"{path}: {e}") from None
    give_up = (job.get("calibrate") or {}).get("give_up")
    if give_up is not None:
        from orca_calibrate.calibrate import GiveUpOptions  # deferred: torch
        known = {f.name for f in fields(GiveUpOptions)}
        if not isinstance(give_up, dict) or set(give_up) - known:
            raise JobError(f"{path}: calibrate.give_up is a mapping of {sorted(known)}")
        if give_up.get("policy", GiveUpPolicy.GUESS) not in GIVE_UP_POLICIES:
            raise JobError(f"{path}: calibrate.give_up.policy is what the server will serve "
                           f"(--orca-give-up-policy): one of {', '.join(GIVE_UP_POLICIES)}, "
                           f"not {give_up['policy']!r:.40}")
        try:
            block_options(GiveUpOptions, give_up)
        except (TypeError, ValueError) as e:
            raise JobError(f"{path}: calibrate.give_up: {e}") from None
    groups = (job.get("calibrate") or {}).get("groups")
    if groups is not None:
        known = {f.name for f in fields(GroupOptions)}
        if not isinstance(groups, dict) or set(groups) - known:
            raise JobError(f"{path}: calibrate.groups is a mapping of {sorted(known)} (e.g. "
                           "{field: family, min_n: 30})")
        try:
            GroupOptions(**groups)
        except (TypeError, ValueError) as e:
            raise JobError(f"{path}: {e}") from None
    collect = job.get("collect") or {}
    temperature = collect.get("temperature", CollectSettings.temperature)
    if collect.get("samples", 1) > 1 and temperature <= 0:
        raise JobError(f"{path}: collect.samples > 1 needs temperature > 0 (greedy samples are "
                       "copies of one trace)")
    consensus = (job.get("calibrate") or {}).get("consensus")
    if consensus is not None:
        from orca_calibrate.consensus import ConsensusOptions  # deferred: torch
        known = {f.name for f in fields(ConsensusOptions)}
        if not isinstance(consensus, dict) or set(consensus) - known:
            raise JobError(f"{path}: calibrate.consensus is a mapping of {sorted(known)}")
        if collect.get("samples", 1) < 2:
            raise JobError(f"{path}: calibrate.consensus needs collect.samples >= 2 (k samples "
                           "per prompt)")
        try:
            block_options(ConsensusOptions, consensus)
        except (TypeError, ValueError) as e:
            raise JobError(f"{path}: calibrate.consensus: {e}") from None
    prompts = prompt_files(path, job)
    check_label_modes(path, job, prompts)
    if job["prompts"] in prompts:
        check_split_size(path, job, prompts[job["prompts"]])
    return job


def prompt_files(path: Path, job: dict[str, Any]) -> dict[str, list[dict]]:
    """The prompts of each of the job's prompt files (prompts, shifted_prompts, group_prompts)
    that is there: read when the job is, so that what they decide is refused before an engine
    starts. A file not there yet (a recipe's data, built later) is refused by the run, which
    reads every prompt file before its first stage."""
    files = [job[k] for k in ("prompts", "shifted_prompts") if job.get(k)]
    try:
        return {f: read_prompts(Path(f)) for f in files + list(job.get("group_prompts") or [])
                if Path(f).is_file()}
    except ValueError as e:
        raise JobError(f"{path}: {e}") from None


def label_modes(job: dict[str, Any]) -> dict[str, str]:
    """The label mode each side of the job reads, by the key that sets it: the stop probe's
    (trained, calibrated and evaluated under it) and, with a give-up block, the give-up's."""
    modes = {"train.label_mode": (job.get("train") or {}).get("label_mode", SUPERVISED)}
    give_up = (job.get("calibrate") or {}).get("give_up")
    if give_up is not None:
        from orca_calibrate.calibrate import GiveUpOptions  # deferred: torch
        modes["calibrate.give_up.label_mode"] = block_options(GiveUpOptions, give_up).label_mode
    return modes


def check_label_modes(path: Path, job: dict[str, Any], prompts: dict[str, list[dict]]) -> None:
    """Refuse a label mode the collection will not give every trace: training, calibration or
    the evaluation found its labels missing only after the collection (hours of engine time).
    Judge labels come from collect.judge; supervised ones from the prompt's reference `answer`,
    so every prompt of every file needs one (a set's label modes are those all its traces
    have, and the shifted and group sets are evaluated and calibrated under the same modes)."""
    for key, mode in label_modes(job).items():
        if mode not in COLLECTED_MODES:
            raise JobError(f"{path}: {key} is one of {', '.join(COLLECTED_MODES)} (the labels a "
                           f"collection writes), got {mode!r:.40}")
        if mode == JUDGE and (job.get("collect") or {}).get("judge") is None:
            raise JobError(f"{path}: {key} judge needs a collect.judge block "
                           "(base_url, model, api_key_env)")
        if mode != SUPERVISED:
            continue
        for file, records in prompts.items():
            bare = next((r["id"] for r in records if r.get("answer") is None), None)
            if bare is not None:
                raise JobError(f"{path}: {key} is {mode} (labels against each prompt's reference "
                               f"`answer`): prompt {bare!r} of {file} has no answer")


def check_split_size(path: Path, job: dict[str, Any], prompts: list[dict]) -> None:
    """Refuse prompts too few for the split to give training the problems it takes and LTT a
    calibration trace: the train or calibrate stage found it after the collection. The split
    is by prompt and its parts' sizes depend on the count alone, so the job's own split of its
    prompts decides; which traces get a step, and a correct one, only the collection shows."""
    split = planned_split(job, prompts)
    parts = Counter(split.values())  # traces per part
    static = (job.get("train") or {}).get("probe", DEFAULT_PROBE) == "static"
    least = 1 if static else MIN_TRAIN_PROBLEMS
    if parts[Split.TRAIN] >= least and parts[Split.CALIBRATION]:
        consensus = (job.get("calibrate") or {}).get("consensus")
        if consensus is not None:  # its share of the calibration prompts must leave both sides
            from orca_calibrate.consensus import ConsensusOptions, held_ids  # deferred: torch
            try:
                held_ids([k for k, s in split.items() if s == Split.CALIBRATION],
                         block_options(ConsensusOptions, consensus))
            except ValueError as e:
                raise JobError(f"{path}: calibrate.consensus: {e}") from None
        return
    f = split_options(job.get("split")).fractions
    samples = CollectSettings(**(job.get("collect") or {})).samples
    # a prompt goes to the part its samples' middle falls in (split_ids): of n prompts the
    # training part holds at least f_train * n - 1/2, the calibration part f_cal * n - 1, so
    # every n > least_prompts / f_train and > 1 / f_cal gives both parts theirs
    enough = math.floor(max(math.ceil(least / samples) / f[0], 1 / f[1])) + 1
    raise JobError(f"{path}: {job['prompts']} holds {len(prompts)} prompt(s), too few for "
                   f"split.fractions {list(f)}: its training part gets {parts[Split.TRAIN]} "
                   f"trace(s) and its calibration part {parts[Split.CALIBRATION]} (the probe's "
                   f"training needs {least}, LTT 1); {enough} prompts or more give them")


def block_options(cls: type[T], block: dict[str, Any]) -> T:
    """A `calibrate:` sub-block (give_up, consensus) as its frozen options (YAML lists as
    tuples): load_job's check and the stages build it the one way."""
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in block.items()})


# What each stage's result depends on, beyond the stages before it.
# (`label` reads the calibrate block: its grid points come from the probes and window there)
STAGE_KEYS = {Stage.COLLECT: ("model", "prompts", "shifted_prompts", "collect"),
              Stage.SPLIT: ("split",), Stage.TRAIN: ("train",), Stage.LABEL: ("calibrate",),
              Stage.GROUPS: ("group_prompts",), Stage.CALIBRATE: (), Stage.EVALUATE: ()}


def selective(job: dict[str, Any]) -> bool:
    """Whether the job labels its calibration split selectively (`collect.label_steps`)."""
    return (job.get("collect") or {}).get("label_steps") == LabelSteps.SELECTIVE


def stage_settings(job: dict[str, Any]) -> dict[Stage, str]:
    """A fingerprint per stage of the settings it depends on, its predecessors' included (with
    selective labelling the split is a collection setting: it says what is left unprobed)."""
    def plain(v: Any) -> Any:  # the judge settings are a dataclass
        return asdict(v) if is_dataclass(v) else str(v)

    out, seen = {}, {}
    for name in STAGES:
        keys = STAGE_KEYS[name] + (("split",) if name == Stage.COLLECT and selective(job) else ())
        seen.update({k: job.get(k) for k in keys})
        text = json.dumps(seen, sort_keys=True, default=plain)
        out[name] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return out


def _done(out: Path, name: Stage) -> str | None:
    """The settings fingerprint stage `name` of the job in `out` was finished with (None: not
    finished; "unknown": a marker from before settings were recorded)."""
    marker = out / f".done-{name}"
    try:
        return json.loads(marker.read_text())["settings"] if marker.exists() else None
    except (ValueError, KeyError, TypeError):
        return "unknown"


def collected(out: Path, settings: str) -> bool:
    """Whether the job in `out` is collected with these collect settings; refuses a collection
    made with other ones (mixing would corrupt the set)."""
    done = _done(out, Stage.COLLECT)
    if done not in (None, "unknown", settings):
        raise JobError(f"the collect settings (model, prompts, collect block, and the split "
                       f"with selective labelling) changed since "
                       f"{out} was collected; use another 'out', or delete {out} to recollect")
    return done is not None


def _stage(out: Path, name: Stage, outputs: list[Path], fn, log: list[str], settings: str,
           rerun: bool) -> bool:
    """Run one stage unless it is done with the same settings; returns whether it ran and
    changed something (a stage whose `fn` returns False ran without changing anything)."""
    current = collected(out, settings) if name == Stage.COLLECT else _done(out, name) == settings
    if not rerun and current and all(p.exists() for p in outputs):
        log.append(f"{name}: done already, skipped")
        return False
    t0 = time.perf_counter()
    changed = fn() is not False
    (out / f".done-{name}").write_text(json.dumps({"settings": settings, "finished": time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
    log.append(f"{name}: {time.perf_counter() - t0:.0f} s")
    return changed


def planned_split(job: dict[str, Any], prompts: list[dict]) -> dict[str, str]:
    """The split of every trace the collection makes (selective labelling needs it before)."""
    samples = CollectSettings(**(job.get("collect") or {})).samples
    keys = [key for key, _ in trace_keys(prompts, samples)]
    return job_split(keys, split_options(job.get("split")))


def collection_sets(job: dict[str, Any]) -> list[tuple[list[dict], Path, set[str]]]:
    """What the collect stage collects: (prompts, trajectory directory, ids collected unprobed)
    per set, the job's prompts into `out/trajectories` (with selective labelling its calibration
    split unprobed) and its shifted prompts into `out/trajectories-shifted`. One definition for
    one engine, the engines of one machine and the workers of a cluster."""
    out = Path(job["out"])
    prompts = read_prompts(Path(job["prompts"]))
    later = {k for k, v in planned_split(job, prompts).items() if v == Split.CALIBRATION} \
        if selective(job) else set()
    sets = [(prompts, out / TRAJECTORIES, later)]
    if job.get("shifted_prompts"):
        sets.append((read_prompts(Path(job["shifted_prompts"])), out / SHIFTED, set()))
    return sets


def group_sets(job: dict[str, Any]) -> list[tuple[list[dict], Path]]:
    """What the groups stage collects: (prompts, trajectory directory) per file of the job's
    `group_prompts`, into `out/trajectories-groups/<its stem>`. Calibration-only: no split, no
    training, only their groups' tables read them (docs/CALIBRATE.md, "Groups collected
    apart")."""
    return [(read_prompts(Path(f)), Path(job["out"]) / GROUP_SETS / Path(f).stem)
            for f in job.get("group_prompts") or []]


def _engines(path: Path, job: dict[str, Any]) -> int:
    """The job's shards (`collect.engines`), refusing a job that has none to spread."""
    n = CollectSettings(**(job.get("collect") or {})).engines
    if n < 2:
        raise JobError(f"{path}: collect.engines is {n}: a job collected in shards says how many "
                       "(collect.engines: N, the number of workers; docs/CALIBRATE.md)")
    return n


def collect_shard(path: Path, shard: int, of: int | None = None) -> Stats | None:
    """`orca-calibrate collect --config JOB --shard I`: collect shard I of the job's
    `collect.engines` into its `out` (shared by all workers), resuming what the shard's folder
    holds. `of`, when given, must be the job's number of shards (the cluster's manifest and the
    job file must agree, or the workers would split the prompts differently). Returns the
    shard's statistics, or None when the job is collected and merged already."""
    job = load_job(path)
    n = _engines(path, job)
    if of is not None and of != n:
        raise JobError(f"--of {of}, but {path} says collect.engines: {n}; make them agree (the "
                       "shards are the job's: collect.engines is the number of workers)")
    if not 0 <= shard < n:
        raise JobError(f"shard {shard} of {n}: a shard is 0 to {n - 1}")
    out = Path(job["out"])
    if collected(out, stage_settings(job)[Stage.COLLECT]):
        return None
    settings = CollectSettings(**(job.get("collect") or {}))
    with claim_shard(out / SHARDS, shard):  # before write_spec: it unmarks the shard complete
        spec = write_spec(job["model"], settings, collection_sets(job), out / SHARDS, shard)
        return run_shard(spec)


def run_job(path: Path, progress: bool = True, merge: bool = False) -> list[str]:
    """Run (or resume) a job; returns one log line per stage. With `merge` the collect stage
    merges the shards the cluster's workers collected (`orca-calibrate merge`; refused until
    every one is complete) instead of collecting."""
    from orca_calibrate.calibrate import (  # deferred: torch
        GiveUpOptions,
        calibrate_bundle,
        deciding_points,
    )
    from orca_calibrate.consensus import (  # deferred: torch
        ConsensusOptions,
        add_consensus,
        evaluate_consensus,
        hold_out,
    )
    from orca_calibrate.evaluate import evaluate_bundle, markdown_table, plot_report  # deferred: torch
    from orca_calibrate.train import (  # deferred: torch
        load_probe,
        save_probe,
        train_give_up,
        train_probe,
    )
    from orca_method.bundle import load_bundle  # deferred: torch
    from orca_method.bundle_checks import check_bundle, data_target  # deferred: torch

    job = load_job(path)
    if merge:
        _engines(path, job)
    sets = collection_sets(job)  # its prompts read (a missing file refused) before out is made
    prompts = sets[0][0]
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    data, shifted = out / TRAJECTORIES, out / SHIFTED
    probe_file, bundle_file = out / "probe.safetensors", out / "bundle.json"
    settings = CollectSettings(**(job.get("collect") or {}))
    tr, ca = (job.get(k) or {} for k in ("train", "calibrate"))
    sp, ltt = split_options(job.get("split")), ltt_options(ca)
    log: list[str] = []

    engine: list[Collector] = []  # one vLLM engine for collect and label, started on first use

    def collector() -> Collector:
        if not engine:
            engine.append(Collector(job["model"], settings))
        return engine[0]

    def collect() -> None:
        if merge:
            stats = merge_shards(job["model"], settings, sets, out / SHARDS)
        elif settings.engines > 1:  # engine processes of their own, a shard each
            stats = collect_shards(job["model"], settings, sets, out / SHARDS)
        else:
            for set_prompts, directory, later in sets:
                stats = collector().run(set_prompts, directory, progress,
                                        defer=lambda key, later=later: key in later)
        (out / "collect-stats.json").write_text(json.dumps(stats.as_dict(), indent=1))

    def split() -> None:
        ids = [p.id for p in TrajectorySet.open(data).problems]
        assignment = planned_split(job, prompts) if selective(job) else job_split(ids, sp)
        set_splits(data, {pid: assignment[pid] for pid in ids})

    def give_up_probe(ts: TrajectorySet) -> tuple[Any, GiveUpOptions] | None:
        """The give-up probe and its options (fitted in seconds, deterministically)."""
        if ca.get("give_up") is None:
            return None
        opts = block_options(GiveUpOptions, ca["give_up"])
        return train_give_up(ts, opts.label_mode, seed=tr.get("seed", 0)), opts

    def label() -> bool:
        ts = TrajectorySet.open(data)
        members = [i for i in ts.split(Split.CALIBRATION)
                   if "selective" in (ts.problems[i].extra or {})]
        if not members:
            return False  # nothing labelled: the later stages need not rerun
        probe, meta = load_probe(probe_file)
        give_up = give_up_probe(ts)
        deciding = deciding_points(probe, ts, members, mode=meta["label_mode"],
                                   window=ltt.window, label_every=settings.label_every,
                                   give_up=give_up)
        resolved = {Side.STOP: meta["label_mode"],
                    Side.GIVE_UP: give_up and give_up[1].label_mode}
        stats = label_deferred(data, deciding, collector, resolved, progress)
        (out / "label-stats.json").write_text(json.dumps(stats.as_dict(), indent=1))
        return True

    def groups() -> None:
        """Collect the groups' calibration-only prompts (resumable; no engine when all are)."""
        for set_prompts, directory in group_sets(job):
            have = {p.id for p in TrajectorySet.open(directory).problems} \
                if (directory / "problems.jsonl").is_file() else set()
            if any(key not in have for key, _ in trace_keys(set_prompts, settings.samples)):
                collector().run(set_prompts, directory, progress)

    def train() -> None:
        ts = TrajectorySet.open(data)
        mode = label_modes(job)["train.label_mode"]
        options = {k: v for k, v in tr.items() if k not in TRAIN_JOB_KEYS}
        probe, facts = train_probe(ts, tr.get("probe", DEFAULT_PROBE), mode,
                                   d_h=tr.get("d_h", DEFAULT_D_H),
                                   seed=tr.get("seed", 0), checkpoints=out / "checkpoints",
                                   progress=progress, **options)
        save_probe(probe, probe_file, {"label_mode": mode, **facts,
                                       "history": json.dumps(facts.get("history", []))})

    def calibrate() -> None:
        probe, meta = load_probe(probe_file)
        ts = TrajectorySet.open(data)
        consensus = None
        if ca.get("consensus") is not None:  # its prompts leave lambda*'s calibration
            opts = block_options(ConsensusOptions, ca["consensus"])
            ts, held = hold_out(ts, opts)
            consensus = (opts, held)
        give_up = give_up_probe(ts)
        calibrate_bundle(probe, ts, bundle_file, give_up=give_up,
                         groups=None if ca.get("groups") is None else GroupOptions(**ca["groups"]),
                         group_sets=[TrajectorySet.open(d) for _, d in group_sets(job)],
                         mode=meta["label_mode"], deltas=ltt.deltas, epsilon=ltt.epsilon,
                         window=ltt.window, gate=gate_options(ca.get("gate")),
                         dump_scores=out / "calibration-scores.jsonl",
                         provenance={"job": str(path), "selected_epoch": meta.get("selected_epoch")})
        if consensus is not None:
            add_consensus(bundle_file, probe, ts, consensus[1], consensus[0])

    def evaluate() -> None:
        bundle, ts = load_bundle(bundle_file), TrajectorySet.open(data)
        check_bundle(bundle, data_target(ts.info, ts.dim))  # as `orca-calibrate evaluate` does
        rows, reports = [], {}
        if ts.split(Split.TEST):  # split.fractions may give it none
            report, scored = evaluate_bundle(bundle, ts, Split.TEST)
            plot_report(bundle, scored, report, out / "plots")
            rows.append(("test split", report))
            reports["test"] = report
            if bundle.consensus is not None:
                reports["consensus"] = evaluate_consensus(bundle, ts, Split.TEST)
        if shifted.exists():
            rep, _ = evaluate_bundle(bundle, TrajectorySet.open(shifted), ALL)
            rows.append(("shifted family", rep))
            reports["shifted"] = rep
        (out / "evaluation.json").write_text(json.dumps(reports, indent=1))
        (out / "evaluation.md").write_text(
            (markdown_table(rows) if rows else "nothing evaluated: the split has no test part "
             "and the job no shifted_prompts") + "\n")

    stages = {Stage.COLLECT: (collect, [data / "problems.jsonl"]), Stage.SPLIT: (split, []),
              Stage.TRAIN: (train, [probe_file]), Stage.LABEL: (label, []),
              Stage.GROUPS: (groups, [d / "problems.jsonl" for _, d in group_sets(job)]),
              Stage.CALIBRATE: (calibrate, [bundle_file]),
              Stage.EVALUATE: (evaluate, [out / "evaluation.json"])}
    fingerprints, rerun = stage_settings(job), False
    try:
        for name in STAGES:
            fn, outputs = stages[name]
            rerun |= _stage(out, name, outputs, fn, log, fingerprints[name], rerun)  # later follow
            if name == Stage.COLLECT:  # merged and recorded: the shards' copies are not needed
                shutil.rmtree(out / SHARDS, ignore_errors=True)
            if progress:
                print(log[-1], flush=True)
            # vLLM ends with the last stage that probes: collect, or label when selective, and
            # (an engine of its own, started when it has something to collect) groups
            if engine and name in (Stage.LABEL if selective(job) else Stage.COLLECT, Stage.GROUPS):
                engine.pop().close()
    finally:
        if engine:
            engine.pop().close()
    return log


def job_split(ids: list[str], sp: SplitOptions) -> dict[str, str]:
    """The job's split of these trajectory ids: every sample of a prompt in one part."""
    groups = {pid: prompt_of(pid)[0] for pid in ids}
    return split_ids(ids, sp.fractions, seed=sp.seed, groups=groups)
