"""Which parts of a tensor a set of writes leaves untouched (pure: regions in, regions out).

A sync must write every element of every live parameter it claims (or the caller must exclude
what it leaves, e.g. a vocabulary's padding rows): a source that omits one half of a fused vLLM
parameter would otherwise leave that half as it was, or zero, and the engine would serve a
broken model. :func:`uncovered` answers "what is left" as disjoint boxes, before any data moves.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from weightsync.layout.regions import Region

__all__ = ["subtract", "uncovered", "format_regions"]


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
