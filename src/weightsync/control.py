"""The control contract between trainer ranks and workers: every store key, and agreement.

Every key a transport, worker engine, agreement or trainer engine reads or writes on the group's
store is spelled here (``tests/test_control_contract.py`` fails on a key spelled anywhere else):

* init keys, one set per ``trainer_init``: the data plane's join (:func:`join_key`, :data:`JOIN_DECISION`,
  used by :mod:`weightsync.comm`), :data:`INIT_DONE`, :func:`init_ack`, the trainer ranks'
  metadata (:func:`model_metas`, :func:`model_digest`), M2N's handshake (:func:`m2n_sources`,
  :func:`m2n_sources_digest`, :func:`m2n_dest`, :func:`m2n_plan_digest`), the broadcast's
  :func:`nccl_loader`;
* per-sync keys, :class:`SyncKeys`: ``SyncKeys(sync_id).recv(worker)`` and the rest. Trainer rank 0
  deletes a sync's keys once its outcome is acknowledged (:meth:`SyncKeys.outcome_keys`), except the
  workers' ``held`` keys, which the next sync's delta decision reads (they go one sync later).

:func:`agree` is the one way parties check that they agree on a value (a digest, a metadata
listing): every party raises the same ``ValueError`` naming both values, before any data moves.
:func:`gather` is the exchange under it (every party's value, e.g. each trainer rank's preflight).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class Channel(Protocol):
    """What agreement needs of a :class:`~weightsync.comm.Communicator` (which imports this module)."""

    def publish(self, key: str, value: Any) -> None: ...

    def read(self, key: str, timeout_s: float | None = None) -> Any: ...

    def read_all(self, keys: list[str], timeout_s: float | None = None) -> list[Any]: ...

__all__ = ["JOIN_DECISION", "join_key", "INIT_DONE", "announced", "trainer_left", "SyncKeys", "Listing", "agree",
           "gather", "init_ack", "model_metas", "model_digest", "m2n_sources", "m2n_sources_digest", "m2n_dest",
           "m2n_plan_digest", "nccl_loader", "membership_change", "replicas_paused",
           "replica_dropped"]

# ---- init keys ----------------------------------------------------------------------------
def join_key(rank: int) -> str:
    """Data-plane rank ``rank`` announced itself (``Communicator.join``)."""
    return f"join/{rank}"


JOIN_DECISION = "join/decision"
"""Whether the data plane's members build the group or raise: set once, by the first to decide."""
INIT_DONE = "init/done"
"""Trainer rank 0: every worker initialized (the other ranks wait for it)."""


def announced(call: str) -> str:
    """Trainer rank 0 announces each ``start``, ``finish`` and ``abort`` it sends the engines here
    (``{"session", "sync_id"}``): vLLM's start and finish carry no session, so a worker checks the call
    against its bound session's announcement (``WorkerEngine.fence_call``)."""
    return f"calls/{call}"


def trainer_left(rank: int) -> str:
    """Trainer rank ``rank`` > 0 shut its engine down: a store that has this key is a previous init's that
    rank 0 has not closed yet (``trainer.session.connect_fresh``); never set for rank 0."""
    return f"init/left/{rank}"


def membership_change(n: int) -> str:
    """Trainer rank 0's ``n``-th membership change (``on_engine_failure="drop"``: the replicas added or
    removed and their groups' ports, or the error every rank raises), on the membership store."""
    return f"members/{n}"


def replicas_paused(sync: int) -> str:
    """Trainer rank 0's answer before its ``sync``-th sync of every replica: the refusal every rank raises
    when some replica's generation is not paused, or ``""`` (on the membership store)."""
    return f"members/sync{sync}/paused"


def replica_dropped(sync: int, replica: int) -> str:
    """Trainer rank 0 dropped ``replica`` in its ``sync``-th sync and is done with its group (the reason)."""
    return f"members/sync{sync}/dropped/{replica}"


def init_ack(rank: int) -> str:
    """Trainer rank ``rank`` > 0 read a failed init's outcome (rank 0, the store's host, waits for it)."""
    return f"init/ack/{rank}"


def model_metas(rank: int) -> str:
    """A trainer rank's metadata listing (rank 0's always: the workers check their model against it)."""
    return f"model/metas/{rank}"


def model_digest(rank: int) -> str:
    return f"model/digest/{rank}"


def m2n_sources(rank: int) -> str:
    """A trainer rank's M2N sources (rank 0's always: every worker plans from it)."""
    return f"m2n/sources/{rank}"


def m2n_sources_digest(rank: int) -> str:
    return f"m2n/sources-digest/{rank}"


def m2n_dest(worker: int) -> str:
    """Worker ``worker``'s resolved destinations (or its error), read by every party to plan."""
    return f"m2n/dest/{worker}"


def m2n_plan_digest(rank: int) -> str:
    """Data-plane rank ``rank``'s plan digest (trainer ranks and workers)."""
    return f"m2n/digest/{rank}"


def nccl_loader(worker: int) -> str:
    """The tensors worker ``worker`` takes only through vLLM's loader (broadcast delta syncs send them dense)."""
    return f"nccl/loader/{worker}"


# ---- per-sync keys -----------------------------------------------------------------------
class SyncKeys:
    """The keys of one sync, ``sync<id>/...``."""

    __slots__ = ("sync_id", "_p")

    def __init__(self, sync_id: int) -> None:
        self.sync_id = sync_id
        self._p = f"sync{sync_id}"

    @property
    def started(self) -> str:
        """Rank 0: the engines accepted the update (the other ranks move no data before it)."""
        return f"{self._p}/started"

    @property
    def verdict(self) -> str:
        """Rank 0: the sync's outcome (set as failed by ``fail_keys`` on any failure)."""
        return f"{self._p}/verdict"

    @property
    def delta(self) -> str:
        """Rank 0's delta decision (M2N: base and holders; broadcast: the sparse entries)."""
        return f"{self._p}/delta"

    @property
    def sum(self) -> str:
        """The broadcast's checksum of every bucket sent (``verify``)."""
        return f"{self._p}/sum"

    def preflight(self, rank: int) -> str:
        return f"{self._p}/preflight/{rank}"

    def sent(self, rank: int) -> str:
        """Trainer rank ``rank`` > 0 finished its part of the transfer."""
        return f"{self._p}/sent/{rank}"

    def ack(self, rank: int) -> str:
        """Trainer rank ``rank`` > 0 read the outcome."""
        return f"{self._p}/ack/{rank}"

    def sizes(self, rank: int) -> str:
        """M2N delta: changed values of each of trainer rank ``rank``'s messages, per worker."""
        return f"{self._p}/sizes/{rank}"

    def sums(self, rank: int) -> str:
        """M2N ``verify``: trainer rank ``rank``'s checksum per worker."""
        return f"{self._p}/sums/{rank}"

    def chunk(self, chunk: int, rank: int) -> str:
        """IPC: trainer rank ``rank``'s handles of chunk ``chunk``."""
        return f"{self._p}/chunk/{chunk}/{rank}"

    def applied(self, chunk: int) -> str:
        """IPC: every worker took chunk ``chunk`` (the buffers may be refilled)."""
        return f"{self._p}/applied/{chunk}"

    def recv(self, worker: int) -> str:
        """The bytes ``worker`` received, once it applied the update."""
        return f"{self._p}/recv/{worker}"

    def phases(self, worker: int) -> str:
        return f"{self._p}/phases/{worker}"

    def drafter(self, worker: int) -> str:
        """Bytes of the drafter's parameters ``worker``'s sync wrote (an engine with a synced drafter)."""
        return f"{self._p}/drafter/{worker}"

    def finishing(self, worker: int) -> str:
        """``worker`` reached its finish (its engine's workers commit only once all of them did)."""
        return f"{self._p}/finishing/{worker}"

    def held(self, worker: int) -> str:
        """``worker`` holds this sync complete (None: no longer)."""
        return f"{self._p}/held/{worker}"

    def outcome_keys(self, ranks: int, workers: int, chunks: int = 0) -> list[str]:
        """Every key this sync may have set but ``held``: once every rank read the outcome, nothing
        reads them again."""
        per_rank = [k(r) for r in range(ranks) for k in (self.preflight, self.sent, self.ack, self.sizes, self.sums)]
        per_worker = [k(w) for w in range(workers) for k in (self.recv, self.phases, self.drafter, self.finishing)]
        chunked = ([self.chunk(b, r) for b in range(chunks) for r in range(ranks)]
                   + [self.applied(b) for b in range(chunks)])
        return [self.started, self.verdict, self.delta, self.sum, *per_rank, *per_worker, *chunked]


# ---- agreement ----------------------------------------------------------------------------
def gather(comm: Channel, key: Callable[[int], str], value: Any, *, rank: int, ranks: int) -> list[Any]:
    """Publish this party's ``value`` under ``key(rank)`` and read every other party's (in rank order), all
    in one wait (``read_all``: a look at the store is one request however many ranks)."""
    if ranks == 1:
        return [value]
    comm.publish(key(rank), value)
    others = iter(comm.read_all([key(r) for r in range(ranks) if r != rank]))
    return [value if r == rank else next(others) for r in range(ranks)]


@dataclass(frozen=True)
class Listing:
    """The list a digest stands for, to name the first entry that differs: rank 0 always publishes
    it under ``key(0)`` (others may read it); any other rank only when its digest differs."""

    key: Callable[[int], str]
    items: Sequence[Any]
    name_of: Callable[[Any], str]
    show: Callable[[Any], str] = str


def agree(comm: Channel, key: Callable[[int], str], value: Any, *, rank: int, ranks: int, what: str,
          who: str = "rank", listing: Listing | None = None) -> Any:
    """Every party (``rank`` of ``ranks``) checks that all hold the same ``value``; on a difference
    every party raises the same ``ValueError``: the first rank differing from rank 0 and both values,
    or, with a ``listing``, the first entry of the lists that differs (a missing or extra entry, or
    both sides' values). Returns the agreed value."""
    if listing is not None and rank == 0:
        comm.publish(listing.key(0), list(listing.items))
    if listing is not None and rank > 0 and ranks > 1 and comm.read(key(0)) != value:
        comm.publish(listing.key(rank), list(listing.items))  # before this rank's value: read once that is seen
    values = gather(comm, key, value, rank=rank, ranks=ranks)
    r = next((r for r, v in enumerate(values) if v != values[0]), None)
    if r is None:
        return value
    if listing is None:
        raise ValueError(f"{what} differs between {who}s: {who} 0 has {values[0]!r}, {who} {r} has {values[r]!r}")
    first, theirs = ((listing.items if k == rank else comm.read(listing.key(k))) for k in (0, r))
    raise ValueError(_first_difference(listing, first, theirs, f"{who} {r}", f"{who} 0", what))


def _first_difference(listing: Listing, first: Sequence[Any], theirs: Sequence[Any], them: str, zero: str,
                      what: str) -> str:
    i = next((k for k, (a, b) in enumerate(zip(first, theirs)) if a != b), min(len(first), len(theirs)))
    a, b = (x[i] if i < len(x) else None for x in (first, theirs))
    names = {side: {listing.name_of(x): x for x in side_items} for side, side_items in (("0", first), ("r", theirs))}
    if a is not None and listing.name_of(a) not in names["r"]:
        name, mine, other = listing.name_of(a), listing.show(a), "nothing"
    elif b is not None and listing.name_of(b) not in names["0"]:
        name, mine, other = listing.name_of(b), "nothing", listing.show(b)
    else:
        name = listing.name_of(a if a is not None else b)
        mine, other = listing.show(names["0"][name]), listing.show(names["r"][name])
        if mine == other:  # same entry at another position
            mine = f"{mine} at position {list(names['0']).index(name)}"
            other = f"{other} at position {list(names['r']).index(name)}"
    return (f"parameter {name!r}: {them}'s {what} differs from {zero}'s at position {i}: "
            f"{zero} has {mine}, {them} has {other}")
