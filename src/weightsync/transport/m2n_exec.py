"""M2N plumbing shared by the trainer and worker engines: the JSON wire form of sources and
destinations exchanged over the rendezvous store, the plan both sides build from them, and the
round executor that moves messages between staging and tensors."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ..comm import Communicator
from ..layout.plan import PairItems, TransferPlan, build_plan
from ..layout.records import DestPiece, TensorSource, align_up, dtype_itemsize
from ..layout.regions import Region, box_slices
from ..layout.schedule import ALIGN, Message
from ..protocol import dtype_from_name
from .delta import decode, patch, sparse_nbytes
from .packing import fold_checksum, fold_value

__all__ = ["FALLBACK", "sources_to_wire", "sources_from_wire", "dests_to_wire", "Gathered", "gather_plan",
           "Rounds", "my_messages", "run_rounds"]

FALLBACK = "fallback:"
"""Prefix of the pseudo-parameter a fallback tensor lands in (whole), before ``load_weights``."""


def sources_to_wire(sources: list[TensorSource]) -> list[Any]:
    """JSON-safe form of the trainer sources (compared for equality across trainer ranks)."""
    return [[s.name, list(s.shape), s.dtype, [[list(r.offsets), list(r.sizes)] for r in s.regions]]
            for s in sources]


def sources_from_wire(wire: list[Any]) -> list[TensorSource]:
    shared: dict[str, tuple[Region, ...]] = {}  # one regions tuple per layout keeps planning fast
    out = []
    for name, shape, dtype, regions in wire:
        key = json.dumps(regions)
        if key not in shared:
            shared[key] = tuple(Region(tuple(o), tuple(s)) for o, s in regions)
        out.append(TensorSource(name, tuple(shape), dtype, shared[key]))
    return out


def dests_to_wire(dests: Any) -> dict[str, Any]:
    """``WorkerDestinations`` -> JSON-safe: pieces, fallbacks (land whole), tied names, and the
    params among the pieces' that are received in checkpoint layout and go through vLLM's processing."""
    return {
        "pieces": [[p.name, list(p.region.offsets), list(p.region.sizes), p.param, list(p.param_offsets)]
                   for p in dests.pieces],
        "fallbacks": [[f.name, f.reason, f.nbytes] for f in dests.fallbacks],
        "tied": list(dests.tied),
        "via_loader": list(getattr(dests, "via_loader", ())),
    }


@dataclass(frozen=True)
class Gathered:
    plan: TransferPlan
    pieces: list[list[DestPiece]]  # per worker, fallbacks included as whole-tensor pieces
    fallbacks: list[list[tuple[str, str]]]  # per worker: (name, reason)
    via_loader: list[list[str]]  # per worker: vLLM params received in checkpoint layout, then processed


def gather_plan(comm: Communicator, sources: list[TensorSource], num_workers: int, prefix: str) -> Gathered:
    """Read every worker's destinations from the store and build the plan (every rank, same result).

    Raises ``ValueError`` with a worker's own error when it could not resolve its destinations.
    """
    by_name = {s.name: s for s in sources}
    interned: dict[str, list[DestPiece]] = {}  # equal layouts (replicas) share one list object
    pieces, fallbacks, via = [], [], []
    for w in range(num_workers):
        raw = comm.read(f"{prefix}/dest/{w}")
        if "error" in raw:
            raise ValueError(f"worker {w} could not resolve destinations: {raw['error']}")
        key = json.dumps([raw["pieces"], [f[0] for f in raw["fallbacks"]]])
        if key not in interned:
            lst = [DestPiece(n, Region(tuple(o), tuple(s)), p, tuple(po)) for n, o, s, p, po in raw["pieces"]]
            for name, _, _ in raw["fallbacks"]:
                shape = by_name[name].shape
                lst.append(DestPiece(name, Region.full(shape), FALLBACK + name, (0,) * len(shape)))
            interned[key] = lst
        pieces.append(interned[key])
        fallbacks.append([(n, r) for n, r, _ in raw["fallbacks"]])
        via.append(list(raw.get("via_loader", ())))
    return Gathered(build_plan(sources, pieces), pieces, fallbacks, via)


def agree(comm: Communicator, prefix: str, value: str, what: str) -> None:
    """Every rank of ``comm`` publishes ``value``; raise ``ValueError`` on every rank if any differs."""
    comm.publish(f"{prefix}/{comm.rank}", value)
    for r in range(comm.world_size):
        theirs = comm.read(f"{prefix}/{r}")
        if theirs != value:
            raise ValueError(f"{what} differs between ranks: rank {comm.rank} has {value!r}, rank {r} has {theirs!r}")


KEEP_ITEMS = 1 << 20
"""A rank with at most this many items keeps its rounds cut once (~100 B per item); above it they are
cut anew from the compact plan on every sync, so memory stays O(one round) at any model size."""


class Rounds:
    """This rank's messages grouped into rounds (the same cuts as its peers'), from the compact
    plan (:meth:`TransferPlan.pairs`): iterable any number of times, kept when small."""

    def __init__(self, pairs: PairItems, itemsize_of: Callable[[str], int], cap: int,
                 apart: Callable[[Any], bool] | None = None) -> None:
        self._make = partial(pairs.rounds, cap=cap, itemsize_of=itemsize_of, apart=apart)
        self.items = pairs.count()
        self._kept = list(self._make()) if self.items <= KEEP_ITEMS else None
        self._len = None if self._kept is None else len(self._kept)
        self.nbytes = (pairs.nbytes(dtype_itemsize) if self._kept is None  # what this rank sends or receives dense
                       else sum(m.nbytes for r in self._kept for m in r))

    def __iter__(self) -> Iterator[list[Message]]:
        if self._kept is not None:
            return iter(self._kept)
        return self._counted()

    def _counted(self) -> Iterator[list[Message]]:
        n = 0
        for rnd in self._make():
            n += 1
            yield rnd
        self._len = n

    def __len__(self) -> int:
        if self._len is None:  # not cut through yet: once more just to count (only above KEEP_ITEMS)
            self._len = sum(1 for _ in self._make())
        return self._len


def my_messages(plan: TransferPlan, sources: list[TensorSource], *, rank: int, sender: bool, cap: int,
                dense_only: Sequence[Collection[str]] = ()) -> Rounds:
    """This rank's rounds (see :class:`Rounds`). ``dense_only[w]``: worker w's params that never take
    a delta (received in checkpoint layout and processed, or fallbacks); their small pieces are packed
    apart from the others' (the same cut on both ends: every rank has every worker's list)."""
    size = {s.name: dtype_itemsize(s.dtype) for s in sources}
    apart = None
    if any(dense_only):
        def apart(item: Any) -> bool:
            return item.param in dense_only[item.dst_rank]
    return Rounds(plan.pairs(rank, sender=sender), size.__getitem__, cap, apart)


DEPTH = 8
"""Staged rounds a rank keeps posted at once (they share the staging buffer, each its own span)."""


def run_rounds(comm: Communicator, plan_rounds: Iterable[list[Message]], staging: torch.Tensor, *, sender: bool,
               peer_rank: Callable[[int], int], dtypes: Mapping[str, str],
               tensor_of: Callable[[Message, int], torch.Tensor], sums: dict[int, int] | None = None,
               sparse: Mapping[tuple[int, int], Any] | None = None, ready: Callable[[], Any] | None = None) -> int:
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
    parameter or fallback buffer; dtype cast if needed) while the later rounds arrive.
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
    packs that much of its staging while ``ready()`` is still to be called (the engines start)."""
    room = staging.numel() // ALIGN * ALIGN
    sparse = sparse or {}
    whole_rounds = getattr(comm, "ordered", False)
    folded: dict[tuple[int, int], int] = {}  # (peer, message index) -> that message's checksum
    moved = 0

    def key(m: Message) -> tuple[int, int]:
        return (m.dst if sender else m.src, m.index)

    def buffers(rnd: list[Message]) -> tuple[list[torch.Tensor | int], list[str]]:
        """The round's buffers and their kinds: "direct" (this rank's own tensor, no copy), "sparse"
        (a delta: the sender's payload, the receiver's slot) or "staged"; a slot still to place in
        staging is its byte count."""
        bufs: list[torch.Tensor | int] = []
        kinds = []
        for m in rnd:
            if (sp := sparse.get(key(m))) is not None:
                kinds.append("sparse")
                bufs.append(sp if sender else sparse_nbytes(_numels(m), sp, _itemsize(m, dtypes),
                                                            [it.name for it in m.items]))
            elif (view := _direct(m, tensor_of, dtypes, sender)) is not None:
                kinds.append("direct")
                bufs.append(view)
            else:
                kinds.append("staged")
                bufs.append(m.nbytes)
        return bufs, kinds

    def place(bufs: list[torch.Tensor | int], area: torch.Tensor) -> list[torch.Tensor]:
        out, base = [], 0
        for b in bufs:
            if isinstance(b, int):
                out.append(area[base : base + b])
                base += align_up(b, ALIGN)
            else:
                out.append(b)
        return out

    held: list[tuple[list[Any], list[Any]]] | None = None if ready is None else []  # ops and their works

    def post(rnd: list[Message], bufs: list[torch.Tensor]) -> list[Any]:
        ops = [(buf, peer_rank(m.dst if sender else m.src), m.index) for m, buf in zip(rnd, bufs)]
        if held is not None:
            held.append((ops, works := []))
            return works  # filled once ready() returned (``release``)
        return comm.post(ops, []) if sender else comm.post([], ops)

    def release() -> None:
        nonlocal held
        if held is not None:
            ready()
            for ops, works in held:
                works.extend(comm.post(ops, []) if sender else comm.post([], ops))
            held = None

    def fold(m: Message, views: Iterable[torch.Tensor]) -> None:
        acc = 0
        for view in views:
            acc = fold_checksum(acc, view)
        folded[key(m)] = acc

    def pack(rnd: list[Message], bufs: list[torch.Tensor], kinds: list[str]) -> None:
        for m, buf, kind in zip(rnd, bufs, kinds):
            if kind != "staged" and sums is None:
                continue  # the shard's own bytes / a ready payload: nothing to copy or fold
            views = []
            for i, (item, off) in enumerate(zip(m.items, m.offsets)):
                if kind == "sparse":  # the checksum is of the values the payload makes
                    src = tensor_of(m, i)[box_slices(item.src_offsets, item.region.sizes)]
                    wire = dtype_from_name(dtypes[item.name])
                    views.append(src if src.dtype == wire else src.to(wire))
                    continue
                view = _view(buf, off, item, dtypes)
                if kind == "staged":
                    view.copy_(tensor_of(m, i)[box_slices(item.src_offsets, item.region.sizes)])
                views.append(view)
            if sums is not None:
                fold(m, views)

    def apply(rnd: list[Message], bufs: list[torch.Tensor], kinds: list[str]) -> None:
        for m, buf, kind in zip(rnd, bufs, kinds):
            if kind == "direct" and sums is None:
                continue  # it arrived in place
            patches = None if kind != "sparse" else decode(buf, _numels(m), sparse[key(m)], _itemsize(m, dtypes),
                                                           [it.name for it in m.items])
            views = []
            for i, (item, off) in enumerate(zip(m.items, m.offsets)):
                target = tensor_of(m, i)[box_slices(item.param_offsets, item.region.sizes)]
                if patches is not None:
                    patch(target, *patches[i])
                    received = target
                else:
                    received = _view(buf, off, item, dtypes)
                    if kind == "staged":
                        target.copy_(received)
                views.append(target if target.dtype == received.dtype else received)  # in the wire dtype
            if sums is not None:  # what was applied
                fold(m, views)

    Posted = tuple[list[Message], list[torch.Tensor], list[str], list[Any], tuple[int, int]]
    in_flight: deque[Posted] = deque()  # staged rounds, oldest first
    early: list[Posted] = []  # messages in this rank's own memory, waited for at the end

    def spot(need: int) -> int | None:
        """The lowest offset with ``need`` bytes of staging free of every posted round's span."""
        spans = [span for *_, span in in_flight if span[0] < span[1]]
        for at in sorted({0, *(e for _, e in spans)}):
            if at + need <= room and all(e <= at or at + need <= s for s, e in spans):
                return at
        return None

    def complete(posted: Posted) -> None:
        nonlocal moved
        release()
        rnd, bufs, kinds, works, _ = posted
        comm.wait_all(works[::-1], "M2N round")  # the last posted first: the others are done by then
        moved += sum(b.numel() for b in bufs)  # what the data plane filled, padding included
        if not sender:
            apply(rnd, bufs, kinds)  # the later rounds are arriving meanwhile

    for rnd in plan_rounds:
        slots, kinds = buffers(rnd)
        own = [kind == "direct" or (sender and kind == "sparse") for kind in kinds]  # no staging needed
        if all(own) or (any(own) and not whole_rounds):
            e_rnd, e_bufs, e_kinds = ([x[i] for i, o in enumerate(own) if o] for x in (rnd, slots, kinds))
            if sender:
                pack(e_rnd, e_bufs, e_kinds)  # (only folds)
            early.append((e_rnd, e_bufs, e_kinds, post(e_rnd, e_bufs), (0, 0)))
            if all(own):
                continue
            rnd, slots, kinds = ([x[i] for i, o in enumerate(own) if not o] for x in (rnd, slots, kinds))
        need = sum(align_up(b, ALIGN) for b in slots if isinstance(b, int))
        if need > room:
            raise ValueError(f"a round needs {need} bytes of staging, more than the {room} there are")
        start = 0
        while need and (start := spot(need)) is None:
            complete(in_flight.popleft())  # the oldest round frees its span first
        bufs = place(slots, staging[start : start + need])
        if sender:
            pack(rnd, bufs, kinds)  # the earlier rounds are on the wire meanwhile
        in_flight.append((rnd, bufs, kinds, post(rnd, bufs), (start, start + need)))
        if len(in_flight) == DEPTH:
            complete(in_flight.popleft())
    release()
    # everything is posted: the receiver applies the staged rounds in order while the later ones
    # arrive, the sender waits for the last posted first (the earlier ones are done by then)
    for posted in [*(reversed(in_flight) if sender else in_flight), *reversed(early)]:
        complete(posted)
    if sums is not None:
        for (peer, _), value in sorted(folded.items()):
            sums[peer] = fold_value(sums.get(peer, 0), value)
    return moved


def _itemsize(m: Message, dtypes: Mapping[str, str]) -> int:
    return dtype_from_name(dtypes[m.items[0].name]).itemsize


def _numels(m: Message) -> list[int]:
    return [item.region.numel for item in m.items]


def _direct(m: Message, tensor_of: Callable[[Message, int], torch.Tensor], dtypes: Mapping[str, str],
            sender: bool) -> torch.Tensor | None:
    """The bytes of message ``m`` in this rank's own tensor, when ``m`` is one item whose region is
    contiguous there in the wire dtype: sent from the shard or received into the parameter with no
    staging copy. Each end decides for itself; the bytes on the wire are the same either way."""
    if len(m.items) != 1:
        return None
    item, tensor = m.items[0], tensor_of(m, 0)
    if tensor.dtype != dtype_from_name(dtypes[item.name]):
        return None
    view = tensor[box_slices(item.src_offsets if sender else item.param_offsets, item.region.sizes)]
    if not view.is_contiguous() or view.numel() * view.element_size() != m.nbytes:
        return None
    return view.reshape(-1).view(torch.uint8)


def _view(buf: torch.Tensor, off: int, item: Any, dtypes: Mapping[str, str]) -> torch.Tensor:
    dtype = dtype_from_name(dtypes[item.name])
    n = item.region.numel * dtype.itemsize
    return buf[off : off + n].view(dtype).view(item.region.sizes)
