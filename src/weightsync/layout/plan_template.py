"""Planning one layout signature: source-region index, overlaps, least-loaded sender choice.

A *signature* is everything about a tensor's layout but its names: shape, dtype, the region
each trainer rank holds and the regions/param offsets each worker class takes.
:func:`plan_template` turns one signature into a :class:`Template` that every tensor with
that signature shares (see :mod:`weightsync.layout.plan_compact`).

Pure: no torch import. Not part of the public API.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from weightsync.layout.regions import Region

__all__ = ["Proto", "SourceLayout", "Template", "plan_template", "source_layout"]

# One planned piece of one destination piece: (region in the global tensor, offsets of the
# region in the source shard, index of the destination piece in the tensor's flat piece list,
# offsets of the region in the param, numel, index of the distinct source region it comes from).
Proto = tuple[Region, tuple[int, ...], int, tuple[int, ...], int, int]


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


def source_layout(name: str, shape: tuple[int, ...], regions: Sequence[Any]) -> SourceLayout:
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

    # protos[c]: the planned pieces of one tensor for a worker of class c, in global order
    protos: tuple[tuple[Proto, ...], ...]
    # choices[w]: the sending trainer rank of every proto of worker w's class
    choices: tuple[tuple[int, ...], ...]
    # number of items per tensor of this signature (all workers)
    count: int
    # memo: trainer rank -> ((dst, region, src_offsets, flat_index, param_offsets), ...)
    by_src: dict[int, tuple[tuple[Any, ...], ...]] = field(default_factory=dict)

    def protos_for_src(self, rank: int, worker_class: Sequence[int]) -> tuple[tuple[Any, ...], ...]:
        """What trainer ``rank`` sends for one tensor: ``(dst, region, src_offsets, flat, param_offsets)``."""
        hit = self.by_src.get(rank)
        if hit is not None:
            return hit
        positions: dict[int, list[int]] = {}
        out = []
        for w, choice in enumerate(self.choices):
            pos = positions.get(id(choice))
            if pos is None:
                pos = positions[id(choice)] = [i for i, r in enumerate(choice) if r == rank]
            protos = self.protos[worker_class[w]]
            for i in pos:
                p = protos[i]
                out.append((w, p[0], p[1], p[2], p[3]))
        result = self.by_src[rank] = tuple(out)
        return result

    def protos_for_dst(self, dst: int, worker_class: Sequence[int]) -> list[tuple[Any, ...]]:
        """What worker ``dst`` receives for one tensor: ``(src, region, src_offsets, flat, param_offsets)``."""
        return [
            (r, p[0], p[1], p[2], p[3]) for r, p in zip(self.choices[dst], self.protos[worker_class[dst]])
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
    """Plan one signature; replicated pieces go to the least-loaded holder (ties: lowest rank)."""
    protos: list[tuple[Proto, ...]] = []
    for c, pieces in enumerate(class_pieces):
        w0 = class_workers[c][0] if class_workers[c] else -1
        out: list[Proto] = []
        for flat, region, poff in pieces:
            _check_piece(name, w0, shape, region)
            if region.is_empty:
                continue
            key = (id(layout), region)
            found = overlap_cache.get(key)
            if found is None:
                found = overlap_cache[key] = _overlaps(name, w0, layout, region)
            for i, inter in found:
                src = layout.regions[i].offsets
                so = tuple(a - b for a, b in zip(inter.offsets, src))
                po = tuple(p + a - b for p, a, b in zip(poff, inter.offsets, region.offsets))
                out.append((inter, so, flat, po, inter.numel, i))
        protos.append(tuple(out))
    holders = layout.holders
    default = [tuple(holders[p[5]][0] for p in ps) for ps in protos]
    if all(len(h) == 1 for h in holders):
        choices = tuple(default[c] for c in worker_class)
        for c, ps in enumerate(protos):
            n = len(class_workers[c]) * weight * itemsize
            for p, r in zip(ps, default[c]):
                load[r] += p[4] * n
    else:
        seen: dict[tuple[int, ...], tuple[int, ...]] = {}
        picked = []
        for c in worker_class:
            choice = []
            for p in protos[c]:
                hs = holders[p[5]]
                r = hs[0] if len(hs) == 1 else min(hs, key=lambda x: (load[x], x))
                load[r] += p[4] * weight * itemsize
                choice.append(r)
            t = tuple(choice)
            picked.append(seen.setdefault(t, t))
        choices = tuple(picked)
    count = sum(len(protos[c]) for c in worker_class)
    return Template(tuple(protos), choices, count)
