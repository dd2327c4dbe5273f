"""Elastic replicas: ``on_engine_failure="drop"`` on the init info (docs/elastic.md).

:class:`ElasticTrainerEngine` keeps one sync group per replica: each is an ordinary trainer engine of
the transport (its own store, data plane and session) for every trainer rank and that replica's
workers, built from ``init_info.for_replica``. So:

* membership changes between syncs (``add_engines`` / ``remove_engines``, collective on every trainer
  rank; rank 0 names the engines, the others follow what it publishes on the membership store, hosted
  by rank 0 on ``master_port``): adding a replica builds its group only (M2N: the plan of its pairs;
  broadcast: a communicator of rank 0 and its workers); the others' groups are not touched;
* a sync runs on every replica's group in turn; one whose sync fails (a worker failed, died, or did
  not answer within ``timeout_s``) raised ``SyncFailed`` on every rank, so every rank drops it alike:
  its update was aborted and its engine is poisoned (its own group's semantics), it leaves the
  membership and ``SyncStats.dropped`` says why; the others complete and advance their version;
* a replica that joins gets the current version dense in its first sync (its group has no delta
  base), while the others take deltas where ``delta=True``.

With fan-out (``init_info.fans_out()``: M2N and NIXL with ``fan_out`` set) the replicas share **one**
group instead (``init_info.for_replicas``), so that the trainers send one replica's worth and every
replica syncs at once. A sync that fails there is settled on every rank alike: rank 0 asks each engine
whether its generation is paused (one call per engine, within a bound); those that do not answer (dead,
or stuck in a call) are dropped (when all answer: the replica of the worker the failure names), the
survivors' workers leave the failed group, a new group over them is built and the same sync runs again
on it, dense (so the replicas behind a dead one are fed from the trainers within that sync). A
membership change rebuilds that group over the new set.

Bad input at add (a duplicate engine, another model, another TP size, an engine bound to another
trainer's live session) is refused on every rank naming ``engines[i]``, and the replicas added by
that call are released again: the running ones are untouched.
"""

from __future__ import annotations

import re
import socket
import time
from dataclasses import fields
from typing import Any

from ..comm import Communicator
from ..control import membership_change, replica_dropped, replicas_paused
from ..errors import Refused, RemoteCallError, SyncFailed
from ..infos import TrainerInitInfo
from ..pausing import not_paused
from ..protocol import WeightSource
from ..stats import DeltaStats, SyncStats
from .session import connect_fresh, leave
from .waits import MARGIN_S, client_result, in_thread, settle

__all__ = ["ElasticTrainerEngine"]

_UNREACHABLE = "could not ask whether every engine's generation is paused"
"""A sync's preflight refusal (``weightsync.pausing``) for an engine that did not answer: dropped too."""


_PROBE_S = 10.0
"""At most how long rank 0 waits for an engine's answer when it settles a failed fanned-out sync."""


class _Member:
    def __init__(self, rid: int, engine: Any, group: Any) -> None:
        self.id, self.engine, self.group = rid, engine, group  # (group: None when fanned out)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _same(a: Any, b: Any) -> bool:
    """Whether two engine handles name the same engine (URLs compared without a trailing slash)."""
    if isinstance(a, str) and isinstance(b, str):
        return a.rstrip("/") == b.rstrip("/")
    return a is b or a == b


def _leave_failed(client: Any) -> None:
    """``client``'s engines leave a failed group: first the update the failed sync left active in vLLM (a
    finish without a version, as the trainer's abort sends, which may still be on its way: a next start
    would find the update active), then the group."""
    try:
        client.finish_weight_update(None)
    except Exception:  # noqa: BLE001,S110 - no update active there (the abort's finish came first)
        pass
    client.shutdown_weight_transfer_engine()


class ElasticTrainerEngine:
    """One sync group per replica (see the module docstring); built by ``TrainerEngine.trainer_init``
    when the init info says ``on_engine_failure="drop"``. ``trainer_init``, ``add_engines``,
    ``remove_engines``, ``send_weights`` and ``shutdown`` run on every trainer rank."""

    def __init__(self, engine_cls: type, init_info: TrainerInitInfo, client: Any, source: WeightSource | None) -> None:
        self.engine_cls, self.init_info, self.client, self.source = engine_cls, init_info, client, source
        self.spec = engine_cls.spec
        self.rank, self.is_sender = init_info.rank, init_info.rank == 0
        self.comm: Communicator | None = None
        self._members: dict[int, _Member] = {}
        self._next_id = self._changes = 0
        self._tp = 0
        self.sync_id = 0
        self._fanned = init_info.fans_out()
        self._group: Any = None  # fanned out: the one group over every replica

    @classmethod
    def trainer_init(cls, engine_cls: type, init_info: TrainerInitInfo, *, client: Any,
                     source: WeightSource | None) -> ElasticTrainerEngine:
        """Host (rank 0) or join the membership store, then add every engine the client drives."""
        i = init_info
        if type(i).replica_workers is TrainerInitInfo.replica_workers:
            i.replica_workers(1)  # a transport without per-replica groups: ValueError on every rank
        engines = list(getattr(client, "engines", None) or ()) if i.rank == 0 else None
        self = cls(engine_cls, i, client, source)

        def connect() -> Communicator:
            return Communicator.connect(i.master_address, i.master_port or 0, name=f"trainer rank {i.rank}",
                                        timeout_s=i.timeout_s, host_store=self.is_sender)

        self.comm = connect() if self.is_sender else connect_fresh(connect, i.rank, i.timeout_s)
        try:
            self.add_engines(engines, _initial=True)
        except BaseException:
            self.shutdown()
            raise
        return self

    # ---- membership ------------------------------------------------------------------
    @property
    def replicas(self) -> dict[int, Any]:
        """Replica id -> its engine (the handle or URL; None on ranks > 0), in sync order."""
        return {rid: m.engine for rid, m in self._members.items()}

    def _agree(self, decide: Any, timeout_s: float | None = None) -> dict[str, Any]:
        """Rank 0 decides the next membership change (``decide()``: a dict, or ``ValueError``) and
        publishes it; every rank returns it (the others wait at most ``timeout_s``, default the store's),
        or raises the same ``ValueError``."""
        if self.comm is None:
            raise RuntimeError("the engine was shut down; call trainer_init again")
        self._changes += 1
        key = membership_change(self._changes)
        if self.is_sender:
            try:
                change = decide()
            except ValueError as e:
                change = {"error": str(e)}
            self.comm.publish(key, change)
            if self._changes > 2:
                self.comm.delete([membership_change(self._changes - 2)])  # every rank read it before the last one
        else:
            change = self.comm.read(key) if timeout_s is None else self.comm.read(key, timeout_s=timeout_s)
        if "error" in change:
            raise ValueError(change["error"])
        return change

    def _engine_list(self, engines: Any) -> list[Any]:
        out = list(engines) if isinstance(engines, (list, tuple)) else [engines]
        if not out:
            raise ValueError("engines must name at least one engine")
        return out

    def _decide_add(self, engines: Any, initial: bool) -> dict[str, Any]:
        if not hasattr(self.client, "for_engines"):
            raise ValueError("client: on_engine_failure='drop' needs a client that can add and remove engines "
                             "(RayVLLMWeightSyncClient, HTTPVLLMWeightSyncClient: for_engines, add_engines, ...)")
        engines = self._engine_list(engines)
        for k, e in enumerate(engines):
            if any(_same(e, other) for other in engines[:k]):
                raise ValueError(f"engines[{k}]: {e!r} is listed twice")
            if (m := next((m for m in self._members.values() if _same(e, m.engine)), None)) is not None:
                raise ValueError(f"engines[{k}]: {e!r} is already replica {m.id} of this trainer")
        self.client.for_engines(engines)  # the client's own checks of each entry, before any rank acts on it
        tp = self.init_info.replica_workers(len(engines)) if initial else self._tp
        ids = list(range(self._next_id, self._next_id + len(engines)))
        host = self.init_info.master_address
        if self._fanned:  # one group over all: its port, and one to regroup the running ones on if refused
            return {"add": [[rid, 0] for rid in ids], "tp": tp, "port": _free_port(host), "again": _free_port(host)}
        return {"add": [[rid, _free_port(host)] for rid in ids], "tp": tp}

    def add_engines(self, engines: Any = None, *, _initial: bool = False) -> list[int]:
        """Add replicas (rank 0: an engine or a list, as the client takes them; ranks > 0: nothing) and
        build their groups only; returns their replica ids. Their first sync is dense. Refused (on every
        rank, naming ``engines[i]``) engines leave nothing behind and the running replicas untouched."""
        listed = engines if self.is_sender else []
        change = self._agree(lambda: self._decide_add(listed, _initial))
        listed = self._engine_list(listed) if self.is_sender else []
        self._tp, added = change["tp"], []
        if self._fanned:
            return self._add_fanned(change, listed, _initial)
        try:
            for k, (rid, port) in enumerate(change["add"]):
                client = self.client.for_engines([listed[k]]) if self.is_sender else None
                try:
                    group = self.engine_cls.trainer_init(self.init_info.for_replica(self._tp, port), client=client,
                                                         source=self.source)
                except ValueError as e:
                    kind = Refused if isinstance(e, Refused) else ValueError
                    raise kind(f"engines[{k}]: refused ({e}); the running replicas are untouched") from e
                added.append(_Member(rid, listed[k] if self.is_sender else None, group))
        except BaseException:
            for m in added:
                m.group.shutdown()
            raise
        self._members.update((m.id, m) for m in added)
        self._next_id += len(change["add"])
        if self.is_sender and not _initial:
            self.client.add_engines([m.engine for m in added])
        return [m.id for m in added]

    def _add_fanned(self, change: dict[str, Any], listed: list[Any], initial: bool) -> list[int]:
        """Fanned out: one group over the running replicas and the added ones. Refused: the running ones
        get a group of their own again (on ``change["again"]``) and every rank raises."""
        added = [_Member(rid, listed[k] if self.is_sender else None, None) for k, (rid, _) in enumerate(change["add"])]
        running = list(self._members.values())
        try:
            self._regroup(running + added, change["port"])
        except ValueError as e:
            if running:
                self._regroup(running, change["again"])
            kind = Refused if isinstance(e, Refused) else ValueError
            raise kind(f"engines: refused ({e}); the running replicas were regrouped without them") from e
        self._members.update((m.id, m) for m in added)
        self._next_id += len(added)
        if self.is_sender and not initial:
            self.client.add_engines([m.engine for m in added])
        return [m.id for m in added]

    def _regroup(self, members: list[_Member], port: int, *, leaving: list[_Member] | None = None) -> None:
        """Fanned out: shut the group down (its workers leave it; ``leaving``: those of ``members`` only,
        without waiting for a stuck call), then build one over ``members`` on ``port``."""
        old, self._group = self._group, None
        if old is not None:
            if leaving is not None and self.is_sender:  # the survivors' workers leave the failed group
                leavers = self.client.for_engines([m.engine for m in leaving])
                settle(in_thread(lambda: _leave_failed(leavers), "weightsync-leave"), self.init_info.timeout_s)
            old.shutdown(drain=leaving is None)
        if not members:
            return
        client = self.client.for_engines([m.engine for m in members]) if self.is_sender else None
        self._group = self.engine_cls.trainer_init(self.init_info.for_replicas(len(members), self._tp, port),
                                                   client=client, source=self.source)

    def _decide_remove(self, engines: list[Any]) -> dict[str, Any]:
        ids = []
        for k, e in enumerate(engines):
            m = next((m for m in self._members.values() if _same(e, m.engine) or (type(e) is int and e == m.id)), None)
            if m is None:
                raise ValueError(f"engines[{k}]: {e!r} is not a replica of this trainer")
            ids.append(m.id)
        return {"remove": ids, **({"port": _free_port(self.init_info.master_address)} if self._fanned else {})}

    def remove_engines(self, engines: Any = None) -> list[int]:
        """Remove replicas (rank 0: engines or replica ids; ranks > 0: nothing): their groups are shut
        down, their workers leave the weight transfer; the others are not touched. Returns their ids."""
        listed = engines if self.is_sender else []
        change = self._agree(lambda: self._decide_remove(self._engine_list(listed)))
        ids = change["remove"]
        if self._fanned:
            gone = [self._members.pop(rid) for rid in ids]
            self._regroup(list(self._members.values()), change["port"])
            for m in gone if self.is_sender else ():
                self._release(m)
            return ids
        for rid in ids:
            m = self._members.pop(rid)
            m.group.shutdown()  # (its workers leave the transfer: ``TrainerEngine.shutdown``)
            if self.is_sender:
                self._release(m)
        return ids

    def _release(self, m: _Member) -> None:
        """Rank 0: the client stops driving ``m``."""
        try:
            self.client.remove_engines([m.engine])
        except ValueError:
            pass

    # ---- syncs -----------------------------------------------------------------------
    def send_weights(self, *, weight_version: str | None = None, verify: bool = False) -> SyncStats:
        """Sync every replica's group in turn; a replica whose sync failed is dropped (see the module
        docstring). ``SyncFailed`` when no replica is left."""
        if not self._members:
            raise RuntimeError("no replicas: every one was dropped or removed; add_engines first")
        self.sync_id += 1
        self._check_paused()
        if self._fanned:
            return self._send_fanned(weight_version, verify)
        done: dict[int, SyncStats] = {}
        dropped: dict[int, str] = {}
        for rid, m in list(self._members.items()):
            try:
                done[rid] = m.group.send_weights(weight_version=weight_version, verify=verify)
            except (SyncFailed, ValueError) as e:
                if isinstance(e, ValueError) and _UNREACHABLE not in str(e):
                    raise  # bad input (the source's, or an unpaused engine): nothing moved on this replica
                dropped[rid] = self._drop(m, str(e))
        if not done:
            raise SyncFailed(f"weight sync {self.sync_id}: every replica was dropped: "
                             + "; ".join(f"replica {r}: {why}" for r, why in dropped.items()), restored=False)
        return merged(done, dropped, self._tp, backend=self.init_info.backend, rank=self.rank,
                      weight_version=weight_version)

    def _send_fanned(self, weight_version: str | None, verify: bool) -> SyncStats:
        """Fanned out: the sync on the one group; after a failure, drop the replicas it was theirs (rank 0
        decides, ``_decide_failed``), regroup the survivors and run it again (see the module docstring)."""
        dropped: dict[int, str] = {}
        while True:
            if self._group is None:  # its rebuild failed (raised then): nothing to sync on
                raise RuntimeError("the replicas' group could not be rebuilt after a failure; add_engines or "
                                   "trainer_init again")
            try:
                stats = self._group.send_weights(weight_version=weight_version, verify=verify)
                return self._replica_stats(stats, dropped)
            except (SyncFailed, ValueError) as e:
                if isinstance(e, ValueError) and _UNREACHABLE not in str(e):
                    raise  # bad input (the source's, or an unpaused engine): nothing moved
                self._drop_failed(e, dropped)

    def _drop_failed(self, error: Exception, dropped: dict[int, str]) -> None:
        """Every rank, after a failed fanned-out sync: drop the replicas rank 0 found failed (into
        ``dropped``) and regroup the others; ``error`` again when it found none (no replica's own
        failure: a trainer rank's, the source's) or none is left."""
        members = list(self._members.values())
        verdict = self._agree(lambda: self._decide_failed(members, str(error)),
                              timeout_s=2 * self.init_info.timeout_s + _PROBE_S + MARGIN_S)
        if not verdict["failed"]:
            raise error
        for rid, why in verdict["failed"].items():
            dropped[int(rid)] = why
            gone = self._members.pop(int(rid))
            if self.is_sender:
                self._release(gone)
        survivors = list(self._members.values())
        self._regroup(survivors, verdict["port"], leaving=survivors)
        if not survivors:
            raise SyncFailed(f"weight sync {self.sync_id}: every replica was dropped: "
                             + "; ".join(f"replica {r}: {why}" for r, why in dropped.items()), restored=False)

    def _decide_failed(self, members: list[_Member], reason: str) -> dict[str, Any]:
        """Rank 0, after a failed fanned-out sync: the replicas it drops (id -> why): those whose engine does
        not say whether its generation is paused within ``_PROBE_S`` (dead, or stuck in a call); when every
        one answers, the replica of the worker the failure names (group worker ``k * tp + tp rank`` is
        ``members[k]``'s). Not the other way round: a worker behind a dead one reports that one's failure."""
        asked = {m.id: in_thread(self.client.for_engines([m.engine]).generation_paused, "weightsync-probe")
                 for m in members}
        deadline = time.monotonic() + min(_PROBE_S, self.init_info.timeout_s)
        failed: dict[int, str] = {}
        for rid, fut in asked.items():
            try:
                client_result(fut, max(0.0, deadline - time.monotonic()), "generation_paused")
            except Exception as e:  # noqa: BLE001 - any failure to answer is this engine's
                failed[rid] = f"{reason} (replica {rid}: {type(e).__name__}: {e})"
        if not failed and (named := re.search(r"\bworker (\d+)\b", reason)) is not None:
            k = int(named.group(1)) // self._tp
            if k < len(members):
                failed.setdefault(members[k].id, reason)
        port = _free_port(self.init_info.master_address)
        return {"failed": {str(rid): why for rid, why in failed.items()}, "port": port}

    def _replica_stats(self, stats: SyncStats, dropped: dict[int, str]) -> SyncStats:
        """The fanned-out group's stats with its workers (``k * tp + tp rank``: ``k``-th replica) under the
        replicas' ids (``replica * tp + tp rank``), the replicas it completed on and those dropped."""
        ids, tp = list(self._members), self._tp

        def worker(w: int) -> int:
            return ids[w // tp] * tp + w % tp

        for f in fields(stats):
            if f.name.endswith("_per_worker") or f.name == "worker_phases":
                setattr(stats, f.name, {worker(w): v for w, v in getattr(stats, f.name).items()})
        if stats.delta is not None:
            stats.delta.workers = [worker(w) for w in stats.delta.workers]
        stats.replicas, stats.dropped = sorted(ids), dict(dropped)
        return stats

    def _check_paused(self) -> None:
        """Every rank: ``Refused`` (the same on every rank, before any replica's sync) when some replica's
        generation is not paused, naming each that serves and counting every replica: rank 0 asks the
        client of all of them once (within half of ``timeout_s``). One that does not answer is left to its
        group's own preflight, which drops it."""
        if not self.init_info.require_paused:
            return
        key = replicas_paused(self.sync_id)
        if self.is_sender:
            refused = None
            try:
                states = client_result(in_thread(self.client.generation_paused, "weightsync-paused"),
                                       self.init_info.timeout_s / 2, "generation_paused")
                refused = not_paused(states)
            except (AttributeError, RemoteCallError, TimeoutError):  # the groups' preflights say it, per replica
                pass
            self.comm.publish(key, "" if refused is None else str(refused))
            if self.sync_id > 2:
                self.comm.delete([replicas_paused(self.sync_id - 2)])
            message = "" if refused is None else str(refused)
        else:
            message = self.comm.read(key)
        if message:
            raise Refused(message)

    def _drop(self, m: _Member, reason: str) -> str:
        """Every rank: leave ``m``'s group. Rank 0 may still be settling its failure (the update call, the
        abort: up to ``timeout_s`` more), so the other ranks wait until it says it is done (and why)."""
        self._members.pop(m.id)
        m.group.shutdown(drain=False)  # (a stuck worker's call is not waited for)
        key = replica_dropped(self.sync_id, m.id)
        if self.is_sender:
            self._release(m)
            self.comm.publish(key, reason)
            return reason
        return self.comm.read(key, timeout_s=2 * self.init_info.timeout_s + MARGIN_S)

    def shutdown(self) -> None:
        """Shut every replica's group down, then the membership store. Call on every trainer rank."""
        for m in list(self._members.values()):
            if m.group is not None:
                m.group.shutdown()
        if self._group is not None:
            self._group.shutdown()
            self._group = None
        self._members.clear()
        if self.comm is not None:
            if not self.is_sender:
                leave(self.comm, self.rank)
            self.comm.shutdown()
        self.comm = None


def merged(per: dict[int, SyncStats], dropped: dict[int, str], tp: int, **head: Any) -> SyncStats:
    """One ``SyncStats`` for a sync of several replicas' groups: bytes and phases summed (the groups
    ran in turn), per-worker fields under worker ``replica * tp + tp rank``."""
    out = SyncStats(**head, replicas=sorted(per), dropped=dict(dropped))

    def remap(rid: int, d: dict[int, Any]) -> dict[int, Any]:
        return {rid * tp + w: v for w, v in d.items()}

    deltas = []
    for rid, s in per.items():
        out.bytes_sent += s.bytes_sent
        out.bytes_received_per_worker.update(remap(rid, s.bytes_received_per_worker))
        out.lower_bound_per_worker.update(remap(rid, s.lower_bound_per_worker))
        out.worker_phases.update(remap(rid, s.worker_phases))
        out.num_tensors, out.num_steps = s.num_tensors, out.num_steps + s.num_steps
        for k, v in s.phases.items():
            out.phases[k] = out.phases.get(k, 0.0) + v
        out.verified = s.verified
        if s.delta is not None:
            deltas.append((rid, s.delta))
    if deltas:
        out.delta = DeltaStats(base=next((d.base for _, d in deltas if d.base is not None), None),
                               workers=sorted(rid * tp + w for rid, d in deltas for w in d.workers))
        for _, d in deltas:
            out.delta.changed += d.changed
            out.delta.compared += d.compared
            out.delta.dense_bytes += d.dense_bytes
            out.delta.diff_seconds += d.diff_seconds
            out.delta.baseline_bytes += d.baseline_bytes
    return out

