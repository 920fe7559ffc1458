"""Hot reload of the calibration bundle: `POST /v1/orca/bundle` (admin key) and SIGHUP.

The server resolves each request's lambda* from its bundle and names that bundle's checksum in
the request (the `orca_bundle` extra arg); the engine joins the deployment of that checksum
(orca_serve/core). A reload is ordered so that the two always agree, and lambda* of one probe is
never compared with the scores of another:

1. The new bundle is read and checked here (its checksum; the checks made at start: the model it
   names, the table's consistency, the probe's scale, `check`; the options the server runs with,
   `orca_serve.checks.bundle.check_options`: --orca-delta in its table, the give-up policy its
   mu* was certified for, ...; the live audit's settings, `audit_config`, and its successor,
   built with the new journal joined: refused when the processes folding that journal run with
   other guard flags, `successor`), then staged on
   every engine worker (`orca_load_bundle`: the checks made at start, against the engine's own
   model). Any refusal: the staged copies are let go, nothing else changes, and the caller gets
   the reason in one line.
2. Every worker makes it its default (`orca_use_bundle`, for requests that name no bundle), then
   the server swaps its bundle, defaults and live audit in one synchronous step on the event
   loop: requests resolved before it run on the old bundle (they name it), requests resolved
   after it on the new one. A request is never resolved against one and scored by the other.
3. The old deployment stays loaded while a request the server resolved with it is in flight.
   When the last one has finished, the engines are told to let it go (`orca_retire_bundles`);
   each frees it once its own last request of it has left the batch.

One reload at a time (a lock, which the retire calls take too, so that they never drop a bundle
being staged). Hot reload needs one API server process: with `--api-server-count N` each process
would hold its own bundle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orca_method.bundle import Bundle, BundleError, load_bundle
from orca_method.bundle_checks import check_semantics
from orca_method.errors import first_line
from orca_serve.checks.bundle import check_options
from orca_serve.live_audit.handover import successor, take_over
from orca_serve.live_audit.live import LiveAudit
from orca_serve.live_audit.options import AuditConfig
from orca_serve.metrics.prometheus import ReloadOutcome
from orca_serve.settings.contract import OrcaSettings, ReloadAnswer
from orca_serve.settings.resolve import OrcaDefaults
from orca_serve.api_server.state import EngineLink, Serving, ServingRef

if TYPE_CHECKING:
    from orca_serve.metrics.prometheus import OrcaMetrics

logger = logging.getLogger("orca_serve.api_server.reload")

BUNDLE_PATH = "/v1/orca/bundle"
RELOAD_TIMEOUT_S = 120.0  # an engine answers between two steps; loading a probe takes seconds


class ReloadRefused(Exception):
    """A bundle that is not swapped in; the old one keeps serving. One line, for the caller."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


async def _successor(old: LiveAudit, bundle: Bundle, config: AuditConfig) -> LiveAudit:
    """`successor`, in a thread (its journal's replay); a reload cancelled meanwhile (the server
    stopping) closes it once built, from that thread: awaited with `asyncio.to_thread`, it stayed
    joined to the new journal for the process's life (its owner lock held, a fleet's key renewed
    and then left to expire), the thread's result dropped."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="orca-reload")
    built = pool.submit(successor, old, bundle, config)
    pool.shutdown(wait=False)
    try:
        return await asyncio.wrap_future(built)
    except asyncio.CancelledError:
        built.add_done_callback(_close_unused)
        raise


def _close_unused(built: Future[LiveAudit]) -> None:
    """Close the audit `built` once built, for a reload that no longer takes it."""
    if not built.cancelled() and built.exception() is None:
        built.result().close()


class Reloader:
    """The server's side of hot reload (see the module docstring): the protocol, the in-flight
    count per bundle that decides when an old one may go, and the admin key."""

    def __init__(self, serving: ServingRef, engine: EngineLink, *, calib_path: str,
                 fixed_delta: float | None = None, admin_key: str | None = None,
                 metrics: OrcaMetrics | None = None,
                 check: Callable[[Bundle], str | None] = check_semantics,
                 audit_config: Callable[[Bundle], AuditConfig] | None = None) -> None:
        self.serving = serving  # what it swaps
        self.engine = engine
        self.metrics = metrics
        self.calib_path = calib_path  # what SIGHUP re-reads
        self.fixed_delta = fixed_delta  # --orca-delta: must be in every bundle's table
        self.admin_key = admin_key  # None: POST /v1/orca/bundle is off (404)
        # the checks a new bundle passes, raising BundleError, returning a note to log and answer
        # (the server's start-up checks against the served model and what it serves,
        # orca_serve.checks.bundle.check_served and serving_warnings)
        self.check = check
        # bundle -> the configuration of its live audit, which takes over from the serving one
        # (orca_serve.live_audit.handover); raises ValueError when the options contradict the
        # bundle. None: the serving audit (if any) stays
        self.audit_config = audit_config
        self.inflight: Counter[str] = Counter()  # checksum -> requests resolved with it, running
        self.last: dict[str, Any] | None = None  # the last reload's outcome
        self._lock: asyncio.Lock | None = None
        self._tasks: set[asyncio.Future] = set()

    def _get_lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- requests in flight ---------------------------------------------------------------------
    def started(self, settings: OrcaSettings) -> None:
        if settings.bundle is not None:
            self.inflight[settings.bundle] += 1

    def finished(self, settings: OrcaSettings) -> None:
        """A request's results were fetched: the last one of a replaced bundle lets it go."""
        c = settings.bundle
        if c is None:
            return
        self.inflight[c] -= 1
        if self.inflight[c] <= 0:
            del self.inflight[c]
            if c != self.current:
                self._spawn(self.retire())

    @property
    def current(self) -> str | None:
        return self.serving.now.checksum

    def _keep(self) -> list[str]:
        return [c for c in [self.current, *self.inflight] if c is not None]

    async def retire(self) -> None:
        """Tell the engines which bundles the server still needs; they free the others once
        their last requests leave."""
        async with self._get_lock():
            try:
                answers = await asyncio.wait_for(
                    self.engine.rpc("orca_retire_bundles", (self._keep(),)), RELOAD_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - it is retried at the next reload
                logger.warning("orca: letting go of replaced bundles failed: %s", first_line(e))
                return
            for wire in answers or []:
                try:
                    error = ReloadAnswer.from_wire(wire).error
                except ValueError as e:
                    error = str(e)
                if error:
                    logger.warning("orca: letting go of replaced bundles: %s", error)

    # -- the reload -----------------------------------------------------------------------------
    async def reload(self, path: str, *, source: str) -> dict[str, Any]:
        """Swap in the bundle at `path` (see the module docstring); raises ReloadRefused."""
        t_asked = time.perf_counter()
        async with self._get_lock():
            t0 = time.perf_counter()
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            try:
                out = await self._reload(path)
            except ReloadRefused as e:
                self.last = {"at": when, "source": source, "path": path, "refused": e.message}
                if self.metrics is not None:
                    self.metrics.reloaded(ReloadOutcome.REFUSED)
                logger.warning("orca: bundle %s refused (%s); the old one serves on: %s", path,
                               source, e.message)
                raise
            # seconds: the reload itself; waited_s: for the one before it (or a release) to end
            out["seconds"] = round(time.perf_counter() - t0, 3)
            out["waited_s"] = round(t0 - t_asked, 3)
            self.last = {"at": when, "source": source, **out}
            if out["changed"] and self.metrics is not None:
                self.metrics.reloaded(ReloadOutcome.LOADED)
            logger.info("orca: bundle %s (%s): %s", path, source,
                        f"now serving {out['checksum']}" if out["changed"] else "unchanged")
            return out

    async def _reload(self, path: str) -> dict[str, Any]:
        st = self.serving.now
        path = str(Path(path).expanduser().absolute())
        try:
            bundle = await asyncio.to_thread(load_bundle, path)
            note = await asyncio.to_thread(self.check, bundle)
        except BundleError as e:
            raise ReloadRefused(str(e)) from None
        if note:
            logger.warning("orca: bundle %s: %s", path, note)
        old = self.current
        if bundle.checksum == old:
            self.serving.swap(replace(st, bundle_path=path))
            return {"changed": False, "checksum": old, "path": path}
        try:  # the options the server runs with, as at start
            check_options(bundle, delta=self.fixed_delta, give_up_delta=st.defaults.give_up_delta,
                          give_up_policy=st.defaults.give_up_policy,
                          effort_map=st.defaults.effort_map, shift_alpha=st.defaults.shift_alpha,
                          shift_give_up_alpha=st.defaults.shift_give_up_alpha,
                          vote_waves=st.defaults.vote_waves)
        except BundleError as e:
            raise ReloadRefused(str(e)) from None
        audit = None
        if self.audit_config is not None and st.audit is not None:
            try:
                # its journal joined: the processes folding it run with the same flags
                # (handover.py)
                audit = await _successor(st.audit, bundle, self.audit_config(bundle))
            except (OSError, ValueError) as e:
                raise ReloadRefused(f"the live audit cannot follow the new bundle: "
                                    f"{first_line(e)}") from None
        try:
            answers = await self._rpc("orca_load_bundle", path)
            self._check(answers, bundle.checksum)
            answers = await self._rpc("orca_use_bundle", bundle.checksum)
            self._check(answers, bundle.checksum)
        except BaseException as e:
            if audit is not None:
                audit.close()  # leaves the journal it joined
            if isinstance(e, ReloadRefused):
                await self._roll_back(old)
            raise
        self._swap(bundle, path, replace(st.defaults, delta=(
            self.fixed_delta if self.fixed_delta is not None else bundle.default_delta)),
            audit)
        if self.inflight.get(old, 0) == 0:
            self._spawn(self.retire())  # runs once this reload lets go of the lock
        return {"changed": True, "checksum": bundle.checksum, "previous": old, "path": path,
                **({"note": note} if note else {})}

    async def _rpc(self, method: str, *args: Any) -> list[Any]:
        try:
            return list(await asyncio.wait_for(self.engine.rpc(method, args), RELOAD_TIMEOUT_S)
                        or [])
        except TimeoutError:
            raise ReloadRefused(f"the engine did not answer {method} within "
                                f"{RELOAD_TIMEOUT_S:g} s") from None
        except Exception as e:  # noqa: BLE001 - the engine's failure is the caller's reason
            raise ReloadRefused(f"{method} failed: {first_line(e)}") from None

    @staticmethod
    def _check(answers: list[Any], want: str) -> None:
        """Every worker answered the bundle `want` (`ReloadAnswer.checksum`); else the first
        refusal is the reason."""
        if not answers:
            raise ReloadRefused("no engine worker answered")
        for wire in answers:
            try:
                a = ReloadAnswer.from_wire(wire)
            except ValueError as e:
                raise ReloadRefused(str(e)) from None
            if a.error:
                raise ReloadRefused(a.error)
            if a.checksum != want:
                raise ReloadRefused("the bundle file changed while it was being loaded "
                                    f"({a.checksum} instead of {want}); try again")

    async def _roll_back(self, old: str | None) -> None:
        """Back to the old bundle on every worker; the staged one is let go."""
        for method, arg in (("orca_use_bundle", old), ("orca_retire_bundles", self._keep())):
            try:
                await asyncio.wait_for(self.engine.rpc(method, (arg,)), RELOAD_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - the old bundle is still current anyway
                logger.warning("orca: rolling back a refused bundle (%s): %s", method,
                               first_line(e))

    def _swap(self, bundle: Bundle, path: str, defaults: OrcaDefaults,
              audit: LiveAudit | None) -> None:
        """The server's switch, synchronous: no request is resolved half way through it. The
        new bundle's live audit (`audit`, built by the reload's check; None: the old one serves
        on, there being none) takes over from the old one first (its store and unfinished
        count)."""
        old = self.serving.now
        if old.audit is not None and audit is not None:
            audit = take_over(old.audit, audit)
        new = Serving(bundle, path, defaults, old.audit if audit is None else audit)
        self.serving.swap(new)
        if self.metrics is not None and new.bundle is not None:
            self.metrics.bundle_in_use(new.bundle.checksum, old.checksum)

    # -- SIGHUP ---------------------------------------------------------------------------------
    def on_sighup(self) -> None:
        """Re-read the --calib path (a signal handler on the server's event loop)."""
        logger.info("orca: SIGHUP: re-reading %s", self.calib_path)
        self._spawn(self._reload_logged(self.calib_path, "SIGHUP"))

    async def _reload_logged(self, path: str, source: str) -> None:
        try:
            await self.reload(path, source=source)
        except ReloadRefused:
            pass  # logged by reload()
