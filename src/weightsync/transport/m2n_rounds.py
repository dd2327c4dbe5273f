"""The M2N round executor: moves this rank's messages, round by round, between its own tensors and
the data plane, through spans of one staging buffer where a message's bytes are not ready in place.
:func:`run_rounds` is the entry point; :class:`~.packing.Staging` hands out the spans, :class:`_Sender` and
:class:`_Receiver` are the two ends of the same schedule (:class:`_Executor`)."""

from __future__ import annotations

import enum
import gc
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..comm import Communicator
from ..layout.regions import box_slices
from ..layout.schedule import Message
from ..protocol import dtype_from_name
from .delta import decode, patch, sparse_nbytes
from .m2n_fast import FastRounds, compile_rounds
from .m2n_views import ItemViews, TensorOf, item_view, itemsize_of_message, numels
from .packing import ByteRuns, Spans, Staging, fold_checksum, fold_value  # Staging: re-exported

__all__ = ["DEPTH", "SlotKind", "Staging", "run_rounds"]

DEPTH = 8
"""Staged rounds a rank keeps posted at once (they share the staging buffer, each its own span)."""

class SlotKind(enum.Enum):
    """Where a message's bytes are on this rank while the data plane moves them."""

    DIRECT = "direct"  # this rank's own tensor (the shard / the parameter): no copy
    SPARSE = "sparse"  # a delta: the sender's ready payload, the receiver's slot in staging
    STAGED = "staged"  # a span of staging, packed from / applied to the tensors item by item


@dataclass(slots=True)
class Posted:
    """A round's messages (or its early part) with their buffers, their ops' works and its span; a
    compiled part has no messages (``rnd`` None), its byte count and, at a receiver, its copies."""

    rnd: Any
    bufs: list[torch.Tensor]
    kinds: Any
    works: list[Any]
    span: tuple[int, int] = (0, 0)  # staging bytes [start, end) it holds; empty for an early part
    moved: int = 0
    copies: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None


class _Executor(ItemViews):
    """One end of the rounds (see :func:`run_rounds`): what both ends do alike. A subclass says who
    its peer is, what a sparse slot is, which slots need no staging, how it posts, what it does to a
    round before posting it (:meth:`_prepare`) and once it was waited for (:meth:`_finish`)."""

    sender: bool

    def __init__(self, comm: Communicator, staging: torch.Tensor, *, peer_rank: Callable[[int], int],
                 dtypes: Mapping[str, str], tensor_of: TensorOf, sums: dict[int, int] | None,
                 sparse: Mapping[tuple[int, int], Any] | None, ready: Callable[[], Any] | None,
                 spans: Spans | None = None) -> None:
        self.comm, self.peer_rank, self.dtypes, self.tensor_of = comm, peer_rank, dtypes, tensor_of
        self.spans = Spans() if spans is None else spans  # kept across syncs by the caller's rounds
        self.sums, self.sparse, self.ready = sums, sparse or {}, ready
        self.staging = Staging(staging)
        self.runs = ByteRuns()  # this sync's tensors' bytes, flat: an item is one view of them
        self.wire: dict[str, torch.dtype] = {}  # tensor name -> its wire dtype
        self.memo: dict[int, Any] = {}  # an item key -> its tensor and flat bytes, this sync (ItemViews._tensors)
        self.whole_rounds = getattr(comm, "ordered", False)
        self.folded: dict[tuple[int, int], int] = {}  # (peer, message index) -> that message's checksum
        self.moved = 0
        self.held: list[tuple[list[Any], list[Any]]] | None = None if ready is None else []  # ops, works
        self.in_flight: deque[Posted] = deque()  # staged rounds, oldest first
        self.early: list[Posted] = []  # messages in this rank's own memory, waited for at the end

    def peer(self, m: Message) -> int:
        raise NotImplementedError

    def _sparse_slot(self, m: Message, sp: Any) -> torch.Tensor | int:
        raise NotImplementedError

    def _own(self, kind: SlotKind) -> bool:
        raise NotImplementedError

    def _post_ops(self, ops: list[Any]) -> list[Any]:
        raise NotImplementedError

    def _prepare(self, posted: Posted) -> None:
        """Before ``posted`` is posted (its buffers placed)."""

    def _finish(self, posted: Posted) -> None:
        """After ``posted`` was waited for."""

    def _drain_order(self) -> list[Posted]:
        raise NotImplementedError

    def key(self, m: Message) -> tuple[int, int]:
        return (self.peer(m), m.index)

    def run(self, plan_rounds: Iterable[list[Message]]) -> int:
        for rnd in plan_rounds:
            self._round(rnd)
        self._release()
        for posted in self._drain_order():
            self._complete(posted)
        if self.sums is not None:
            for (peer, _), value in sorted(self.folded.items()):
                self.sums[peer] = fold_value(self.sums.get(peer, 0), value)
        return self.moved

    def run_fast(self, fast: FastRounds, views: list[torch.Tensor]) -> int:
        """:meth:`run` of compiled rounds (``m2n_fast``): the same ops, order and spans, from lists."""
        staging, in_flight = self.staging, self.in_flight
        for early, staged in fast.rounds:
            if early is not None:
                bufs = [views[v] for v in early.vids]
                self.early.append(self._post(Posted(None, bufs, None, [], moved=early.moved),
                                             list(zip(bufs, early.ranks, early.index))))
            if staged is None:
                continue
            need = staged.need
            while need and (start := staging.spot(need, (p.span for p in in_flight))) is None:
                self._complete(in_flight.popleft())
            bufs, mine, theirs, reps = staged.cut(staging.buf, start if need else 0, views)
            copies = None
            if self.sender:
                torch._foreach_copy_(theirs, mine)
                if reps[0]:
                    torch._foreach_copy_(reps[1], reps[0])
            elif mine:
                copies = (mine, theirs)
            posted = Posted(None, bufs, None, [], (start, start + need) if need else (0, 0), staged.moved, copies)
            in_flight.append(self._post(posted, list(zip(bufs, staged.ranks, staged.index))))
            if len(in_flight) == DEPTH:
                self._complete(in_flight.popleft())
        self._release()
        for posted in self._drain_order():
            self._complete(posted)
        return self.moved

    def _round(self, rnd: list[Message]) -> None:
        """Post one round: what needs no staging early (all of it, or on an ordered plane only a round
        with no staged message), the rest in a span of staging, waiting for the oldest rounds first
        while there is no room or ``DEPTH`` staged rounds are posted."""
        slots, kinds = self._slots(rnd)
        own = [self._own(kind) for kind in kinds]
        if all(own) or (any(own) and not self.whole_rounds):
            e_rnd, e_bufs, e_kinds = ([x[i] for i, o in enumerate(own) if o] for x in (rnd, slots, kinds))
            self.early.append(self._post(Posted(e_rnd, e_bufs, e_kinds, [])))
            if all(own):
                return
            rnd, slots, kinds = ([x[i] for i, o in enumerate(own) if not o] for x in (rnd, slots, kinds))
        need = self.staging.need(slots)
        start = 0
        while need and (start := self.staging.spot(need, (p.span for p in self.in_flight))) is None:
            self._complete(self.in_flight.popleft())  # the oldest round frees its span first
        bufs = self.staging.place(slots, start, need)
        self.in_flight.append(self._post(Posted(rnd, bufs, kinds, [], (start, start + need))))
        if len(self.in_flight) == DEPTH:
            self._complete(self.in_flight.popleft())

    def _slots(self, rnd: list[Message]) -> tuple[list[torch.Tensor | int], list[SlotKind]]:
        """The round's buffers and their kinds; a slot still to place in staging is its byte count."""
        bufs: list[torch.Tensor | int] = []
        kinds = []
        for m in rnd:
            if (sp := self.sparse.get(self.key(m))) is not None:
                kinds.append(SlotKind.SPARSE)
                bufs.append(self._sparse_slot(m, sp))
            elif (view := self._direct(m)) is not None:
                kinds.append(SlotKind.DIRECT)
                bufs.append(view)
            else:
                kinds.append(SlotKind.STAGED)
                bufs.append(m.nbytes)
        return bufs, kinds

    def _post(self, posted: Posted, ops: list[Any] | None = None) -> Posted:
        """Prepare and post ``posted``'s ops (a compiled part's: ``ops``); with ``ready`` still to
        call, hold them back instead (its works are filled in by :meth:`_release`)."""
        if ops is None:
            self._prepare(posted)
            ops = [(buf, self.peer_rank(self.peer(m)), m.index) for m, buf in zip(posted.rnd, posted.bufs)]
        if self.held is not None:
            self.held.append((ops, posted.works))
        else:
            posted.works = self._post_ops(ops)
        return posted

    def _release(self) -> None:
        """Once: call ``ready()``, then post every op held back, in order."""
        if self.held is not None:
            self.ready()
            for ops, works in self.held:
                works.extend(self._post_ops(ops))
            self.held = None

    def _complete(self, posted: Posted) -> None:
        self._release()
        self.comm.wait_all(posted.works[::-1], "M2N round")  # the last posted first: the others are done by then
        if posted.rnd is None:  # a compiled part: at a receiver, its staged items' copies
            self.moved += posted.moved
            if posted.copies is not None:
                torch._foreach_copy_(*posted.copies)
            return
        self.moved += sum(b.numel() for b in posted.bufs)  # what the data plane filled, padding included
        self._finish(posted)

    def _fold(self, m: Message, views: Iterable[torch.Tensor]) -> None:
        acc = 0
        for view in views:
            acc = fold_checksum(acc, view)
        self.folded[self.key(m)] = acc


class _Sender(_Executor):
    """Packs each staged item's region of its shard into the span and posts while the earlier
    rounds are on the wire; direct messages and sparse payloads go from where they are."""

    sender = True

    def peer(self, m: Message) -> int:
        return m.dst

    def _sparse_slot(self, m: Message, sp: Any) -> torch.Tensor | int:
        return sp

    def _own(self, kind: SlotKind) -> bool:
        return kind is not SlotKind.STAGED

    def _post_ops(self, ops: list[Any]) -> list[Any]:
        return self.comm.post(ops, [])

    def _drain_order(self) -> list[Posted]:
        return [*reversed(self.in_flight), *reversed(self.early)]  # the earlier ones are done by then

    def _prepare(self, posted: Posted) -> None:
        for m, buf, kind in zip(posted.rnd, posted.bufs, posted.kinds):
            if kind is SlotKind.STAGED or self.sums is not None:  # else: the shard's own bytes / a ready payload
                self._pack(m, buf, kind)

    def _pack(self, m: Message, buf: torch.Tensor, kind: SlotKind) -> None:
        """Copy a staged message's items into ``buf`` (one grouped copy); with ``sums``, fold what it sends."""
        tensor_of, dtypes = self.tensor_of, self.dtypes
        if kind is SlotKind.STAGED and self.sums is None:
            srcs, dsts = self._pairs(m, buf)
            torch._foreach_copy_(dsts, srcs)
            return
        views = []
        for i, (item, off) in enumerate(zip(m.items, m.offsets)):
            if kind is SlotKind.SPARSE:  # the checksum is of the values the payload makes
                src = tensor_of(m, i)[box_slices(item.src_offsets, item.region.sizes)]
                wire = dtype_from_name(dtypes[item.name])
                views.append(src if src.dtype == wire else src.to(wire))
                continue
            view = item_view(buf, off, item, dtypes)
            if kind is SlotKind.STAGED:
                view.copy_(tensor_of(m, i)[box_slices(item.src_offsets, item.region.sizes)])
            views.append(view)
        if self.sums is not None:
            self._fold(m, views)


class _Receiver(_Executor):
    """When a staged round completes, copies each item into its target region (dtype cast if
    needed) while the later rounds arrive; direct messages arrive in place."""

    sender = False

    def peer(self, m: Message) -> int:
        return m.src

    def _sparse_slot(self, m: Message, sp: Any) -> torch.Tensor | int:
        return sparse_nbytes(numels(m), sp, itemsize_of_message(m, self.dtypes), [it.name for it in m.items])

    def _own(self, kind: SlotKind) -> bool:
        return kind is SlotKind.DIRECT

    def _post_ops(self, ops: list[Any]) -> list[Any]:
        return self.comm.post([], ops)

    def _drain_order(self) -> list[Posted]:
        return [*self.in_flight, *reversed(self.early)]  # staged rounds applied in order

    def _finish(self, posted: Posted) -> None:
        for m, buf, kind in zip(posted.rnd, posted.bufs, posted.kinds):
            if kind is not SlotKind.DIRECT or self.sums is not None:  # else: it arrived in place
                self._apply(m, buf, kind)

    def _apply(self, m: Message, buf: torch.Tensor, kind: SlotKind) -> None:
        """Copy (or patch) a received message's items into their targets; with ``sums``, fold what
        was applied (in the wire dtype)."""
        tensor_of, dtypes = self.tensor_of, self.dtypes
        if kind is SlotKind.STAGED and self.sums is None:
            targets, received = self._pairs(m, buf)
            torch._foreach_copy_(targets, received)
            return
        patches = None
        if kind is SlotKind.SPARSE:
            patches = decode(buf, numels(m), self.sparse[self.key(m)], itemsize_of_message(m, dtypes),
                             [it.name for it in m.items])
        views = []
        for i, (item, off) in enumerate(zip(m.items, m.offsets)):
            target = tensor_of(m, i)[box_slices(item.param_offsets, item.region.sizes)]
            if patches is not None:
                patch(target, *patches[i])
                received = target
            else:
                received = item_view(buf, off, item, dtypes)
                if kind is SlotKind.STAGED:
                    target.copy_(received)
            views.append(target if target.dtype == received.dtype else received)  # in the wire dtype
        if self.sums is not None:  # what was applied
            self._fold(m, views)


def run_rounds(comm: Communicator, plan_rounds: Iterable[list[Message]], staging: torch.Tensor, *, sender: bool,
               peer_rank: Callable[[int], int], dtypes: Mapping[str, str], tensor_of: TensorOf,
               sums: dict[int, int] | None = None, sparse: Mapping[tuple[int, int], Any] | None = None,
               ready: Callable[[], Any] | None = None) -> int:
    """Execute rounds; returns payload bytes moved.

    A message whose bytes are ready in this rank's own memory needs no staging: one item contiguous
    in this rank's tensor in the wire dtype (``_direct``: sent from the shard, received into the
    parameter) or a sender's sparse payload. Those are posted as their round comes, without waiting
    for anything, and waited for once every round is posted, the last posted first (this rank
    sleeps about once for all of them, not once a round). On a data plane whose point-to-point ops
    run in issue order (``comm.ordered``: NCCL, one stream) a round is posted whole, so only rounds
    with no staged message go early. The other messages of a round go through one span of
    ``staging``, just the bytes they need, at the lowest offset no posted staged round holds (when
    there is none, the oldest are waited for until there is; low bytes are reused first, so only as
    much of the buffer is touched as the rounds in flight stage at once), up to ``DEPTH`` staged
    rounds posted at once. Sender: copy each staged item's region of its local shard (``tensor_of``
    gives the shard) into the span and post while the earlier rounds are on the wire. Receiver: when
    a staged round completes, copy each item into its target region (``tensor_of`` gives the
    parameter or fallback buffer; dtype cast if needed) while the later rounds arrive. ``tensor_of``
    must pick an item's tensor by the item's tensor name or param name only: for rounds kept as
    arrays it is asked once per sync and (name, param), not once per item.
    No deadlock: a rank posts round k's ops only after those of rounds < k, and waits only for
    posted staged rounds in order (or, once everything is posted, for the rest in any order). Take
    the lowest round with a blocked op: its peer has not posted the counterpart, so that peer is
    blocked on a lower round.
    With ``sums``, fold per peer what moved, message by message in index order on both ends: the
    sender what it sent, the receiver what it applied (for a sparse message: the whole region, as it
    is after the patch). ``sparse`` (delta sync, keyed by (peer, message index)): the sender's sparse
    payloads, the receiver's counts of changed values; those messages go as
    :mod:`~weightsync.transport.delta` encodes them, in their dense slot's place.
    With ``ready``, nothing is posted before ``ready()`` returned; the rounds go on as without it
    (packed, their ops held back) until one would have to be waited for, or they end: a sender
    packs that much of its staging while ``ready()`` is still to be called (the engines start).
    A dense sync (no ``sums``, no ``sparse``) over rounds kept as arrays (``m2n_exec.Rounds``) is
    compiled for the next ones, which run from lists while every tensor keeps its layout
    (:mod:`.m2n_fast`): the same ops in the same order and the same bytes."""
    end = _Sender if sender else _Receiver
    paused = gc.isenabled()  # a sync's views are freed by their counts: no cyclic GC pass over the plan's objects
    gc.disable()
    try:
        ex = end(comm, staging, peer_rank=peer_rank, dtypes=dtypes, tensor_of=tensor_of, sums=sums,
                 sparse=sparse, ready=ready, spans=getattr(plan_rounds, "spans", None))
        dense = sums is None and not sparse and hasattr(plan_rounds, "fast")
        fast = plan_rounds.fast if dense else None
        if fast is not None:
            views = fast.views(tensor_of, ex.runs, peer_rank, ex.whole_rounds, ex.staging.room,
                               staging.storage_offset())
            if views is not None:
                return ex.run_fast(fast, views)
        moved = ex.run(plan_rounds)
        if dense:  # compiled from what this sync found, for the next ones
            plan_rounds.fast = compile_rounds(ex, plan_rounds, peer_rank)
        return moved
    finally:
        if paused:
            gc.enable()
