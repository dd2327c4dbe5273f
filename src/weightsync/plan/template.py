"""Planning one layout signature: source-region index, overlaps, least-loaded sender choice.

A *signature* is everything about a tensor's layout but its names: shape, dtype, the region
each trainer rank holds and the regions/param offsets each worker class takes.
:func:`plan_template` turns one signature into a :class:`Template` that every tensor with
that signature shares (see :mod:`weightsync.plan.transfer`).

Pure: no torch import. Not part of the public API.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import NamedTuple

from weightsync.plan.regions import Region

__all__ = ["Proto", "RecvProto", "SendProto", "SourceLayout", "Template", "plan_template", "source_layout"]


class Proto(NamedTuple):
    """One planned copy of one tensor for a worker class: a destination piece's overlap with one
    source region. Names aside it is a TransferItem; the sender is chosen per worker (``Template.choices``)."""

    # the overlap, in the coordinates of the global tensor
    region: Region
    # region.offsets relative to the source region (the sender's local shard)
    src_offsets: tuple[int, ...]
    # index of the destination piece in the tensor's piece list (picks the param name)
    piece: int
    # where region.offsets lands in the param
    param_offsets: tuple[int, ...]
    # region.numel
    numel: int
    # index of the distinct source region (SourceLayout.regions) it is cut from
    source: int


class SendProto(NamedTuple):
    """What one trainer rank sends for one tensor: a Proto with its receiving worker."""

    # worker rank that receives
    dst: int
    # the overlap, in the coordinates of the global tensor
    region: Region
    # region.offsets relative to the sender's local shard
    src_offsets: tuple[int, ...]
    # index of the destination piece in the tensor's piece list (picks the param name)
    piece: int
    # where region.offsets lands in the param
    param_offsets: tuple[int, ...]


class RecvProto(NamedTuple):
    """What one worker receives for one tensor: a Proto with its sending trainer rank."""

    # trainer rank that sends
    src: int
    # the overlap, in the coordinates of the global tensor
    region: Region
    # region.offsets relative to the sender's local shard
    src_offsets: tuple[int, ...]
    # index of the destination piece in the tensor's piece list (picks the param name)
    piece: int
    # where region.offsets lands in the param
    param_offsets: tuple[int, ...]


@dataclass(frozen=True)
class SourceLayout:
    """The distinct non-empty source regions of a tensor and which trainer ranks hold each."""

    # distinct non-empty regions, ordered by their lowest holder rank
    regions: tuple[Region, ...]
    # holders[i]: ascending trainer ranks holding regions[i]
    holders: tuple[tuple[int, ...], ...]
    # the dim the lookup index sorts on (the one with most distinct offsets)
    split_dim: int
    # region indices sorted by offset along split_dim
    order: tuple[int, ...]
    # offsets / ends along split_dim in `order`; bisect-able when ends_sorted
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    ends_sorted: bool

    def candidates(self, region: Region) -> Sequence[int]:
        """Indices of the source regions that may overlap ``region``."""
        if region.ndim == 0 or not self.ends_sorted:
            return self.order
        d = self.split_dim
        lo = bisect.bisect_right(self.ends, region.offsets[d])
        hi = bisect.bisect_left(self.starts, region.offsets[d] + region.sizes[d])
        return self.order[lo:hi]


def source_layout(name: str, shape: tuple[int, ...], regions: Sequence[Region]) -> SourceLayout:
    """Validate one tensor's source regions and index them (raises ValueError naming tensor and rank)."""
    distinct: dict[Region, list[int]] = {}
    for rank, region in enumerate(regions):
        if not isinstance(region, Region):
            raise TypeError(f"source region of tensor {name!r} on trainer rank {rank} must be a Region, got {region!r}")
        if region.ndim != len(shape):
            raise ValueError(
                f"source region {region} of tensor {name!r} on trainer rank {rank} has ndim {region.ndim}, "
                f"tensor has ndim {len(shape)} (shape {shape})"
            )
        if region.is_empty:
            continue
        if any(o < 0 or o + s > n for o, s, n in zip(region.offsets, region.sizes, shape)):
            raise ValueError(
                f"source region {region} of tensor {name!r} on trainer rank {rank} is out of bounds for shape {shape}"
            )
        distinct.setdefault(region, []).append(rank)
    regs = tuple(distinct)
    holders = tuple(tuple(h) for h in distinct.values())
    ndim = len(shape)
    split_dim = 0
    if ndim:
        counts = [len({r.offsets[d] for r in regs}) for d in range(ndim)]
        split_dim = counts.index(max(counts))
    order = tuple(sorted(range(len(regs)), key=lambda i: (regs[i].offsets[split_dim] if ndim else 0, i)))
    starts = tuple(regs[i].offsets[split_dim] if ndim else 0 for i in order)
    ends = tuple(regs[i].end[split_dim] if ndim else 1 for i in order)
    # Equal regions were merged above; partially overlapping ones cannot be planned.
    active: list[int] = []
    for pos, i in enumerate(order):
        active = [j for j in active if not ndim or regs[j].end[split_dim] > starts[pos]]
        for j in active:
            if regs[j].intersect(regs[i]) is not None:
                raise ValueError(
                    f"source regions of tensor {name!r} overlap without being equal: trainer rank "
                    f"{holders[j][0]} holds {regs[j]}, trainer rank {holders[i][0]} holds {regs[i]}"
                )
        active.append(i)
    ends_sorted = all(a <= b for a, b in pairwise(ends))
    return SourceLayout(regs, holders, split_dim, order, starts, ends, ends_sorted)


@dataclass
class Template:
    """The plan of one signature, shared by every tensor that has it."""

    # protos[c]: the planned copies of one tensor for a worker of class c, in global order
    protos: tuple[tuple[Proto, ...], ...]
    # choices[w]: the sending trainer rank of every proto of worker w's class
    choices: tuple[tuple[int, ...], ...]
    # number of items per tensor of this signature (all workers)
    count: int
    # memo of protos_for_src: trainer rank -> what it sends
    by_src: dict[int, tuple[SendProto, ...]] = field(default_factory=dict)

    def protos_for_src(self, rank: int, worker_class: Sequence[int]) -> tuple[SendProto, ...]:
        """What trainer ``rank`` sends for one tensor of this signature, in global order."""
        hit = self.by_src.get(rank)
        if hit is not None:
            return hit
        # Workers of one class with one choice tuple share the positions this rank sends.
        positions: dict[int, list[int]] = {}
        out = []
        for w, choice in enumerate(self.choices):
            pos = positions.get(id(choice))
            if pos is None:
                pos = positions[id(choice)] = [i for i, r in enumerate(choice) if r == rank]
            protos = self.protos[worker_class[w]]
            for i in pos:
                p = protos[i]
                out.append(SendProto(w, p.region, p.src_offsets, p.piece, p.param_offsets))
        result = self.by_src[rank] = tuple(out)
        return result

    def protos_for_dst(self, dst: int, worker_class: Sequence[int]) -> list[RecvProto]:
        """What worker ``dst`` receives for one tensor of this signature, in global order."""
        return [
            RecvProto(r, p.region, p.src_offsets, p.piece, p.param_offsets)
            for r, p in zip(self.choices[dst], self.protos[worker_class[dst]])
        ]


def _overlaps(
    name: str, w: int, layout: SourceLayout, region: Region
) -> list[tuple[int, Region]]:
    """``(source region index, overlap)`` for every source region ``region`` meets, sorted by offsets."""
    out = []
    covered = 0
    for i in layout.candidates(region):
        inter = layout.regions[i].intersect(region)
        if inter is not None:
            out.append((i, inter))
            covered += inter.numel
    if covered != region.numel:
        raise ValueError(
            f"destination region {region} of tensor {name!r} on worker {w} is not covered by the "
            f"source regions ({covered} of {region.numel} elements held by trainer ranks)"
        )
    out.sort(key=lambda x: x[1].offsets)
    return out


def _check_piece(name: str, w: int, shape: tuple[int, ...], region: Region) -> None:
    """Raise ValueError when a destination region does not fit the tensor."""
    if region.ndim != len(shape):
        raise ValueError(
            f"destination region {region} of tensor {name!r} on worker {w} has ndim {region.ndim}, "
            f"tensor has ndim {len(shape)} (shape {shape})"
        )
    if not region.is_empty and any(o < 0 or o + s > n for o, s, n in zip(region.offsets, region.sizes, shape)):
        raise ValueError(
            f"destination region {region} of tensor {name!r} on worker {w} is out of bounds for shape {shape}"
        )


def _class_protos(
    name: str,
    shape: tuple[int, ...],
    layout: SourceLayout,
    pieces: Sequence[tuple[int, Region, tuple[int, ...]]],
    w0: int,
    overlap_cache: dict[tuple[int, Region], list[tuple[int, Region]]],
) -> tuple[Proto, ...]:
    """Cut one worker class's destination pieces ``(piece index, region, param offsets)`` of one
    tensor into Protos: one per overlap with a source region, in piece order then offset order.

    ``w0`` (the class's first worker) names the worker in errors; overlaps are cached per
    (source layout, region), as many signatures share both.
    """
    out: list[Proto] = []
    for piece, region, param_offsets in pieces:
        _check_piece(name, w0, shape, region)
        if region.is_empty:
            continue
        key = (id(layout), region)
        found = overlap_cache.get(key)
        if found is None:
            found = overlap_cache[key] = _overlaps(name, w0, layout, region)
        for source, inter in found:
            src_origin = layout.regions[source].offsets
            src_offsets = tuple(a - b for a, b in zip(inter.offsets, src_origin))
            to_param = tuple(p + a - b for p, a, b in zip(param_offsets, inter.offsets, region.offsets))
            out.append(Proto(inter, src_offsets, piece, to_param, inter.numel, source))
    return tuple(out)


def _choose_senders(
    protos: Sequence[tuple[Proto, ...]],
    holders: Sequence[tuple[int, ...]],
    class_workers: Sequence[Sequence[int]],
    worker_class: Sequence[int],
    bytes_per_elem: int,
    load: list[int],
) -> tuple[tuple[int, ...], ...]:
    """The sending trainer rank of every proto, per worker, charging ``load`` (bytes per rank).

    ``bytes_per_elem`` is the itemsize times the number of tensors of the signature. A proto
    with one holder goes to it; a replicated one to the holder with the least load so far,
    ties to the lowest rank, worker by worker in rank order. Equal choice tuples are shared.
    """
    if all(len(h) == 1 for h in holders):  # no replication: one pass per class, not per worker
        default = [tuple(holders[p.source][0] for p in ps) for ps in protos]
        for c, ps in enumerate(protos):
            n = len(class_workers[c]) * bytes_per_elem
            for p, r in zip(ps, default[c]):
                load[r] += p.numel * n
        return tuple(default[c] for c in worker_class)
    seen: dict[tuple[int, ...], tuple[int, ...]] = {}
    picked = []
    for c in worker_class:
        choice = []
        for p in protos[c]:
            hs = holders[p.source]
            r = hs[0] if len(hs) == 1 else min(hs, key=lambda x: (load[x], x))
            load[r] += p.numel * bytes_per_elem
            choice.append(r)
        t = tuple(choice)
        picked.append(seen.setdefault(t, t))
    return tuple(picked)


def plan_template(
    name: str,
    shape: tuple[int, ...],
    itemsize: int,
    layout: SourceLayout,
    class_pieces: Sequence[Sequence[tuple[int, Region, tuple[int, ...]]]],
    class_workers: Sequence[Sequence[int]],
    worker_class: Sequence[int],
    weight: int,
    load: list[int],
    overlap_cache: dict[tuple[int, Region], list[tuple[int, Region]]],
) -> Template:
    """Plan one signature held by ``weight`` tensors: cut every class's pieces into Protos, then
    choose each worker's senders (replicated pieces to the least-loaded holder; ties: lowest rank)."""
    protos = [
        _class_protos(name, shape, layout, pieces, workers[0] if workers else -1, overlap_cache)
        for pieces, workers in zip(class_pieces, class_workers)
    ]
    choices = _choose_senders(protos, layout.holders, class_workers, worker_class, weight * itemsize, load)
    count = sum(len(protos[c]) for c in worker_class)
    return Template(tuple(protos), choices, count)
