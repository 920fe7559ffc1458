"""The repository stands alone: no README, doc, script or code comment points outside it.

Scans the tracked text files for references to folders beside the checkout and for relative
paths (parent-directory hops) that leave the repository when resolved from the file that names them. What the
project needs from elsewhere is written down in its own docs (docs/METHOD.md, docs/VLLM-CPU.md).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT = (".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".cfg", ".txt", ".ini")
NAMES = ("Makefile",)
# Spelled in pieces so that this file does not match itself.
OUTSIDE = ["." + "./sha" + "red", "sha" + "red/notes", "sha" + "red/spec", "sha" + "red/reference",
           "/wo" + "rk/"]
RELATIVE = re.compile(r"(?<![\w/.>~$])((?:\.\./)+[\w.\-/]*)")


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
        names = [n for n in out.stdout.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk it
        names = [str(Path(d, f).relative_to(ROOT)) for d, dirs, files in os.walk(ROOT)
                 for f in files if not any(p.startswith(".") for p in Path(d).relative_to(ROOT).parts)]
    return [ROOT / n for n in names
            if n.endswith(TEXT) or Path(n).name in NAMES or Path(n).name.startswith("Dockerfile")]


def test_no_file_points_outside_the_repository():
    bad = []
    for path in _tracked():
        if not path.is_file():
            continue
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
            where = f"{path.relative_to(ROOT)}:{lineno}"
            bad += [f"{where}: {word}" for word in OUTSIDE if word in line]
            for rel in RELATIVE.findall(line):
                target = (path.parent / rel).resolve()
                if not target.is_relative_to(ROOT):
                    bad.append(f"{where}: {rel} leaves the repository")
    assert not bad, "references outside the repository:\n" + "\n".join(bad)


def test_the_scan_sees_what_it_must_refuse(tmp_path):
    """The patterns match the kinds of reference they exist for."""
    up = "." + "./"
    assert RELATIVE.findall(f"see {up}{up}x/y.md and <out>/{up}z") == [f"{up}{up}x/y.md"]
    line = "(paper: " + OUTSIDE[0] + "/reference/p.tex)"
    assert any(word in line for word in OUTSIDE)
