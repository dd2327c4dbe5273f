"""The M2N transfer plan: which trainer rank sends which piece of which tensor to which worker.

Inputs are plain data: one :class:`TensorSource` per HF tensor (the region each trainer rank
holds) and, per worker, the :class:`DestPiece` list of where regions of HF tensors land in its
vLLM parameters. :func:`build_plan` intersects them into a :class:`TransferPlan` of
:class:`TransferItem` s. Call order on every rank of a sync group::

    plan = build_plan(sources, destinations)   # same inputs everywhere -> same plan
    agree on plan.digest over the control plane   # before any data moves
    trainer rank r: plan.items_for_src(r); worker d: plan.items_for_dst(d)

At model scale (a 1T-parameter MoE exported as per-expert 2-D tensors) those listings are millions
of objects and hundreds of MB per rank. :meth:`TransferPlan.pairs` gives a rank's side compact
instead (:class:`PairItems`): for each peer, the signatures whose tensors it exchanges with this rank
and the planned copies of one tensor of that signature (shared by every tensor that has it). The
items between one (trainer, worker) pair come out of :meth:`PairItems.items` in *pair order*:
signatures in plan order, then their tensors in sources order, then the copies of each in plan
order; both ends of a pair see the same sequence, and the M2N executor cuts it into messages.

Pure: no torch import; the plan is built from compact per-layout templates
(:mod:`weightsync.layout.plan_compact`) so model-scale plans take seconds, not hours.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

from weightsync.layout.plan_compact import Compact, compact_plan
from weightsync.layout.plan_template import RecvProto, SendProto
from weightsync.layout.records import (
    DestPiece,
    PlanCoverage,
    TensorSource,
    TransferItem,
    dtype_itemsize,
    new_item,
)
from weightsync.layout.schedule import ALONE, PEERS, Message, iter_rounds, peer_group, peer_groups, peer_messages
from weightsync.layout.schedule_compact import CompactRounds, cut_rounds

__all__ = [
    "DestPiece",
    "PairItems",
    "PlanCoverage",
    "TensorSource",
    "TransferItem",
    "TransferPlan",
    "build_plan",
    "dtype_itemsize",
]


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while millions of acyclic items are allocated (its passes would rescan them)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class TransferPlan:
    """A deterministic M2N plan; build it with :func:`build_plan`, read it on any rank.

    All item listings follow one global order: tensors in ``sources`` order, then worker
    rank, then the worker's piece order for that tensor, then the piece's overlaps by offset.
    So the items between one (trainer, worker) pair come in the same sequence from
    :meth:`items_for_src` and :meth:`items_for_dst`: both sides post point-to-point ops in it.
    """

    def __init__(self, compact: Compact, itemsize_of: Callable[[str], int]) -> None:
        self._c = compact
        self._itemsize_of = itemsize_of
        self._members: tuple[tuple[int, ...], ...] | None = None

    @property
    def digest(self) -> str:
        """Hex sha256 of the canonical inputs; equal on ranks with equal inputs, else different."""
        return self._c.digest

    @property
    def num_src_ranks(self) -> int:
        """Number of trainer ranks."""
        return self._c.num_src

    @property
    def num_dst_ranks(self) -> int:
        """Number of workers."""
        return self._c.num_dst

    @property
    def num_tensors(self) -> int:
        """Number of HF tensors in the sources."""
        return len(self._c.names)

    @property
    def num_signatures(self) -> int:
        """Number of distinct layouts, each planned once."""
        return len(self._c.templates)

    @property
    def num_items(self) -> int:
        """Total number of items over all ranks."""
        c = self._c
        return sum(t.count * n for t, n in zip(c.templates, c.sig_tensors))

    def __repr__(self) -> str:
        return (
            f"TransferPlan(tensors={self.num_tensors}, src_ranks={self.num_src_ranks}, "
            f"dst_ranks={self.num_dst_ranks}, items={self.num_items}, digest={self.digest[:12]})"
        )

    def _check(self, rank: int, n: int, what: str) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < n:
            raise ValueError(f"{what} must be an int in [0, {n}), got {rank!r}")

    def items_for_src(self, rank: int) -> list[TransferItem]:
        """Everything trainer ``rank`` sends, in the global order."""
        self._check(rank, self.num_src_ranks, "rank")
        c = self._c
        wc = c.worker_class
        memo: dict[int, tuple[SendProto, ...]] = {}
        out: list[TransferItem] = []
        with _gc_paused():
            for name, sig, params in zip(c.names, c.tensor_sig, c.params):
                protos = memo.get(sig)
                if protos is None:
                    protos = memo[sig] = c.templates[sig].protos_for_src(rank, wc)
                if protos:
                    out += [new_item(rank, dst, name, region, src_offsets, params[piece], param_offsets)
                            for dst, region, src_offsets, piece, param_offsets in protos]
        return out

    def items_for_dst(self, rank: int) -> list[TransferItem]:
        """Everything worker ``rank`` receives, in the global order."""
        self._check(rank, self.num_dst_ranks, "rank")
        c = self._c
        wc = c.worker_class
        memo: dict[int, list[RecvProto]] = {}
        out: list[TransferItem] = []
        with _gc_paused():
            for name, sig, params in zip(c.names, c.tensor_sig, c.params):
                protos = memo.get(sig)
                if protos is None:
                    protos = memo[sig] = c.templates[sig].protos_for_dst(rank, wc)
                if protos:
                    out += [new_item(src, rank, name, region, src_offsets, params[piece], param_offsets)
                            for src, region, src_offsets, piece, param_offsets in protos]
        return out

    def pairs(self, rank: int, *, sender: bool) -> PairItems:
        """Trainer ``rank``'s (``sender``) or worker ``rank``'s items per peer, compact: what the
        M2N executor cuts into messages, without listing every item (see :class:`PairItems`)."""
        self._check(rank, self.num_src_ranks if sender else self.num_dst_ranks, "rank")
        if self._members is None:
            members: list[list[int]] = [[] for _ in self._c.templates]
            for t, sig in enumerate(self._c.tensor_sig):
                members[sig].append(t)
            self._members = tuple(map(tuple, members))
        return PairItems(self._c, self._members, rank, sender=sender)

    def iter_items(self) -> Iterator[TransferItem]:
        """Every item of the plan, in the global order (lazy; model-scale plans are huge)."""
        c = self._c
        wc = c.worker_class
        for name, sig, params in zip(c.names, c.tensor_sig, c.params):
            tpl = c.templates[sig]
            for w in range(c.num_dst):
                for src, region, src_offsets, piece, param_offsets in tpl.protos_for_dst(w, wc):
                    yield new_item(src, w, name, region, src_offsets, params[piece], param_offsets)

    def coverage(self, itemsize_of: Callable[[str], int] | None = None) -> PlanCoverage:
        """Bytes received per worker, sent per trainer rank, and asked for per worker."""
        size_of = itemsize_of or self._itemsize_of
        c = self._c
        recv = [0] * c.num_dst
        send = [0] * c.num_src
        want = [0] * c.num_dst
        for tpl, n, dtype, numels in zip(c.templates, c.sig_tensors, c.sig_dtype, c.sig_dst_numel):
            scale = n * size_of(dtype)
            for w, choice in enumerate(tpl.choices):
                want[w] += numels[w] * scale
                for r, p in zip(choice, tpl.protos[c.worker_class[w]]):
                    recv[w] += p.numel * scale
                    send[r] += p.numel * scale
        return PlanCoverage(tuple(recv), tuple(send), tuple(want))

    def bytes_per_dst(self, itemsize_of: Callable[[str], int] | None = None) -> tuple[int, ...]:
        """Bytes each worker receives."""
        return self.coverage(itemsize_of).recv_bytes


class PairItems:
    """What one rank sends to (``sender``) or receives from each peer; build it with
    :meth:`TransferPlan.pairs`. Holds O(peers x signatures) entries, not one per item."""

    def __init__(self, compact: Compact, members: Sequence[tuple[int, ...]], rank: int, *, sender: bool) -> None:
        self._c, self._members, self.rank, self.sender = compact, members, rank, sender
        runs: dict[int, list[tuple[int, tuple[Any, ...]]]] = {}
        wc = compact.worker_class
        for sig, tpl in enumerate(compact.templates):
            protos = tpl.protos_for_src(rank, wc) if sender else tpl.protos_for_dst(rank, wc)
            by_peer: dict[int, list[Any]] = {}
            for p in protos:  # SendProto.dst / RecvProto.src first: the peer
                by_peer.setdefault(p[0], []).append(p)
            for peer, ps in by_peer.items():
                runs.setdefault(peer, []).append((sig, tuple(ps)))
        self._runs = {peer: tuple(runs[peer]) for peer in sorted(runs)}

    @property
    def peers(self) -> tuple[int, ...]:
        """The peers this rank exchanges anything with, ascending."""
        return tuple(self._runs)

    def count(self, peer: int | None = None) -> int:
        """Number of items with ``peer`` (all peers when None)."""
        peers = self._runs if peer is None else (peer,)
        return sum(len(self._members[sig]) * len(ps) for p in peers for sig, ps in self._runs.get(p, ()))

    def nbytes(self, itemsize_of: Callable[[str], int]) -> int:
        """Bytes of all items (``itemsize_of`` maps a dtype name to bytes per element)."""
        dtypes = self._c.sig_dtype
        return sum(len(self._members[sig]) * sum(p.region.numel for p in ps) * itemsize_of(dtypes[sig])
                   for runs in self._runs.values() for sig, ps in runs)

    def items(self, peer: int) -> Iterator[TransferItem]:
        """The items with ``peer``, in pair order (made as they are consumed)."""
        names, params = self._c.names, self._c.params
        src, dst = (self.rank, peer) if self.sender else (peer, self.rank)
        for sig, protos in self._runs.get(peer, ()):
            for t in self._members[sig]:
                name, pn = names[t], params[t]
                for p in protos:
                    yield new_item(src, dst, name, p.region, p.src_offsets, pn[p.piece], p.param_offsets)

    def rounds(self, *, cap: int, itemsize_of: Callable[[str], int],
               apart: Callable[[TransferItem], bool] | None = None,
               alone: int = ALONE, peers: int = PEERS) -> Iterator[list[Message]]:
        """This rank's rounds: every peer's items cut by :func:`~weightsync.layout.schedule.peer_messages`
        (``itemsize_of`` maps a tensor name to bytes per element; ``apart``, ``alone`` as there), made as
        they are consumed; at most ``peers`` peers a round (the peers' groups one after another:
        :func:`~weightsync.layout.schedule.peer_groups`)."""
        groups = peer_groups(self._c.num_src, self._c.num_dst, peers)
        n = self._c.num_src
        group = None if groups == 1 else (lambda p: peer_group(*((self.rank, p) if self.sender else (p, self.rank)),
                                                                groups, n))
        return iter_rounds({p: peer_messages(partial(self.items, p), cap=cap, itemsize_of=itemsize_of, apart=apart,
                                             alone=alone) for p in self.peers}, group)

    def compact_rounds(self, *, cap: int, itemsize_of: Callable[[str], int],
                       apart: Callable[[TransferItem], bool] | None = None,
                       alone: int = ALONE, peers: int = PEERS) -> CompactRounds:
        """:meth:`rounds`, the same messages in the same order, cut once into numeric arrays
        (:mod:`~weightsync.layout.schedule_compact`): no object per item, whatever the item count."""
        c, members = self._c, self._members
        sizes = [itemsize_of(c.names[m[0]]) if m else 1 for m in members]
        return cut_rounds(rank=self.rank, sender=self.sender, num_src=c.num_src, num_dst=c.num_dst, names=c.names,
                          params=c.params, members=members, runs=self._runs, sig_itemsize=sizes, cap=cap,
                          alone=alone, peers=peers, apart=apart)


def build_plan(
    sources: Sequence[TensorSource],
    destinations: Sequence[Sequence[DestPiece]],
    *,
    itemsize_of: Callable[[str], int] | None = None,
) -> TransferPlan:
    """Plan every byte every worker asks for; call with equal inputs on every rank, then agree on the digest.

    ``destinations[w]`` lists worker w's pieces. Every byte of every piece becomes exactly one
    item. A piece held by several trainer ranks (equal source regions) goes to the holder that
    sends the fewest bytes so far, ties to the lowest rank (as torch DCP's ``dedup_save_plans``).
    Tensors sharing a layout (shape, dtype, source regions, per-worker destination regions and
    param offsets; names aside) are planned once, in order of first appearance, their bytes
    counted once per tensor. The order of pieces of *different* tensors in a worker's list does
    not matter. Equal destination lists are recognized by identity first: pass one list object
    for workers with identical layouts (e.g. one TP rank in several replicas) at model scale.

    Raises ValueError (naming the tensor, worker or trainer rank and both values) for an unknown
    tensor name, a piece whose ndim or bounds do not fit the tensor, a piece not covered by the
    source regions, source regions that overlap without being equal, or disagreeing rank counts.
    ``itemsize_of`` maps a dtype name to bytes per element (default :func:`dtype_itemsize`).
    """
    size_of = itemsize_of or dtype_itemsize
    return TransferPlan(compact_plan(sources, destinations, size_of), size_of)
