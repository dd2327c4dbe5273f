"""The reshard executor: moves this rank's messages, round by round, between its own tensors and the
data plane, through spans of one staging buffer where a message's bytes are not ready in place.

:func:`run_rounds` is the entry point; :class:`~.packing.Staging` hands out the spans, :class:`_Sender`
and :class:`_Receiver` are the two ends of the same schedule (:class:`_Executor`).

Item views. A staged message is copied as two lists of views (this rank's tensors' side, the staging
span's side) in one grouped copy; a one-item message that is one run of its tensor goes from / into
it directly. Where each item's bytes are is found on the first sync and kept (:class:`~.packing.Spans`).
An item's tensor comes from the caller's ``tensor_of(m, i)``, asked once per sync for each distinct
(tensor name, param) key when the message's items say theirs without being made
(:class:`~weightsync.plan.schedule.LazyItems`), so a sync makes no item object for a message whose
spans are known.

The compiled path. After a dense sync (no checksums, no delta) over rounds kept as arrays,
:func:`compile_rounds` turns what that sync found (each message direct or staged, each staged item's
bytes in its tensor and in the message: :class:`~.packing.Spans`) into per-round parts: the ops'
peers and tags, the byte ranges of every view the round needs (deduplicated, adjacent items merged
into one copy) and the split of its staging span. A later dense sync asks ``tensor_of`` once per
tensor (not per item), checks that every tensor has the layout it had (shape, byte strides, dtype)
and that ``peer_rank`` gives the same ranks, cuts all views at once and posts each round from lists,
with one grouped copy per staged round; if anything differs it runs the general path (which compiles
anew). Decisions are the general path's own, so the ops, their order and the bytes are the same
(``tests/test_m2n_fast.py``); a sender's staged messages that are equal within a round (the same
items for each engine replica) are packed once and sent from one span, so it stages and copies less.
Nothing holding a tensor is kept across syncs.
"""

from __future__ import annotations

import enum
import gc
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Generic, Protocol, TypeVar, cast

import numpy as np
import numpy.typing as npt
import torch

from ..dataplane import DataPlane, Op, Work
from ..plan.regions import box_slices
from ..plan.schedule import ALIGN, PEERS, CompactRounds, Message
from ..plan.transfer import TransferItem, align_up
from ..protocol import dtype_from_name
from .delta import decode, patch, sparse_nbytes
from .packing import ByteRuns, Flat, Layout, Spans, Staging, fold_checksum, fold_value  # Staging: re-exported

__all__ = ["DEPTH", "FAST_ITEMS", "FastRounds", "ItemKey", "ItemsOf", "Relay", "SlotKind", "Sparse", "Staging",
           "TensorOf",
           "compile_rounds", "item_view", "itemsize_of_message", "numels", "run_rounds"]


class ItemKey(Protocol):
    """What ``tensor_of`` may read of an item: its tensor name and its param."""

    @property
    def name(self) -> str: ...

    @property
    def param(self) -> str: ...


class ItemsOf(Protocol):
    """What ``tensor_of`` may read of a message: its items' :class:`ItemKey` (a :class:`Message`, or
    the stand-in a compiled sync asks with)."""

    @property
    def items(self) -> Sequence[ItemKey]: ...


TensorOf = Callable[[ItemsOf, int], torch.Tensor]
"""``tensor_of(m, i)``: item ``i``'s tensor, picked by its tensor name or param only (see :func:`run_rounds`)."""

Sparse = Mapping[tuple[int, int], torch.Tensor] | Mapping[tuple[int, int], int]
"""A delta sync's sparse messages by (peer, message index): the sender's payloads, the receiver's
counts of changed values (:mod:`~weightsync.reshard.delta`)."""

_SparseT = TypeVar("_SparseT", torch.Tensor, int)  # an end's sparse slot: a payload (sender), a count (receiver)
_Memo = tuple[torch.Tensor, Flat]  # an item key's tensor and its flat bytes, this sync
_Shape = tuple[tuple[int, ...], tuple[int, ...], int]  # a strided view's (shape, strides, element width)
_Row = tuple[int, int, int, int]  # a view: (tensor slot, start, end, strided shape id or -1)
_Group = tuple[int, int, list[int], list[int] | None]  # a tensor's split: (slot, start, sizes, picks or None)
_Copy = tuple[int, int, int, int, int, int]  # a staged item: (slot, start, end, shape id, offset in span, bytes)
_Msg = tuple[int, int, int, int, list[_Copy] | None]  # (peer, index, nbytes, direct view id or -1, items)


class _Kept(Protocol):
    """Rounds kept across syncs (``handshake.Rounds``), as far as the executor compiles them."""

    fast: FastRounds | None

DEPTH = 8
"""Staged rounds a rank keeps posted at once (they share the staging buffer, each its own span)."""

@dataclass(frozen=True)
class Relay:
    """A worker's part in the replica fan-out (:mod:`weightsync.plan.fanout`): it receives the rounds
    of its position's plan from the trainers (replica 0) or from its parent worker, and forwards each
    message, once its round arrived, to each of ``children`` (data-plane ranks) as it received it
    (dense, sparse or fp8 bytes alike). Over one (parent, child) pair the messages of every trainer
    rank travel, so their tags say the trainer rank too (:meth:`tag`)."""

    children: tuple[int, ...]  # data-plane ranks this worker forwards every message to, in order
    from_parent: bool  # its messages come from a worker (tags by :meth:`tag`), not from the trainers
    trainers: int  # trainer ranks (the plan's sources)

    def tag(self, m: Message) -> int:
        """A message's tag over a (parent, child) pair: unique per (trainer rank, message index)."""
        return m.src + self.trainers * m.index


class SlotKind(enum.Enum):
    """Where a message's bytes are on this rank while the data plane moves them."""

    DIRECT = "direct"  # this rank's own tensor (the shard / the parameter): no copy
    SPARSE = "sparse"  # a delta: the sender's ready payload, the receiver's slot in staging
    STAGED = "staged"  # a span of staging, packed from / applied to the tensors item by item


@dataclass(slots=True)
class Posted:
    """A round's messages (or its early part) with their buffers, their ops' works and its span; a
    compiled part has no messages (``rnd`` None), its byte count and, at a receiver, its copies."""

    rnd: list[Message] | None
    bufs: list[torch.Tensor]
    kinds: list[SlotKind] | None
    works: list[Work]
    span: tuple[int, int] = (0, 0)  # staging bytes [start, end) it holds; empty for an early part
    moved: int = 0
    copies: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None


class _Executor(Generic[_SparseT]):
    """One end of the rounds (see :func:`run_rounds`): what both ends do alike. A subclass says who
    its peer is, what a sparse slot is, which slots need no staging, how it posts, what it does to a
    round before posting it (:meth:`_prepare`) and once it was waited for (:meth:`_finish`)."""

    sender: bool
    sparse: Mapping[tuple[int, int], _SparseT]

    def __init__(self, plane: DataPlane, staging: torch.Tensor, *, peer_rank: Callable[[int], int],
                 dtypes: Mapping[str, str], tensor_of: TensorOf, sums: dict[int, int] | None,
                 sparse: Mapping[tuple[int, int], torch.Tensor | int] | None, ready: Callable[[], object] | None,
                 spans: Spans | None = None, relay: Relay | None = None) -> None:
        self.plane, self.peer_rank, self.dtypes, self.tensor_of = plane, peer_rank, dtypes, tensor_of
        self.relay = relay
        self.forwarding = relay is not None and bool(relay.children)
        self.spans = Spans() if spans is None else spans  # kept across syncs by the caller's rounds
        # (a sender's sparse slots are payloads, a receiver's counts: run_rounds' caller says which)
        self.sums, self.sparse, self.ready = sums, cast("Mapping[tuple[int, int], _SparseT]", sparse or {}), ready
        self.staging = Staging(staging)
        self.runs = ByteRuns()  # this sync's tensors' bytes, flat: an item is one view of them
        self.wire: dict[str, torch.dtype] = {}  # tensor name -> its wire dtype
        self.memo: dict[int, _Memo] = {}  # an item key -> its tensor and flat bytes, this sync (_tensors)
        self.whole_rounds = plane.ordered
        self.folded: dict[tuple[int, int], int] = {}  # (peer, message index) -> that message's checksum
        self.moved = 0
        self.held: list[tuple[list[Op], list[Work]]] | None = None if ready is None else []  # ops, works
        self.in_flight: deque[Posted] = deque()  # staged rounds, oldest first
        self.early: list[Posted] = []  # messages in this rank's own memory, waited for at the end

    def peer(self, m: Message) -> int:
        raise NotImplementedError

    # where a message's items are, as tensor views (see the module docstring)

    def _wire(self, name: str) -> torch.dtype:
        dt = self.wire.get(name)
        if dt is None:
            dt = self.wire[name] = dtype_from_name(self.dtypes[name])
        return dt

    def _at(self, item: TransferItem) -> tuple[int, ...]:
        return item.src_offsets if self.sender else item.param_offsets

    def _tensors(self, m: Message) -> tuple[list[torch.Tensor], list[Flat] | None]:
        """Each item's tensor and, where the items give keys, its :meth:`ByteRuns.flat` (else None):
        ``tensor_of`` is then asked once per key and sync (it picks a tensor by the item's name or
        param only), else once per item."""
        keys: Callable[[], list[int]] | None = getattr(m.items, "keys", None)
        if keys is None:
            return [self.tensor_of(m, i) for i in range(len(m.items))], None
        memo, ks = self.memo, keys()
        got = list(map(memo.get, ks))
        for i, t in enumerate(got):
            if t is None:
                tensor = self.tensor_of(m, i)
                got[i] = memo[ks[i]] = (tensor, self.runs.flat(tensor))
        done = cast("list[_Memo]", got)  # (each None was filled)
        return [g[0] for g in done], [g[1] for g in done]

    def _pairs(self, m: Message, buf: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(this rank's side, ``buf``'s side) of each item of staged message ``m``: byte views where
        its tensor is contiguous in the wire dtype, else views in the item's shape (the tensor's side
        may then differ in dtype: the copy casts)."""
        runs, wire = self.runs, self._wire
        tensors, flats = self._tensors(m)

        def find(i: int) -> tuple[torch.Tensor, int] | None:
            t, item = tensors[i], m.items[i]
            box = runs.box(t, self._at(item), item.region.sizes) if t.dtype == wire(item.name) else None
            return None if box is None else (box, m.offsets[i])

        got = self.spans.pairs((self.sender, self.peer(m), m.index), runs, tensors, buf, find, flats)
        if got is not None:
            return got
        items = tuple(m.items)
        mine = [runs.box(t, self._at(item), item.region.sizes) if t.dtype == wire(item.name) else None
                for item, t in zip(items, tensors)]
        theirs = runs.likes(buf, m.offsets, mine)
        for i, box in enumerate(mine):
            if box is None:
                item = items[i]
                mine[i] = tensors[i][box_slices(self._at(item), item.region.sizes)]
                theirs[i] = item_view(buf, m.offsets[i], item, self.dtypes)
        return cast("list[torch.Tensor]", mine), cast("list[torch.Tensor]", theirs)  # (each None was filled)

    def _direct(self, m: Message) -> torch.Tensor | None:
        """The bytes of message ``m`` in this rank's own tensor, when ``m`` is one item contiguous
        there in the wire dtype: sent from the shard or received into the parameter with no
        staging copy. Each end decides for itself; the bytes on the wire are the same either way.
        Where it is in the tensor is kept (``Spans``) while the tensor's layout stays the same."""
        if len(m.items) != 1:
            return None
        item, tensor = m.items[0], self._tensors(m)[0][0]
        if tensor.dtype != self._wire(item.name):
            return None
        flat, layout = self.runs.flat(tensor)
        if flat is None:  # not contiguous: the item's own view may still be
            return _direct_view(m, tensor, self.dtypes, self.sender)
        at = self._at(item)
        return self.spans.direct((self.sender, self.peer(m), m.index), flat, layout, m.nbytes,
                                 lambda: self.runs.box(tensor, at, item.region.sizes))

    def _sparse_slot(self, m: Message, sp: _SparseT) -> torch.Tensor | int:
        raise NotImplementedError

    def _own(self, kind: SlotKind) -> bool:
        raise NotImplementedError

    def _post_ops(self, ops: list[Op]) -> list[Work]:
        raise NotImplementedError

    def _prepare(self, posted: Posted) -> None:
        """Before ``posted`` is posted (its buffers placed)."""

    def _finish(self, posted: Posted) -> None:
        """After ``posted`` was waited for."""

    def _drain_order(self) -> list[Posted]:
        raise NotImplementedError

    def key(self, m: Message) -> tuple[int, int]:
        return (self.peer(m), m.index)

    def tag(self, m: Message) -> int:
        return self.relay.tag(m) if self.relay is not None and self.relay.from_parent else m.index

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
        """:meth:`run` of compiled rounds (:func:`compile_rounds`): the same ops, order and spans, from lists."""
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
            bufs, mine, theirs, reps = staged.cut(staging.buf, cast(int, start) if need else 0, views)  # (found)
            copies = None
            if self.sender:
                torch._foreach_copy_(theirs, mine)
                if reps[0]:
                    torch._foreach_copy_(reps[1], reps[0])
            elif mine:
                copies = (mine, theirs)
            span = (cast(int, start), cast(int, start) + need) if need else (0, 0)
            posted = Posted(None, bufs, None, [], span, staged.moved, copies)
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
            posted = self._post(Posted(cast("list[Message]", e_rnd), cast("list[torch.Tensor]", e_bufs),
                                       cast("list[SlotKind]", e_kinds), []))  # (own slots: tensors)
            if self.forwarding:  # forwarded as it arrives: completed in order with the staged rounds
                self.in_flight.append(posted)
                if len(self.in_flight) == DEPTH:
                    self._complete(self.in_flight.popleft())
            else:
                self.early.append(posted)
            if all(own):
                return
            r_rnd, r_slots, r_kinds = ([x[i] for i, o in enumerate(own) if not o] for x in (rnd, slots, kinds))
            rnd, slots = cast("list[Message]", r_rnd), cast("list[torch.Tensor | int]", r_slots)
            kinds = cast("list[SlotKind]", r_kinds)
        need = self.staging.need(slots)
        start: int | None = 0
        while need and (start := self.staging.spot(need, (p.span for p in self.in_flight))) is None:
            self._complete(self.in_flight.popleft())  # the oldest round frees its span first
        start = cast(int, start)  # (a spot was found, or none was needed)
        bufs = self.staging.place(slots, start, need)
        self.in_flight.append(self._post(Posted(rnd, bufs, kinds, [], (start, start + need))))
        if len(self.in_flight) == DEPTH:
            self._complete(self.in_flight.popleft())

    def _slots(self, rnd: list[Message]) -> tuple[list[torch.Tensor | int], list[SlotKind]]:
        """The round's buffers and their kinds; a slot still to place in staging is its byte count."""
        bufs: list[torch.Tensor | int] = []
        kinds: list[SlotKind] = []
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

    def _post(self, posted: Posted, ops: list[Op] | None = None) -> Posted:
        """Prepare and post ``posted``'s ops (a compiled part's: ``ops``); with ``ready`` still to
        call, hold them back instead (its works are filled in by :meth:`_release`)."""
        if ops is None:
            self._prepare(posted)
            rnd = cast("list[Message]", posted.rnd)  # (only a compiled part comes with its ops)
            ops = [(buf, self.peer_rank(self.peer(m)), self.tag(m)) for m, buf in zip(rnd, posted.bufs)]
        if self.held is not None:
            self.held.append((ops, posted.works))
        else:
            posted.works = self._post_ops(ops)
        return posted

    def _release(self) -> None:
        """Once: call ``ready()``, then post every op held back, in order."""
        if self.held is not None:
            cast("Callable[[], object]", self.ready)()  # (ops are held only while there is a ready to call)
            for ops, works in self.held:
                works.extend(self._post_ops(ops))
            self.held = None

    def _complete(self, posted: Posted) -> None:
        self._release()
        self.plane.wait_all(posted.works[::-1], "M2N round")  # the last posted first: the others are done by then
        if posted.rnd is None:  # a compiled part: at a receiver, its staged items' copies
            self.moved += posted.moved
            if posted.copies is not None:
                torch._foreach_copy_(*posted.copies)
            return
        self.moved += sum(b.numel() for b in posted.bufs)  # what the data plane filled, padding included
        if not self.forwarding:
            self._finish(posted)
            return
        relay = cast(Relay, self.relay)  # (forwarding: a relay)
        sends = [(buf, child, relay.tag(m)) for child in relay.children for m, buf in zip(posted.rnd, posted.bufs)]
        works = self.plane.post(sends, [])  # on the wire while this worker applies the round
        self._finish(posted)
        self.plane.wait_all(works[::-1], "M2N fan-out")  # the span is free (and reused) only after this

    def _fold(self, m: Message, views: Iterable[torch.Tensor]) -> None:
        acc = 0
        for view in views:
            acc = fold_checksum(acc, view)
        self.folded[self.key(m)] = acc


class _Sender(_Executor[torch.Tensor]):
    """Packs each staged item's region of its shard into the span and posts while the earlier
    rounds are on the wire; direct messages and sparse payloads go from where they are."""

    sender = True

    def peer(self, m: Message) -> int:
        return m.dst

    def _sparse_slot(self, m: Message, sp: torch.Tensor) -> torch.Tensor | int:
        return sp

    def _own(self, kind: SlotKind) -> bool:
        return kind is not SlotKind.STAGED

    def _post_ops(self, ops: list[Op]) -> list[Work]:
        return self.plane.post(ops, [])

    def _drain_order(self) -> list[Posted]:
        return [*reversed(self.in_flight), *reversed(self.early)]  # the earlier ones are done by then

    def _prepare(self, posted: Posted) -> None:
        rnd, kinds = cast("list[Message]", posted.rnd), cast("list[SlotKind]", posted.kinds)  # (a round, not a part)
        for m, buf, kind in zip(rnd, posted.bufs, kinds):
            if kind is SlotKind.STAGED or self.sums is not None:  # else: the shard's own bytes / a ready payload
                self._pack(m, buf, kind)

    def _pack(self, m: Message, buf: torch.Tensor, kind: SlotKind) -> None:
        """Copy a staged message's items into ``buf`` (one grouped copy); with ``sums``, fold what it sends."""
        tensor_of, dtypes = self.tensor_of, self.dtypes
        if kind is SlotKind.STAGED and self.sums is None:
            srcs, dsts = self._pairs(m, buf)
            torch._foreach_copy_(dsts, srcs)
            return
        views: list[torch.Tensor] = []
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


class _Receiver(_Executor[int]):
    """When a staged round completes, copies each item into its target region (dtype cast if
    needed) while the later rounds arrive; direct messages arrive in place."""

    sender = False

    def peer(self, m: Message) -> int:
        return m.src

    def _sparse_slot(self, m: Message, sp: int) -> torch.Tensor | int:
        return sparse_nbytes(numels(m), sp, itemsize_of_message(m, self.dtypes), [it.name for it in m.items])

    def _own(self, kind: SlotKind) -> bool:
        return kind is SlotKind.DIRECT

    def _post_ops(self, ops: list[Op]) -> list[Work]:
        return self.plane.post([], ops)

    def _drain_order(self) -> list[Posted]:
        return [*self.in_flight, *reversed(self.early)]  # staged rounds applied in order

    def _finish(self, posted: Posted) -> None:
        rnd, kinds = cast("list[Message]", posted.rnd), cast("list[SlotKind]", posted.kinds)  # (a round, not a part)
        for m, buf, kind in zip(rnd, posted.bufs, kinds):
            if kind is not SlotKind.DIRECT or self.sums is not None:  # else: it arrived in place
                self._apply(m, buf, kind)

    def _apply(self, m: Message, buf: torch.Tensor, kind: SlotKind) -> None:
        """Copy (or patch) a received message's items into their targets; with ``sums``, fold what
        was applied (in the wire dtype)."""
        received: list[torch.Tensor] | torch.Tensor
        tensor_of, dtypes = self.tensor_of, self.dtypes
        if kind is SlotKind.STAGED and self.sums is None:
            targets, received = self._pairs(m, buf)
            torch._foreach_copy_(targets, received)
            return
        patches = None
        if kind is SlotKind.SPARSE:
            patches = decode(buf, numels(m), self.sparse[self.key(m)], itemsize_of_message(m, dtypes),
                             [it.name for it in m.items])
        views: list[torch.Tensor] = []
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


_End = _Sender | _Receiver  # one end of the rounds


def run_rounds(plane: DataPlane, plan_rounds: Iterable[list[Message]], staging: torch.Tensor, *, sender: bool,
               peer_rank: Callable[[int], int], dtypes: Mapping[str, str], tensor_of: TensorOf,
               sums: dict[int, int] | None = None, sparse: Sparse | None = None,
               ready: Callable[[], object] | None = None, relay: Relay | None = None) -> int:
    """Execute rounds; returns payload bytes moved.

    A message whose bytes are ready in this rank's own memory needs no staging: one item contiguous
    in this rank's tensor in the wire dtype (``_direct``: sent from the shard, received into the
    parameter) or a sender's sparse payload. Those are posted as their round comes, without waiting
    for anything, and waited for once every round is posted, the last posted first (this rank
    sleeps about once for all of them, not once a round). On a data plane whose point-to-point ops
    run in issue order (``plane.ordered``: NCCL, one stream) a round is posted whole, so only rounds
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
    :mod:`~weightsync.reshard.delta` encodes them, in their dense slot's place.
    With ``ready``, nothing is posted before ``ready()`` returned; the rounds go on as without it
    (packed, their ops held back) until one would have to be waited for, or they end: a sender
    packs that much of its staging while ``ready()`` is still to be called (the engines start).
    A dense sync (no ``sums``, no ``sparse``) over rounds kept as arrays (``handshake.Rounds``) is
    compiled for the next ones, which run from lists while every tensor keeps its layout
    (:func:`compile_rounds`): the same ops in the same order and the same bytes.
    With ``relay`` (a worker in the replica fan-out, :class:`Relay`): its receives are tagged by
    :meth:`Relay.tag` where they come from a parent worker, and every round it receives (direct
    messages too, then completed in order with the staged ones) is forwarded to its children once it
    arrived, while it is applied; the round's span is reused only after the children received it.
    No deadlock: a child posts its rounds as a receiver does and completes them in order, so a
    parent's forward of round k is matched once the child completed its rounds < k, which needs only
    the parent's earlier forwards. A relay runs the general path (not compiled)."""
    end: type[_Sender] | type[_Receiver] = _Sender if sender else _Receiver
    paused = gc.isenabled()  # a sync's views are freed by their counts: no cyclic GC pass over the plan's objects
    gc.disable()
    try:
        ex = end(plane, staging, peer_rank=peer_rank, dtypes=dtypes, tensor_of=tensor_of, sums=sums,
                 sparse=sparse, ready=ready, spans=getattr(plan_rounds, "spans", None), relay=relay)
        dense = sums is None and not sparse and hasattr(plan_rounds, "fast") and relay is None
        fast = cast(_Kept, plan_rounds).fast if dense else None
        if fast is not None:
            views = fast.views(tensor_of, ex.runs, peer_rank, ex.whole_rounds, ex.staging.room,
                               staging.storage_offset())  # type: ignore[arg-type]  # (int | SymInt: SymInt if traced)
            if views is not None:
                return ex.run_fast(fast, views)
        moved = ex.run(plan_rounds)
        if dense:  # compiled from what this sync found, for the next ones
            cast(_Kept, plan_rounds).fast = compile_rounds(ex, plan_rounds, peer_rank)
        return moved
    finally:
        if paused:
            gc.enable()


def itemsize_of_message(m: Message, dtypes: Mapping[str, str]) -> int:
    return dtype_from_name(dtypes[m.items[0].name]).itemsize


def numels(m: Message) -> list[int]:
    return [item.region.numel for item in m.items]


def _direct_view(m: Message, tensor: torch.Tensor, dtypes: Mapping[str, str], sender: bool) -> torch.Tensor | None:
    """The bytes of one-item message ``m`` in ``tensor``, when its region is contiguous there in the
    wire dtype (``_Executor._direct`` without its byte views: any tensor)."""
    item = m.items[0]
    if tensor.dtype != dtype_from_name(dtypes[item.name]):
        return None
    view = tensor[box_slices(item.src_offsets if sender else item.param_offsets, item.region.sizes)]
    if not view.is_contiguous() or view.numel() * view.element_size() != m.nbytes:
        return None
    return view.reshape(-1).view(torch.uint8)


def item_view(buf: torch.Tensor, off: int, item: TransferItem, dtypes: Mapping[str, str]) -> torch.Tensor:
    """``item``'s bytes at ``off`` of the uint8 ``buf``, in its wire dtype and shape."""
    dtype = dtype_from_name(dtypes[item.name])
    n = item.region.numel * dtype.itemsize
    return buf[off : off + n].view(dtype).view(item.region.sizes)


WIDE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""A strided copy goes in elements of its tensor's width (its bits as integers): half the elements
of a bf16 column slice's bytes, and about half the time where its rows are short."""

FAST_ITEMS = 1 << 18
"""Most items a rank's rounds may have to be compiled (above: the general path, kept arrays only):
every benchmark shape's rank (DeepSeek-V3 TP worker 0: ~180 k) but a 1T-class MoE with per-expert
tensors (k2: ~5 M, one tensor per item, where compiling would keep ~100 B per item and save little)."""


class _Probe:
    """What ``tensor_of`` reads of an item: its tensor name and param."""

    __slots__ = ("name", "param")

    def __init__(self, name: str, param: str) -> None:
        self.name, self.param = name, param


class _One:
    """A stand-in message of one item for ``tensor_of(m, 0)``."""

    __slots__ = ("items",)

    def __init__(self, probe: _Probe) -> None:
        self.items = (probe,)


class Part:
    """One posting of a round: ``vids`` per message (>= 0: a view of this rank's tensor, sent from /
    received into it; < 0: ``~vid``-th part of the staging span's ``msg_sizes`` split), the ops'
    ranks and tags, and the staged items' copies: tensor views ``item_vids``, span parts
    ``item_picks`` of its ``item_sizes`` split (``item_shapes`` for strided ones), then batches of
    equal items evenly spaced on both sides: tensor views ``batch_vids`` (one more dim) and span
    views ``batch_at`` (shape, strides, offset, width); a sender's ``reps`` (copies, elements,
    step, offset, width): a batch's one region copied from the span to the next messages'."""

    __slots__ = ("vids", "ranks", "index", "moved", "need", "msg_sizes", "item_vids", "item_sizes", "item_picks",
                 "item_shapes", "batch_vids", "batch_at", "reps")

    def __init__(self) -> None:
        self.vids: list[int] = []
        self.ranks: list[int] = []
        self.index: list[int] = []
        self.moved = self.need = 0
        self.msg_sizes: list[int] = []
        self.item_vids: list[int] = []
        self.item_sizes: list[int] = []
        self.item_picks: list[int] = []
        self.item_shapes: list[tuple[tuple[int, ...], int] | None] | None = None  # (shape, width) or None
        self.batch_vids: list[int] = []
        self.batch_at: list[tuple[tuple[int, ...], tuple[int, ...], int, int]] = []
        self.reps: list[tuple[int, int, int, int, int]] = []

    def cut(self, staging: torch.Tensor, start: int, views: list[torch.Tensor]) -> tuple[
            list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Its buffers, its copies' (tensor side, span side) views, at ``start`` of ``staging``, and
        its ``reps`` (from, to) views (after the copies)."""
        area = staging[start : start + self.need]
        mp = area.split(self.msg_sizes)  # type: ignore[no-untyped-call]  # torch's Tensor.split is unannotated
        bufs = [views[v] if v >= 0 else mp[~v] for v in self.vids]
        ip = area.split(self.item_sizes)  # type: ignore[no-untyped-call]  # (as above)
        theirs = [ip[j] for j in self.item_picks]
        if self.item_shapes is not None:
            theirs = [t if s is None else t.view(WIDE[s[1]]).view(s[0]) for t, s in zip(theirs, self.item_shapes)]
        mine = [views[v] for v in self.item_vids]
        if self.batch_vids:
            wide = {w: area.view(WIDE[w]) for w in {b[3] for b in self.batch_at}}
            base = area.storage_offset()
            mine += [views[v] for v in self.batch_vids]
            theirs += [wide[w].as_strided(shape, strides, (base + at) // w) for shape, strides, at, w in self.batch_at]
        reps: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for k, n, step, at, w in self.reps:
            t, o = area.view(WIDE[w]), (area.storage_offset() + at) // w
            reps[0].append(t.as_strided((k, n), (0, 1), o))
            reps[1].append(t.as_strided((k, n), (step, 1), o + step))
        return bufs, mine, theirs, reps

    def nbytes(self) -> int:
        lists = (self.vids, self.ranks, self.index, self.msg_sizes, self.item_vids, self.item_sizes, self.item_picks,
                 self.batch_vids)
        extra = 8 * len(self.item_shapes or ()) + 200 * (len(self.batch_at) + len(self.reps))
        return 120 + 36 * sum(map(len, lists)) + extra


class FastRounds:
    """Compiled rounds (see the module docstring): per round its early and staged :class:`Part`
    (either may be None), the tensors (a stand-in message and the layout each had) and the views'
    byte ranges. View ids are renumbered so that each tensor's runs that do not overlap come
    first, in order: a sync cuts them with one ``split`` per tensor (``groups``: tensor, start,
    split sizes, the parts to keep); the other views are cut one by one from arrays (tensor,
    start, end, strided shape id or -1)."""

    slot: npt.NDArray[np.int32]
    start: npt.NDArray[np.int64]
    end: npt.NDArray[np.int64]
    sid: npt.NDArray[np.int32]

    def __init__(self, slots: list[tuple[_One, Layout]], table: list[_Row], shapes: list[_Shape],
                 rounds: list[tuple[Part | None, Part | None]], peers: dict[int, int], whole: bool, room: int) -> None:
        self.slots, self.shapes, self.rounds, self.peers = slots, shapes, rounds, peers
        self.whole, self.room = whole, room
        order, self.groups = _grouped(table)
        new = [0] * len(table)
        for i, old in enumerate(order):
            new[old] = i
        for part in (p for r in rounds for p in r if p is not None):
            part.vids = [new[v] if v >= 0 else v for v in part.vids]
            part.item_vids = [new[v] for v in part.item_vids]
            part.batch_vids = [new[v] for v in part.batch_vids]
        rest = [table[v] for v in order[sum(len(g[2]) if g[3] is None else len(g[3]) for g in self.groups):]]
        cols = np.asarray(rest, dtype=np.int64).reshape(-1, 4).T
        self.slot, self.start, self.end, self.sid = cols[0].astype(np.int32), cols[1], cols[2], cols[3].astype(np.int32)

    def nbytes(self) -> int:
        """About the host bytes kept."""
        arrays = self.slot.nbytes + self.start.nbytes + self.end.nbytes + self.sid.nbytes
        groups = sum(100 + 36 * (len(g[2]) + len(g[3] or ())) for g in self.groups)
        parts = sum(p.nbytes() for r in self.rounds for p in r if p is not None)
        return arrays + groups + 200 * len(self.slots) + parts

    def views(self, tensor_of: TensorOf, runs: ByteRuns, peer_rank: Callable[[int], int],
              whole: bool, room: int, staging_offset: int) -> list[torch.Tensor] | None:
        """This sync's views (by view id), or None when a tensor's layout, a peer's rank, the plane's
        ordering or the staging room differ from the compiled sync's."""
        if whole != self.whole or room != self.room or staging_offset % 8:
            return None
        if any(peer_rank(p) != r for p, r in self.peers.items()):
            return None
        flats: list[torch.Tensor] = []
        for stub, layout in self.slots:
            flat, lay = runs.flat(tensor_of(stub, 0))
            if flat is None or lay != layout:
                return None
            flats.append(flat)
        views: list[torch.Tensor] = []
        for k, lo, sizes, picks in self.groups:
            parts = flats[k][lo : lo + sum(sizes)].split(sizes)  # type: ignore[no-untyped-call]  # (unannotated)
            views += parts if picks is None else [parts[j] for j in picks]
        wide: dict[tuple[int, int], torch.Tensor]
        shapes, wide = self.shapes, {}
        for k, s, e, sid in zip(self.slot.tolist(), self.start.tolist(), self.end.tolist(), self.sid.tolist()):
            if sid < 0:
                views.append(flats[k][s:e])
                continue
            shape, strides, w = shapes[sid]
            t = wide.get((k, w))
            if t is None:
                t = wide[k, w] = flats[k].view(WIDE[w])
            views.append(t.as_strided(shape, strides, t.storage_offset() + s // w))
        return views


def _grouped(table: list[_Row]) -> tuple[list[int], list[_Group]]:
    """View ids in their new order, and per tensor its split (tensor, start, sizes, picks or None):
    each tensor's runs (not strided) sorted by start, those that do not overlap the one before first."""
    runs = sorted((v for v, row in enumerate(table) if row[3] < 0), key=lambda v: (table[v][0], table[v][1]))
    first: list[int]
    rest: list[int]
    groups: list[_Group]
    end: int | None
    sizes: list[int]
    picks: list[int]
    first, rest, groups = [], [], []
    at = 0
    while at < len(runs):
        slot, end, sizes, picks, lo, j = table[runs[at]][0], None, [], [], table[runs[at]][1], at
        while j < len(runs) and table[runs[j]][0] == slot:
            _, s, e, _ = table[runs[j]]
            if end is not None and s < end:
                rest.append(runs[j])
            else:
                if end is not None and s > end:
                    sizes.append(s - end)
                picks.append(len(sizes))
                sizes.append(e - s)
                first.append(runs[j])
                end = e
            j += 1
        groups.append((slot, lo, sizes, None if len(picks) == len(sizes) else picks))
        at = j
    rest += [v for v, row in enumerate(table) if row[3] >= 0]
    return first + rest, groups


class _Compiler:
    """What :func:`compile_rounds` builds up: tensors (slots), unique views, strided shapes."""

    def __init__(self, ex: _End, names: Callable[[int], tuple[str, str]]) -> None:
        self.ex, self.names = ex, names
        self.slot_of: dict[tuple[str, int], int] = {}  # (name or param, id of its tensor) -> slot
        self.slots: list[tuple[_One, Layout]] = []
        self.vid_of: dict[tuple[int, int, int, int], int] = {}
        self.peers: dict[int, int] = {}
        # (shape, strides, width): the spans', then the batches'
        self.shapes: list[_Shape] = [_widen(*s) for s in ex.spans._shape_list]

    def slot(self, key: int) -> int | None:
        got = self.ex.memo.get(key)
        if got is None or got[1][0] is None:
            return None
        name, param = self.names(key)
        group = (name if self.ex.sender else param, id(got[0]))
        s = self.slot_of.get(group)
        if s is None:
            s = self.slot_of[group] = len(self.slots)
            self.slots.append((_One(_Probe(name, param)), got[1][1]))
        return s

    def vid(self, slot: int, start: int, end: int, sid: int) -> int:
        return self.vid_of.setdefault((slot, start, end, sid), len(self.vid_of))

    def message(self, m: Message) -> _Msg | None:
        """(peer, index, nbytes, direct view id or -1, staged items [(slot, start, end, sid, offset, n)]),
        or None where the message was not found as numbers."""
        ex = self.ex
        keys: Callable[[], list[int]] | None = getattr(m.items, "keys", None)
        if keys is None:
            return None
        found = [self.slot(k) for k in keys()]
        if None in found:
            return None
        slots = cast("list[int]", found)
        peer = ex.peer(m)
        key = (ex.sender, peer, m.index)
        if len(slots) == 1 and (d := ex.spans._direct.get(key)) is not None and d[1] >= 0 \
                and d[0] == self.slots[slots[0]][1]:
            return peer, m.index, m.nbytes, self.vid(slots[0], d[1], d[1] + m.nbytes, -1), None
        got = ex.spans._of.get(key)
        if not got or any(lay != self.slots[s][1] for lay, s in zip(got[0], slots)):
            return None
        sizes: array[int] | list[int]
        _, spans, sizes, picks, sids = got
        starts = np.concatenate(([0], np.cumsum(np.asarray(sizes, dtype=np.int64))[:-1])).tolist()
        sizes = sizes.tolist()
        items = []
        for j, s in enumerate(slots):
            p = j if picks is None else picks[j]
            items.append((s, spans[2 * j], spans[2 * j + 1], -1 if sids is None else sids[j], starts[p], sizes[p]))
        return peer, m.index, m.nbytes, -1, items

    def part(self, msgs: list[_Msg], peer_rank: Callable[[int], int]) -> Part:
        """A posting of ``msgs``; a sender's staged message equal to one before it in the posting
        (its items at the same offsets: a replica's) is sent from that one's span."""
        copies: list[_Copy]
        same: dict[tuple[int, tuple[_Copy, ...]], int]
        part, copies, same = Part(), [], {}
        for peer, index, nbytes, vid, items in msgs:
            rank = self.peers.setdefault(peer, peer_rank(peer))
            part.ranks.append(rank)
            part.index.append(index)
            part.moved += nbytes
            if vid >= 0:
                part.vids.append(vid)
                continue
            items = cast("list[_Copy]", items)  # (a staged message: its items)
            if self.ex.sender:
                key = (nbytes, tuple(items))
                if key in same:
                    part.vids.append(same[key])
                    continue
                same[key] = ~len(part.msg_sizes)
            base = part.need
            part.vids.append(~len(part.msg_sizes))  # its part of the msg_sizes split
            part.msg_sizes += [nbytes, align_up(nbytes, ALIGN) - nbytes]
            part.need += align_up(nbytes, ALIGN)
            copies += [(s, a, b, sid, base + off, n) for s, a, b, sid, off, n in items]
        self._copies(part, copies)
        return part

    def _copies(self, part: Part, copies: list[_Copy]) -> None:
        merged: list[list[int]] = []
        for s, a, b, sid, off, n in copies:
            last = merged[-1] if merged else None
            if last is not None and sid < 0 and last[3] < 0 and last[0] == s and last[2] == a \
                    and last[4] + last[5] == off:
                last[2], last[5] = b, last[5] + n
            else:
                merged.append([s, a, b, sid, off, n])
        merged = self._batches(part, merged)
        shapes: list[tuple[tuple[int, ...], int] | None]
        at, shapes = 0, []
        for s, a, b, sid, off, n in merged:
            if off > at:
                part.item_sizes.append(off - at)
            part.item_picks.append(len(part.item_sizes))
            part.item_sizes.append(n)
            part.item_vids.append(self.vid(s, a, b, sid))
            shapes.append(None if sid < 0 else (self.shapes[sid][0], self.shapes[sid][2]))
            at = off + n
        if at < part.need:
            part.item_sizes.append(part.need - at)
        part.item_shapes = None if all(s is None for s in shapes) else shapes

    def _batches(self, part: Part, copies: list[list[int]]) -> list[list[int]]:
        """Copies of one tensor, size and shape whose tensor starts and span offsets step evenly (a
        norm's shards from every trainer rank, one shard sent to every worker, a column slice's rows)
        go as one copy of one more dim each; returns the others. A tensor step of 0 is allowed where
        the tensor is only read (a sender)."""
        by: dict[tuple[int, int, int], list[list[int]]] = {}
        for c in copies:
            by.setdefault((c[0], c[5], c[3]), []).append(c)
        rest = []
        for (slot, n, sid), group in by.items():
            group.sort(key=lambda c: (c[1], c[4]))
            shape, strides, w = self.shapes[sid] if sid >= 0 else _widen((n,), (1,), self.slots[slot][1][2].itemsize)
            i = 0
            while i < len(group):
                j, dt, da = i + 1, 0, 0
                if j < len(group):
                    dt, da = group[j][1] - group[i][1], group[j][4] - group[i][4]
                    while j < len(group) and group[j][1] - group[j - 1][1] == dt \
                            and group[j][4] - group[j - 1][4] == da:
                        j += 1
                first = group[i]
                span = first[2] - first[1]
                if j - i < 4 or not (dt > 0 or self.ex.sender):  # (items' regions are disjoint: distinct starts)
                    rest.append(first)
                    i += 1
                    continue
                k, (sh, st, w) = j - i, (shape, strides, w)
                if dt % w or da % w or n % w:
                    sh, st, w = ((n,), (1,), 1) if sid < 0 else (*self.ex.spans._shape_list[sid], 1)
                if dt == 0:  # one region to k messages: copied once, then its copy k - 1 times (contiguous)
                    part.reps.append((k - 1, n // w, da // w, first[4], w))
                    k = 1
                self.shapes.append(((k, *sh), (dt // w, *st), w))
                part.batch_vids.append(self.vid(slot, first[1], first[1] + span, len(self.shapes) - 1))
                part.batch_at.append(((k, *sh), (da // w, *_row_major(sh)), first[4], w))
                i = j
        rest.sort(key=lambda c: c[4])
        return rest


def _widen(shape: tuple[int, ...], strides: tuple[int, ...], width: int | None = None) -> _Shape:
    """A byte view's (shape, strides) in elements of ``width`` bytes (a strided box: its last dim's
    bytes; a run: ``width``), where they divide; else as it is, width 1."""
    if width is None:  # a strided box: (*sizes, element bytes), (*byte strides, 1)
        w = shape[-1]
        if w in WIDE and strides[-1] == 1 and all(st % w == 0 for st in strides[:-1]):
            return shape[:-1], tuple(st // w for st in strides[:-1]), w
        return shape, strides, 1
    if width in WIDE and shape[0] % width == 0:
        return (shape[0] // width,), (1,), width
    return shape, strides, 1


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _fits(msgs: list[_Msg], room: int) -> bool:
    """Consecutive rounds' messages post as one: at most ``PEERS`` messages and half the staging
    (each end keeps its order per peer; on an ordered plane the round's direct messages go with it)."""
    return len(msgs) <= PEERS and sum(align_up(x[2], ALIGN) for x in msgs if x[3] < 0) <= room // 2


def compile_rounds(ex: _End, plan_rounds: Iterable[list[Message]],
                   peer_rank: Callable[[int], int]) -> FastRounds | None:
    """``plan_rounds`` (``handshake.Rounds``) compiled from what executor ``ex`` found in the dense
    sync it just ran, or None where a message was not found as numbers (a dtype cast, a tensor
    that is not contiguous) or the rounds have more than :data:`FAST_ITEMS` items."""
    compact: CompactRounds | None = getattr(plan_rounds, "compact", None)
    if compact is None or compact.num_items > FAST_ITEMS:
        return None
    if any(v is False for v in ex.spans._of.values()) or any(g[1][0] is None for g in ex.memo.values()):
        return None  # a message goes item by item (a cast, a tensor not contiguous): known without a pass
    comp = _Compiler(ex, compact.key_names)
    rounds: list[tuple[Part | None, Part | None]]
    pending: list[_Msg]
    early: Part | None
    staged: Part | None
    rounds, pending = [], []
    for rnd in chain(plan_rounds, [None]):  # (None: flush the last)
        found = [] if rnd is None else [comp.message(m) for m in rnd]
        if None in found:
            return None
        msgs = cast("list[_Msg]", found)
        if rnd is not None and _fits(pending + msgs, ex.staging.room):
            pending += msgs  # thin rounds merge (one peer's stream, peers' last messages): fewer posts
            continue
        own, early, staged = [x[3] >= 0 for x in pending], None, None
        if (pending and all(own)) or (any(own) and not ex.whole_rounds):
            early = comp.part([x for x, o in zip(pending, own) if o], peer_rank)
            pending = [x for x, o in zip(pending, own) if not o]
        if pending:
            staged = comp.part(pending, peer_rank)
        if early or staged:
            rounds.append((early, staged))
        pending = msgs
    table = sorted(comp.vid_of, key=comp.vid_of.__getitem__)
    return FastRounds(comp.slots, table, comp.shapes, rounds, comp.peers, ex.whole_rounds, ex.staging.room)
