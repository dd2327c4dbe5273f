"""M2N plumbing shared by the trainer and worker engines: the JSON wire form of sources and
destinations exchanged over the rendezvous store, the plan both sides build from them, and each
rank's rounds of messages (the executor that moves them, :mod:`.executor`, is re-exported here)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import TypedDict, cast

from ..comm import Communicator
from ..control import agree, m2n_dest, m2n_plan_digest
from ..errors import refusal
from ..plan.regions import Region
from ..plan.schedule import ALONE, PEERS, ItemProbe, Message, pair_rounds
from ..plan.transfer import DestPiece, PairItems, TensorSource, TransferPlan, build_plan, dtype_itemsize
from ..worker.destinations import WorkerDestinations
from .compiled import FastRounds
from .executor import DEPTH, run_rounds  # DEPTH, run_rounds re-exported: callers import them from here
from .packing import Spans

__all__ = ["DEPTH", "FALLBACK", "DestsWire", "SourceWire", "sources_to_wire", "sources_from_wire", "sources_digest",
           "source_name", "show_source", "dests_to_wire", "pieces_to_wire", "pieces_from_wire", "Gathered",
           "gather_plan", "planned", "agree_digest", "Rounds", "my_messages", "run_rounds"]

FALLBACK = "fallback:"
"""Prefix of the pseudo-parameter a fallback tensor lands in (whole), before ``load_weights``."""

SourceWire = tuple[str, list[int], str, list[list[list[int]]]]
"""A source's wire form: ``[name, shape, dtype, [[offsets, sizes] of each trainer rank]]``, a JSON
array (a list, as the store gives it back), typed as the tuple of fields it is read as."""


class DestsWire(TypedDict):
    """A worker's destinations, JSON-safe (:func:`dests_to_wire`)."""

    pieces: list[list[str | list[int]]]  # [name, offsets, sizes, param, param offsets]
    fallbacks: list[list[str | int]]  # [name, reason, nbytes]
    tied: list[str]
    via_loader: list[str]
    fp8: dict[str, int]


def sources_to_wire(sources: list[TensorSource]) -> list[SourceWire]:
    """JSON-safe form of the trainer sources (compared for equality across trainer ranks)."""
    return cast("list[SourceWire]", [[s.name, list(s.shape), s.dtype, [[list(r.offsets), list(r.sizes)]
                                                                       for r in s.regions]] for s in sources])


def sources_from_wire(wire: list[SourceWire]) -> list[TensorSource]:
    shared: dict[str, tuple[Region, ...]] = {}  # one regions tuple per layout keeps planning fast
    out = []
    for name, shape, dtype, regions in wire:
        key = json.dumps(regions)
        if key not in shared:
            shared[key] = tuple(Region(tuple(o), tuple(s)) for o, s in regions)
        out.append(TensorSource(name, tuple(shape), dtype, shared[key]))
    return out


def sources_digest(wire: list[SourceWire]) -> str:
    """The digest the trainer ranks agree on: their sources' wire form, hashed."""
    return hashlib.sha256(json.dumps(wire).encode()).hexdigest()


def source_name(wire: SourceWire) -> str:
    """A source's name, from its wire form."""
    return wire[0]


def show_source(wire: SourceWire) -> str:
    """A source's wire form, in a message: dtype, shape and each trainer rank's shard sizes."""
    return f"{wire[2]} {tuple(wire[1])} (shards {[tuple(sizes) for _, sizes in wire[3]]})"


def dests_to_wire(dests: WorkerDestinations, fp8: dict[str, int] | None = None) -> DestsWire:
    """``WorkerDestinations`` -> JSON-safe: pieces, fallbacks (land whole), tied names, the params
    among the pieces' that are received in checkpoint layout and go through vLLM's processing, and
    ``fp8``: the worker's block-FP8 counts (``fp8.WorkerWire.to_wire``)."""
    return {
        "pieces": [[p.name, list(p.region.offsets), list(p.region.sizes), p.param, list(p.param_offsets)]
                   for p in dests.pieces],
        "fallbacks": [[f.name, f.reason, f.nbytes] for f in dests.fallbacks],
        "tied": list(dests.tied),
        "via_loader": list(getattr(dests, "via_loader", ())),
        "fp8": dict(fp8 or {}),
    }


def pieces_to_wire(pieces: Sequence[DestPiece]) -> DestsWire:
    """Destinations that are pieces only (no fallback, nothing through a loader), JSON-safe: what a
    worker publishes for destinations that are not vLLM parameters (LoRA slots)."""
    return {"pieces": [[p.name, list(p.region.offsets), list(p.region.sizes), p.param, list(p.param_offsets)]
                       for p in pieces], "fallbacks": [], "tied": [], "via_loader": [], "fp8": {}}


def pieces_from_wire(wire: DestsWire) -> list[DestPiece]:
    """The pieces of a worker's wire destinations (:func:`pieces_to_wire`, :func:`dests_to_wire`)."""
    return [DestPiece(cast(str, n), Region(tuple(cast("list[int]", o)), tuple(cast("list[int]", s))), cast(str, p),
                      tuple(cast("list[int]", po))) for n, o, s, p, po in wire["pieces"]]


@dataclass(frozen=True)
class Gathered:
    plan: TransferPlan  # to the first ``positions`` workers (replica 0, where the replicas are fanned out)
    positions: int  # the workers the plan addresses (all of them, or one replica's)
    pieces: list[list[DestPiece]]  # per worker, fallbacks included as whole-tensor pieces
    fallbacks: list[list[tuple[str, str]]]  # per worker: (name, reason)
    via_loader: list[list[str]]  # per worker: vLLM params received in checkpoint layout, then processed
    fp8: list[dict[str, int]]  # per worker: its block-FP8 counts (blocks quantized by the trainer / by it)


def gather_plan(comm: Communicator, sources: list[TensorSource], num_workers: int,
                positions: int | None = None) -> Gathered:
    """Read every worker's destinations from the store and build the plan (every rank, same result).
    ``positions`` (replica fan-out: the workers of one replica): the plan addresses workers
    ``0 .. positions - 1`` only, when every worker's destinations equal those of its position's worker
    in replica 0 (else the plan addresses every worker: ``Gathered.positions`` says which).

    Raises ``Refused`` with a worker's own refusal (its ``ValueError``: a model mismatch), as the
    worker reports it on the store (``worker N: ValueError: ...``); ``RuntimeError`` for another failure.
    """
    by_name = {s.name: s for s in sources}
    interned: dict[str, list[DestPiece]] = {}  # equal layouts (replicas) share one list object
    pieces, fallbacks, via, fp8, keys = [], [], [], [], []
    for w in range(num_workers):
        raw = comm.read(m2n_dest(w))
        if "error" in raw:  # a worker's refusal (a model mismatch, naming the parameter): ``Refused``, as on the store
            raise refusal(f"worker {w}: {raw['error']}") or RuntimeError(f"worker {w}: {raw['error']}")
        key = json.dumps([raw["pieces"], [f[0] for f in raw["fallbacks"]]])
        keys.append(json.dumps([key, raw.get("via_loader", ()), raw.get("fp8", {})]))
        if key not in interned:
            lst = [DestPiece(n, Region(tuple(o), tuple(s)), p, tuple(po)) for n, o, s, p, po in raw["pieces"]]
            for name, _, _ in raw["fallbacks"]:
                shape = by_name[name].shape
                lst.append(DestPiece(name, Region.full(shape), FALLBACK + name, (0,) * len(shape)))
            interned[key] = lst
        pieces.append(interned[key])
        fallbacks.append([(n, r) for n, r, _ in raw["fallbacks"]])
        via.append(list(raw.get("via_loader", ())))
        fp8.append(dict(raw.get("fp8", {})))
    n = num_workers
    if positions is not None and all(keys[w] == keys[w % positions] for w in range(num_workers)):
        n = positions
    return Gathered(build_plan(sources, pieces[:n]), n, pieces, fallbacks, via, fp8)


def planned(sources: list[TensorSource], pieces: list[list[DestPiece]]) -> Gathered:
    """The plan of destinations known without the store (pieces only: no fallback, no loader, no FP8),
    as :func:`gather_plan` would build it from the same pieces published."""
    n = len(pieces)
    return Gathered(build_plan(sources, pieces), n, pieces, [[] for _ in range(n)], [[] for _ in range(n)],
                    [{} for _ in range(n)])


def agree_digest(comm: Communicator, digest: str) -> str:
    """Every party of ``comm``'s data plane (joined) checks that all hold plan ``digest``, before any data
    moves: a ``ValueError`` on every party when one differs."""
    return cast(str, agree(comm, m2n_plan_digest, digest, rank=cast(int, comm.rank), ranks=comm.world_size,
                           what="plan digest"))


class Rounds:
    """This rank's messages grouped into rounds (the same cuts as its peers'), cut once from the
    compact plan (:func:`~weightsync.plan.schedule.pair_rounds`) into numeric arrays, whatever the item count:
    iterable any number of times, each pass making its :class:`Message` s from the arrays."""

    def __init__(self, pairs: PairItems, itemsize_of: Callable[[str], int], cap: int,
                 apart: Callable[[ItemProbe], bool] | None = None, alone: int = ALONE, peers: int = PEERS) -> None:
        self.compact = pair_rounds(pairs, cap=cap, itemsize_of=itemsize_of, apart=apart, alone=alone, peers=peers)
        self.items = pairs.count()  # the plan's items (the pieces a large one is cut into: compact.num_items)
        self.spans = Spans()  # the staged messages' byte spans, found on the first sync (the executor's)
        self.nbytes = self.compact.total_bytes()  # what this rank sends or receives dense
        self.fast: FastRounds | None = None  # compiled by a dense sync for the next ones (the executor's)

    def __iter__(self) -> Iterator[list[Message]]:
        return iter(self.compact)

    def __len__(self) -> int:
        return len(self.compact)

    def kept_bytes(self) -> int:
        """About the host bytes kept across syncs: the rounds' arrays, the spans found and the compiled rounds."""
        return self.compact.kept_bytes() + self.spans.nbytes() + (0 if self.fast is None else self.fast.nbytes())


def my_messages(plan: TransferPlan, sources: list[TensorSource], *, rank: int, sender: bool, cap: int,
                dense_only: Sequence[Collection[str]] = (), alone: int = ALONE, peers: int = PEERS) -> Rounds:
    """This rank's rounds (see :class:`Rounds`). ``dense_only[w]``: worker w's params that never take
    a delta (received in checkpoint layout and processed, or fallbacks); their small pieces are packed
    apart from the others' (the same cut on both ends: every rank has every worker's list); ``alone``:
    as in the schedule (:mod:`weightsync.plan.schedule`); ``peers``: the most peers a round has
    (``cap`` from :func:`~weightsync.plan.schedule.message_cap` with the same ``peers``)."""
    size = {s.name: dtype_itemsize(s.dtype) for s in sources}
    apart = None
    if any(dense_only):
        def apart(item: ItemProbe) -> bool:
            return item.param in dense_only[item.dst_rank]
    return Rounds(plan.pairs(rank, sender=sender), size.__getitem__, cap, apart, alone, peers)
