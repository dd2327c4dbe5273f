"""Regions of a global tensor and the regions DTensor placements give each rank.

A :class:`Region` is a box ``(offsets, sizes)`` in a global tensor. :func:`local_region`
computes the box a rank of a device mesh holds under DTensor placements, with torch's exact
semantics (uneven ``torch.chunk``-style shards, empty shards placed at the end of the
dimension, several mesh dimensions splitting one tensor dimension in mesh order).

Coverage: a sync must write every element of every live parameter it claims (or the caller must
exclude what it leaves, e.g. a vocabulary's padding rows): a source that omits one half of a fused
vLLM parameter would otherwise leave that half as it was, or zero, and the engine would serve a
broken model. :func:`uncovered` answers "what is left" as disjoint boxes, before any data moves.

Pure: no torch import, plain ints and tuples in, frozen dataclasses out.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

__all__ = [
    "Placement",
    "Region",
    "Replicate",
    "Shard",
    "box_slices",
    "format_regions",
    "local_region",
    "mesh_coordinates",
    "placements_from_torch",
    "source_regions",
    "subtract",
    "uncovered",
]


def _int_tuple(value: Iterable[int], param: str) -> tuple[int, ...]:
    """Return ``value`` as a tuple of ints or raise TypeError naming ``param`` (checked: callers may be untyped)."""
    try:
        out = tuple(value)
    except TypeError:
        raise TypeError(f"{param} must be a sequence of ints, got {value!r}") from None
    for item in out:
        if isinstance(item, bool) or not isinstance(item, int):
            raise TypeError(f"{param} must be a sequence of ints, got {value!r}")
    return out


@dataclass(frozen=True)
class Region:
    """A box in a global tensor: ``sizes[d]`` elements from ``offsets[d]`` in every dim ``d``.

    A 0-dim region (``offsets == sizes == ()``) is the single element of a scalar tensor.
    """

    # first index of the box in every dimension of the global tensor
    offsets: tuple[int, ...]
    # number of elements of the box in every dimension (0 makes the region empty)
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        offsets = _int_tuple(self.offsets, "offsets")
        sizes = _int_tuple(self.sizes, "sizes")
        if len(offsets) != len(sizes):
            raise ValueError(
                f"offsets and sizes must have the same length, got offsets {offsets} and sizes {sizes}"
            )
        if any(s < 0 for s in sizes):
            raise ValueError(f"sizes must be non-negative, got {sizes} (offsets {offsets})")
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "sizes", sizes)

    @classmethod
    def full(cls, shape: Sequence[int]) -> Region:
        """The region covering a whole tensor of ``shape``."""
        sizes = _int_tuple(shape, "shape")
        return cls((0,) * len(sizes), sizes)

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.sizes)

    @property
    def numel(self) -> int:
        """Number of elements (1 for a 0-dim region)."""
        return math.prod(self.sizes)

    @property
    def is_empty(self) -> bool:
        """True when the region holds no element."""
        return 0 in self.sizes

    @property
    def end(self) -> tuple[int, ...]:
        """One past the last index in every dimension (``offsets + sizes``)."""
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def intersect(self, other: Region) -> Region | None:
        """The overlap of two regions of the same tensor, or None when they share no element."""
        if other.ndim != self.ndim:
            raise ValueError(
                f"cannot intersect regions of different ndim: {self} and {other}"
            )
        offsets = []
        sizes = []
        for o1, s1, o2, s2 in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            lo = max(o1, o2)
            hi = min(o1 + s1, o2 + s2)
            if hi <= lo:
                return None
            offsets.append(lo)
            sizes.append(hi - lo)
        return _region_unchecked(tuple(offsets), tuple(sizes))

    def shift(self, origin_offsets: Sequence[int]) -> Region:
        """This region with offsets relative to ``origin_offsets`` (e.g. another region's offsets)."""
        origin = _int_tuple(origin_offsets, "origin_offsets")
        if len(origin) != self.ndim:
            raise ValueError(
                f"origin_offsets must have {self.ndim} entries for region {self}, got {origin}"
            )
        return Region(tuple(o - b for o, b in zip(self.offsets, origin)), self.sizes)

    def contains(self, other: Region) -> bool:
        """True when every element of ``other`` lies in this region (an empty ``other`` always does)."""
        if other.ndim != self.ndim:
            raise ValueError(f"cannot compare regions of different ndim: {self} and {other}")
        if other.is_empty:
            return True
        return all(
            o1 <= o2 and o2 + s2 <= o1 + s1
            for o1, s1, o2, s2 in zip(self.offsets, self.sizes, other.offsets, other.sizes)
        )

    def slices(self) -> tuple[slice[int, int, None], ...]:
        """Python slices that select this region from the global tensor (``t[region.slices()]``)."""
        return box_slices(self.offsets, self.sizes)


def box_slices(offsets: Sequence[int], sizes: Sequence[int]) -> tuple[slice[int, int, None], ...]:
    """Python slices that select the box at ``offsets`` of ``sizes`` (``t[box_slices(o, s)]``)."""
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes))


def _region_unchecked(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Region:
    """A Region from values already known valid (skips ``__post_init__``; hot paths only)."""
    region = object.__new__(Region)
    object.__setattr__(region, "offsets", offsets)
    object.__setattr__(region, "sizes", sizes)
    return region


@dataclass(frozen=True)
class Shard:
    """The tensor dimension ``dim`` is split over one mesh dimension (DTensor ``Shard``)."""

    # tensor dimension being split; negative values count from the end
    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"Shard.dim must be an int, got {self.dim!r}")


@dataclass(frozen=True)
class Replicate:
    """Every rank along one mesh dimension holds the same data (DTensor ``Replicate``)."""


Placement = Shard | Replicate


class TorchPlacement(Protocol):
    """What is read of a DTensor placement (``torch.distributed.tensor.Placement``), duck-typed so
    torch is not imported: ``is_shard()`` / ``is_replicate()``, and ``dim`` where ``is_shard()``."""

    def is_shard(self) -> bool: ...

    def is_replicate(self) -> bool: ...


class _TorchShard(TorchPlacement, Protocol):
    """A DTensor ``Shard``: a placement whose ``is_shard()`` is true."""

    @property
    def dim(self) -> int: ...


def placements_from_torch(placements: Sequence[Placement | TorchPlacement]) -> tuple[Placement, ...]:
    """Convert DTensor placements (or ours) to :class:`Shard` / :class:`Replicate`.

    Duck-typed on ``is_shard()`` / ``is_replicate()`` and ``dim`` so torch is not imported.
    ``_StridedShard`` and ``Partial`` placements are rejected with ValueError.
    """
    out: list[Placement] = []
    for i, p in enumerate(placements):
        if isinstance(p, (Shard, Replicate)):
            out.append(p)
        elif getattr(p, "split_factor", None) is not None:
            raise ValueError(f"placements[{i}] is a strided shard, which is not supported: {p!r}")
        elif hasattr(p, "is_shard") and p.is_shard():
            out.append(Shard(cast("_TorchShard", p).dim))
        elif hasattr(p, "is_replicate") and p.is_replicate():
            out.append(Replicate())
        else:
            raise ValueError(f"placements[{i}] must be a Shard or Replicate placement, got {p!r}")
    return tuple(out)


def _check_mesh(mesh_shape: tuple[int, ...], placements: tuple[Placement, ...]) -> None:
    """Validate a mesh shape against its placements."""
    if len(placements) != len(mesh_shape):
        raise ValueError(
            f"placements must have one entry per mesh dim: mesh_shape {mesh_shape}, placements {placements}"
        )
    if any(n <= 0 for n in mesh_shape):
        raise ValueError(f"mesh_shape entries must be positive, got {mesh_shape}")


def local_region(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement | TorchPlacement],
) -> Region:
    """The region of a DTensor of ``global_shape`` held by the rank at ``coordinate`` in the mesh.

    Matches ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``: a
    ``Shard(d)`` on mesh dim ``m`` splits the current local piece of dim ``d`` into
    ``mesh_shape[m]`` chunks of ``ceil(size / n)`` (the last ones smaller or empty); mesh dims
    apply in order, so two mesh dims sharding one tensor dim nest. An empty shard's offset in
    that dim is ``global_shape[d]``, as in torch.
    """
    shape = _int_tuple(global_shape, "global_shape")
    mesh = _int_tuple(mesh_shape, "mesh_shape")
    coord = _int_tuple(coordinate, "coordinate")
    places = placements_from_torch(placements)
    _check_mesh(mesh, places)
    if len(coord) != len(mesh):
        raise ValueError(f"coordinate {coord} must have one entry per mesh dim of mesh_shape {mesh}")
    if any(s < 0 for s in shape):
        raise ValueError(f"global_shape entries must be non-negative, got {shape}")
    offsets = [0] * len(shape)
    sizes = list(shape)
    for m, place in enumerate(places):
        if not 0 <= coord[m] < mesh[m]:
            raise ValueError(f"coordinate {coord} is outside mesh_shape {mesh} in mesh dim {m}")
        if isinstance(place, Replicate):
            continue
        d = place.dim + len(shape) if place.dim < 0 else place.dim
        if not 0 <= d < len(shape):
            raise ValueError(f"{place} on mesh dim {m} is out of range for global_shape {shape}")
        size, n = sizes[d], mesh[m]
        chunk = -(-size // n)
        start = min(chunk * coord[m], size)
        new_size = max(0, min(size, start + chunk) - start)
        sizes[d] = new_size
        offsets[d] = offsets[d] + start if new_size > 0 else shape[d]
    return Region(tuple(offsets), tuple(sizes))


def mesh_coordinates(mesh_shape: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Coordinates of every rank of a mesh, in row-major rank order (as ``DeviceMesh`` numbers them)."""
    mesh = _int_tuple(mesh_shape, "mesh_shape")
    if any(n <= 0 for n in mesh):
        raise ValueError(f"mesh_shape entries must be positive, got {mesh}")
    return tuple(itertools.product(*(range(n) for n in mesh)))


def source_regions(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement | TorchPlacement],
    rank_coordinates: Sequence[Sequence[int]],
) -> tuple[Region, ...]:
    """One :func:`local_region` per trainer rank, ``rank_coordinates[r]`` being rank r's mesh coordinate.

    Ranks with equal regions (replicated along a mesh dim) share one Region object.
    """
    shape = _int_tuple(global_shape, "global_shape")
    mesh = _int_tuple(mesh_shape, "mesh_shape")
    places = placements_from_torch(placements)
    seen: dict[Region, Region] = {}
    out = []
    for coord in rank_coordinates:
        region = local_region(shape, mesh, coord, places)
        out.append(seen.setdefault(region, region))
    return tuple(out)


def subtract(box: Region, cut: Region) -> list[Region]:
    """``box`` minus ``cut``, as at most ``2 * ndim`` disjoint boxes (``[box]`` when they do not overlap)."""
    overlap = box.intersect(cut)
    if overlap is None:
        return [] if box.is_empty else [box]
    out: list[Region] = []
    offsets, sizes = list(box.offsets), list(box.sizes)
    for d in range(box.ndim):
        lo, hi = overlap.offsets[d], overlap.offsets[d] + overlap.sizes[d]
        if lo > offsets[d]:  # the slab before the overlap along d (full extent in the later dims)
            out.append(Region(tuple(offsets[:d] + [offsets[d]] + offsets[d + 1:]),
                              tuple(sizes[:d] + [lo - offsets[d]] + sizes[d + 1:])))
        end = offsets[d] + sizes[d]
        if hi < end:  # the slab after it
            out.append(Region(tuple(offsets[:d] + [hi] + offsets[d + 1:]),
                              tuple(sizes[:d] + [end - hi] + sizes[d + 1:])))
        offsets[d], sizes[d] = lo, hi - lo  # keep narrowing to the overlap in this dim
    return out


def uncovered(shape: Sequence[int], written: Iterable[Region]) -> list[Region]:
    """The parts of a tensor of ``shape`` that no region of ``written`` touches, as disjoint boxes."""
    left = [] if 0 in tuple(shape) else [Region.full(shape)]
    for cut in written:
        left = [part for box in left for part in subtract(box, cut)]
        if not left:
            break
    return left


def format_regions(regions: Sequence[Region], limit: int = 3) -> str:
    """``[0:4, 8:16], ...`` (index ranges per dim) for error messages."""
    shown = ["[" + ", ".join(f"{o}:{o + s}" for o, s in zip(r.offsets, r.sizes)) + "]" for r in regions[:limit]]
    more = f" and {len(regions) - limit} more" if len(regions) > limit else ""
    return ", ".join(shown) + more
