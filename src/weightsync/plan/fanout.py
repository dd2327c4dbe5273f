"""Replica fan-out, pure: who forwards to whom when the plan addresses one engine replica.

With several engine replicas in one sync group the trainers send one replica's worth (the plan of
replica 0); every worker forwards what it received, round by round as it arrives, to the worker
of the same position (TP rank, PP stage, EP rank: ``worker = replica * positions + position``) in
the replicas below it. Each position has its own tree over the replicas, rooted at replica 0.

Cost model (docs/design.md, "Replica fan-out"): a tree where each worker forwards to at most ``k``
children (``k = 1``: a chain; replicas numbered breadth first, so replica ``r``'s parent is
``(r - 1) // k``). A position's shard of ``B`` bytes moves in chunks of ``c`` bytes (a round), so
``n = ceil(B / c)`` chunks; a worker with ``j`` children sends each chunk ``j`` times over its one
egress link of ``bandwidth`` bytes/s. The last chunk reaches the deepest replica after

    T(k) = (n - 1) * k_max * c / bandwidth + sum over the hops of its path (latency + j_hop * c / bandwidth)

(the busiest sender sets the pace of the pipeline; the first chunk pays every hop once). ``chain``
minimizes the bytes each link carries (one copy per worker: best when the shard is many chunks),
a tree cuts the hops to ``log_k R`` (best for few, small chunks or a large per-hop latency);
``auto`` takes the ``k`` in ``1 .. R - 1`` with the least ``T`` (ties: the smaller ``k``).

Plain data in, frozen records out; no torch import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, cast

__all__ = ["FAN_OUT_MODES", "FanOut", "FanOutMode", "LinkCost", "PositionTree", "plan_fan_out", "tree_seconds"]

FanOutMode = Literal["auto", "chain", "tree", "off"]
FAN_OUT_MODES: tuple[FanOutMode, ...] = ("auto", "chain", "tree", "off")


@dataclass(frozen=True, kw_only=True)
class LinkCost:
    """What one hop of the fan-out costs."""

    latency_s: float = 20e-6
    """Seconds a chunk pays per hop before its bytes move (post, match, first byte)."""
    bandwidth: float = 50e9
    """Bytes per second of one worker's egress link (IB: ~50 GB/s, NVLink: ~450 GB/s)."""

    def __post_init__(self) -> None:
        if not self.latency_s >= 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s!r}")
        if not self.bandwidth > 0:
            raise ValueError(f"bandwidth must be > 0, got {self.bandwidth!r}")


@dataclass(frozen=True)
class PositionTree:
    """One position's tree over the replicas."""

    degree: int  # most children a replica forwards to (1: a chain)
    parents: tuple[int | None, ...]  # per replica: the replica it receives from (None: replica 0, the trainers)
    seconds: float  # the cost model's time for the last chunk to reach the deepest replica

    @property
    def shape(self) -> str:
        return "chain" if self.degree == 1 else "tree"

    def children(self, replica: int) -> tuple[int, ...]:
        """The replicas ``replica`` forwards to, in order."""
        return tuple(r for r, p in enumerate(self.parents) if p == replica)

    def depth(self) -> int:
        """Hops from replica 0 to the deepest replica."""
        return max((_depth(self.parents, r) for r in range(len(self.parents))), default=0)


@dataclass(frozen=True)
class FanOut:
    """Every position's tree (``trees[position]``) over ``replicas`` replicas."""

    replicas: int
    trees: tuple[PositionTree, ...]

    @property
    def positions(self) -> int:
        return len(self.trees)

    def worker(self, replica: int, position: int) -> int:
        """The worker rank (``replica * positions + position``)."""
        return replica * self.positions + position

    def parent(self, worker: int) -> int | None:
        """The worker ``worker`` receives its pieces from (None: the trainers)."""
        replica, position = divmod(worker, self.positions)
        p = self.trees[position].parents[replica]
        return None if p is None else self.worker(p, position)

    def children(self, worker: int) -> tuple[int, ...]:
        """The workers ``worker`` forwards each round to, in order."""
        replica, position = divmod(worker, self.positions)
        return tuple(self.worker(c, position) for c in self.trees[position].children(replica))

    def forwards(self) -> list[tuple[int, int]]:
        """Every (from worker, to worker) edge, by position then replica."""
        return [(self.worker(p, pos), self.worker(r, pos)) for pos, t in enumerate(self.trees)
                for r, p in enumerate(t.parents) if p is not None]

    def describe(self) -> str:
        """One line both ends agree on (folded into the plan digest)."""
        return ";".join(f"{t.shape}{t.degree}" for t in self.trees) + f"/{self.replicas}"


def _depth(parents: Sequence[int | None], r: int) -> int:
    d = 0
    while (p := parents[r]) is not None:
        r, d = p, d + 1
    return d


def _parents(replicas: int, degree: int) -> tuple[int | None, ...]:
    return (None, *((r - 1) // degree for r in range(1, replicas)))


def tree_seconds(replicas: int, degree: int, shard_bytes: int, chunk_bytes: int, cost: LinkCost) -> float:
    """The cost model's time (module docstring) for a ``degree``-ary tree over ``replicas``."""
    if replicas < 2 or shard_bytes <= 0:
        return 0.0
    parents = _parents(replicas, degree)
    kids = [0] * replicas
    for p in parents[1:]:
        kids[cast(int, p)] += 1  # (every replica but 0 has a parent)
    chunk = min(max(chunk_bytes, 1), shard_bytes)
    n = -(-shard_bytes // chunk)
    r, path = replicas - 1, 0.0  # breadth first: the last replica is a deepest one
    while (p := parents[r]) is not None:
        path += cost.latency_s + kids[p] * chunk / cost.bandwidth
        r = p
    return (n - 1) * max(kids) * chunk / cost.bandwidth + path


def _best(replicas: int, shard_bytes: int, chunk_bytes: int, cost: LinkCost, mode: FanOutMode) -> PositionTree:
    if mode == "chain" or replicas < 3:
        degrees = [1]
    elif mode == "tree":
        degrees = [2]
    else:
        degrees = list(range(1, replicas))
    timed = [(tree_seconds(replicas, k, shard_bytes, chunk_bytes, cost), k) for k in degrees]
    seconds, k = min(timed)
    return PositionTree(k, _parents(replicas, k), seconds)


def plan_fan_out(replicas: int, shard_bytes: Sequence[int], *, chunk_bytes: int, mode: str = "auto",
                 cost: LinkCost | None = None) -> FanOut | None:
    """Each position's tree (``shard_bytes[position]``: the bytes one worker of that position
    receives per sync; ``chunk_bytes``: the most one round carries), or None where there is nothing
    to fan out (``mode="off"`` or one replica). Every party calls it with the same values and gets
    the same trees."""
    if mode not in FAN_OUT_MODES:
        raise ValueError(f"fan_out must be one of {', '.join(FAN_OUT_MODES)}, got {mode!r}")
    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be a positive int, got {replicas!r}")
    if not shard_bytes or any(b < 0 for b in shard_bytes):
        raise ValueError(f"shard_bytes must list each position's bytes (>= 0), got {list(shard_bytes)!r}")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes!r}")
    if mode == "off" or replicas == 1:
        return None
    cost = cost or LinkCost()
    m = cast(FanOutMode, mode)
    return FanOut(replicas, tuple(_best(replicas, b, chunk_bytes, cost, m) for b in shard_bytes))
