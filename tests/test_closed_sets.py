"""Code compares enum members, never their words: a closed set of words (a stop reason, a split,
a probe kind, ...) is a `StrEnum` in one place, and a literal equal to one of its words compared
elsewhere is a copy of that set that a rename would miss. Read off the source (ast), so it checks
every module, imported or not."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("orca_serve", "orca_method", "orca_calibrate")

# (module, word): the same word compared in another vocabulary than our enum's
OTHER_VOCABULARIES = {
    ("orca_serve/live_audit/redis_journal.py", "none"),  # Redis TYPE's reply for a missing key
    ("orca_serve/api_server/apis.py", "message"),  # Anthropic's and Responses' object types
    ("orca_serve/api_server/vote_stream.py", "message"),  # the Responses API's output item type
    ("orca_calibrate/calibrate_cli.py", "collect"),  # a subcommand's name, not the job's stage
}


def _modules() -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(ROOT)), ast.parse(p.read_text(), str(p)))
            for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


def _enum_words(modules: list[tuple[str, ast.Module]]) -> dict[str, set[str]]:
    """word -> the StrEnums that have it."""
    words: dict[str, set[str]] = {}
    for _, tree in modules:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(b, ast.Name) and b.id == "StrEnum" for b in node.bases):
                for st in node.body:
                    if (isinstance(st, ast.Assign) and isinstance(st.value, ast.Constant)
                            and isinstance(st.value.value, str)):
                        words.setdefault(st.value.value, set()).add(node.name)
    return words


def _compared_words(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, word) of each string literal compared by ==, != or `in` a literal collection."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for op, (left, right) in zip(node.ops, zip([node.left, *node.comparators],
                                                    node.comparators)):
            sides = [left, right] if isinstance(op, (ast.Eq, ast.NotEq)) else (
                [left, *getattr(right, "elts", [])]
                if isinstance(op, (ast.In, ast.NotIn))
                and isinstance(right, (ast.Tuple, ast.List, ast.Set)) else [])
            out += [(node.lineno, s.value) for s in sides
                    if isinstance(s, ast.Constant) and isinstance(s.value, str)]
    return out


def test_no_enum_word_is_compared_as_a_literal():
    modules = _modules()
    words = _enum_words(modules)
    assert {"stop", "train", "qk", "collect", "picked"} <= set(words)  # the scan sees the enums
    found = [f"{path}:{line}: {word!r} (a word of {', '.join(sorted(words[word]))})"
             for path, tree in modules for line, word in _compared_words(tree)
             if word in words and (path, word) not in OTHER_VOCABULARIES]
    assert not found, "compare the enum's member instead:\n" + "\n".join(found)


def test_the_scan_finds_a_literal_comparison():
    tree = ast.parse('if split == "train" or kind in ("qk", "x"):\n    pass\n')
    assert _compared_words(tree) == [(1, "train"), (1, "qk"), (1, "x")]
