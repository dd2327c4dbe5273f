"""The sync group's control channel (a TCPStore), and the data plane each party joins through it.

Trainer rank 0 hosts the store; every party (trainer ranks, vLLM workers) connects with
:meth:`Communicator.connect`. The store carries small JSON values only (agreement, verdicts, byte
counts, checksums, the first failure: ``fail`` wakes every waiting party), never weights. Waits
poll with a backoff (``read``; ``read_all``: one request per look for many keys); the keys every
failure path sets (``fail_keys``) are awaited with one blocking request (``await_key``).

Parties that move data then :meth:`~Communicator.join` the data plane (``comm.plane``, a
:class:`~weightsync.dataplane.DataPlane`: today :class:`~weightsync.dataplane.torch_group.TorchGroupPlane`,
gloo on CPU and NCCL on CUDA, whose rendezvous goes through the same store object). The store's host
listens on ``master_address`` only; with a shared secret every key name and value is sealed
(:mod:`weightsync.sealed`, docs/security.md). A failure recorded here drops the plane, which releases
the peers blocked on this party.
"""

from __future__ import annotations

import errno
import json
import time
import traceback
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .control import JOIN_DECISION, join_key
from .dataplane import DataPlane, PlaneFactory
from .dataplane.torch_group import TorchGroupPlane
from .errors import DataPlaneError, SyncAborted
from .sealed import ForgedValueError, open_store

__all__ = ["Communicator", "DataPlaneError", "SyncAborted", "describe"]

_ERROR = "error"
_FAILED = "failed"  # what a failing party sets on the keys others block on (``fail_keys``)
_OK = "ok"
_ABSENT = "\x00"
"""Never a published value (those are JSON): ``compare_set(key, _ABSENT, _ABSENT)`` answers it for a
key not set, and sets nothing (a non-empty expected value is never written to a missing key)."""
_STORE_POLL_S = 0.005  # the longest pause between two looks at the store while waiting for a key
_FIRST_POLL_S = 5e-5  # the first: a key set moments later is seen within ~0.1 ms, not 5 ms


def _pauses() -> Iterator[float]:
    """Pauses between looks at the store: from ``_FIRST_POLL_S``, doubling up to ``_STORE_POLL_S``."""
    pause = _FIRST_POLL_S
    while True:
        yield pause
        pause = min(2 * pause, _STORE_POLL_S)


_HOSTED: weakref.WeakValueDictionary[int, Communicator] = weakref.WeakValueDictionary()
"""Port -> this process's store host on it: a failed one (its engine never shut down) is released
when a new group is hosted on its port."""


def _named(keys: list[str]) -> str:  # how a wait names its keys in errors
    return repr(keys[0]) if len(keys) == 1 else f"{keys[0]!r} (and {len(keys) - 1} more)"


def describe(error: BaseException) -> str:
    """``"TypeName: message"``: how failures are reported to the other parties."""
    return f"{type(error).__name__}: {error}"


def _get_if_set(store: Any, key: str) -> bytes | None:
    """``key``'s raw value, or None when it is not set: one store request (``check`` + ``get`` are two)."""
    raw = store.compare_set(key, _ABSENT, _ABSENT)
    return None if raw == _ABSENT.encode() else raw


def _parsed(key: str, raw: bytes) -> Any:
    """``raw``'s JSON value; ``DataPlaneError`` naming ``key`` when it is not JSON or nested too deep."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        kind = "nested too deep" if isinstance(e, RecursionError) else f"not JSON ({str(e)[:120]})"
        raise DataPlaneError(f"the value under store key {key!r} is {kind}: {len(raw)} bytes, "
                             "not one a party of the group published") from None


class Communicator:
    """One party's view of a sync group: the control channel, and the data plane once joined. Every
    method that moves data must be called by the matching peers (collective rule)."""

    def __init__(self, store: Any, *, name: str, timeout_s: float, secret: Any = None, group: str = "") -> None:
        self.store = store
        self._secret = secret
        self.group: str = getattr(store, "group_id", b"").hex() or group
        """The sealed group's id (hex; "" for a store without a secret): a client given it refuses another."""
        self.failed = False  # set by ``fail``: a hosted store may then be released (``connect``)
        self.name = name
        """Who this party is, in messages (``trainer rank 1``, ``worker 3``)."""
        self.timeout_s = timeout_s
        self.rank: int | None = None
        """Rank in the data plane (None until ``join``)."""
        self.world_size = 0
        self.device = torch.device("cpu")
        self.plane: DataPlane | None = None
        """The data plane, once joined (None before, and after a failure dropped it)."""

    @classmethod
    def connect(cls, host: str, port: int, *, name: str, timeout_s: float = 300.0, host_store: bool = False,
                secret: Any = None, group: str = "", hosted: bool = False) -> Communicator:
        """The control channel of the group at ``host:port``; ``host_store`` hosts it, listening on
        ``host`` only (port 0: any free port). ``secret`` (default ``$WEIGHTSYNC_STORE_SECRET``) seals
        the store: every party must have the same one; ``group`` (hex, a client's): the group id the
        host drew (:attr:`group`), learnt from a trusted channel, else taken from the store. A failed
        group of this process on ``port`` is released. ``hosted``: the store was hosted before this party
        was asked to connect (a worker's init), so a refused connection raises ``StoreClosed`` at once."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not host_store:
            return cls(open_store(host, port, timeout_s, is_master=False, secret=secret, group=group, hosted=hosted),
                       name=name, timeout_s=timeout_s, secret=secret, group=group)
        if (old := _HOSTED.get(port)) is not None and old.failed:
            old, _ = None, old.shutdown()  # the store's server closes its socket with its last reference
        try:
            store = open_store(host, port, timeout_s, is_master=True, secret=secret)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            live = " by a live sync group of this process: shut its engine down first" if old and old.store else ""
            raise OSError(e.errno, f"master_port {port} on {host!r} is in use{live}") from None
        comm = cls(store, name=name, timeout_s=timeout_s, secret=secret)
        _HOSTED[comm.port] = comm
        return comm

    def second_channel(self) -> Communicator:
        """Another connection to this group's store (no data plane), for a thread that must reach the
        store while this party blocks in ``await_keys``: a store client serves one request at a time."""
        return Communicator.connect(self.store.host, self.store.port, name=self.name, timeout_s=self.timeout_s,
                                    secret=self._secret, group=self.group)

    @property
    def data(self) -> DataPlane:
        """The data plane joined; ``DataPlaneError`` when a failure dropped it (or before ``join``)."""
        if self.plane is None:
            raise DataPlaneError(f"{self.name}: the data plane was dropped after a failure (re-initialize)")
        return self.plane

    @property
    def port(self) -> int:
        """The store's port (the one picked, for a host started on port 0)."""
        return int(self.store.port)

    @staticmethod
    def report(host: str, port: int, message: str, timeout_s: float = 10.0, secret: Any = None) -> None:
        """Tell every party of the group at ``host:port`` that this one failed (it never connected)."""
        open_store(host, port, timeout_s, is_master=False, secret=secret, hosted=True).compare_set(_ERROR, "", message)

    def join(self, rank: int, world_size: int, *, device: torch.device | str = "cpu",
             group_name: str = "weightsync", plane: PlaneFactory = TorchGroupPlane) -> None:
        """Join the data plane ``plane`` (default: a torch group, gloo on CPU, NCCL on CUDA) as ``rank``
        of ``world_size``. Every member first announces itself; a failure any party reports meanwhile
        raises at once."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.publish(join_key(rank), self.name)
        self._agree_to_join(world_size)
        self.plane = plane(self.store, rank, world_size, device=self.device, name=self.name,
                           timeout_s=self.timeout_s, peer_error=self.peer_error, group_name=group_name)
        self.plane.barrier()  # everyone joined before any data moves

    def _agree_to_join(self, world_size: int) -> None:
        """Every member of the data plane takes the same decision: build the group, or raise. The first member
        to decide sets it for all (``compare_set``): "ok" once it saw every member announced, "failed" when a
        failure was reported (or the time ran out) before. Without it, a member that saw a failure while a peer's
        announcement was still missing left, while the others waited out ``timeout_s`` building the group with it."""
        seen: DataPlaneError | None = None
        try:
            self.read_all([join_key(r) for r in range(world_size)])
        except DataPlaneError as e:
            seen = e
        try:
            decision = self.store.compare_set(JOIN_DECISION, "", _FAILED if seen else _OK).decode()
        except Exception as e:  # noqa: BLE001 - the store's host is gone
            raise self._unreachable(_named([JOIN_DECISION]), e) from None
        if decision != _OK:
            raise seen or DataPlaneError(f"a party failed while {self.name} joined the data plane: "
                                         f"{self.peer_error() or 'unknown'}")

    # ---- control channel (store) -------------------------------------------------------
    def publish(self, key: str, value: Any) -> None:
        """Put a JSON-safe value under ``key`` for every party to read."""
        self.store.set(key, json.dumps(value))

    def fail(self, message: str, error: BaseException | None = None) -> None:
        """Record this party's failure for everyone (the first report wins) and drop the data plane:
        parties waiting on the store or blocked on this one raise at once. Call on any failure, with
        the ``error`` being handled: its traceback's frames are cleared first, since a pending work
        they hold keeps gloo's connections open (only freeing the group and its works closes them)."""
        if error is not None:
            traceback.clear_frames(error.__traceback__)
        self.failed = True
        self.record(message)
        self.abort()

    def record(self, message: str) -> None:
        """Record this party's failure on the store only (the first report wins): every party
        waiting on the store raises it. Safe from any thread."""
        if self.store is not None:
            try:
                self.store.compare_set(_ERROR, "", f"{self.name}: {message}")
            except Exception:  # noqa: BLE001 - the store's host may be gone already
                pass

    def abort(self) -> None:
        """Drop the data plane now (NCCL: abort the communicator)."""
        plane, self.plane = self.plane, None
        if plane is not None:
            plane.abort()

    def peer_error(self) -> str | None:
        """The first failure reported on this group, if any (never blocks)."""
        store = self.store
        if store is None:
            return None
        try:
            raw = _get_if_set(store, _ERROR)
            return None if raw is None else raw.decode()
        except ForgedValueError as e:  # garbage under the failure key's sealed name: not a party's report
            return str(e)
        except Exception as e:  # noqa: BLE001 - the store's host (trainer rank 0) is gone
            return f"the sync group's store is unreachable ({str(e).splitlines()[0][:200]})"

    def read(self, key: str, timeout_s: float | None = None) -> Any:
        """Wait (up to the timeout) for ``key``'s JSON value; ``DataPlaneError`` at once when a party failed."""
        return self.read_all([key], timeout_s)[0]

    def read_all(self, keys: list[str], timeout_s: float | None = None) -> list[Any]:
        """``read`` for several keys: their values, once every one is set. A look at the store costs
        one request however many keys (``check``, then one ``multi_get``), and one for the failure key."""
        deadline = time.monotonic() + (limit := timeout_s or self.timeout_s)
        for pause in _pauses():
            try:
                if len(keys) == 1 and (raw := _get_if_set(self.store, keys[0])) is not None:
                    return [_parsed(keys[0], raw)]
                if len(keys) > 1 and self.store.check(keys):
                    return [_parsed(k, raw) for k, raw in zip(keys, self.store.multi_get(keys))]
            except DataPlaneError:  # (ForgedValueError, a value that is not JSON)
                raise
            except Exception as e:  # noqa: BLE001 - the store's host is gone
                raise self._unreachable(_named(keys), e) from None
            if (err := self.peer_error()) is not None:
                raise DataPlaneError(f"a party failed: {err}")
            if time.monotonic() > deadline:  # (named: the keys still not set)
                raise self._timed_out(_named([k for k in keys if not self.store.check([k])] or keys), limit)
            time.sleep(pause)

    def await_key(self, key: str) -> Any:
        """``read`` for a key that every failure path sets too (``fail_keys``): a blocking wait on the
        store, woken the moment the key is set (no polling: one request, however many ranks wait).
        ``DataPlaneError`` when the key says a party failed, the store's host is gone, or on timeout."""
        return self.await_keys([key])[0]

    def await_keys(self, keys: list[str]) -> list[Any]:
        """``await_key`` for several keys at once: their values, once every one is set."""
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout_s))
            raws = self.store.multi_get(keys)
        except ForgedValueError:
            raise
        except Exception as e:  # noqa: BLE001 - timed out, or the store's host (trainer rank 0) is gone
            what = _named(keys)
            if isinstance(e, dist.DistStoreError) and "timeout" in str(e):
                raise self._timed_out(what, self.timeout_s) from None
            raise self._unreachable(what, e) from None
        if _FAILED.encode() in raws:
            raise DataPlaneError(f"a party failed: {self.peer_error() or 'unknown'}")
        return [_parsed(k, raw) for k, raw in zip(keys, raws)]

    def _timed_out(self, what: str, limit: float) -> DataPlaneError:
        return DataPlaneError(f"timed out after {limit}s on {self.name} waiting for {what}")

    def _unreachable(self, what: str, error: BaseException) -> DataPlaneError:
        return DataPlaneError(f"{self.name}: the sync group's store is unreachable while waiting for {what} "
                              f"({str(error).splitlines()[0][:200]})")

    def fail_keys(self, keys: list[str]) -> None:
        """Set each of ``keys`` that is not set yet to the failure mark, waking the parties blocked
        on it in ``await_key`` (a value already set stays)."""
        for key in keys:
            try:
                self.store.compare_set(key, "", _FAILED)
            except Exception:  # noqa: BLE001 - the store's host may be gone already
                return

    def wait_for(self, keys: list[str], timeout_s: float) -> bool:
        """Wait until every key is set, ignoring reported failures (e.g. a store host that lingers
        until its peers have read a failure); False when the time ran out or the store is gone."""
        deadline = time.monotonic() + timeout_s
        pauses = _pauses()
        try:
            while not self.store.check(keys):
                if time.monotonic() > deadline:
                    return False
                time.sleep(next(pauses))
        except Exception:  # noqa: BLE001 - the store is gone: nothing left to wait for
            return False
        return True

    def delete(self, keys: list[str]) -> None:
        """Delete ``keys`` from the store (one not set is skipped): keys no party reads any more."""
        for key in keys:
            self.store.delete_key(key)

    def peek(self, key: str) -> Any | None:
        """The JSON value under ``key`` if set, else None (never blocks)."""
        return None if (raw := _get_if_set(self.store, key)) is None else _parsed(key, raw)

    def shutdown(self) -> None:
        """Drop the data plane and the store. Safe to call twice."""
        self.abort()
        self.store = None
