"""Recorded reasoning trajectories: the on-disk format (version 1), its reader and writer.

A trajectory directory holds ``info.json``, ``problems.jsonl`` (one metadata line per problem)
and ``embeddings.bin`` (raw little-endian rows ``[total_steps, dim]``, problem after problem).
Embeddings are memory-mapped, never loaded whole: a 32B-model collection is gigabytes; each
problem's rows are checked for NaN/inf the first time they are read.
The writer is append-only and resumable so a killed collection job loses at most the problem
in flight. The authors' research pickles are read too (``TrajectorySet.open`` on a ``.pkl``)
and can be converted with ``import_pickle``. See docs/TRAJECTORIES.md.
"""

from __future__ import annotations

import json
import math
import os
import pickle
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, Self

import numpy as np

from orca_method.errors import first_line
from orca_method.files import write_atomic
from orca_method.normalizations import DEFAULT_NORMALIZATION, NORMALIZATIONS, Normalization
from orca_method.risk import cumulative

FORMAT = "orca-trajectories"
VERSION = 1
INFO_FILE, PROBLEMS_FILE, EMBEDDINGS_FILE = "info.json", "problems.jsonl", "embeddings.bin"
DTYPES = {"float16": np.dtype("<f2"), "float32": np.dtype("<f4")}
# The stored embeddings' dtype by default (not the dtype a model computes in): float16 halves the
# disk for sets converted or generated from given numbers (import-pickle, synth, a plain writer);
# embeddings recorded from an engine (collect, the live audit) are kept float32, as the server's
# probe reads them, so a replay scores exactly what was served
STORED_DTYPE = "float16"
RECORDED_DTYPE = "float32"


class Split(StrEnum):
    """The parts a set's problems are split into (a problem's `split`): the probe is trained on
    TRAIN, lambda* certified on CALIBRATION, the bundle evaluated on TEST."""

    TRAIN = "train"
    CALIBRATION = "calibration"
    TEST = "test"


SPLITS: tuple[str, ...] = tuple(str(s) for s in Split)
ALL = "all"  # not a split: every problem of a set, whatever its split (TrajectorySet.split)
DEFAULT_FRACTIONS = (0.6, 0.2, 0.2)  # of SPLITS, in that order

INFO_DEFAULTS: dict[str, Any] = {
    "model": None, "normalization": DEFAULT_NORMALIZATION, "segmentation": None, "source": None,
    "think": None, "tokenizer_fingerprint": None, "model_config": None, "labelling": None,
    "collected_under": None,  # dtype and sampling of the traces (orca_method/bundle.py Generation)
}


class PickleLabels(StrEnum):
    """How a research-code pickle's one label per block becomes a label per step
    (`expand_block_labels`)."""

    PESSIMISTIC = "pessimistic"
    RESEARCH = "research"


PICKLE_LABELS: tuple[str, ...] = tuple(str(m) for m in PickleLabels)
_PICKLE_LABEL_KEYS = {"step_labels": "supervised", "step_labels_consistent": "consistent"}


class TrajectoryError(ValueError):
    """Invalid trajectory data; the message says what is wrong and what to do."""


# ---------------------------------------------------------------------------------- problems


@dataclass
class Problem:
    """Metadata of one trajectory; its embeddings live in the set's ``embeddings.bin``."""

    id: str
    n_steps: int
    offset: int = 0
    prompt: str | None = None
    answer: str | None = None
    split: str | None = None
    family: str | None = None
    step_tokens: list[int] | None = None
    step_answers: list[str | None] | None = None
    final_answer: str | None = None
    labels: dict[str, list[int]] = field(default_factory=dict)
    step_texts: list[str] | None = None
    extra: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> Problem:
        """Validate a metadata object and coerce numpy scalars/arrays to plain JSON values."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise TrajectoryError(f"{where}: unknown field(s) {sorted(unknown)}; "
                                  f"allowed fields are {sorted(known)}")
        for name in ("id", "n_steps"):
            if name not in d:
                raise TrajectoryError(f"{where}: missing required field {name!r}")
        p = cls(**d)
        if not isinstance(p.id, str) or not p.id:
            raise TrajectoryError(f"{where}: 'id' must be a non-empty string, got {p.id!r}")
        where = f"{where} (id {p.id!r})"
        p.n_steps = _int(p.n_steps, where, "n_steps", minimum=1)
        p.offset = _int(p.offset, where, "offset", minimum=0)
        for name in ("prompt", "answer", "family", "final_answer"):
            _str_or_none(getattr(p, name), where, name)
        if p.split is not None and p.split not in SPLITS:
            raise TrajectoryError(f"{where}: split {p.split!r} is not one of {SPLITS} or null")
        n = p.n_steps
        if p.step_tokens is not None:
            p.step_tokens = [_int(t, where, "step_tokens", minimum=1)
                             for t in _seq(p.step_tokens, n, where, "step_tokens")]
        if p.step_answers is not None:
            p.step_answers = list(_seq(p.step_answers, n, where, "step_answers"))
            for a in p.step_answers:
                _str_or_none(a, where, "step_answers")
        if p.step_texts is not None:
            p.step_texts = list(_seq(p.step_texts, n, where, "step_texts"))
            if not all(isinstance(t, str) for t in p.step_texts):
                raise TrajectoryError(f"{where}: 'step_texts' must be a list of strings")
        if not isinstance(p.labels, Mapping):
            raise TrajectoryError(f"{where}: 'labels' must be an object mode -> list of 0/1")
        p.labels = {mode: _labels(v, n, where, mode) for mode, v in p.labels.items()}
        if p.extra is not None and not isinstance(p.extra, Mapping):
            raise TrajectoryError(f"{where}: 'extra' must be an object or null")
        return p

    def to_dict(self) -> dict[str, Any]:
        """JSON object in the documented field order; optional fields only when present."""
        d = {k: getattr(self, k) for k in (
            "id", "prompt", "answer", "split", "family", "offset", "n_steps",
            "step_tokens", "step_answers", "final_answer", "labels")}
        for name in ("step_texts", "extra"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        return d


def _int(v: Any, where: str, name: str, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
        raise TrajectoryError(f"{where}: {name!r} must be an integer >= {minimum}, "
                              f"got {_show(v)}")
    return int(v)


def _show(v: Any) -> str:
    """A value for a one-line message (numpy arrays print on several lines)."""
    text = repr(v).replace("\n", " ")
    return text if len(text) <= 80 else text[:77] + "..."


def _str_or_none(v: Any, where: str, name: str) -> None:
    if v is not None and not isinstance(v, str):
        raise TrajectoryError(f"{where}: {name!r} must be a string or null, got {type(v).__name__}")


def _seq(v: Any, n: int, where: str, name: str) -> Sequence[Any]:
    if isinstance(v, (str, bytes, Mapping)) or not hasattr(v, "__len__"):
        raise TrajectoryError(f"{where}: {name!r} must be a list, got {type(v).__name__}")
    if len(v) != n:
        raise TrajectoryError(f"{where}: {name!r} has {len(v)} entries but n_steps is {n}; "
                              "there must be exactly one per step")
    return v


def _labels(v: Any, n: int, where: str, mode: str) -> list[int]:
    if not isinstance(mode, str) or not mode:
        raise TrajectoryError(f"{where}: label mode names must be non-empty strings, got {mode!r}")
    values = _seq(v, n, where, f"labels[{mode!r}]")
    if not all(isinstance(x, (int, float, np.number, np.bool_)) and x in (0, 1) for x in values):
        raise TrajectoryError(f"{where}: labels[{mode!r}] must contain only 0/1, "
                              f"got {sorted({repr(x) for x in values} - {'0', '1'})[:5]}")
    return [int(x) for x in values]


def _read_problems(path: Path, tolerate_partial_tail: bool) -> tuple[list[Problem], int]:
    """Parse problems.jsonl; returns the problems and the byte length of the complete lines.

    A last line without its newline is what a killed writer leaves behind: the writer drops
    it (``tolerate_partial_tail``), the reader refuses it.
    """
    data = _read_bytes(path)
    complete = data.rfind(b"\n") + 1
    if complete < len(data) and not tolerate_partial_tail:
        raise TrajectoryError(
            f"{path}: the last line is incomplete (collection interrupted?). Open the directory "
            "with TrajectoryWriter to repair it (it drops the incomplete problem), then re-read.")
    problems = []
    for lineno, line in enumerate(data[:complete].split(b"\n"), start=1):
        if not line.strip():
            continue
        where = f"{path.name} line {lineno}"
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, too many digits, too deep
            raise TrajectoryError(f"{where}: not valid JSON ({first_line(e)}); fix or remove "
                                  "the line") from None
        if not isinstance(obj, dict):
            raise TrajectoryError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        problems.append(Problem.from_dict(obj, where))
    return problems, complete


def _check_problem_set(problems: Sequence[Problem], where: str) -> int:
    """Unique ids and contiguous offsets; returns the total number of embedding rows."""
    seen: set[str] = set()
    row = 0
    for p in problems:
        if p.id in seen:
            raise TrajectoryError(f"{where}: duplicate problem id {p.id!r}; ids must be unique "
                                  "(remove the duplicate line or rename one of them)")
        seen.add(p.id)
        if p.offset != row:
            raise TrajectoryError(
                f"{where}: problem {p.id!r} has offset {p.offset} but the problems before it end "
                f"at row {row}; offsets must be contiguous in file order (rows were lost or "
                "lines reordered: re-collect or rewrite the offsets)")
        row += p.n_steps
    return row


# -------------------------------------------------------------------------------------- info


def _make_info(dim: int, dtype: str, info_fields: Mapping[str, Any]) -> dict[str, Any]:
    unknown = set(info_fields) - set(INFO_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown info field(s) {sorted(unknown)}; "
                        f"allowed: {sorted(INFO_DEFAULTS)}")
    info = {"format": FORMAT, "version": VERSION, "dim": dim, "dtype": dtype,
            **INFO_DEFAULTS, **info_fields}
    _check_info(info, "info")
    return info


def _check_info(info: Any, where: str) -> None:
    if not isinstance(info, dict):
        raise TrajectoryError(f"{where}: must be a JSON object")
    missing = {"format", "version", "dim", "dtype"} - set(info)
    if missing:
        raise TrajectoryError(f"{where}: missing field(s) {sorted(missing)}")
    unknown = set(info) - {"format", "version", "dim", "dtype", *INFO_DEFAULTS}
    if unknown:  # a misspelt optional field would otherwise silently take its default
        raise TrajectoryError(f"{where}: unknown field(s) {sorted(unknown)}; allowed are "
                              f"{sorted({'format', 'version', 'dim', 'dtype', *INFO_DEFAULTS})}")
    for name, default in INFO_DEFAULTS.items():  # optional fields (older sets lack the newer ones)
        info.setdefault(name, default)
    if info["format"] != FORMAT:
        raise TrajectoryError(f"{where}: format is {info['format']!r}, expected {FORMAT!r}; "
                              "this is not an orca trajectory directory")
    if isinstance(info["version"], bool) or info["version"] != VERSION:
        raise TrajectoryError(f"{where}: format version {info['version']!r} is not supported "
                              f"(this code reads version {VERSION}); use a matching orca-serve")
    _int(info["dim"], where, "dim", minimum=1)
    if not isinstance(info["dtype"], str) or info["dtype"] not in DTYPES:
        raise TrajectoryError(f"{where}: dtype {info['dtype']!r} is not one of {sorted(DTYPES)}")
    if not isinstance(info["normalization"], str) or info["normalization"] not in NORMALIZATIONS:
        raise TrajectoryError(f"{where}: normalization {info['normalization']!r} is not one of "
                              f"{NORMALIZATIONS}")
    for name in ("model", "source", "tokenizer_fingerprint"):
        _str_or_none(info[name], where, name)
    for name in ("segmentation", "think", "model_config", "collected_under"):
        if info[name] is not None and not isinstance(info[name], dict):
            raise TrajectoryError(f"{where}: {name} must be an object or null")
    _check_labelling(info["labelling"], where)


def _check_labelling(labelling: Any, where: str) -> None:
    """`labelling`: null (not recorded) or how the answer probes labelled the steps, the two
    settings a bundle's `labelling` block takes from it (orca_method/bundle.py `Labelling`)."""
    if labelling is None:
        return
    if not (isinstance(labelling, dict) and set(labelling) == {"suffix", "answer_tokens"}
            and isinstance(labelling["suffix"], str) and labelling["suffix"]
            and type(labelling["answer_tokens"]) is int and labelling["answer_tokens"] >= 1):
        raise TrajectoryError(f"{where}: labelling must be null or an object with a non-empty "
                              "string `suffix` and an integer `answer_tokens` >= 1")


def _read_info(directory: Path) -> dict[str, Any]:
    try:
        info = json.loads(_read_bytes(directory / INFO_FILE))
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, too many digits, too deep
        raise TrajectoryError(f"{directory / INFO_FILE}: not valid JSON ({first_line(e)})") \
            from None
    _check_info(info, str(directory / INFO_FILE))
    return info


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise TrajectoryError(f"cannot read {path}: {e.strerror or e}") from None


# ---------------------------------------------------------------------------------- the set


class TrajectorySet:
    """Problems plus their step embeddings; open with ``TrajectorySet.open``."""

    def __init__(self, path: Path, info: dict[str, Any], problems: list[Problem],
                 arrays: list[np.ndarray]):
        self.path = path
        self.info = info
        self.problems = problems
        self._arrays = arrays
        self._finite = [False] * len(arrays)  # rows checked for NaN/inf (on first read)

    @classmethod
    def open(cls, path: str | Path, *, pickle_labels: str = "pessimistic") -> TrajectorySet:
        """Open a trajectory directory (memory-mapped) or a research-code pickle (in memory).

        ``pickle_labels`` only matters for pickles: "pessimistic" (docs/METHOD.md section 4) or
        "research" (the authors' block copy, to reproduce the paper's numbers).
        """
        path = Path(path)
        if path.is_dir():
            return cls._open_directory(path)
        if path.is_file() and _looks_like_pickle(path):
            return cls._open_pickle(path, pickle_labels)
        if not path.exists():
            raise TrajectoryError(f"{path} does not exist; pass a trajectory directory or a "
                                  "research-code .pkl file")
        raise TrajectoryError(f"{path} is neither a trajectory directory nor a pickle file")

    @classmethod
    def _open_directory(cls, path: Path) -> TrajectorySet:
        for name in (INFO_FILE, PROBLEMS_FILE, EMBEDDINGS_FILE):
            if not (path / name).is_file():
                raise TrajectoryError(f"{path}: missing {name}; a trajectory directory needs "
                                      f"{INFO_FILE}, {PROBLEMS_FILE} and {EMBEDDINGS_FILE} "
                                      "(was the collection started?)")
        info = _read_info(path)
        problems, _ = _read_problems(path / PROBLEMS_FILE, tolerate_partial_tail=False)
        rows = _check_problem_set(problems, str(path / PROBLEMS_FILE))
        dim, dtype = info["dim"], DTYPES[info["dtype"]]
        size, need = (path / EMBEDDINGS_FILE).stat().st_size, rows * dim * dtype.itemsize
        if size != need:
            raise TrajectoryError(
                f"{path / EMBEDDINGS_FILE}: {size} bytes, but {PROBLEMS_FILE} covers {rows} rows "
                f"of {dim} x {info['dtype']} = {need} bytes. "
                + ("If collection was interrupted, open the directory with TrajectoryWriter to "
                   "repair it (it drops rows without metadata)." if size > need
                   else "Embeddings are missing: the data is corrupted; re-collect it."))
        matrix = (np.memmap(path / EMBEDDINGS_FILE, dtype=dtype, mode="r", shape=(rows, dim))
                  if rows else np.empty((0, dim), dtype))
        arrays = [matrix[p.offset:p.offset + p.n_steps] for p in problems]
        return cls(path, info, problems, arrays)

    @classmethod
    def _open_pickle(cls, path: Path, pickle_labels: str) -> TrajectorySet:
        pkl = _load_pickle(path)
        info = _pickle_info(pkl, path, pickle_labels, "float32")
        problems, arrays, row = [], [], 0
        for fields_, emb in _pickle_records(pkl, pickle_labels):
            problems.append(Problem.from_dict({**fields_, "offset": row},
                                              f"{path.name} problem {len(problems)}"))
            arrays.append(emb)
            row += len(emb)
        _check_problem_set(problems, str(path))
        return cls(path, info, problems, arrays)

    @property
    def dim(self) -> int:
        return self.info["dim"]

    def __len__(self) -> int:
        return len(self.problems)

    def embeddings(self, i: int) -> np.ndarray:
        """Step embeddings [n_steps, dim] of problem i: a read-only view, no copy.

        The first read of a problem checks its rows for NaN/inf, so no consumer ever computes on
        them (a scan of the whole file on open would cost seconds on a large set).
        """
        a = self._arrays[i]
        if not self._finite[i]:
            if not np.isfinite(a).all():
                raise TrajectoryError(f"problem {self.problems[i].id!r} (index {i}) has non-finite "
                                      "embeddings (NaN/inf); drop it or re-collect")
            self._finite[i] = True
        return a

    def labels(self, i: int, mode: str) -> np.ndarray:
        """Cumulative int8 labels of problem i under ``mode`` (stored labels are raw per step)."""
        return cumulative(self.raw_labels(i, mode))

    def raw_labels(self, i: int, mode: str) -> np.ndarray:
        """The stored int8 labels of problem i under ``mode``: whether each step's answer is
        right (the give-up loss reads these: a right answer ahead, not one behind)."""
        p = self.problems[i]
        if mode not in p.labels:
            raise TrajectoryError(
                f"problem {p.id!r} (index {i}) has no {mode!r} labels; it has "
                f"{sorted(p.labels) or 'none'}, and every problem has {list(self.label_modes)}")
        return np.asarray(p.labels[mode], dtype=np.int8)

    @property
    def label_modes(self) -> tuple[str, ...]:
        """Label modes present for every problem, sorted."""
        if not self.problems:
            return ()
        return tuple(sorted(set.intersection(*(set(p.labels) for p in self.problems))))

    def with_splits(self, splits: Mapping[int, str | None]) -> TrajectorySet:
        """A view of the same embeddings whose problems `splits` (index -> split or None) are in
        other splits, in memory only (e.g. calibration prompts held out for another test)."""
        bad = {s for s in splits.values() if s is not None and s not in SPLITS}
        if bad:
            raise TrajectoryError(f"unknown split name(s) {sorted(bad)}; splits are {SPLITS}")
        problems = [replace(p, split=splits[i]) if i in splits else p
                    for i, p in enumerate(self.problems)]
        view = TrajectorySet(self.path, self.info, problems, self._arrays)
        view._finite = list(self._finite)
        return view

    def split(self, name: str) -> list[int]:
        """Indices of the problems in split ``name`` (ALL: every problem)."""
        if name == ALL:
            return list(range(len(self.problems)))
        if name not in SPLITS:
            raise TrajectoryError(f"unknown split {name!r}; splits are {SPLITS} (or {ALL!r})")
        return [i for i, p in enumerate(self.problems) if p.split == name]

    def check_finite(self) -> None:
        """Raise if any embedding is NaN/inf (a full scan, so not done on open)."""
        bad = []
        for i, p in enumerate(self.problems):
            try:
                self.embeddings(i)
            except TrajectoryError:
                bad.append(p.id)
        if bad:
            raise TrajectoryError(f"{len(bad)} problem(s) have non-finite embeddings, e.g. "
                                  f"{bad[:5]}; drop them or re-collect")


# ---------------------------------------------------------------------------------- writing


class TrajectoryWriter:
    """Append problems to a trajectory directory, creating it or resuming an interrupted one.

    On resume the incomplete tail is dropped (a partial metadata line, and embedding rows not
    covered by a complete line), and ``ids`` tells the collector what to skip. Each ``append``
    writes the embeddings first and the metadata line last, so a kill loses at most that problem.
    """

    def __init__(self, path: str | Path, dim: int, dtype: str = STORED_DTYPE, *,
                 fsync: bool = False, **info_fields: Any):
        self.path = Path(path)
        self.info = _make_info(dim, dtype, info_fields)
        self._dtype = DTYPES[dtype]
        self._fsync = fsync
        self._prepare_directory()
        problems, complete = _read_problems(self.path / PROBLEMS_FILE, tolerate_partial_tail=True)
        self._rows = _check_problem_set(problems, str(self.path / PROBLEMS_FILE))
        self._ids = {p.id for p in problems}
        self._truncate(complete)
        self._meta = open(self.path / PROBLEMS_FILE, "ab")  # noqa: SIM115 - held until close()
        self._emb = open(self.path / EMBEDDINGS_FILE, "ab")  # noqa: SIM115

    def _prepare_directory(self) -> None:
        info_path = self.path / INFO_FILE
        if info_path.is_file():
            stored = _read_info(self.path)
            diff = {k: (stored[k], v) for k, v in self.info.items() if stored[k] != v}
            if diff:
                raise TrajectoryError(
                    f"{self.path} holds a set with different settings (stored, requested): {diff}; "
                    "resume with the same settings or write to a new directory")
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            stray = [n for n in (PROBLEMS_FILE, EMBEDDINGS_FILE) if (self.path / n).exists()]
            if stray:
                raise TrajectoryError(f"{self.path} has {stray} but no {INFO_FILE}; it is not a "
                                      "trajectory directory this writer can resume")
            write_atomic(info_path, json.dumps(self.info, indent=1) + "\n", fsync=True)
        for name in (PROBLEMS_FILE, EMBEDDINGS_FILE):
            (self.path / name).touch()

    def _truncate(self, complete_bytes: int) -> None:
        need = self._rows * self.info["dim"] * self._dtype.itemsize
        emb = self.path / EMBEDDINGS_FILE
        if emb.stat().st_size < need:
            raise TrajectoryError(f"{emb}: {emb.stat().st_size} bytes, fewer than the {need} "
                                  f"that {PROBLEMS_FILE} refers to; the data is corrupted, "
                                  "re-collect it")
        os.truncate(emb, need)
        os.truncate(self.path / PROBLEMS_FILE, complete_bytes)

    @property
    def ids(self) -> frozenset[str]:
        """Ids already written (including those from before a resume)."""
        return frozenset(self._ids)

    def append(self, problem_fields: Mapping[str, Any], embeddings: np.ndarray) -> None:
        """Write one problem; ``n_steps`` and ``offset`` are filled in from the embeddings."""
        emb = np.asarray(embeddings)
        name = problem_fields.get("id")
        if emb.ndim != 2 or emb.shape[0] == 0 or emb.shape[1] != self.info["dim"]:
            raise TrajectoryError(f"problem {name!r}: embeddings must have shape "
                                  f"[n_steps >= 1, {self.info['dim']}], got {emb.shape}")
        d = {"n_steps": len(emb), **problem_fields}
        if "offset" in d and d["offset"] != self._rows:
            raise TrajectoryError(f"problem {name!r}: offset {d['offset']} given, but the next "
                                  f"row is {self._rows}; leave 'offset' out")
        d["offset"] = self._rows
        problem = Problem.from_dict(d, f"problem {name!r}")
        if problem.n_steps != len(emb):
            raise TrajectoryError(f"problem {name!r}: n_steps {problem.n_steps} but "
                                  f"{len(emb)} embedding rows")
        if problem.id in self._ids:
            raise TrajectoryError(f"problem {problem.id!r} is already in {self.path}; "
                                  "skip ids in writer.ids")
        with np.errstate(over="ignore"):  # overflow is reported just below, with advice
            data = emb.astype(self._dtype)
        if not np.isfinite(data).all():
            raise TrajectoryError(
                f"problem {problem.id!r}: embeddings contain NaN/inf after conversion to "
                f"{self.info['dtype']} (float16 overflows above 65504: normalise or use float32)")
        self._write(self._emb, data.tobytes())
        self._write(self._meta, (json.dumps(problem.to_dict()) + "\n").encode())
        self._ids.add(problem.id)
        self._rows += problem.n_steps

    def _write(self, f: Any, data: bytes) -> None:
        f.write(data)
        f.flush()
        if self._fsync:
            os.fsync(f.fileno())

    def close(self) -> None:
        self._emb.close()
        self._meta.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------------- splits


def set_splits(path: str | Path, assignment: Mapping[str, str | None]) -> None:
    """Rewrite the split field of the given ids (others keep theirs), atomically.

    Must not run while a TrajectoryWriter has the directory open.
    """
    bad = {s for s in assignment.values() if s is not None and s not in SPLITS}
    if bad:
        raise TrajectoryError(f"unknown split name(s) {sorted(bad)}; splits are {SPLITS}")
    update_problems(path, {pid: {"split": s} for pid, s in assignment.items()})


def update_problems(path: str | Path, changes: Mapping[str, Mapping[str, Any]]) -> None:
    """Replace fields of the given ids' metadata (others unchanged), atomically: a split, or the
    labels of a trajectory labelled after collection (`orca_calibrate.collect.label_deferred`). The
    fields that locate its embeddings (`offset`, `n_steps`) and its `id` stay.

    Must not run while a TrajectoryWriter has the directory open.
    """
    path = Path(path)
    if not path.is_dir():
        raise TrajectoryError(f"{path}: updating problems needs a trajectory directory (import "
                              "pickles with import_pickle first)")
    problems, _ = _read_problems(path / PROBLEMS_FILE, tolerate_partial_tail=False)
    unknown = set(changes) - {p.id for p in problems}
    if unknown:
        raise TrajectoryError(f"{path}: {len(unknown)} id(s) to update are not in the set, "
                              f"e.g. {sorted(unknown)[:5]}")
    fixed = {"id", "offset", "n_steps"}
    lines = []
    for p in problems:
        d = {**p.to_dict(), **{k: v for k, v in changes.get(p.id, {}).items() if k not in fixed}}
        lines.append(json.dumps(Problem.from_dict(d, f"problem {p.id!r}").to_dict()) + "\n")
    write_atomic(path / PROBLEMS_FILE, "".join(lines), fsync=True)


def split_ids(ids: Sequence[str], fractions: Sequence[float] = DEFAULT_FRACTIONS, seed: int = 0,
              groups: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Deterministic disjoint train/calibration/test split by prompt group.

    All samples of one prompt (``groups[id]``; default: each id its own group) land in the
    same split, otherwise calibration would see near-copies of training problems and the
    LTT guarantee's exchangeability would be broken. The result depends only on the ids,
    groups and seed, not on the order of ``ids``. Fractions are of samples, approximately.
    """
    if len(fractions) != len(SPLITS) or min(fractions) < 0 or not math.isclose(sum(fractions), 1):
        raise ValueError(f"fractions must be {len(SPLITS)} non-negative numbers summing to 1, "
                         f"got {tuple(fractions)}")
    members: dict[Any, list[str]] = {}
    for i in ids:
        members.setdefault(groups[i] if groups is not None else i, []).append(i)
    keys = sorted(members, key=str)
    order = np.random.default_rng(seed).permutation(len(keys))
    bounds = np.cumsum(fractions) * len(ids)
    out, done = {}, 0
    for k in order:
        group = members[keys[k]]
        # A group goes where the middle of its sample range falls, so sizes track fractions.
        split = SPLITS[min(int(np.searchsorted(bounds, done + len(group) / 2)), len(SPLITS) - 1)]
        out.update({i: split for i in group})
        done += len(group)
    return out


# ----------------------------------------------------------------------- research pickles


def _looks_like_pickle(path: Path) -> bool:
    if path.suffix in (".pkl", ".pickle"):
        return True
    return _read_bytes(path)[:1] == b"\x80"  # protocol >= 2 header


def _load_pickle(path: Path) -> dict[str, Any]:
    """Load a research pickle (it can run code: only open pickles from trusted sources)."""
    data = _read_bytes(path)
    try:
        pkl = pickle.loads(data)
    except Exception as e:  # noqa: BLE001 - unpickling raises anything (EOF, missing class, ...)
        raise TrajectoryError(f"{path}: not a readable pickle ({type(e).__name__}: "
                              f"{first_line(e)}); truncated or not a research-code pickle") \
            from None
    _check_pickle(pkl, path.name)
    return pkl


def _check_pickle(pkl: Any, where: str) -> None:
    """The research format's structure and types, before anything is derived from it."""
    if not isinstance(pkl, Mapping) or not isinstance(pkl.get("problems"), (list, tuple)):
        raise TrajectoryError(f"{where}: expected a dict with a 'problems' list (the research "
                              "code's format), got " + type(pkl).__name__)
    for key in ("embed_dim", "batch_size"):
        if pkl.get(key) is not None:
            _int(pkl[key], where, key, minimum=1)
    splits = {} if pkl.get("splits") is None else pkl["splits"]
    if not isinstance(splits, Mapping):
        raise TrajectoryError(f"{where}: 'splits' must be a dict split -> problem indices")
    for name, indices in splits.items():
        if isinstance(indices, (str, bytes, Mapping)) or not isinstance(indices, Sequence | np.ndarray):
            raise TrajectoryError(f"{where}: split {name!r} must be a list of problem indices")
        for i in indices:
            _int(i, where, f"split {name!r} index", minimum=0)
    dim = pkl.get("embed_dim")
    for i, raw in enumerate(pkl["problems"]):
        if not isinstance(raw, Mapping) or "step_embeddings" not in raw:
            raise TrajectoryError(f"{where} problem {i}: expected a dict with 'step_embeddings'")
        try:
            emb = np.asarray(raw["step_embeddings"], dtype=np.float32)
        except (ValueError, TypeError, OverflowError) as e:
            raise TrajectoryError(f"{where} problem {i}: step_embeddings are not a numeric "
                                  f"[n_steps, dim] array ({first_line(e)})") from None
        if emb.size == 0:
            continue  # no step: skipped when read, as the research code skips it
        dim = emb.shape[1] if dim is None and emb.ndim == 2 else dim
        if emb.ndim != 2 or emb.shape[1] != dim:
            raise TrajectoryError(f"{where} problem {i}: step_embeddings shape {emb.shape}, "
                                  f"expected [n_steps, embed_dim={dim}]")


def expand_block_labels(block_labels: Sequence[Any], n_steps: int, batch_size: int,
                        mode: str = "pessimistic") -> np.ndarray:
    """Per-step raw labels from the research code's one-label-per-block labels.

    Block j's label was computed at step min(batch_size*j + batch_size-1, n_steps-1).
    "research" copies it to the whole block (optimistic: early steps borrow a later answer);
    "pessimistic" gives each step the label of the latest labelled step at or before it,
    and 0 before the first labelled step.
    """
    try:
        raw = np.asarray(block_labels)
    except ValueError as e:  # ragged nesting
        raise TrajectoryError(f"block labels are not a list of 0/1 ({first_line(e)})") from None
    if raw.dtype.kind not in "biuf" or not np.isin(raw, (0, 1)).all():
        raise TrajectoryError(f"block labels must be 0/1 numbers, got {raw.dtype} values "
                              f"{np.unique(raw.astype(str))[:5].tolist()}")
    lab = raw.astype(np.int8).reshape(-1)
    if len(lab) != math.ceil(n_steps / batch_size):
        raise TrajectoryError(f"{len(lab)} block labels for {n_steps} steps with batch_size "
                              f"{batch_size}; expected ceil({n_steps}/{batch_size}) = "
                              f"{math.ceil(n_steps / batch_size)}")
    t = np.arange(n_steps)
    batch_size = min(batch_size, n_steps + 1)  # same blocks; keeps the arithmetic in int64
    if mode == PickleLabels.RESEARCH:
        return lab[t // batch_size]
    if mode != PickleLabels.PESSIMISTIC:
        raise TrajectoryError(f"pickle_labels must be one of {PICKLE_LABELS}, got {mode!r}")
    block = (t + 1) // batch_size - 1
    block[-1] = len(lab) - 1  # the last (possibly partial) block is labelled at the last step
    return np.where(block >= 0, lab[np.maximum(block, 0)], 0).astype(np.int8)


_ID_KEYS = ("id", "problem_id", "unique_id", "idx", "problem_idx")
_PROMPT_KEYS = ("question", "problem", "prompt")
_ANSWER_KEYS = ("answer", "gt_answer", "ground_truth", "reference_answer")


def _first(d: Mapping[str, Any], keys: Sequence[str]) -> tuple[str | None, Any]:
    return next(((k, d[k]) for k in keys if k in d and d[k] is not None), (None, None))


def _pickle_splits(pkl: Mapping[str, Any]) -> dict[int, str]:
    n = len(pkl["problems"])
    out: dict[int, str] = {}
    for name, indices in (pkl.get("splits") if pkl.get("splits") is not None else {}).items():
        if name not in SPLITS:
            raise TrajectoryError(f"pickle split {name!r} is not one of {SPLITS}")
        for i in indices:
            i = int(i)
            if not 0 <= i < n or i in out:
                raise TrajectoryError(f"pickle split {name!r}: problem index {i} is out of range "
                                      f"(0..{n - 1}) or already in split {out.get(i)!r}")
            out[i] = name
    return out


def _aligned_steps(raw: Mapping[str, Any], n_emb: int, batch_size: int) -> int:
    """How many leading step embeddings carry a label, under the authors' alignment.

    Their pickles embed steps *after* cutting long ones into 500-token chunks (and dropping empty
    ones), while labels are one per block of ``batch_size`` steps *before* the cut, so the two
    counts need not agree. Their code pairs embedding t with block t // batch_size and truncates
    both sides to the shorter one; so do we (docs/TRAJECTORIES.md).
    """
    counts = [len(raw[key]) if isinstance(raw[key], (list, tuple, np.ndarray)) else 1
              for key in _PICKLE_LABEL_KEYS if key in raw]  # not a list: refused when expanded
    return min([n_emb] + [batch_size * c for c in counts])


def _step_tokens(raw: Mapping[str, Any], n_emb: int, n: int) -> list[int] | None:
    """Tokens per step from the pickle's ``step_limits`` ([start, end) per chunk, empty chunks
    included, which have no embedding); None when they do not pair with the embeddings."""
    limits = raw.get("step_limits")
    try:
        sizes = [int(r) - int(left) for left, r in limits or ()]
    except (TypeError, ValueError):
        return None
    sizes = [k for k in sizes if k > 0]
    return sizes[:n] if len(sizes) == n_emb else None


def _pickle_batch_size(pkl: Mapping[str, Any]) -> int:
    return 10 if pkl.get("batch_size") is None else int(pkl["batch_size"])


def _usable_steps(raw: Mapping[str, Any], batch_size: int) -> int:
    """Steps of a pickle problem with both an embedding and a label; 0: the problem is skipped,
    as the research code skips it (no step embedding or no label)."""
    emb = np.asarray(raw["step_embeddings"])  # shape checked by _check_pickle
    return _aligned_steps(raw, len(emb), batch_size) if emb.size else 0


def _pickle_records(pkl: Mapping[str, Any], pickle_labels: str
                    ) -> Iterator[tuple[dict[str, Any], np.ndarray]]:
    """(problem fields, float32 embeddings) per usable pickle problem, labels expanded per step.

    Problems with no step embedding or no label are skipped, as the research code skips them.
    """
    batch_size = _pickle_batch_size(pkl)
    splits = _pickle_splits(pkl)
    for i, raw in enumerate(pkl["problems"]):
        n = _usable_steps(raw, batch_size)
        if n == 0:
            continue
        emb = np.asarray(raw["step_embeddings"], dtype=np.float32)
        labels = {}
        for key, mode in _PICKLE_LABEL_KEYS.items():
            if key in raw:
                blocks = raw[key]
                if isinstance(blocks, (list, tuple, np.ndarray)):  # else refused just below
                    blocks = blocks[:math.ceil(n / batch_size)]
                try:
                    labels[mode] = expand_block_labels(blocks, n, batch_size, pickle_labels)
                except TrajectoryError as e:
                    raise TrajectoryError(f"pickle problem {i} ({key}): {e}") from e
        id_key, pid = _first(raw, _ID_KEYS)
        prompt_key, prompt = _first(raw, _PROMPT_KEYS)
        answer_key, answer = _first(raw, _ANSWER_KEYS)
        used = {"step_embeddings", *_PICKLE_LABEL_KEYS, id_key, prompt_key, answer_key}
        extra = {k: v for k, v in raw.items() if k not in used and _is_json_scalar(v)}
        if n < len(emb):
            extra["pickle_unlabelled_steps"] = len(emb) - n  # dropped, as the authors drop them
        yield {
            "id": str(pid) if pid is not None else str(i),
            "prompt": None if prompt is None else str(prompt),
            "answer": None if answer is None else str(answer),
            "split": splits.get(i),
            "n_steps": n,
            "step_tokens": _step_tokens(raw, len(emb), n),
            "labels": labels,
            "extra": {"pickle_index": i, **extra},
        }, emb[:n]


def _is_json_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (str, bool, int, float))


def _infer_normalization(pkl: Mapping[str, Any]) -> Normalization:
    """Guess from step norms: all ~1 is step-l2; all <= 1 is token-l2 (a mean of unit vectors)."""
    arrays = [np.asarray(p["step_embeddings"], dtype=np.float32) for p in pkl["problems"]]
    norms = np.concatenate([np.linalg.norm(a, axis=-1) for a in arrays if a.ndim == 2]
                           or [np.zeros(0)])
    if norms.size and np.all(np.abs(norms - 1) < 1e-3):
        return Normalization.STEP_L2
    if norms.size and np.all(norms <= 1 + 1e-3):
        return Normalization.TOKEN_L2
    return Normalization.NONE


def _pickle_info(pkl: Mapping[str, Any], path: Path | None, pickle_labels: str,
                 dtype: str) -> dict[str, Any]:
    """The set's info; refuses a pickle with no usable problem before anything is written (it
    would convert to an empty set without a word)."""
    if pickle_labels not in PICKLE_LABELS:
        raise TrajectoryError(f"pickle_labels must be one of {PICKLE_LABELS}, "
                              f"got {pickle_labels!r}")
    batch_size = _pickle_batch_size(pkl)
    first = next((raw for raw in pkl["problems"] if _usable_steps(raw, batch_size)), None)
    if first is None:
        raise TrajectoryError(f"{path or 'pickle'} holds no problems with both step embeddings "
                              f"and labels ({len(pkl['problems'])} problems in all)")
    dim = pkl.get("embed_dim")
    if dim is None:
        dim = np.asarray(first["step_embeddings"]).shape[-1]
    model = pkl.get("model")
    return _make_info(int(dim), dtype, {
        "model": None if model is None else str(model),
        "normalization": _infer_normalization(pkl),
        "source": (f"research-pickle {path.name if path else '<object>'}; "
                   f"batch_size={pkl.get('batch_size', 10)}; labels={pickle_labels}"),
    })


def import_pickle(pkl: str | Path | Mapping[str, Any], out_dir: str | Path,
                  dtype: str = STORED_DTYPE, *, pickle_labels: str = "pessimistic") -> Path:
    """Convert a research pickle (path or loaded dict) to a directory, problem by problem.

    Resumable like any TrajectoryWriter: problems already in ``out_dir`` are skipped.
    """
    path = Path(pkl) if isinstance(pkl, (str, Path)) else None
    if path is None:
        _check_pickle(pkl, "pickle")
    data = _load_pickle(path) if path is not None else pkl
    info = _pickle_info(data, path, pickle_labels, dtype)
    extra = {k: info[k] for k in INFO_DEFAULTS}
    with TrajectoryWriter(out_dir, info["dim"], dtype, **extra) as w:
        done = w.ids
        for fields_, emb in _pickle_records(data, pickle_labels):
            if fields_["id"] not in done:
                w.append(fields_, emb)
    return Path(out_dir)
