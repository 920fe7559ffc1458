"""Data-parallel collection's bookkeeping (orca_calibrate/shards.py) without engines: which
shard a prompt goes to, the devices each engine gets, and the merge of the shards' folders into
the job's one trajectory directory (tests/test_shards_engine.py runs real engines)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from orca_calibrate.collect import PENDING_FILE, CollectSettings, Stats
from orca_calibrate.shards import device_env, merge, shard_of
from orca_method.trajectories import TrajectorySet, TrajectoryWriter


def test_prompts_go_round_robin_with_all_their_samples():
    assert shard_of(["a", "b", "c", "d", "e"], 2) == {"a": 0, "b": 1, "c": 0, "d": 1, "e": 0}
    assert set(shard_of(["a"], 3).values()) == {0}


def test_each_cpu_engine_binds_cores_of_its_own(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    binds = [device_env(i, 2, CollectSettings(), {})["VLLM_CPU_OMP_THREADS_BIND"]
             for i in range(2)]
    assert binds == ["0,1", "2,3,4"]
    with pytest.raises(ValueError, match="one engine needs a core"):
        device_env(0, 6, CollectSettings(), {})


def _shard(path, ids, steps, pending=()):
    with TrajectoryWriter(path, dim=3, dtype="float32", model="m") as w:
        for pid, n in zip(ids, steps):
            w.append({"id": pid, "labels": {"consistent": [0] * (n - 1) + [1]}},
                     np.full((n, 3), float(n), np.float32))
    if pending:
        (path / PENDING_FILE).write_text("".join(json.dumps({"id": p}) + "\n" for p in pending))


def test_merge_keeps_the_jobs_order_and_resumes(tmp_path):
    _shard(tmp_path / "s0", ["a", "c"], [2, 4], pending=["c"])
    _shard(tmp_path / "s1", ["b", "d"], [3, 5])
    into = tmp_path / "all"
    _shard(into, ["a"], [2])  # a merge killed after its first problem
    merge([tmp_path / "s0", tmp_path / "s1", tmp_path / "s2-never-ran"], into,
          ["a", "b", "c", "d", "e-had-no-steps"])
    ts = TrajectorySet.open(into)
    assert [p.id for p in ts.problems] == ["a", "b", "c", "d"]
    assert [float(ts.embeddings(i)[0, 0]) for i in range(4)] == [2.0, 3.0, 4.0, 5.0]
    assert [p.offset for p in ts.problems] == [0, 2, 5, 9]
    assert ts.problems[3].labels["consistent"] == [0, 0, 0, 0, 1]
    assert [json.loads(x)["id"] for x in (into / PENDING_FILE).read_text().splitlines()] == ["c"]


def _job(tmp_path, engines=2, **collect):
    """A job file of 5 prompts (no model is loaded by what these tests call)."""
    (tmp_path / "p.jsonl").write_text("".join(
        json.dumps({"id": f"q{k}", "prompt": "x", "answer": "1"}) + "\n" for k in range(5)))
    job = {"model": "m", "prompts": "p.jsonl", "out": "run",
           "collect": {"engines": engines, "temperature": 0.0, **collect}}
    (tmp_path / "job.yaml").write_text(json.dumps(job))  # JSON is YAML
    return tmp_path / "job.yaml"


def test_a_shard_is_the_same_partition_on_one_machine_and_on_a_cluster(tmp_path):
    from orca_calibrate.job import collection_sets, load_job
    from orca_calibrate.shards import write_spec

    job = load_job(_job(tmp_path))
    sets = collection_sets(job)
    settings = CollectSettings(**job["collect"])
    specs = [json.loads(write_spec("m", settings, sets, tmp_path / "w", i).read_text())
             for i in range(2)]
    assert [[p["id"] for p in s["sets"][0]["prompts"]] for s in specs] == \
        [["q0", "q2", "q4"], ["q1", "q3"]]
    other = CollectSettings(**{**job["collect"], "max_tokens": 7})
    with pytest.raises(ValueError, match="other collection settings"):
        write_spec("m", other, sets, tmp_path / "w", 0)
    # prompts added between two shards' starts would land in no shard (a probe: 7 of 8 merged)
    more = [(prompts + [{"id": "q5", "prompt": "x", "answer": "1"}], d, defer)
            for prompts, d, defer in sets]
    with pytest.raises(ValueError, match="started with other prompts"):
        write_spec("m", settings, more, tmp_path / "w", 1)
    reordered = [(prompts[::-1], d, defer) for prompts, d, defer in sets]
    with pytest.raises(ValueError, match="started with other prompts"):
        write_spec("m", settings, reordered, tmp_path / "w", 1)
    write_spec("m", settings, sets, tmp_path / "w", 1)  # the same prompts: it resumes
    # a shard started by a version before top_k and min_p were settings sampled with neither:
    # it resumes with neither, not with others
    spec = tmp_path / "w" / "shard-0.json"
    older = json.loads(spec.read_text())
    for key in ("top_k", "min_p"):
        del older["settings"][key]
    spec.write_text(json.dumps(older))
    write_spec("m", settings, sets, tmp_path / "w", 1)
    with pytest.raises(ValueError, match="other collection settings"):
        write_spec("m", CollectSettings(**{**job["collect"], "top_k": 20}), sets, tmp_path / "w", 1)


def test_merge_names_the_shards_that_are_not_complete(tmp_path):
    from orca_calibrate.job import collection_sets, load_job
    from orca_calibrate.shards import merge_shards, write_spec

    job = load_job(_job(tmp_path, engines=3))
    sets, settings, work = collection_sets(job), CollectSettings(**job["collect"]), tmp_path / "w"
    write_spec("m", settings, sets, work, 0)
    write_spec("m", settings, sets, work, 2)
    _shard(work / "shard-0" / "set-0", ["q0", "q3"], [2, 3])
    (work / "shard-0.stats.json").write_text(json.dumps(
        {"trajectories": 2, "answer_probes": 5, "generate_s": 1.0, "probe_s": 2.0}))
    with pytest.raises(ValueError) as e:
        merge_shards("m", settings, sets, work)
    assert "2 of the 3 shards are not complete: shard 1 never started; shard 2 started but " \
        "did not finish" in str(e.value)
    assert not (sets[0][1] / "problems.jsonl").exists()  # nothing merged from an incomplete set


def test_the_shard_comes_from_the_completion_index_and_must_fit_the_job(tmp_path, monkeypatch,
                                                                        capsys):
    from orca_calibrate.calibrate_cli import main

    job = str(_job(tmp_path))
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "2")
    assert main(["collect", "--config", job]) == 2
    assert "shard 2 of 2: a shard is 0 to 1" in capsys.readouterr().err
    assert main(["collect", "--config", job, "--shard", "0", "--of", "3"]) == 2
    assert "--of 3, but" in capsys.readouterr().err
    monkeypatch.delenv("JOB_COMPLETION_INDEX")
    assert main(["collect", "--config", job]) == 2
    assert "give --shard I (or set JOB_COMPLETION_INDEX" in capsys.readouterr().err
    assert main(["collect", "--config", job, "--shard", "0", "--model", "m"]) == 2
    assert "drop --model" in capsys.readouterr().err
    assert main(["merge", "--config", str(_job(tmp_path, engines=1))]) == 2
    assert "collect.engines is 1" in capsys.readouterr().err


def test_merged_statistics_sum_the_counts_and_take_the_slowest_shards_seconds(tmp_path):
    from orca_calibrate.job import collection_sets, load_job
    from orca_calibrate.shards import merge_shards, write_spec

    job = load_job(_job(tmp_path, engines=2))
    sets, settings, work = collection_sets(job), CollectSettings(**job["collect"]), tmp_path / "w"
    for i, (ids, probes, seconds) in enumerate([(["q0", "q2", "q4"], 9, 30.0),
                                                (["q1", "q3"], 5, 20.0)]):
        write_spec("m", settings, sets, work, i)
        _shard(work / f"shard-{i}" / "set-0", ids, [3] * len(ids))
        (work / f"shard-{i}.stats.json").write_text(json.dumps(
            {"trajectories": len(ids), "answer_probes": probes, "generated_tokens": 100 * (i + 1),
             "generate_s": 0.0, "probe_s": 0.0, "pipelined_s": seconds}))
    stats = merge_shards("m", settings, sets, work)
    assert (stats.trajectories, stats.answer_probes, stats.generated_tokens) == (5, 14, 300)
    assert stats.pipelined_s == stats.engine_s == 30.0  # the shards collect at once
    assert [p.id for p in TrajectorySet.open(sets[0][1]).problems] == [f"q{k}" for k in range(5)]


def test_a_second_worker_on_a_shard_being_collected_is_refused(tmp_path, monkeypatch, capsys):
    # a Kubernetes retry racing the pod it replaced appended the same traces to the shard's
    # folder again (136 duplicate ids of 200 on the toy job) and marked the shard complete
    import fcntl

    from orca_calibrate import job as job_module
    from orca_calibrate.calibrate_cli import main

    ran = []
    monkeypatch.setattr(job_module, "run_shard", lambda spec: ran.append(spec) or Stats())
    config = str(_job(tmp_path))
    work = tmp_path / "run" / "shards"
    work.mkdir(parents=True)
    (work / "shard-0.stats.json").write_text("{}")  # the first worker's finished run
    with open(work / "shard-0.lock", "w") as held:  # the first worker, collecting again
        fcntl.flock(held, fcntl.LOCK_EX)
        assert main(["collect", "--config", config, "--shard", "0"]) == 2
        assert "is being collected by another process" in capsys.readouterr().err
        assert not ran and (work / "shard-0.stats.json").exists()  # its marker left to it
    assert main(["collect", "--config", config, "--shard", "0"]) == 0  # it ended: resumes
    assert len(ran) == 1


def test_a_second_merge_at_once_is_refused(tmp_path):
    """A merge pod retried while the first still runs would append every shard's traces to the
    job's directory a second time: it is refused, naming the holder."""
    import fcntl

    from orca_calibrate.job import collection_sets, load_job
    from orca_calibrate.shards import ShardError, merge_shards

    job = load_job(_job(tmp_path))
    work = tmp_path / "w"
    work.mkdir()
    with open(work / "merge.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(ShardError, match="are being merged by another process"):
            merge_shards("m", CollectSettings(**job["collect"]), collection_sets(job), work)
    with pytest.raises(ShardError, match="2 shards are not complete"):  # free again: it checks
        merge_shards("m", CollectSettings(**job["collect"]), collection_sets(job), work)


def test_merge_refuses_a_complete_shard_whose_folder_is_gone(tmp_path):
    # removed after the shard ended (to collect it again): the merge skipped it, recorded the
    # collection and removed the shards, and half the job's traces were lost for good
    from orca_calibrate.job import collection_sets, load_job
    from orca_calibrate.shards import merge_shards, write_spec

    job = load_job(_job(tmp_path))
    sets, settings, work = collection_sets(job), CollectSettings(**job["collect"]), tmp_path / "w"
    for i, ids in enumerate((["q0", "q2", "q4"], ["q1", "q3"])):
        write_spec("m", settings, sets, work, i)
        _shard(work / f"shard-{i}" / "set-0", ids, [2] * len(ids))
        (work / f"shard-{i}.stats.json").write_text("{}")
    shutil.rmtree(work / "shard-1" / "set-0")
    with pytest.raises(ValueError, match="shard 1 is marked complete but its set-0 are gone"):
        merge_shards("m", settings, sets, work)
    assert not (sets[0][1] / "problems.jsonl").exists()


def test_an_interrupted_collection_stops_its_shard_processes(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM of `run` with collect.engines > 1 left its shard processes collecting,
    orphaned, holding their devices: they are now stopped and waited for."""
    import subprocess
    import sys

    from orca_calibrate import shards
    from orca_calibrate.job import collection_sets, load_job

    started = []

    class Interrupted(subprocess.Popen):
        def wait(self, timeout=None):
            if timeout is None and self is started[0]:
                raise KeyboardInterrupt  # the user's Ctrl-C while the shards collect
            return super().wait(timeout)

    def start(cmd, env, log):
        started.append(Interrupted([sys.executable, "-c", "import time; time.sleep(60)"]))
        return started[-1]

    monkeypatch.setattr(shards, "start_shard", start)
    monkeypatch.setattr(shards, "device_env", lambda i, n, settings: {})
    job = load_job(_job(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        shards.collect_shards("m", CollectSettings(**job["collect"]), collection_sets(job),
                              tmp_path / "w")
    assert len(started) == 2 and all(p.returncode is not None for p in started)


def _gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie its new parent has not reaped yet has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_a_killed_shard_leaves_no_engine_behind(tmp_path, monkeypatch):
    """A shard SIGKILLed (the OOM killer, `kill -9`) cannot shut its engine down: vLLM's engine
    core and workers ran on, orphaned, holding the shard's devices (measured with an `LLM` on the
    toy model: both alive 15 s after their process's SIGKILL). The job's collect ends what the
    shard left in its process group. Here the engine is a child of the shard, which then kills
    itself outright."""
    import sys

    from orca_calibrate import shards
    from orca_calibrate.job import collection_sets, load_job

    engine = tmp_path / "engine.pid"
    shard = ("import os, pathlib, signal, subprocess, sys\n"
             "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
             f"pathlib.Path({str(engine)!r}).write_text(str(c.pid))\n"
             "os.kill(os.getpid(), signal.SIGKILL)\n")
    start = shards.start_shard
    monkeypatch.setattr(shards, "start_shard",
                        lambda cmd, env, log: start([sys.executable, "-c", shard], env, log))
    monkeypatch.setattr(shards, "device_env", lambda i, n, settings: {})
    job = load_job(_job(tmp_path, engines=1))
    with pytest.raises(RuntimeError, match=r"collection shard\(s\) \[0\] failed"):
        shards.collect_shards("m", CollectSettings(**job["collect"]), collection_sets(job),
                              tmp_path / "w")
    pid = int(engine.read_text())
    try:
        assert _gone(pid), "the killed shard's engine outlived the collection"
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_group_of_zombies_has_ended():
    """An ended shard's group whose last members are zombies nobody reaped (a container's init
    may not) holds nothing: it counts as ended, though `killpg(pgid, 0)` still answers for it."""
    from orca_calibrate.shards import group_alive

    pid = os.fork()
    if pid == 0:  # a group of its own, then a zombie: this process does not reap it yet
        os.setsid()
        os._exit(0)
    try:
        for _ in range(200):
            if _gone(pid):
                break
            time.sleep(0.01)
        os.killpg(pid, 0)  # no ProcessLookupError: the zombie is still there
        assert not group_alive(pid)
        assert group_alive(os.getpgid(0))  # this process's own group runs
    finally:
        os.waitpid(pid, 0)
    assert not group_alive(pid)


def test_a_shard_process_stops_when_the_process_that_started_it_dies(tmp_path):
    """`python -m orca_calibrate.shards` under a SIGKILLed `run`: SIGTERM (prctl's parent-death
    signal), which unwinds it as Ctrl-C does (its engine shut down), instead of collecting on."""
    import subprocess
    import sys

    child = ("import pathlib, time\n"
             "from orca_calibrate.shards import die_with_parent, exit_on_sigterm\n"
             "exit_on_sigterm(); die_with_parent()\n"
             f"out = pathlib.Path({str(tmp_path)!r})\n"
             "(out / 'ready').write_text('')\n"
             "try:\n    time.sleep(60)\n"
             "finally:\n    (out / 'unwound').write_text('')\n")
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                               f"c = subprocess.Popen([sys.executable, '-c', {child!r}])\n"
                               "print(c.pid, flush=True)\ntime.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    for _ in range(600):
        if (tmp_path / "ready").exists():
            break
        time.sleep(0.05)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    for _ in range(200):  # its `finally` runs once the parent-death SIGTERM unwinds it
        if (tmp_path / "unwound").exists():
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the shard process outlived its parent")
