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

The compiled path (:mod:`~.compiled`): after a dense sync over rounds kept as arrays, the next dense
syncs run from lists while every tensor keeps its layout (:func:`~.compiled.compile_rounds`).
"""

from __future__ import annotations

import enum
import gc
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, cast

import torch

from ..dataplane import DataPlane, Op, Work
from ..plan.regions import box_slices
from ..plan.schedule import Message
from ..plan.transfer import TransferItem
from ..protocol import dtype_from_name
from .compiled import FastRounds, compile_rounds
from .delta import decode, patch, sparse_nbytes
from .packing import ByteRuns, Flat, Spans, Staging, fold_checksum, fold_value  # Staging: re-exported

__all__ = ["DEPTH", "ItemKey", "ItemsOf", "Relay", "SlotKind", "Sparse", "Staging", "TensorOf", "item_view",
           "itemsize_of_message", "numels", "run_rounds"]


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
        return self.tag_of(m.src, m.index)

    def tag_of(self, src: int, index: int) -> int:
        """:meth:`tag` of message ``index`` from trainer rank ``src``."""
        return src + self.trainers * index


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
    fwd: list[int] | None = None  # a compiled part's tags to a relay's children


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
        return self.tag_of(self.peer(m), m.index)

    def tag_of(self, peer: int, index: int) -> int:
        """The tag of message ``index`` to or from plan peer ``peer`` (a receiver's peer: its trainer rank)."""
        return self.relay.tag_of(peer, index) if self.relay is not None and self.relay.from_parent else index

    def forward_tag(self, peer: int, index: int) -> int | None:
        """The tag a relay forwards that message to its children with (None: it forwards nothing)."""
        return cast(Relay, self.relay).tag_of(peer, index) if self.forwarding else None

    @property
    def relay_key(self) -> tuple[tuple[int, ...], bool] | None:
        """Its relay's children and whether it receives from a parent (None: no relay)."""
        return None if self.relay is None else (self.relay.children, self.relay.from_parent)

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
        """:meth:`run` of compiled rounds (:mod:`~.compiled`): the same ops, order and spans, from lists."""
        staging, in_flight = self.staging, self.in_flight
        for early, staged in fast.rounds:
            if early is not None:
                bufs = [views[v] for v in early.vids]
                posted = self._post(Posted(None, bufs, None, [], moved=early.moved, fwd=early.fwd),
                                    list(zip(bufs, early.ranks, early.tags)))
                if self.forwarding:  # forwarded as it arrives: completed in order with the staged parts
                    in_flight.append(posted)
                    if len(in_flight) == DEPTH:
                        self._complete(in_flight.popleft())
                else:
                    self.early.append(posted)
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
            posted = Posted(None, bufs, None, [], span, staged.moved, copies, staged.fwd)
            in_flight.append(self._post(posted, list(zip(bufs, staged.ranks, staged.tags))))
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
        relay = cast(Relay, self.relay)  # (read only when forwarding: a relay)
        if posted.rnd is None:  # a compiled part: at a receiver, its staged items' copies
            self.moved += posted.moved
            tags = cast("list[int]", posted.fwd)  # (a relay's parts carry their forward tags)
            works = self._forward([(b, t) for b, t in zip(posted.bufs, tags)]) if self.forwarding else []
            if posted.copies is not None:
                torch._foreach_copy_(*posted.copies)
        else:
            self.moved += sum(b.numel() for b in posted.bufs)  # what the data plane filled, padding included
            works = self._forward([(b, relay.tag(m)) for m, b in zip(posted.rnd, posted.bufs)]) \
                if self.forwarding else []
            self._finish(posted)
        if works:
            self.plane.wait_all(works[::-1], "M2N fan-out")  # the span is free (and reused) only after this

    def _forward(self, msgs: list[tuple[torch.Tensor, int]]) -> list[Work]:
        """A relay: send a completed round's (buffer, tag) messages on to each child, in order; they are
        on the wire while this worker applies the round."""
        children = cast(Relay, self.relay).children
        return self.plane.post([(buf, child, tag) for child in children for buf, tag in msgs], [])

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
    (:func:`~.compiled.compile_rounds`): the same ops in the same order and the same bytes.
    With ``relay`` (a worker in the replica fan-out, :class:`Relay`): its receives are tagged by
    :meth:`Relay.tag` where they come from a parent worker, and every round it receives (direct
    messages too, then completed in order with the staged ones) is forwarded to its children once it
    arrived, while it is applied; the round's span is reused only after the children received it.
    No deadlock: a child posts its rounds as a receiver does and completes them in order, so a
    parent's forward of round k is matched once the child completed its rounds < k, which needs only
    the parent's earlier forwards. A relay's dense syncs are compiled too (each part forwarded as it
    completes, with its messages' tags): the same messages, tags and order as the general path's."""
    end: type[_Sender] | type[_Receiver] = _Sender if sender else _Receiver
    paused = gc.isenabled()  # a sync's views are freed by their counts: no cyclic GC pass over the plan's objects
    gc.disable()
    try:
        ex = end(plane, staging, peer_rank=peer_rank, dtypes=dtypes, tensor_of=tensor_of, sums=sums,
                 sparse=sparse, ready=ready, spans=getattr(plan_rounds, "spans", None), relay=relay)
        dense = sums is None and not sparse and hasattr(plan_rounds, "fast")
        fast = cast(_Kept, plan_rounds).fast if dense else None
        if fast is not None:
            views = fast.views(tensor_of, ex.runs, peer_rank, ex.whole_rounds, ex.staging.room,
                               staging.storage_offset(),  # type: ignore[arg-type]  # (int | SymInt: SymInt if traced)
                               ex.relay_key)
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
