"""Check on a CUDA device that the engine-step core waits for the device only where
docs/PLUGIN.md says it does ("How it works").

    python scripts/cuda_sync_check.py [--scenario NAME ...] [--dry-run]   (exit 0: none found)

The core's sync tests run it on a CPU stand-in (tests/core_sim.py: `DeviceTensor`,
`count_copies`, `count_join_copies`) that logs the host reads it knows of (`.item()`, a host
tensor in a device op, a number written into one element, ...); a real device waits wherever
torch synchronises. This runs the tests' scenarios through the core on CUDA under
`torch.cuda.set_sync_debug_mode("warn")`, which warns at each synchronising call torch detects
(not yet all, torch warns), and records each one made inside the core's calls (`OrcaCore` step,
join, leave and settle, `DraftSteps` step and finish) by scenario, at the innermost frame of
orca_serve or orca_method on its stack: the line of ours that made it. The scenarios:
`core_sim.sync_sims` on the plain bundle, in record mode, with a keyword table and with a
give-up probe (tests/test_core.py), and the draft run of tests/test_speculation.py.

Counted apart, and allowed: the fence's wait (`pooling.Fence.wait`, reached from the readback),
the core's one documented wait. Only torch's sync warning counts ("called a synchronizing CUDA
operation"): the notice the first `set_sync_debug_mode` call gives, that the mode is a prototype,
is none (a first version of this tool, matching "synchroniz", counted it once). It exits 1 on
any other sync, and also when a scenario ran no core call, scored no step or failed a request
(it would prove nothing), so it can gate a GPU run.

It checks the checkout it sits in (its packages and its tests' scenario builders). Without CUDA,
or with `--dry-run`, it runs the scenarios on the CPU stand-in instead (`core_sim.to_device`):
each host read the stand-in logs inside a core call counts as a sync; the staging and readback
copies it logs do not (on CUDA they are non_blocking and pinned; the tests check there is one of
each per step), and the fence has no event to wait on. tests/test_cuda_sync_check.py runs it.
"""

from __future__ import annotations

import argparse
import linecache
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's packages and its tests' scenario builders

import orca_method  # noqa: E402
import orca_serve  # noqa: E402
from orca_serve.core.engine import OrcaCore  # noqa: E402
from orca_serve.core.speculation import DraftSteps  # noqa: E402
from orca_serve.settings.contract import XARG_GIVE_UP_MU, XARG_LAM  # noqa: E402
from tests.core_sim import (  # noqa: E402
    DeviceTensor,
    FactoryWatch,
    gated_sim_bundle,
    make_core,
    run,
    sim_bundle,
    sync_sims,
    to_device,
)
from tests.test_speculation import draft_sims, run_speculative  # noqa: E402

SYNC_WARNING = "called a synchronizing CUDA operation"  # c10/cuda warn_or_error_on_sync
# where ours are imported from (this checkout, unless a caller imported them from elsewhere first)
PACKAGES = [Path(m.__file__).parent for m in (orca_serve, orca_method)]
OURS = tuple(f"{p}/" for p in PACKAGES)
DOCUMENTED_WAITS = {("orca_serve/core/pooling.py", "Fence.wait")}
# what the stand-in logs for the staging and readback copies: not waits on CUDA (see above)
STAND_IN_COPIES = {"h2d copy_", "d2h copy_"}
# scenario -> (bundle, max_tokens, extra_args of every request), as tests/test_core.py's sync
# checks run them; "record" puts their requests in record mode (its own test there runs three
# shadow ones: these also stop, answer, are preempted and lag)
PLAIN_SCENARIOS: dict[str, tuple[str, int, dict[str, Any]]] = {
    "plain": ("plain", 60, {}),
    "record": ("plain", 60, {"orca_record": 1}),
    "keywords": ("keywords", 90, {}),
    "give_up": ("two_sided", 90, {XARG_LAM: "inf", XARG_GIVE_UP_MU: 0.2}),
}
SCENARIOS = [*PLAIN_SCENARIOS, "speculation"]


@dataclass
class Tally:
    """What the scenarios did: core calls, steps scored and failed requests per scenario; syncs
    by (scenario, place of ours); documented waits per scenario."""

    calls: Counter[str] = field(default_factory=Counter)
    scored: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    syncs: Counter[tuple[str, str]] = field(default_factory=Counter)
    waits: Counter[str] = field(default_factory=Counter)

    def unexpected(self, scenario: str | None = None) -> int:
        """Syncs outside the documented waits, of `scenario` (None: of all)."""
        return sum(n for (s, _), n in self.syncs.items() if scenario is None or s == scenario)


def innermost_ours(frame: FrameType | None) -> FrameType | None:
    """The innermost frame of orca_serve or orca_method from `frame` outwards: the line of ours
    that made the sync (torch's frames, the stand-in's and this tool's are not)."""
    while frame is not None and not frame.f_code.co_filename.startswith(OURS):
        frame = frame.f_back
    return frame


def place(frame: FrameType) -> tuple[str, str]:
    """(path in the checkout, qualified function name) of a frame of ours."""
    path = Path(frame.f_code.co_filename)
    root = next(p.parent for p in PACKAGES if path.is_relative_to(p))
    return path.relative_to(root).as_posix(), frame.f_code.co_qualname


class Watch:
    """Runs the core's calls under the device's sync watch and records each sync they make:
    on CUDA, torch's sync debug mode (a warning per synchronising call); in a dry run, the CPU
    stand-in's log of host reads. Nested calls (DraftSteps.step calls core.step) watch once."""

    def __init__(self, dry: bool) -> None:
        self.dry = dry
        self.device = torch.device("cpu" if dry else "cuda")
        self.tally = Tally()
        self.scenario = ""
        self._depth = 0
        self._stack = ExitStack()

    def record(self, frame: FrameType | None) -> None:
        """A sync happened with `frame` innermost on the stack: file it by the frame of ours
        that made it."""
        if not self._depth:
            return  # outside the core's calls: the fake engine's or a result's fetch
        ours = innermost_ours(frame)
        if ours is None:  # only this tool's code runs in a core call besides ours: a bug here
            self.tally.syncs[(self.scenario, "no frame of orca_serve or orca_method")] += 1
            return
        path, name = place(ours)
        if (path, name) in DOCUMENTED_WAITS:
            self.tally.waits[self.scenario] += 1
            return
        line = linecache.getline(ours.f_code.co_filename, ours.f_lineno).strip()
        where = f"{Path(path).name}:{ours.f_lineno} {name}: {line}"
        self.tally.syncs[(self.scenario, where)] += 1

    @contextmanager
    def watching(self) -> Iterator[None]:
        """The sync watch on for the outermost core call: syncs are recorded while it lasts."""
        if not self._depth:
            self._stack.enter_context(FactoryWatch() if self.dry else _sync_debug_mode())
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth:
                self._stack.close()

    def watched(self, fn: Callable) -> Callable:
        """`fn` counted as a core call of the current scenario and run under the watch."""
        def call(*args: Any, **kwargs: Any) -> Any:
            self.tally.calls[self.scenario] += 1
            with self.watching():
                return fn(*args, **kwargs)
        return call

    def on_device(self, fn: Callable) -> Callable:
        """`fn` (an engine step: its last two arguments are the hidden and logits rows) watched,
        with those rows on the device as the engine's are: moved there before the call (outside
        the watch: the engine's work) and the logits, which the core changes in place, back."""
        def call(*args: Any, **kwargs: Any) -> Any:
            *head, hidden, logits = args
            if self.dry:
                dev_hidden, dev_logits = (hidden.as_subclass(DeviceTensor),
                                          logits.as_subclass(DeviceTensor))  # views: no copy
            else:
                dev_hidden, dev_logits = hidden.to(self.device), logits.to(self.device)
            out = self.watched(fn)(*head, dev_hidden, dev_logits, **kwargs)
            if not self.dry:
                logits.copy_(dev_logits)
            return out
        return call


@contextmanager
def _sync_debug_mode() -> Iterator[None]:
    """torch's sync warnings on while a core call runs: "warn", so that each is recorded and the
    run goes on ("error" would raise inside the core's step, which fails its requests instead)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


class _HostReads(list):
    """The stand-in's log (`DeviceTensor.log`) in a dry run: each host read it logs is recorded
    as a sync where it happens."""

    def __init__(self, watch: Watch) -> None:
        super().__init__()
        self._watch = watch

    def append(self, entry: str) -> None:
        super().append(entry)
        if entry not in STAND_IN_COPIES:
            self._watch.record(sys._getframe(1))


class _Folders:
    """What `core_sim.sim_bundle` asks of pytest's tmp_path_factory: a new folder per call."""

    def __init__(self, root: Path) -> None:
        self._root = root

    def mktemp(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=name, dir=self._root))


def watched_core(watch: Watch, bundle: Path, max_num_seqs: int, *,
                 drafts: bool = False) -> OrcaCore:
    """A core on the watch's device whose step, join, leave and settle are watched; its step
    takes the engine's rows to the device unless `drafts` (DraftSteps.step does, then calls it
    with device rows)."""
    core = make_core(bundle, max_num_seqs=max_num_seqs, device=watch.device)
    if watch.dry:
        to_device(core)
    core.step = watch.watched(core.step) if drafts else watch.on_device(core.step)
    for name in ("join", "leave", "settle"):
        setattr(core, name, watch.watched(getattr(core, name)))
    return core


def run_scenario(watch: Watch, name: str, bundles: dict[str, Path]) -> None:
    """Scenario `name` through a watched core, as its sync test runs it; its steps scored and
    failed requests go to the tally."""
    watch.scenario = name
    if name == "speculation":
        core, sims = watched_core(watch, bundles["plain"], 9, drafts=True), draft_sims(0)
        with mock.patch.object(DraftSteps, "step", watch.on_device(DraftSteps.step)), \
                mock.patch.object(DraftSteps, "finish", watch.watched(DraftSteps.finish)):
            run_speculative(core, sims, 3, 0.7, 0)
    else:
        bundle, max_tokens, xa = PLAIN_SCENARIOS[name]
        core, sims = watched_core(watch, bundles[bundle], 4), sync_sims(max_tokens, lambda i: xa)
        run(core, sims)
    results = core.pop_results([s.name for s in sims]).values()
    watch.tally.scored[name] += sum(r["steps_scored"] for r in results)
    watch.tally.failed[name] += sum("error" in r for r in results)


def check(scenarios: list[str], dry: bool) -> Tally:
    """Run the scenarios under the watch (on CUDA, or the stand-in when `dry`)."""
    watch = Watch(dry)
    with tempfile.TemporaryDirectory() as tmp, \
            (recording_host_reads if dry else recording_sync_warnings)(watch):
        folders = _Folders(Path(tmp))
        bundles = {"plain": sim_bundle(folders), "keywords": sim_bundle(folders, keywords=["x"]),
                   "two_sided": gated_sim_bundle(Path(tmp) / "two_sided.json", None)}
        for name in scenarios:
            run_scenario(watch, name, bundles)
    return watch.tally


@contextmanager
def recording_host_reads(watch: Watch) -> Iterator[None]:
    """The dry run's record: each host read the stand-in logs (`DeviceTensor.log`)."""
    log, DeviceTensor.log = DeviceTensor.log, _HostReads(watch)
    try:
        yield
    finally:
        DeviceTensor.log = log


@contextmanager
def recording_sync_warnings(watch: Watch) -> Iterator[None]:
    """CUDA's record: torch's sync warnings, each recorded where it is raised (so the stack is
    the sync's), every one (not the first of each place); other warnings are shown, but the
    mode's notice that it is a prototype."""
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        show = warnings.showwarning

        def showwarning(message: Warning | str, category: type[Warning], filename: str,
                        lineno: int, file: Any = None, line: str | None = None) -> None:
            if SYNC_WARNING in str(message):  # torch may append "(Triggered internally at ...)"
                watch.record(sys._getframe(1))
            else:
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = showwarning
        yield


def report(tally: Tally, scenarios: list[str], dry: bool) -> int:
    """Print the table and the places of unexpected syncs; the exit code (1: a sync, or a
    scenario that proves nothing)."""
    device = "CPU stand-in (dry run)" if dry else torch.cuda.get_device_name()
    print(f"cuda_sync_check: {PACKAGES[0].parent} on {device}, torch {torch.__version__}")
    print(f"{'scenario':<12} {'core calls':>10} {'steps scored':>12} {'failed':>6} "
          f"{'syncs':>6} {'documented waits':>16}")
    unproven = []
    for s in scenarios:
        print(f"{s:<12} {tally.calls[s]:>10} {tally.scored[s]:>12} {tally.failed[s]:>6} "
              f"{tally.unexpected(s):>6} {tally.waits[s]:>16}")
        if not tally.calls[s] or not tally.scored[s] or tally.failed[s]:
            unproven.append(s)
    for (s, where), n in sorted(tally.syncs.items()):
        print(f"  [{s}] x{n}  {where}")
    if unproven:
        print(f"proves nothing (no core call, no step scored or a request failed): {unproven}")
    return int(bool(tally.unexpected() or unproven))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="Exit 0: no sync but the documented waits, and every scenario ran.")
    parser.add_argument("--scenario", action="append", choices=SCENARIOS,
                        help="run this scenario (repeat for more; default: all)")
    parser.add_argument("--dry-run", action="store_true",
                        help="the CPU stand-in even where CUDA is available (the default "
                             "without CUDA)")
    args = parser.parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    scenarios = args.scenario or SCENARIOS
    return report(check(scenarios, dry), scenarios, dry)


if __name__ == "__main__":
    sys.exit(main())
