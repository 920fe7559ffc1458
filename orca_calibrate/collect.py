"""Collection: run the model on the user's prompts with the plugin in record mode, probe answers.

The step embeddings come from the plugin's own capture and segmentation (the code that serves),
so calibration is on-policy for exactly the online procedure. Every labelled step boundary of a
trajectory is continued with the answer-forcing suffix (greedy, prefix caching on) to read the
intermediate answer; labels follow. Probe prompts, their sampling and the labelled record are
orca_method/answer_probes.py's, shared with the server's live audits. When the probes run is the
`schedule`: as soon as the trajectory is generated, in the engine's batches with the trajectories
still generating (`pipelined`, orca_calibrate/pipeline.py), or after its whole batch is
(`batches`). With a judge configured its verdicts too (orca_calibrate/judge.py, one concurrent
round per group of trajectories written). Each finished problem is appended and flushed at once,
so a killed job loses at most the trajectories in flight (`batch`; pipelined, at most twice that).

With `label_steps: selective` the trajectories of the calibration split are written unprobed
(labels pending) with what probing them needs beside them (`PENDING_FILE`); once the probe is
trained, `label_deferred` probes only the steps LTT reads (orca_method/selective.py).
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import closing
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from orca_calibrate.job_options import check_number, check_whole
from orca_calibrate.judge import Judge, JudgeSettings, question_text
from orca_calibrate.pipeline import Schedule
from orca_calibrate.progress import progress_bar
from orca_method.answer_probes import (
    DEFAULT_ANSWER_TOKENS,
    DEFAULT_SUFFIX,
    JUDGE,
    ProbeSettings,
    probe_prompts,
    probe_sampling,
    step_ends,
    trajectory_fields,
)
from orca_method.consensus import sample_id
from orca_method.labels import extract_forced, require_math_verify
from orca_method.normalizations import DEFAULT_NORMALIZATION, NORMALIZATIONS
from orca_method.outcomes import LABEL_STEPS, LabelSteps
from orca_method.selective import DecidingSteps, next_round
from orca_method.trajectories import (
    DTYPES,
    PROBLEMS_FILE,
    RECORDED_DTYPE,
    TrajectorySet,
    TrajectoryWriter,
    update_problems,
)
from orca_serve.checks.bundle import check_model_folder
from orca_serve.settings.contract import ORCA_OFF, merge_results
from orca_serve.vllm_compat import launch, offline
from orca_serve.vllm_plugin.config import engine_kwargs, prepare_environment

# the dtype the engine computes in (vLLM's `dtype`; a job's `engine: {dtype: ...}` overrides):
# float32, as the CPU tests serve, so collection and serving compute the same hidden states
ENGINE_DTYPE = "float32"
# beside a trajectory directory: what probing its deferred trajectories needs (token ids)
PENDING_FILE = "pending-probes.jsonl"


class Scheduling(StrEnum):
    """How the engine's time is spent (collect's `schedule`): PIPELINED, probes of finished
    traces while later ones generate (orca_calibrate/pipeline.py); BATCHES, a batch generated,
    then probed."""

    PIPELINED = "pipelined"
    BATCHES = "batches"


SCHEDULES: tuple[str, ...] = tuple(str(s) for s in Scheduling)  # what argparse lists
# pipelined: traces started and not yet written, in batches (what a kill loses at most)
UNWRITTEN = 2


@dataclass
class CollectSettings:
    # trajectories per prompt, ids "<id>#<n>" (orca_method.consensus.sample_id): distinct draws
    # at `temperature` > 0, each from its own generator seeded by `seed` and its id
    # (`trace_seed`)
    samples: int = 1
    temperature: float = 0.7
    top_p: float = 1.0
    # as the model's authors advise (Qwen3 thinking mode: top_k 20, min_p 0), so that serving
    # with its generation config samples as calibrated; 0: none (vLLM's SamplingParams' own)
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 1024
    seed: int = 0
    suffix: str = DEFAULT_SUFFIX  # answer-forcing text appended to a reasoning prefix
    answer_tokens: int = DEFAULT_ANSWER_TOKENS  # greedy tokens generated after the suffix
    label_every: int = 1
    batch: int = 64  # traces generating at once (batches: prompts per generation batch)
    dtype: str = RECORDED_DTYPE  # of the stored embeddings (the engine's: engine["dtype"])
    # the procedure's settings (copied into the bundle later; defaults = the Bundle defaults)
    segmentation: dict[str, Any] = field(default_factory=dict)
    think: dict[str, Any] = field(default_factory=dict)
    normalization: str = DEFAULT_NORMALIZATION
    engine: dict[str, Any] = field(default_factory=dict)  # extra vLLM LLM(...) arguments
    judge: JudgeSettings | None = None  # adds labels["judge"]
    label_steps: LabelSteps = LabelSteps.EVERY  # on the calibration split
    engines: int = 1  # engine processes collecting shards at once (a job's; orca_calibrate/shards.py)
    schedule: Scheduling = Scheduling.PIPELINED

    def __post_init__(self) -> None:
        if self.label_steps not in LABEL_STEPS:
            raise ValueError(f"collect.label_steps is one of {', '.join(LABEL_STEPS)}, not "
                             f"{self.label_steps!r:.40}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"collect.schedule is one of {', '.join(SCHEDULES)}, not "
                             f"{self.schedule!r:.40}")
        self.label_steps, self.schedule = LabelSteps(self.label_steps), Scheduling(self.schedule)
        for name, least in (("samples", 1), ("max_tokens", 1), ("seed", 0), ("top_k", 0),
                            ("answer_tokens", 1), ("label_every", 1), ("batch", 1), ("engines", 1)):
            check_whole(f"collect.{name}", getattr(self, name), least)
        # vLLM refuses a temperature above 2 (SamplingParams), but only once the engine holds
        # the model: refused here before anything loads
        check_number("collect.temperature", self.temperature, 0, 2)
        check_number("collect.top_p", self.top_p, 0, 1, low_open=True)
        check_number("collect.min_p", self.min_p, 0, 1)
        for name in ("segmentation", "think", "engine"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"collect.{name} is a mapping, got {getattr(self, name)!r:.40}")
        from pydantic import ValidationError

        from orca_method.bundle import Segmentation, ThinkTags, first_error  # deferred: torch
        for name, model in (("segmentation", Segmentation), ("think", ThinkTags)):
            try:  # the bundle's own types: checked when the job is read, not at engine start
                model(**getattr(self, name))
            except ValidationError as e:
                raise ValueError(f"collect.{name}: {first_error(e)}") from None
        if not isinstance(self.suffix, str):
            raise ValueError(f"collect.suffix is text, got {self.suffix!r:.40}")
        if self.dtype not in DTYPES:
            raise ValueError(f"collect.dtype is one of {', '.join(DTYPES)}, not {self.dtype!r:.40}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"collect.normalization is one of {', '.join(NORMALIZATIONS)}, not "
                             f"{self.normalization!r:.40}")
        if self.label_steps == LabelSteps.SELECTIVE and self.judge is not None:
            raise ValueError("collect.label_steps selective asks no judge (its label stage "
                             "probes without one): label every step with a judge")

    def probe(self) -> ProbeSettings:
        """The answer probes these settings make (orca_method/answer_probes.py)."""
        return ProbeSettings(suffix=self.suffix, answer_tokens=self.answer_tokens,
                             label_every=self.label_every)


@dataclass
class Stats:
    """What a collection did and where the engine's time went: generating alone and probing
    alone (`batches`), or both at once (`pipelined_s`)."""

    trajectories: int = 0
    answer_probes: int = 0
    generated_tokens: int = 0
    generate_s: float = 0.0
    probe_s: float = 0.0
    pipelined_s: float = 0.0
    judge_s: float = 0.0
    judge: dict[str, int] = field(default_factory=dict)  # the judge's counts, when there is one

    @property
    def engine_s(self) -> float:
        """Seconds the engine ran (generating, probing, or both at once)."""
        return self.generate_s + self.probe_s + self.pipelined_s

    def as_dict(self) -> dict[str, float]:
        total = self.engine_s + self.judge_s
        probing = self.probe_s + self.pipelined_s  # seconds in which probes ran
        judge = {**self.judge, "judge_s": round(self.judge_s, 2)} if self.judge else {}
        return {"trajectories": self.trajectories, "answer_probes": self.answer_probes,
                "generated_tokens": self.generated_tokens,
                "generate_s": round(self.generate_s, 2), "probe_s": round(self.probe_s, 2),
                "pipelined_s": round(self.pipelined_s, 2),
                "trajectories_per_min": round(60 * self.trajectories / total, 2) if total else 0,
                "generated_tokens_per_s": round(self.generated_tokens / self.engine_s, 1)
                if self.engine_s else 0,
                "answer_probes_per_s": round(self.answer_probes / probing, 2) if probing else 0,
                "probe_share": round(self.probe_s / total, 3) if total else 0, **judge}


def read_prompts(path: Path) -> list[dict]:
    """JSON lines with `id`, `messages` (chat) or `prompt`, optional `answer` and `family`."""
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} not found")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"prompts file {path} is not text (UTF-8 JSON lines)") from None
    out, seen = [], set()
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(rec, dict) or "id" not in rec or not (
                isinstance(rec.get("messages"), list) or isinstance(rec.get("prompt"), str)):
            raise ValueError(f"{path}:{n}: each line needs `id` and `messages` (list) or "
                             "`prompt` (string)")
        if rec.get("messages") == [] and "prompt" not in rec:  # vLLM said only "prompt"
            raise ValueError(f"{path}:{n}: `messages` is empty: nothing to ask")
        rid = str(rec["id"])
        if rid in seen:
            raise ValueError(f"{path}:{n}: duplicate id {rid!r}")
        seen.add(rid)
        out.append(rec)
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out


def trace_keys(prompts: list[dict], samples: int) -> list[tuple[str, dict]]:
    """(trajectory id, prompt record) of every trace a collection makes: `id`, or `id#k` for
    the k-th of several samples."""
    return [(sample_id(str(rec["id"]), k) if samples > 1 else str(rec["id"]), rec)
            for rec in prompts for k in range(samples)]


def trace_seed(seed: int, key: str) -> int:
    """The sampling seed of the trace `key` (a prompt id, or a sample's "<id>#<n>") in a
    collection seeded `seed`. Per trace, not the engine's one generator: that one hands its
    draws out in the order the batch happens to run, so one trace ending a step sooner (or a
    request reaching the engine a step later) changed nearly every other trace of a rerun (1,195
    of the toy job's 1,200); a trace's own generator makes its draws its own."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:4], "big")


def _chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


class Collector:
    """One vLLM engine with the plugin in record mode; writes a trajectory directory."""

    def __init__(self, model: str, settings: CollectSettings) -> None:
        check_model_folder(model, settings.engine.get("hf_config_path"))  # before vLLM's import
        require_math_verify()
        self.judge = Judge(settings.judge) if settings.judge else None
        if self.judge is not None:
            self.judge.check()  # before the model loads: a bad endpoint fails in seconds
        from vllm import LLM  # deferred: vllm (calibrate_cli imports this module)

        note = prepare_environment()  # the tested V1 model runner unless the environment chose
        if note:
            print(f"note: {note}", file=sys.stderr, flush=True)
        self.settings = settings
        plugin = engine_kwargs(None, segmentation=settings.segmentation, think=settings.think,
                               normalization=settings.normalization)
        kwargs = {"dtype": ENGINE_DTYPE, "enforce_eager": True, "enable_prefix_caching": True,
                  "seed": settings.seed, **plugin, **settings.engine}
        if launch.is_cpu_platform():  # each trace is seeded (`trace_seed`): prefills kept whole
            chunking = launch.chunking_option(kwargs)
            if chunking:
                raise ValueError(f"collect.engine.{chunking} is refused: "
                                 f"{launch.SEEDED_CHUNKS_CRASH}; every trace is seeded")
            budget = kwargs.get("max_num_batched_tokens")
            if budget is not None:  # a step must then fit a whole prompt
                max_len = (kwargs.get("max_model_len")
                           or launch.derived_max_model_len({"model": model, **kwargs}))
                if budget < max_len:
                    raise ValueError(f"collect.engine.max_num_batched_tokens {budget} is below "
                                     f"the context length {max_len}: "
                                     f"{launch.SEEDED_CHUNKS_CRASH}; every trace is seeded, so "
                                     "a step must fit a whole prompt (raise it, or lower "
                                     "collect.engine.max_model_len)")
            kwargs["enable_chunked_prefill"] = False
        try:
            self.llm = LLM(model=model, **kwargs)
        except TypeError as e:  # an argument vLLM does not take: a job's collect.engine, --engine
            if "unexpected keyword argument" not in str(e):
                raise
            raise ValueError(f"engine arguments (collect.engine, --engine): {e}") from None
        self.model = model
        self.tokenizer = self.llm.get_tokenizer()
        self.record_settings = kwargs["additional_config"]["orca"]
        self.stats = Stats()

    def info_fields(self) -> dict[str, Any]:
        """What the bundle later takes from the data: model identity, the procedure settings and
        how the steps were labelled (the live audit must label the same way)."""
        # deferred: torch
        from orca_method.bundle import (
            COLLECTED_UNDER,
            Generation,
            config_fingerprint,
            tokenizer_fingerprint,
        )
        rs, s = self.record_settings, self.settings
        model_config = self.llm.llm_engine.model_config
        config = config_fingerprint(model_config.hf_config)
        # the engine's resolved dtype (collect.engine's `auto` included) and every trace's sampling
        under = Generation(dtype=launch.dtype_name(model_config.dtype), temperature=s.temperature,
                           top_p=s.top_p, top_k=s.top_k, min_p=s.min_p)
        return {"model": self.model, "normalization": rs.get("normalization", DEFAULT_NORMALIZATION),
                "segmentation": rs.get("segmentation"), "think": rs.get("think"),
                "tokenizer_fingerprint": tokenizer_fingerprint(self.tokenizer.get_vocab()),
                "model_config": None if config is None else config.model_dump(),
                "labelling": s.probe().labelling(), COLLECTED_UNDER: under.record()}

    def _generation(self, batch: list[tuple[str, dict]]) -> tuple[list[Any], list[Any]]:
        """The prompts (all chats, or all rendered) and sampling of these traces, in record mode."""
        from vllm import SamplingParams  # deferred: vllm (calibrate_cli imports this module)
        s = self.settings
        params, chats = [], []
        for key, rec in batch:
            params.append(SamplingParams(
                temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
                max_tokens=s.max_tokens, seed=trace_seed(s.seed, key),
                extra_args={"orca_key": key, "orca_record": 1, "orca_enabled": 0}))
            chats.append(rec.get("messages") or rec["prompt"])
        if not all(isinstance(c, list) for c in chats):
            chats = [c if isinstance(c, str) else self._render(c) for c in chats]
        return chats, params

    def _generate(self, batch: list[tuple[str, dict]]) -> list[tuple[str, dict, Any, dict]]:
        t0 = time.perf_counter()
        prompts, params = self._generation(batch)
        if all(isinstance(c, list) for c in prompts):
            outs = self.llm.chat(prompts, params, use_tqdm=False)
        else:
            outs = self.llm.generate(prompts, params, use_tqdm=False)
        results = self._results([key for key, _ in batch])
        self.stats.generate_s += time.perf_counter() - t0
        self.stats.generated_tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        return [(k, rec, out, results[k]) for (k, rec), out in zip(batch, outs)]

    def _render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)

    def _results(self, keys: list[str]) -> dict[str, dict]:
        # the trajectory record's fields (`OrcaResult.to_dict`): what the record writer takes
        merged = {k: r.to_dict() for k, r in
                  merge_results(self.llm.collective_rpc("orca_results", args=(keys,))).items()}
        missing = [k for k in keys if k not in merged]
        if missing:
            raise RuntimeError(f"the plugin returned no record for {len(missing)} request(s), "
                               f"e.g. {missing[:3]}; is the plugin loaded in record mode?")
        return merged

    def _probe_answers(self, done: list[tuple[str, dict, Any, dict]]) -> list[dict[int, str | None]]:
        """Continue every labelled step prefix with the answer-forcing suffix (orca_method/answer_probes.py)."""
        return self.probe_steps([(out.prompt_token_ids, out.outputs[0].token_ids, res, None)
                                 for _, _, out, res in done])

    def _probe_requests(self, traces: list[tuple[list[int], list[int], dict, set[int] | None]]
                        ) -> tuple[list[Any], list[tuple[int, int]], Any]:
        """The answer probes of each (prompt ids, generated ids, record, steps): prompts, (trace,
        step) of each, and their sampling."""
        from vllm import SamplingParams  # deferred: vllm (calibrate_cli imports this module)
        from vllm.inputs import TokensPrompt  # deferred: vllm
        s = self.settings
        suffix_ids = self.tokenizer.encode(s.suffix, add_special_tokens=False)
        prompts, where = [], []
        for j, (prompt_ids, gen_ids, record, steps) in enumerate(traces):
            for t, ids in probe_prompts(prompt_ids, gen_ids, record, suffix_ids, s.label_every,
                                        steps):
                prompts.append(TokensPrompt(prompt_token_ids=ids))
                where.append((j, t))
        return prompts, where, SamplingParams(**probe_sampling(s.answer_tokens),
                                              extra_args=dict(ORCA_OFF))

    def probe_steps(self, traces: list[tuple[list[int], list[int], dict, set[int] | None]]
                    ) -> list[dict[int, str | None]]:
        """The answers probed at `steps` (None: every labelled step) of each (prompt ids,
        generated ids, record, steps), in one engine call."""
        t0 = time.perf_counter()
        prompts, where, params = self._probe_requests(traces)
        outs = self.llm.generate(prompts, params, use_tqdm=False) if prompts else []
        answers: list[dict[int, str | None]] = [{} for _ in traces]
        for (j, t), o in zip(where, outs):
            answers[j][t] = extract_forced(o.outputs[0].text)
        self.stats.answer_probes += len(prompts)
        self.stats.probe_s += time.perf_counter() - t0
        return answers

    def close(self) -> None:
        """Shut the engine down now (dropping the last reference runs vLLM's own shutdown), so
        its shutdown lines come before what the caller prints next, and its workers exit while
        the process still runs: left to interpreter exit, vLLM logged them after the job's table
        and force-killed a worker, whose shared memory Python then reported as leaked."""
        self.llm = None
        gc.collect()

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def record(self, prompts: list[dict]) -> list[dict]:
        """Run `prompts` once each in record mode, no answer probes: each one's record (step
        embeddings included), in order. What the shift gate's features need (orca_calibrate/gate.py)."""
        todo = [(str(rec.get("id", i)), rec) for i, rec in enumerate(prompts)]
        return [res for batch in _chunks(todo, self.settings.batch)
                for _, _, _, res in self._generate(batch)]

    def run(self, prompts: list[dict], out_dir: Path, progress: bool = True,
            defer: Callable[[str], bool] | None = None) -> Stats:
        """Collect every (prompt, sample) not yet in `out_dir`; resumable. Trajectories whose id
        `defer` accepts are written unprobed, labels pending (`label_deferred` labels them)."""
        s = self.settings
        later = defer or (lambda key: False)
        collect = self._pipelined if s.schedule == Scheduling.PIPELINED else self._batches
        with TrajectoryWriter(out_dir, dim=self.llm.llm_engine.model_config.get_hidden_size(),
                              dtype=s.dtype, **self.info_fields()) as writer:
            todo = [(key, rec) for key, rec in trace_keys(prompts, s.samples)
                    if key not in writer.ids]
            bar = progress_bar(total=len(todo), desc="collect", unit="traj", disable=not progress)
            # closed on the way out, an exception's too: what is still in the engine is aborted
            with closing(collect(todo, later)) as ready:
                for ended, generated, answers in ready:
                    self._write(generated, answers, writer, out_dir)
                    bar.update(ended)
                    bar.set_postfix(refresh=False, **{
                        k: v for k, v in self.stats.as_dict().items()
                        if k in ("trajectories_per_min", "probe_share")})
            bar.close()
        if self.judge is not None and self.judge.unparseable:
            print(f"warning: {self.judge.unparseable} of {self.judge.calls} judge replies were "
                  f"neither yes nor no (labelled 0), e.g. {self.judge.example!r}", file=sys.stderr)
        return self.stats

    def _batches(self, todo: list[tuple[str, dict]], defer: Callable[[str], bool]) -> Iterator[
            tuple[int, list[tuple[str, dict, Any, dict]], list[dict[int, str | None] | None]]]:
        """Generate a batch, then probe it: per batch, (traces it ended, those with a step,
        their answers: None for the deferred ones, written after the probed ones)."""
        for batch in _chunks(todo, self.settings.batch):
            generated = [d for d in self._generate(batch) if d[3]["step_tokens"]]
            done = [d for d in generated if not defer(d[0])]
            later = [d for d in generated if defer(d[0])]
            yield len(batch), done + later, [*self._probe_answers(done), *[None] * len(later)]

    def _pipelined(self, todo: list[tuple[str, dict]], defer: Callable[[str], bool]) -> Iterator[
            tuple[int, list[tuple[str, dict, Any, dict]], list[dict[int, str | None] | None]]]:
        """Probe each trace as soon as it is generated, while later ones generate
        (orca_calibrate/pipeline.py): (traces ended, those with a step, their answers: None for
        the deferred ones), in the job's order, as they become ready. Requests still in the
        engine when this stops early (a kill, an error) are aborted."""
        s = self.settings
        schedule = Schedule([key for key, _ in todo], generating=s.batch,
                            unwritten=UNWRITTEN * s.batch)
        records = dict(todo)
        requests: dict[str, tuple[str, int | None]] = {}  # engine id -> (trace, probed step)
        traces: dict[str, tuple[str, dict, Any, dict]] = {}  # generated, not yet handed on
        answers: dict[str, dict[int, str | None]] = {}
        t0 = time.perf_counter()
        try:
            while not schedule.done:
                if start := schedule.start():
                    ids = offline.enqueue(self.llm, *self._generation(
                        [(key, records[key]) for key in start]))
                    requests.update((rid, (key, None)) for rid, key in zip(ids, start))
                if not offline.busy(self.llm):
                    raise RuntimeError("the pipelined collection stalled: nothing in the engine "
                                       "and no trace ready")
                finished = offline.step(self.llm)
                generated = [o for o in finished if requests[o.request_id][1] is None]
                results = self._results([requests[o.request_id][0] for o in generated]) \
                    if generated else {}
                probes: list[tuple[str, Any]] = []
                for o in finished:
                    key, step = requests.pop(o.request_id)
                    if step is not None:
                        answers[key][step] = extract_forced(o.outputs[0].text)
                        schedule.probed(key)
                        continue
                    res = results[key]
                    traces[key] = (key, records[key], o, res)
                    self.stats.generated_tokens += len(o.outputs[0].token_ids)
                    if res["step_tokens"] and not defer(key):
                        answers[key] = {}
                        probes.append((key, (o.prompt_token_ids, o.outputs[0].token_ids, res,
                                             None)))
                    else:
                        schedule.generated(key, 0)
                if probes:
                    prompts, where, params = self._probe_requests([t for _, t in probes])
                    ids = offline.enqueue(self.llm, prompts, params)
                    requests.update((rid, (probes[j][0], t)) for rid, (j, t) in zip(ids, where))
                    per_trace = Counter(j for j, _ in where)
                    for j, (key, _) in enumerate(probes):
                        schedule.generated(key, per_trace[j])
                    self.stats.answer_probes += len(prompts)
                if ready := schedule.ready():
                    self.stats.pipelined_s += time.perf_counter() - t0
                    done = [traces.pop(key) for key in ready]
                    done = [d for d in done if d[3]["step_tokens"]]
                    yield len(ready), done, [answers.pop(d[0], None) for d in done]
                    t0 = time.perf_counter()
            self.stats.pipelined_s += time.perf_counter() - t0
        finally:
            offline.abort(self.llm, list(requests))

    def _write(self, generated: list[tuple[str, dict, Any, dict]],
               answers: list[dict[int, str | None] | None], writer: TrajectoryWriter,
               out_dir: Path) -> None:
        """Append these traces to the set, in the order given: a probed one (its answers) with
        its labels (and the judge's, one round for all), a deferred one (answers None) with its
        probe data beside the set (`PENDING_FILE`)."""
        probed = [(d, a) for d, a in zip(generated, answers) if a is not None]
        t0 = time.perf_counter()
        labelled = iter(_label_batch([d for d, _ in probed], [a for _, a in probed], self.judge))
        if self.judge is not None:
            self.stats.judge_s += time.perf_counter() - t0
            self.stats.judge = self.judge.counts()
        for (key, rec, out, res), a in zip(generated, answers):
            if a is None:  # the sidecar line first; on a resume (the trajectory generated
                # again) the last line of an id is its record's
                p = _pending_line(key, rec, out, res)
                with open(out_dir / PENDING_FILE, "a") as f:
                    f.write(json.dumps(p) + "\n")
                record = _deferred_fields(p, {})
            else:
                record = next(labelled)
            writer.append(record, res["step_embeddings"])
            self.stats.trajectories += 1


@dataclass
class LabelStats:
    """What `label_deferred` did: trajectories labelled, probes and probe rounds, and the probes
    every-step labelling would have made on them (`labelled_steps`)."""

    trajectories: int = 0
    answer_probes: int = 0
    every_step_probes: int = 0
    rounds: int = 0
    probe_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        n = self.trajectories or 1
        return {"trajectories": self.trajectories, "answer_probes": self.answer_probes,
                "every_step_probes": self.every_step_probes, "rounds": self.rounds,
                "probes_per_trajectory": round(self.answer_probes / n, 2),
                "every_step_probes_per_trajectory": round(self.every_step_probes / n, 2),
                "probe_s": round(self.probe_s, 2)}


def _pending_line(key: str, rec: dict, out: Any, res: dict) -> dict[str, Any]:
    """What probing a deferred trajectory later needs: its prompt and generated token ids (to
    the end of its last step) and step ends, and what its record is built from."""
    o = out.outputs[0]
    gen = list(o.token_ids)
    ends = step_ends(gen, res["step_token_ids"])
    return {"id": key, "rec": rec, "text": o.text, "finish_reason": o.finish_reason,
            "completion_tokens": len(gen), "step_tokens": list(res["step_tokens"]),
            "prompt_ids": list(out.prompt_token_ids), "gen_ids": gen[:ends[-1]],
            "step_ends": ends}


def _deferred_fields(p: dict[str, Any], probed: dict[int, str | None],
                     resolved: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The record of a deferred trajectory with the answers probed so far; `extra.selective`
    says which steps were probed and for which label modes' LTT (`resolved`: None while its
    labels are pending, and calibration refuses it)."""
    record = trajectory_fields(p["id"], p["rec"], text=p["text"],
                               finish_reason=p["finish_reason"],
                               completion_tokens=p["completion_tokens"],
                               step_tokens=p["step_tokens"], probed=probed)
    record["extra"]["selective"] = {"probed": sorted(probed), "resolved": resolved}
    return record


def label_deferred(out_dir: Path, deciding: Mapping[str, Mapping[str, DecidingSteps]],
                   collector: Callable[[], Collector], resolved: Mapping[str, Any],
                   progress: bool = True) -> LabelStats:
    """Label the deferred trajectories `deciding` names (id -> label mode -> its deciding
    points, orca_method/selective.py) in rounds of probes (each one engine call over all of
    them) until every point is settled, and rewrite their records after each round (a killed
    stage resumes from the answers already stored). `collector` is called only when there is
    something to probe (no engine starts for a finished set); `resolved` goes into each
    record's `extra.selective` (the modes calibration may read)."""
    ts = TrajectorySet.open(out_dir)
    by_id = {p.id: p for p in ts.problems}
    pending = {}
    for line in (out_dir / PENDING_FILE).read_text().splitlines():
        p = json.loads(line)
        if p["id"] in deciding:
            pending[p["id"]] = p
    missing = set(deciding) - set(pending)
    if missing:
        raise ValueError(f"{out_dir / PENDING_FILE} has no token ids for {len(missing)} deferred "
                         f"trajectories, e.g. {sorted(missing)[:3]}; recollect {out_dir}")
    answers: dict[str, dict[int, str | None]] = {}
    for pid in deciding:
        prob = by_id[pid]
        answers[pid] = {t: prob.step_answers[t] for t in prob.extra["selective"]["probed"]}
    # the candidates of every mode are the steps every-step labelling probes
    stats = LabelStats(trajectories=len(deciding), every_step_probes=sum(
        len(next(iter(modes.values())).candidates) for modes in deciding.values()))
    engine: Collector | None = None
    while True:
        todo = {}
        for pid, modes in deciding.items():
            labels = _deferred_fields(pending[pid], answers[pid])["labels"]
            steps = next_round(modes, labels, answers[pid])
            if steps:
                todo[pid] = steps
        if not todo:
            break
        engine = engine or collector()
        t0 = time.perf_counter()
        got = engine.probe_steps([(pending[pid]["prompt_ids"], pending[pid]["gen_ids"],
                                   pending[pid], steps) for pid, steps in todo.items()])
        stats.probe_s += time.perf_counter() - t0
        stats.rounds += 1
        for pid, new in zip(todo, got):
            answers[pid].update(new)
        update_problems(out_dir, {pid: _deferred_fields(pending[pid], answers[pid])
                                  for pid in todo})
        if progress:
            print(f"label: round {stats.rounds}: {sum(map(len, todo.values()))} probes on "
                  f"{len(todo)} trajectories", flush=True)
    stats.answer_probes = sum(map(len, answers.values()))  # a resumed stage's earlier ones too
    update_problems(out_dir, {pid: _deferred_fields(pending[pid], answers[pid], resolved)
                              for pid in deciding})
    return stats


def _label_batch(done: list[tuple[str, dict, Any, dict]], answers: list[dict[int, str | None]],
                 judge: Judge | None) -> list[dict[str, Any]]:
    """The records of a generated batch; a judge sees all their step answers in one round."""
    records = [_problem_fields(key, rec, out, res, probed)
               for (key, rec, out, res), probed in zip(done, answers)]
    if judge is not None:
        verdicts = judge.label([(question_text(rec), r["answer"], r["step_answers"])
                                for (_, rec, _, _), r in zip(done, records)])
        for r, v in zip(records, verdicts):
            r["labels"][JUDGE] = v
    return records


def _problem_fields(key: str, rec: dict, out: Any, res: dict,
                    probed: dict[int, str | None]) -> dict[str, Any]:
    """The shared record (orca_method/answer_probes.py) of one vLLM `RequestOutput`."""
    o = out.outputs[0]
    return trajectory_fields(key, rec, text=o.text, finish_reason=o.finish_reason,
                             completion_tokens=len(o.token_ids), step_tokens=res["step_tokens"],
                             probed=probed)
