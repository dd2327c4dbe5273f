"""FP8 on the wire (issue 38, mode (b)): which blocks a trainer rank quantizes and sends, planned.

With the trainer init info's ``fp8_wire=True``, every 2-D trainer tensor ``X`` in a quantizable
dtype, and every 3-D one (fused experts ``[E, rows, cols]``: blocks of the last two dims, one
expert each, so a block is ``(1, rows, cols)``), gets two derived sources, planned like any other
tensor (:func:`wire_sources`):

* ``X@fp8`` (``float8_e4m3fn``, ``X``'s shape): trainer rank r holds the *whole blocks* inside its
  shard of ``X`` (:func:`whole_blocks`: the box from the first block boundary in the shard to the
  last one, or to ``X``'s edge where the shard reaches it), quantized by that rank;
* ``X@scale`` (``float32``, ``X``'s shape in blocks): those blocks' ``weight_scale_inv``.

A worker whose piece of ``X`` lands in a block-FP8 weight asks for the part of it inside some rank's
whole blocks from ``X@fp8`` (into the layer's fp8 weight) and ``X@scale`` (into its block scales), and
for the rest, the blocks a shard boundary cuts, from ``X`` itself in the trainer's dtype, which it
quantizes as in mode (a) (:func:`split_piece`). A whole block's amax is its holder's alone, so both
ways give the reference quantizer's bytes. Every party derives the same sources from the agreed
ones, so nothing new crosses the store, and the plan's digest covers them.

Pure: no torch import.
"""

from __future__ import annotations

from collections.abc import Sequence

from weightsync.plan.regions import Region, subtract
from weightsync.plan.transfer import DestPiece, TensorSource

__all__ = ["FP8_SUFFIX", "SCALE_SUFFIX", "QUANTIZABLE", "WIRE_DTYPE", "SCALE_DTYPE", "whole_blocks",
           "block_region", "blocks_shape", "full_block", "wire_sources", "split_piece", "block_count", "check_block"]

FP8_SUFFIX = "@fp8"
"""``X@fp8``: the derived source of ``X``'s fp8 bytes (and the pseudo-parameter a worker receives them in)."""
SCALE_SUFFIX = "@scale"
"""``X@scale``: the derived source of ``X``'s float32 block scales."""
WIRE_DTYPE = "float8_e4m3fn"
SCALE_DTYPE = "float32"
QUANTIZABLE = ("bfloat16", "float16", "float32")
"""Trainer dtypes with derived sources (float32 holds each of them exactly)."""


def check_block(block: Sequence[int], what: str = "fp8_block") -> tuple[int, int]:
    """``block`` as ``(rows, cols)`` of positive ints; ``ValueError`` naming ``what`` otherwise."""
    got = tuple(block) if isinstance(block, (list, tuple)) else ()
    if len(got) != 2 or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in got):
        raise ValueError(f"{what} must be (rows, cols) of positive ints, got {block!r}")
    return got[0], got[1]


def full_block(block: Sequence[int], ndim: int) -> tuple[int, ...]:
    """``block`` (of the last two dims) for a tensor of ``ndim`` dims: one block per leading index."""
    return (1,) * (ndim - len(block)) + tuple(block)


def whole_blocks(region: Region, shape: Sequence[int], block: Sequence[int]) -> Region:
    """The box of the whole ``block``s of a tensor of ``shape`` that lie inside ``region`` (a partial
    block at the tensor's edge counts as whole); empty (sizes 0) where there is none."""
    offsets, sizes = [], []
    for o, s, n, b in zip(region.offsets, region.sizes, shape, full_block(block, len(shape))):
        lo, end = -(-o // b) * b, o + s
        hi = n if end == n else end // b * b
        offsets.append(min(lo, n))
        sizes.append(hi - lo if s > 0 and hi > lo else 0)
    if 0 in sizes:
        sizes = [0] * len(sizes)
    return Region(tuple(offsets), tuple(sizes))


def block_region(region: Region, block: Sequence[int]) -> Region:
    """A block-aligned ``region`` in block coordinates (a partial edge block is one block)."""
    block = full_block(block, len(region.offsets))
    return Region(tuple(o // b for o, b in zip(region.offsets, block)),
                  tuple(-(-s // b) for s, b in zip(region.sizes, block)))


def blocks_shape(shape: Sequence[int], block: Sequence[int]) -> tuple[int, ...]:
    """The shape of the block scales of a tensor of ``shape``."""
    return tuple(-(-n // b) for n, b in zip(shape, full_block(block, len(shape))))


def block_count(region: Region, block: Sequence[int]) -> int:
    """Blocks of a block-aligned ``region``."""
    n = 1
    for s in block_region(region, block).sizes:
        n *= s
    return n


def wire_sources(sources: Sequence[TensorSource], block: Sequence[int]) -> list[TensorSource]:
    """``sources`` followed by the derived ``X@fp8`` and ``X@scale`` of each 2-D or 3-D quantizable ``X``;
    ``ValueError`` naming the parameter where a trainer tensor already has a derived name."""
    names = {s.name for s in sources}
    # one tuple per layout (fast plans): (shape, regions) -> (whole blocks, their block regions)
    shared: dict[tuple[tuple[int, ...], tuple[Region, ...]], tuple[tuple[Region, ...], tuple[Region, ...]]] = {}
    out = list(sources)
    for s in sources:
        if len(s.shape) not in (2, 3) or s.dtype not in QUANTIZABLE:
            continue
        for derived in (s.name + FP8_SUFFIX, s.name + SCALE_SUFFIX):
            if derived in names:
                raise ValueError(f"parameter {derived!r}: the trainer sends a tensor of this name, which "
                                 f"fp8_wire=True takes for {s.name!r}'s quantized blocks")
        key = (s.shape, s.regions)
        if key not in shared:
            inner = tuple(whole_blocks(r, s.shape, block) for r in s.regions)
            shared[key] = inner, tuple(block_region(r, block) for r in inner)
        fp8, scales = shared[key]
        out.append(TensorSource(s.name + FP8_SUFFIX, s.shape, WIRE_DTYPE, fp8))
        out.append(TensorSource(s.name + SCALE_SUFFIX, blocks_shape(s.shape, block), SCALE_DTYPE, scales))
    return out


def split_piece(piece: DestPiece, source: TensorSource, block: Sequence[int], wire_param: str,
                scale_param: str) -> tuple[list[DestPiece], list[DestPiece]]:
    """``(wire pieces, staged pieces)`` of a worker's ``piece`` of ``source`` into a block-FP8 weight
    (whole blocks in the tensor and the parameter: ``worker.fp8.check_blocks``): the part inside a
    trainer rank's whole blocks comes from ``X@fp8`` into ``wire_param`` with its scales from
    ``X@scale`` into ``scale_param``; the rest from ``X`` into ``piece.param`` (the worker quantizes)."""
    wire: list[DestPiece] = []
    rest = [piece.region]
    for inner in dict.fromkeys(whole_blocks(r, source.shape, block) for r in source.regions):
        hit = piece.region.intersect(inner) if inner.numel else None
        if hit is None:
            continue
        at = _moved(piece, hit)
        wire.append(DestPiece(piece.name + FP8_SUFFIX, hit, wire_param, at))
        wire.append(DestPiece(piece.name + SCALE_SUFFIX, block_region(hit, block), scale_param,
                              tuple(a // b for a, b in zip(at, full_block(block, len(at))))))
        rest = [part for box in rest for part in subtract(box, hit)]
    return wire, [DestPiece(piece.name, box, piece.param, _moved(piece, box)) for box in rest]


def _moved(piece: DestPiece, box: Region) -> tuple[int, ...]:
    """Where ``box`` (inside ``piece.region``) lands in the piece's parameter."""
    return tuple(p + b - o for p, b, o in zip(piece.param_offsets, box.offsets, piece.region.offsets))
