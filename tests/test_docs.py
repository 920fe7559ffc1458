"""The docs name only what exists (paths, Python names, flags, `orca_*` names, metrics, bundle
keys, extra_args, result fields, the sections they point to), and their lists are complete (every
bundle key, metric, extra_arg, subcommand, wing module, doc page, script and benchmark).

A newcomer follows README.md and docs/ literally; a renamed module, a dropped flag or a moved
section turns a sentence into a dead end without failing any other test. These checks are
mechanical and cheap (no vLLM imported, no engine): each reads the docs' text, finds the names
of one kind and looks them up in the code that defines them. What they cannot read (whether a
sentence is still true) stays with review; tests/test_standalone.py checks that no doc points
outside the repository, tests/test_recipes.py that the job files load.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
import typing
from functools import cache
from pathlib import Path

from pydantic import BaseModel

from orca_calibrate.calibrate_cli import build_parser
from orca_method.bundle import Bundle
from orca_method.outcomes import Ended
from orca_method.probe import ProbeSpec
from orca_method.trajectories import INFO_DEFAULTS, Problem
from orca_serve.metrics.prometheus import AlarmChange, Outcome, ReloadOutcome, SampleEvent
from orca_serve.settings import contract
from orca_serve.settings.field import GiveUpFields, OrcaFields
from orca_serve.startup.preflight import add_orca_args

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "orca_demo").glob("*/README.md"))]
PACKAGES = ("orca_serve", "orca_method", "orca_calibrate", "orca_demo")
REPO_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./*{},-]*[\w*}])"
                       % "|".join((*PACKAGES, "benchmarks", "deploy", "docs", "scripts", "tests")))
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])(?![\w*-])")  # not `--orca-*`
SUFFIXES = re.compile(r"_(total|bucket|sum|count|created)$")  # Prometheus adds these to a family


def _text(path: Path) -> str:
    return path.read_text()


def _where(path: Path, text: str, pos: int) -> str:
    return f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, pos) + 1}"


def code_spans(path: Path) -> list[tuple[str, str]]:
    """(where, code) for each inline code span (it may wrap a line) and each command of a fenced
    block (lines ending in a backslash joined), as a reader would copy them."""
    text, out = _text(path), []
    for block in re.finditer(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S):
        for m in re.finditer(r"(?:[^\n]*\\\n)*[^\n]+", block.group(1)):
            out.append((_where(path, text, block.start(1) + m.start()), m.group(0)))
    prose = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.M | re.S)
    out += [(_where(path, prose, m.start()), m.group(1).replace("\n", " "))
            for m in re.finditer(r"`([^`]+)`", prose)]
    return out


def _expand(path: str) -> list[str]:
    """`a/{b,c}.png` -> a/b.png, a/c.png (a doc's shorthand for several files)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    head, tail = path[:m.start()], path[m.end():]
    return [q for alt in m.group(1).split(",") for q in _expand(head + alt + tail)]


def test_every_path_a_doc_names_exists():
    missing = []
    for doc in DOCS + [ROOT / "benchmarks" / "RESULTS.md"]:
        text = _text(doc)
        for m in REPO_PATH.finditer(text):
            for name in _expand(m.group(1).rstrip(".")):
                found = (any(ROOT.glob(name)) if "*" in name
                         else (ROOT / name).exists() or (doc.parent / name).exists())
                if not found:
                    missing.append(f"{_where(doc, text, m.start())}: {name}")
    assert not missing, "paths the docs name that do not exist:\n" + "\n".join(missing)


@cache
def _defined(module: Path) -> frozenset[str]:
    """The names a module defines or imports at any level (what `module.name` can reach)."""
    names = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return frozenset(names)


def test_every_dotted_python_name_resolves():
    """`orca_method.bundle.load_bundle`: the module exists and defines the name (read, not
    imported: no doc may make this test import vLLM)."""
    bad = []
    for doc in DOCS:
        text = _text(doc)
        for m in re.finditer(r"\b((?:%s)(?:\.\w+)+)" % "|".join(PACKAGES), text):
            parts = m.group(1).split(".")
            k = len(parts)
            while k and not (ROOT.joinpath(*parts[:k]).with_suffix(".py").is_file()
                             or (ROOT.joinpath(*parts[:k]) / "__init__.py").is_file()):
                k -= 1
            module = ROOT.joinpath(*parts[:k])
            module = module.with_suffix(".py") if module.with_suffix(".py").is_file() \
                else module / "__init__.py"
            if k == 0 or (parts[k:] and parts[k] != "py" and parts[k] not in _defined(module)):
                bad.append(f"{_where(doc, text, m.start())}: {m.group(1)}")
    assert not bad, "Python names the docs give that do not exist:\n" + "\n".join(bad)


def _subcommand_flags() -> dict[str, set[str]]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {o for a in p._actions for o in a.option_strings}
            for name, p in sub.choices.items()}


def _script_flags(script: Path) -> set[str]:
    """The flags a script's parser defines: its own option strings, and those of the modules of
    benchmarks/ and scripts/ it imports them from."""
    sources = [script.read_text()]
    sources += [(ROOT / (mod.replace(".", "/") + ".py")).read_text()
                for mod in re.findall(r"from ((?:benchmarks|scripts)\.\w+) import", sources[0])]
    return {f for s in sources for f in re.findall(r"""["'](--[a-z0-9][a-z0-9-]*)["']""", s)}


def test_every_flag_of_a_command_line_in_the_docs_exists():
    """Flags after `orca-calibrate SUB` are that subcommand's; after `benchmarks/X.py` or
    `scripts/X.py`, that script's; `--orca-*` and orca-serve's own anywhere are orca-serve's
    (`add_orca_args`; vLLM's own flags are vLLM's to keep)."""
    subs = _subcommand_flags()
    serve = {o for a in add_orca_args(argparse.ArgumentParser())._actions for o in a.option_strings}
    bad = []
    for doc in DOCS + [ROOT / "benchmarks" / "RESULTS.md"]:
        for where, code in code_spans(doc):
            flags = FLAG.findall(code)
            # `orca-calibrate SUB ...`, or `SUB ...` alone as CALIBRATE.md's table writes it
            calib = re.search(r"orca-calibrate\s+([a-z-]+)", code) or (
                doc.name == "CALIBRATE.md" and re.match(r"([a-z-]+)\b", code))
            script = re.search(r"(?:benchmarks|scripts)/\w+\.py|\bbench_\w+\.py", code)
            if calib and calib.group(1) in subs:
                known, who = subs[calib.group(1)], calib.group(0)
            elif script:
                path = ROOT / script.group(0) if "/" in script.group(0) \
                    else ROOT / "benchmarks" / script.group(0)
                known, who = _script_flags(path), script.group(0)
            else:
                known, who = serve, "orca-serve"
                flags = [f for f in flags if f.startswith("--orca") or f in serve]
            bad += [f"{where}: {who} has no {f}" for f in flags if f not in known]
    assert not bad, "flags the docs give that the command does not take:\n" + "\n".join(bad)


def test_calibrate_md_lists_every_subcommand():
    text = _text(ROOT / "docs" / "CALIBRATE.md")
    section = text[text.index("## The subcommands"):]
    listed = set(re.findall(r"^\| `([a-z-]+)", section, re.M)) | set(
        re.findall(r"`([a-z-]+) --config JOB.yaml`", section))
    assert set(_subcommand_flags()) == listed


def test_trajectories_md_documents_every_field():
    """docs/TRAJECTORIES.md names every key of info.json and every field of a problem."""
    named = set(re.findall(r"`(\w+)`", _text(ROOT / "docs" / "TRAJECTORIES.md")))
    info = set(re.findall(r'"(\w+)":', _text(ROOT / "docs" / "TRAJECTORIES.md")))
    keys = {*INFO_DEFAULTS, "format", "version", "dim", "dtype"}
    assert keys - named - info == set()
    assert {f.name for f in dataclasses.fields(Problem)} - named == set()


def test_every_orca_serve_flag_is_documented():
    flags = {o for a in add_orca_args(argparse.ArgumentParser())._actions
             for o in a.option_strings if o.startswith("--")}
    text = "".join(_text(d) for d in DOCS)
    missing = [f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", text)]
    assert len(flags) >= 30 and not missing, f"orca-serve flags no doc names: {missing}"


@cache
def _code_words() -> frozenset[str]:
    return frozenset(w for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                     for w in re.findall(r"\w+", p.read_text()))


def test_every_orca_name_a_doc_gives_is_in_the_code():
    """`orca_*` names (extra_args, metrics, RPCs, response words) exist in the code: a rename
    must reach the docs."""
    bad = []
    for doc in DOCS:
        for where, code in code_spans(doc):
            for name in re.findall(r"\b(orca_[a-z0-9_]*[a-z0-9])\b", code):
                if SUFFIXES.sub("", name) not in _code_words() and name not in _code_words():
                    bad.append(f"{where}: {name}")
    assert not bad, "orca_* names the docs give that the code does not have:\n" + "\n".join(bad)


def _registered_metrics() -> set[str]:
    """Metric families orca-serve registers: the names given to prometheus_client's types."""
    sources = (ROOT / "orca_serve").rglob("*.py")
    pattern = re.compile(
        r"""(?:Counter|Gauge|Histogram|Summary|MetricFamily)\s*[(,]\s*"(orca_\w+)\"""")
    return {n for p in sources for n in pattern.findall(p.read_text())}


def test_metrics_md_lists_exactly_the_registered_metrics():
    """docs/METRICS.md names every metric family orca-serve registers and no other; a row may
    abbreviate siblings (`orca_vote_error`, `_lower`, `_upper`)."""
    registered = _registered_metrics()
    assert len(registered) >= 30  # the scan sees the registrations
    documented = set()
    for row in _text(ROOT / "docs" / "METRICS.md").splitlines():
        if not row.startswith("| `"):
            continue
        first = row.split("|")[1]
        full = [SUFFIXES.sub("", n) for n in re.findall(r"`(orca_\w+)`", first)]
        documented |= set(full)
        for tail in re.findall(r"`(_\w+)`", first):  # `_lower` after `orca_vote_error`: its sibling
            base = full[0]
            overlap = next((k for k in range(len(tail), 0, -1) if base.endswith(tail[:k])), 0)
            documented.add(base + tail[overlap:])
    assert documented - registered == set(), "documented but not registered"
    assert registered - documented == set(), "registered but not in docs/METRICS.md"
    text = _text(ROOT / "docs" / "METRICS.md")
    values = [str(v) for enum in (Outcome, SampleEvent, AlarmChange, ReloadOutcome, Ended)
              for v in enum]
    assert [v for v in values if f"`{v}`" not in text] == [], "label values METRICS.md lacks"


def _model_fields(model: type[BaseModel], seen: frozenset[str] = frozenset()) -> set[str]:
    """Every key of a bundle's JSON, at any depth (a model's field names and its sub-models')."""
    keys = set()
    for name, field in model.model_fields.items():
        keys.add(field.alias or name)
        args = [b for a in (typing.get_args(field.annotation) or (field.annotation,))
                for b in (typing.get_args(a) or (a,))]
        for sub in args:
            if isinstance(sub, type) and issubclass(sub, BaseModel) and sub.__name__ not in seen:
                keys |= _model_fields(sub, seen | {sub.__name__})
    return keys


def test_bundle_md_documents_every_key_the_bundle_has():
    """Both ways: each key `Bundle` reads and writes (and each field of the probe's `spec`) is in
    docs/BUNDLE.md, and each key its top-level table lists is one of Bundle's."""
    text = _text(ROOT / "docs" / "BUNDLE.md")
    named = {w for span in re.findall(r"`([^`]+)`", text) for w in re.findall(r"\w+", span)}
    keys = _model_fields(Bundle) | {f.name for f in dataclasses.fields(ProbeSpec)}
    assert keys - named == set(), "bundle keys docs/BUNDLE.md does not name"
    table = set(re.findall(r"^\| `(\w+)` \|", text, re.M))
    assert table and table <= set(Bundle.model_fields), "BUNDLE.md's table lists no such key"


def test_plugin_md_lists_every_extra_arg():
    """docs/PLUGIN.md's table of per-request arguments has every `orca_*` extra_arg the engine
    reads, the server-set ones included (contract.XARG_*)."""
    names = {v for k, v in vars(contract).items() if k.startswith("XARG_") and isinstance(v, str)}
    text = _text(ROOT / "docs" / "PLUGIN.md")
    section = text[text.index("## Per-request arguments"):text.index("## How a request's settings")]
    missing = names - set(re.findall(r"`(orca_\w+)`", section))
    assert len(names) >= 15 and not missing, f"extra_args PLUGIN.md's table lacks: {missing}"


def test_plugin_md_names_every_result_field_and_stat():
    """docs/PLUGIN.md's "Results" names every field of `OrcaResult` and every key the engine's
    `orca_stats` reports (the core's counters and gauges)."""
    text = _text(ROOT / "docs" / "PLUGIN.md")
    results = text[text.index("## Results"):text.index("## State lifetime")]
    fields = {f.name for f in dataclasses.fields(contract.OrcaResult)}
    engine = _text(ROOT / "orca_serve" / "core" / "engine.py")
    counters = re.search(r"self\.stats = \{(.*?)\}", engine, re.S).group(1)
    stats = set(re.findall(r'"(\w+)":', counters)) | set(re.findall(r's\["(\w+)"\] =', engine))
    assert len(stats) >= 15, "the scan sees the core's stats"
    assert [n for n in sorted(fields) if not re.search(rf"\b{n}\b", results)] == []
    assert [n for n in sorted(stats) if not re.search(rf"\b{n}\b", text)] == []


def test_server_md_documents_every_request_field():
    """Each field of the body's `orca` object (and of `orca.give_up`) is in docs/SERVER.md, as
    `orca.NAME` or as a key of an example."""
    text = _text(ROOT / "docs" / "SERVER.md")
    names = set(OrcaFields.model_fields) | {f"give_up.{n}" for n in GiveUpFields.model_fields}
    assert [n for n in sorted(names) if f"orca.{n}" not in text
            and f'"{n.rpartition(".")[2]}":' not in text] == []


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


@cache
def _sections(doc: Path) -> tuple[str, ...]:
    """The headings of a doc and its bold paragraph or list-item leads (`**Where it runs.**`)."""
    text = _text(doc)
    heads = [h.strip() for h in re.findall(r"^#+\s*(.+)$", text, re.M)]
    leads = re.findall(r"^(?:- )?\*\*(.+?)\*\*", text, re.M)
    return tuple(heads + leads)


def test_every_section_a_doc_points_to_exists():
    """`docs/SERVER.md, "Hot reload of the bundle"` and `[x](RESULTS.md#goodput)` lead somewhere:
    the quoted words begin a heading or a bold lead of that file, the anchor is a heading's."""
    bad = []
    ref = re.compile(r"([\w./-]*[A-Z][\w-]*\.md)`?[,:]?\s*\(?\s*\"([^\"]+)\"")
    for doc in DOCS:
        text = _text(doc)
        flat = re.sub(r"\s*\n\s*", " ", text)
        for m in ref.finditer(flat):
            name, quoted = m.group(1), m.group(2).lower()
            target = next((p for p in (ROOT / name, doc.parent / name, ROOT / "docs" / name,
                                       ROOT / "benchmarks" / Path(name).name) if p.is_file()), None)
            if target is None or not any(quoted in s.lower() for s in _sections(target)):
                bad.append(f"{doc.relative_to(ROOT)}: {name}, \"{m.group(2)}\"")
        for m in re.finditer(r"\]\(([^)#\s]*)#([^)\s]+)\)", text):
            target = doc.parent / m.group(1) if m.group(1) else doc
            if m.group(2) not in {_anchor(h) for h in _sections(target)}:
                bad.append(f"{_where(doc, text, m.start())}: {m.group(1)}#{m.group(2)}")
    assert not bad, "sections the docs point to that do not exist:\n" + "\n".join(bad)


def test_every_method_section_a_doc_or_docstring_cites_exists():
    """`docs/METHOD.md section 11a` (and `section 9, "Giving up under consistency labels"`) in a
    doc or in the code's docstrings: METHOD.md has that numbered section (and that lead)."""
    method = ROOT / "docs" / "METHOD.md"
    numbers = set(re.findall(r"^##+ (\d+[a-z]?)\. ", _text(method), re.M))
    cite = re.compile(r"METHOD\.md`?,?\s+section\s+(\d+[a-z]?)\b(?:,?\s*\"([^\"]+)\")?")
    sources = DOCS + [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    bad = []
    for path in sources:
        text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", _text(path))  # a citation may wrap a comment
        for m in cite.finditer(text):
            lead = m.group(2)
            if m.group(1) not in numbers or (
                    lead and not any(lead.lower() in s.lower() for s in _sections(method))):
                bad.append(f"{path.relative_to(ROOT)}: {m.group(0)}")
    assert len(numbers) >= 14 and not bad, "METHOD.md sections cited that do not exist:\n" + \
        "\n".join(bad)


def test_every_wing_lists_its_modules():
    """Each wing of orca_serve/ names each of its modules on its face (its `__init__` docstring)
    and in docs/CODE.md's "Where the code lives": a module added or renamed reaches both."""
    code = _text(ROOT / "docs" / "CODE.md")
    rows = dict(re.findall(r"^\| `(\w+)/` \|(.*)$", code, re.M))
    wings = [d for d in (ROOT / "orca_serve").iterdir() if (d / "__init__.py").is_file()]
    assert len(wings) >= 9 and set(rows) == {d.name for d in wings}
    bad = []
    for wing in wings:
        face = ast.get_docstring(ast.parse(_text(wing / "__init__.py"))) or ""
        for module in sorted(p.stem for p in wing.glob("*.py") if p.stem != "__init__"):
            bad += [f"{wing.name}/{module}.py: not in {where}" for where, text in
                    (("its __init__", face), ("docs/CODE.md", rows[wing.name]))
                    if f"`{module}`" not in text]
    assert not bad, "\n".join(bad)


def test_the_indexes_are_complete():
    """docs/README.md links every page of docs/ and names every tool in scripts/; every
    benchmark has its figure in benchmarks/RESULTS.md."""
    index = _text(ROOT / "docs" / "README.md")
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages <= set(re.findall(r"\]\((\w[\w-]*\.md)\)", index)), "pages docs/README.md lacks"
    assert [p.name for p in (ROOT / "scripts").iterdir()
            if p.name not in index and not p.name.startswith(("_", "."))] == []
    results = _text(ROOT / "benchmarks" / "RESULTS.md")
    assert [p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name not in results] == []


def test_the_scans_see_what_they_check():
    """The patterns find the kinds of name they exist for (a scan that matches nothing passes)."""
    assert REPO_PATH.findall("see `orca_serve/settings/field.py` and benchmarks/x-{a,b}.png.") == [
        "orca_serve/settings/field.py", "benchmarks/x-{a,b}.png"]
    assert _expand("b/x-{a,b}.png") == ["b/x-a.png", "b/x-b.png"]
    assert FLAG.findall("`orca-calibrate run --config J` --orca-delta, `--orca-*`") == [
        "--config", "--orca-delta"]
    assert _anchor("Parallel samples, served (issue 35 item 2, 2026-11-28)") == \
        "parallel-samples-served-issue-35-item-2-2026-11-28"
    spans = dict((c, w) for w, c in code_spans(ROOT / "README.md"))
    assert any(c.startswith("orca-calibrate run --config") for c in spans)
    assert {"--data", "--window"} <= _subcommand_flags()["calibrate"]
