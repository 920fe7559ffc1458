"""The demo jobs' prompts files are what the commands in their job files' headers write: a user
who regenerates them (or checks where they came from) gets the shipped bytes."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
JOBS = ROOT / "orca_calibrate" / "jobs"


def _commands(job: Path) -> list[list[str]]:
    """The `python -m ... --out F` commands of a job file's header comment."""
    return [shlex.split(m) for m in re.findall(r"^#[ \t]+(?:Prompts:)?[ \t]*(python -m .+)$",
                                                 job.read_text(), re.M)]


@pytest.mark.parametrize("name", ["toy", "long"])
def test_the_shipped_prompts_are_what_the_header_commands_write(tmp_path, name):
    commands = _commands(JOBS / f"{name}.yaml")
    assert len(commands) >= 2
    for argv in commands:
        out = argv[argv.index("--out") + 1]
        argv[argv.index("--out") + 1] = str(tmp_path / Path(out).name)
        subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, check=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
        written = (tmp_path / Path(out).name).read_bytes()
        assert written == (JOBS / out).read_bytes(), f"{name}: {shlex.join(argv)} differs"
