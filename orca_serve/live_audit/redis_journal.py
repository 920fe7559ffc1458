"""The audit journal on a Redis server, so that the replicas of a fleet share one sequence.

The same events as the file journal (orca_serve/live_audit/journal.py), in the same order for
every process, under keys named by the bundle's full checksum:

    orca:guard:<checksum>:events     a list, one JSON event per element: the total order
    orca:guard:<checksum>:chain      the running digest after each element (40 hex each)
    orca:guard:<checksum>:created    when the list was started (tells it from a recreated one)
    orca:guard:<checksum>:snapshot   the folded state and the list length it covers
    orca:guard:<checksum>:fold       the settings the fleet folds under, and who joined
    orca:guard-owner:<owner>         exists while that process runs (a TTL its heartbeat renews)

- **Order**: an append is one server-side script, so atomic: it pushes the event and returns
  the list's new length and the events between this process's read position and its own
  event (the others' appends it has not applied yet). Redis runs scripts one at a time, so
  every process applies the same list in the same order, as `flock` does for the file.
- **Reading** costs one round trip per request (the list's length, its start marker and what
  is new). A list that is shorter than what this process already read, whose start marker
  changed, or whose running digest at this process's read position is not the one this
  process computed over what it read, was rolled back or recreated by the store (a restart
  without persistence or from an older save, a flush): that raises `StoreRolledBack`, and the
  caller stops using the store (fleet.py), because events others applied are gone and the
  processes' states can no longer agree. The script checks before it pushes, so a process that
  finds the list rolled back adds nothing to it. The digest is needed because a list restored
  from an older save may have grown back past this process's position (the other replicas
  append meanwhile) before this process reads again, and then neither its length nor its start
  marker tells; it covers every element up to the position, since the elements appended after
  the restore can equal the lost ones at the end and differ before (a vote's events carry no
  number: ten groups without error read the same, whoever ran them), which a comparison of the
  last few missed. The `chain` list holds it after each element, sha1(previous digest + the
  element), appended by the script with the element; elements a process that keeps no chain
  appended (an older version, during a rolling upgrade) are chained by the next script that
  runs, and a chain longer than the list (the list alone cut, by hand) is cut to it.
- **Owners**: each process sets its owner key with a TTL (`OWNER_TTL`) and a daemon thread
  renews it every third of that; a process that died stops renewing, its key expires, and the
  next process that reaps journals its open admissions as `lost`. A renewal and `close` take
  one lock, so a beat never runs on a closed client nor sets the key again after `close`
  deleted it; a renewal that fails (any exception) is logged and retried at the next beat,
  never ending the heartbeat.
- **Settings**: a replica joins (`join`) in one optimistic transaction on the `fold` key
  (WATCH, then MULTI): the fleet's settings are the first replica's, a replica whose settings
  (its flags, its fold format) differ while one that joined runs (its owner key lives) is
  refused, naming each (journal.py `joined`); once none runs, the next one's settings become
  the fleet's. A `fold` value that is not a fold record is refused while any other owner key
  lives (journal.py `fold_record`), a key of another type (a hash, a list) too.
- **Keys of another type**: a key above that holds another Redis type than the journal keeps
  there (a hash under `events`, a list under `created`: another program's data under the
  prefix, a store half migrated) is refused when a replica opens the journal, at start or in a
  hot reload, whether or not others run (`KeyOfAnotherType`: one line naming each such key and
  what to do), and never written anew: it may be data that is not the audit's, and a SET (the
  start marker's, a snapshot's) replaces a key of any type. Before, its first call failed
  (WRONGTYPE), taken for an unreachable store, and the replica folded alone, apart from the
  fleet. The fold record has its own rule ("Settings"); a key that changes type while the
  replica runs fails its calls, the snapshot's SET too (a script checks the type first), and
  the replica leaves the store as for any failed call (fleet.py).
- **Snapshots** carry the running digest of the events they cover, checked against the
  chain before one is used (as the file journal's digest: journal.py, "Snapshots"), and corrupt
  elements are skipped by the file journal's rule (journal.py, "Corrupt lines").
- **Durability** is the server's: with `appendonly yes` and `appendfsync always` an event
  acknowledged is on the store's disk (the file journal's guarantee); with Redis's default
  (`everysec`) a crash of the store may lose the last second, which the processes then detect
  as a rollback.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis

from orca_serve.live_audit.journal import (
    JournalRefused,
    fold_record,
    joined,
    parse_events,
    read_snapshot_json,
    snapshot_json,
)

logger = logging.getLogger("orca_serve.live_audit")

OWNER_TTL = 15.0  # seconds an owner key lives without a heartbeat
TIMEOUT = 2.0  # seconds a store call may take before the store counts as unreachable

# KEYS: events, created, chain. ARGV: the event (or "" to only read), the read position, the
# start marker read, the running digest at the read position ("" at 0). Chains what is not
# chained yet, then returns {length, events after the position and before the pushed one}, or
# {-1, length} without pushing when the list is not the one this process read (module
# docstring).
_APPEND_READ = """
local n = redis.call('LLEN', KEYS[1])
local from = tonumber(ARGV[2])
if n < from or redis.call('GET', KEYS[2]) ~= ARGV[3] then return {-1, n} end
local m = redis.call('LLEN', KEYS[3])
if m > n then
  redis.call('LTRIM', KEYS[3], 0, n - 1)
  m = n
end
local d = ''
if m > 0 then d = redis.call('LINDEX', KEYS[3], m - 1) end
if m < n then
  for _, e in ipairs(redis.call('LRANGE', KEYS[1], m, n - 1)) do
    d = redis.sha1hex(d .. e)
    redis.call('RPUSH', KEYS[3], d)
  end
end
if from > 0 and redis.call('LINDEX', KEYS[3], from - 1) ~= ARGV[4] then return {-1, n} end
local new = {}
if n > from then new = redis.call('LRANGE', KEYS[1], from, n - 1) end
if ARGV[1] ~= '' then
  n = redis.call('RPUSH', KEYS[1], ARGV[1])
  redis.call('RPUSH', KEYS[3], redis.sha1hex(d .. ARGV[1]))
end
return {n, new}
"""


# KEYS: snapshot. ARGV: the snapshot. A SET replaces a key of any type, so the type is checked
# in the same script: a key that became a hash or a list while the replica serves (another
# program's data) is not overwritten; the call fails, as every other call on it does (module
# docstring, "Keys of another type").
_SET_SNAPSHOT = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'string' and kind ~= 'none' then
  return redis.error_reply('WRONGTYPE ' .. KEYS[1] .. ' holds a ' .. kind .. ', not a snapshot')
end
return redis.call('SET', KEYS[1], ARGV[1])
"""


def chained(digest: str, element: bytes) -> str:
    """The running digest after `element` (the script's `redis.sha1hex(d .. e)`)."""
    return hashlib.sha1(digest.encode() + element).hexdigest()


class StoreRolledBack(redis.RedisError):
    """The store lost events this process had already applied (see the module docstring)."""


class KeyOfAnotherType(JournalRefused):
    """A key of the journal holds a value of another Redis type than the journal keeps there
    (module docstring, "Keys of another type")."""


def shown_url(url: str) -> str:
    """The store's address without its password, for the log, the table and /metrics."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


class RedisJournal:
    """One bundle's event journal on a Redis server (see the module docstring)."""

    def __init__(self, url: str, checksum: str, *, owner_ttl: float = OWNER_TTL,
                 timeout: float = TIMEOUT, ours: Iterable[str] = ()) -> None:
        """`ours`: the owners of this process's other journals, as the file journal's."""
        self.checksum = checksum
        self.owner = uuid.uuid4().hex[:12]
        self._ours = frozenset([self.owner, *ours])
        self.owner_ttl = owner_ttl
        self._client = redis.Redis.from_url(url, socket_timeout=timeout,
                                            socket_connect_timeout=timeout)
        prefix = f"orca:guard:{checksum}"
        self._events, self._created_key, self._chain_key, self._snapshot, self._fold = (
            f"{prefix}:events", f"{prefix}:created", f"{prefix}:chain", f"{prefix}:snapshot",
            f"{prefix}:fold")
        self._store = shown_url(url)  # for a refusal
        self.path = f"{self._store} {self._events}"
        self._fold_at = f"{self._store} {self._fold}"  # the fold record, for a refusal
        self._script = self._client.register_script(_APPEND_READ)
        self._set_snapshot = self._client.register_script(_SET_SNAPSHOT)
        self._offset = 0  # list elements this process has read
        self._chain = ""  # the running digest of those (the rollback check's, a snapshot's)
        self.skipped = 0
        self._stop = threading.Event()
        self._beat_lock = threading.Lock()  # a renewal and close() never overlap
        self._heart = threading.Thread(target=self._beat, name="orca-audit-owner", daemon=True)
        try:
            self._renew()  # first: reaping by others must not see our admissions as orphans
            self._check_types()
            self._warn_if_evicting()
            self._client.set(self._created_key, repr(time.time()), nx=True)
            self.created = self._client.get(self._created_key).decode()
            self._heart.start()
        except BaseException:  # refused (the store failed mid-open): holds nothing, as Journal
            self.close()
            raise

    def _check_types(self) -> None:
        """`KeyOfAnotherType`, naming each key of the journal (but the fold record: `_read_fold`)
        that holds another Redis type than the journal keeps there, and what to do (module
        docstring, "Keys of another type")."""
        kept = [(self._events, "list", "its events"),
                (self._chain_key, "list", "their running digests"),
                (self._created_key, "string", "its start marker"),
                (self._snapshot, "string", "its snapshot")]
        with self._client.pipeline(transaction=False) as p:
            for key, _, _ in kept:
                p.type(key)
            found = [kind.decode() for kind in p.execute()]
        wrong = [f"{key} is a Redis {kind}, where the audit journal keeps {what} (a {want})"
                 for (key, want, what), kind in zip(kept, found, strict=True)
                 if kind not in (want, "none")]
        if wrong:
            raise KeyOfAnotherType(
                f"{self._store}: {'; '.join(wrong)}: another program's data under the "
                "audit's keys, or a store half migrated, which this replica neither reads as its "
                "audit's nor overwrites; rename each such key away (RENAME) or delete it, then "
                "start (or reload) again")

    def _warn_if_evicting(self) -> None:
        """Warn when the store may evict keys (a `maxmemory-policy` other than `noeviction`,
        Redis's default): full, it drops the owner keys first under a volatile-* policy (the
        only keys here with a TTL), so running replicas count as dead, their open audits are
        reaped as lost and a replica with other guard flags joins. A server that refuses
        CONFIG (a managed one) is not asked."""
        try:
            policy = self._client.config_get("maxmemory-policy").get("maxmemory-policy")
        except redis.ResponseError:
            return
        if policy not in (None, "noeviction"):
            logger.warning("orca audit: the audit store at %s may evict keys (maxmemory-policy "
                           "%s): set it to noeviction, or a full store drops the replicas' owner "
                           "keys and the fleet's guard flags go unchecked", self.path, policy)

    def _owner_key(self, owner: str) -> str:
        return f"orca:guard-owner:{owner}"

    def _renew(self) -> None:
        self._client.set(self._owner_key(self.owner), "1", px=int(self.owner_ttl * 1000))

    def _beat(self) -> None:
        """Renew the owner key until closed; a failed renewal is logged and retried at the next
        beat (the request path is what notices an unreachable store)."""
        while not self._stop.wait(self.owner_ttl / 3):
            with self._beat_lock:
                if self._stop.is_set():  # closed while this beat waited for the lock
                    return
                try:
                    self._renew()
                except redis.RedisError:
                    pass  # unreachable: the request path says so (fleet.py)
                except Exception:  # noqa: BLE001 - the heartbeat must outlive any one beat
                    logger.warning("orca audit: renewing the owner key %s failed; retrying "
                                   "at the next beat", self._owner_key(self.owner),
                                   exc_info=True)

    def _call(self, event: str) -> list[dict[str, Any]]:
        n, new = self._script(keys=[self._events, self._created_key, self._chain_key],
                              args=[event, self._offset, self.created, self._chain])
        if n < 0:
            raise StoreRolledBack(f"the store's {self._events} no longer holds the events "
                                  f"this process applied ({new} events now, {self._offset} "
                                  "read, or another start marker, or other events before)")
        self._offset = int(n)
        for element in new:
            self._chain = chained(self._chain, element)
        events, skipped = parse_events(new, self.path)
        self.skipped += skipped
        return events

    def join(self, settings: dict[str, Any], fold_format: int) -> None:
        """Record this replica in the fold record under `settings` and `fold_format`, or
        `FoldSettingsDiffer` (module docstring, "Settings"); retried when another replica
        joined meanwhile."""
        with self._client.pipeline() as p:
            while True:
                try:
                    p.watch(self._fold)
                    record = fold_record(self._read_fold(p), self._fold_at, self._others_run)
                    record = joined(record, settings, fold_format, self.owner, self.alive,
                                    self.path, self.owner_ttl)
                    p.multi()
                    p.set(self._fold, json.dumps(record))
                    p.execute()
                    return
                except redis.WatchError:
                    continue

    def _read_fold(self, p: Any) -> bytes | str | None:
        """The fold key's value for `fold_record` (None: none yet), read on the watching
        pipeline `p`. A value of another type (a hash, a list: another program's) is no fold
        record either, so it is named by its type and refused or written anew by the same rule
        (a SET replaces a key of any type). Before, its GET failed (WRONGTYPE, a RedisError),
        taken for an unreachable store: the replica folded alone, apart from the fleet."""
        kind = p.type(self._fold).decode()
        if kind == "none":
            return None
        return p.get(self._fold) if kind == "string" else f"a Redis {kind}"

    def _others_run(self) -> bool:
        """Whether an owner key other than this replica's (`ours`) lives on the store: a process
        that may fold this list (a key does not say which bundle's list its process folds)."""
        own = {self._owner_key(o).encode() for o in self._ours}
        return any(k not in own for k in self._client.scan_iter(match=self._owner_key("*"),
                                                                count=1000))

    def read(self) -> list[dict[str, Any]]:
        return self._call("")

    def append(self, event: dict[str, Any], durable: bool = True) -> list[dict[str, Any]]:
        """Append one event (durable or not is the store's configuration: module docstring)."""
        line = json.dumps(event, separators=(",", ":"))
        before = self._call(line)
        self._chain = chained(self._chain, line.encode())
        return [*before, event]

    def write_snapshot(self, state: dict[str, Any]) -> None:
        self._set_snapshot(keys=[self._snapshot], args=[snapshot_json(
            self.checksum, self.created, self._offset, self._chain, state)])

    def read_snapshot(self) -> dict[str, Any] | None:
        """The snapshot's state when the chain holds its digest at its offset (a chain that
        lags there, elements appended by a process that keeps none: replayed whole)."""
        digests: dict[int, str] = {}

        def digest(at: int) -> str:
            found = self._client.lindex(self._chain_key, at - 1)
            digests[at] = "" if found is None else found.decode()
            return digests[at]

        found = read_snapshot_json(self._client.get(self._snapshot), self.checksum, self.created,
                                   self._client.llen(self._events), digest)
        if found is None:
            return None
        self._offset, state = found
        self._chain = digests[self._offset]
        return state

    def rewind(self) -> None:
        self._offset, self.skipped, self._chain = 0, 0, ""

    def alive(self, owner: str) -> bool:
        return owner == self.owner or bool(self._client.exists(self._owner_key(owner)))

    def close(self) -> None:
        """Stop the heartbeat and give up the owner key (best effort: an unreachable store lets
        it expire), so the others reap what this process left open."""
        with self._beat_lock:  # after a renewal in flight, before any other
            self._stop.set()
            try:
                self._client.delete(self._owner_key(self.owner))
            except redis.RedisError:
                pass
            self._client.close()
        if self._heart.is_alive() and self._heart is not threading.current_thread():
            self._heart.join(timeout=self.owner_ttl)  # not started: closed by a failed open
