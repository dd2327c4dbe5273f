"""M2N into block-FP8 engines, both ends: where the blocks are quantized (issue 38).

Mode (a), always possible: each worker receives its shard of a block-FP8 weight in the trainer's dtype
and quantizes it (``worker/fp8.py``). Mode (b), the trainer init info's ``fp8_wire=True``: a block
that lies inside one trainer shard is quantized by the trainer rank that holds it and sent as fp8
bytes plus its float32 scale (about half the bytes); a block a shard boundary cuts still goes in the
trainer's dtype and the worker quantizes it, as in mode (a). The planning is
:mod:`weightsync.plan.fp8_blocks`; here:

* :class:`TrainerWire`: a trainer rank's quantized whole blocks of each shard the plan sends as FP8
  (the reference quantizer, :func:`weightsync.worker.fp8.quantize_blocks`, on the values as the
  wire would carry them, so both modes give the same bytes);
* :func:`split_dests`: a worker's pieces into block-FP8 weights split into what comes quantized
  (into the layer's checkpoint-layout fp8 ``weight``, received as the pseudo-parameter
  ``<weight>@fp8``, and its ``weight_scale_inv``) and what it quantizes (the boxes of
  ``WorkerWire.staged``), with the blocks counted for the sync's stats.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypedDict, cast

import torch

from ..plan.fp8_blocks import FP8_SUFFIX, SCALE_SUFFIX, block_count, split_piece, whole_blocks
from ..plan.regions import Region, box_slices
from ..plan.schedule import Message
from ..plan.transfer import DestPiece, TensorSource, dtype_itemsize
from ..protocol import dtype_from_name
from ..worker.destinations import WorkerDestinations
from ..worker.fp8 import block_size, quantize_blocks, scale_name

__all__ = ["TrainerWire", "WireStats", "WorkerWire", "split_dests", "wire_stats"]


class TrainerWire:
    """What one trainer rank sends quantized: the base tensors whose ``X@fp8`` the plan has this rank
    send (read from its rounds once, at init)."""

    def __init__(self, sources: Sequence[TensorSource], block: tuple[int, int], rank: int,
                 rounds: Iterable[list[Message]]) -> None:
        cut = len(FP8_SUFFIX)
        names = {it.name[:-cut] for rnd in rounds for m in rnd for it in m.items if it.name.endswith(FP8_SUFFIX)}
        self.sources = [s for s in sources if s.name in names]
        self.block, self.rank = block, rank

    @torch.no_grad()
    def tensors(self, shards: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``X@fp8`` and ``X@scale`` of this rank's whole blocks of each such shard ``X``: what it
        holds of the derived sources (their regions), quantized from the values in the wire dtype."""
        out: dict[str, torch.Tensor] = {}
        for s in self.sources:
            shard, held = shards[s.name], s.regions[self.rank]
            inner = whole_blocks(held, s.shape, self.block)
            local = shard[box_slices(tuple(i - o for i, o in zip(inner.offsets, held.offsets)), inner.sizes)]
            wire = dtype_from_name(s.dtype)
            q, scale = quantize_blocks(local if local.dtype == wire else local.to(wire), self.block)
            out[s.name + FP8_SUFFIX], out[s.name + SCALE_SUFFIX] = q, scale
        return out


@dataclass
class WorkerWire:
    """A worker's pieces as it asks the plan for them, and where its block-FP8 weights come from."""

    pieces: list[DestPiece]
    wire_params: list[str] = field(default_factory=list)  # <weight>@fp8 pseudo-parameters (never deltas)
    staged: dict[str, list[Region]] = field(default_factory=dict)  # FP8 weight -> boxes the worker quantizes
    blocks: dict[str, int] = field(default_factory=lambda: {"trainer": 0, "worker": 0})
    saved_bytes: int = 0  # what mode (a) would receive more (fp8 instead of the trainer's dtype, less scales)

    def to_wire(self) -> dict[str, int]:
        return {**self.blocks, "saved_bytes": self.saved_bytes}


def split_dests(model: torch.nn.Module, dests: WorkerDestinations, sources: Sequence[TensorSource],
                block: Sequence[int] | None) -> WorkerWire:
    """Worker side: ``dests``' pieces with those into block-FP8 weights split for FP8 on the wire
    (``block``: the trainer's ``fp8_block``; None: mode (a), nothing split, the blocks counted).
    ``ValueError`` naming the parameter where the model's blocks are not the trainer's."""
    quantized = set(dests.quantized)
    by_name = {s.name: s for s in sources}
    out = WorkerWire([])
    blocks: dict[str, tuple[int, int]] = {}
    for p in dests.pieces:
        if p.param not in quantized:
            out.pieces.append(p)
            continue
        mine = blocks.get(p.param) or blocks.setdefault(p.param, _model_block(model, p.param))
        if block is None:
            out.pieces.append(p)
            out.blocks["worker"] += block_count(p.region, mine)
            continue
        if tuple(block) != mine:
            raise ValueError(f"parameter {p.name!r}: the trainer quantizes {block[0]} x {block[1]} blocks "
                             f"(fp8_block), vLLM's {p.param} has {mine[0]} x {mine[1]} (weight_block_size)")
        scale = cast(str, scale_name(p.param.rpartition(".")[2]))  # (a block-FP8 weight has its scale)
        _split(out, p, by_name[p.name], mine, scale)
    if block is not None:
        out.wire_params = list(dict.fromkeys(p.param for p in out.pieces if p.param.endswith(FP8_SUFFIX)))
    return out


def _split(out: WorkerWire, p: DestPiece, source: TensorSource, block: tuple[int, int], scale_attr: str) -> None:
    path = p.param.rpartition(".")[0]
    wire, staged = split_piece(p, source, block, p.param + FP8_SUFFIX, f"{path}.{scale_attr}")
    out.pieces.extend(wire + staged)
    boxes = out.staged.setdefault(p.param, [])
    boxes.extend(Region(q.param_offsets, q.region.sizes) for q in staged)
    out.blocks["worker"] += sum(block_count(q.region, block) for q in staged)
    itemsize = dtype_itemsize(source.dtype)
    for q in wire:
        if q.name.endswith(SCALE_SUFFIX):
            out.blocks["trainer"] += q.region.numel
            out.saved_bytes -= 4 * q.region.numel
        else:
            out.saved_bytes += (itemsize - 1) * q.region.numel


def _model_block(model: torch.nn.Module, param: str) -> tuple[int, int]:
    path = param.rpartition(".")[0]
    got = block_size(model.get_submodule(path), param)
    if got is None:  # pragma: no cover - dests.quantized lists block-FP8 weights only
        raise ValueError(f"parameter {param!r}: not a block-FP8 weight")
    return got


class WireStats(TypedDict, total=False):
    """The sync stats' FP8 fields (``M2NSyncStats``), where any block is quantized."""

    fp8_blocks_per_worker: dict[int, dict[str, int]]
    unquantized_bytes_per_worker: dict[int, int]


def wire_stats(fp8: Sequence[Mapping[str, int]], lower_bound: Mapping[int, int]) -> WireStats:
    """Rank 0: the sync stats' FP8 fields from every worker's published counts."""
    if not any(f.get("trainer", 0) or f.get("worker", 0) for f in fp8):
        return {}
    return {"fp8_blocks_per_worker": {w: {"trainer": f.get("trainer", 0), "worker": f.get("worker", 0)}
                                      for w, f in enumerate(fp8)},
            "unquantized_bytes_per_worker": {w: lower_bound.get(w, 0) + f.get("saved_bytes", 0)
                                             for w, f in enumerate(fp8)}}


def with_pieces(dests: WorkerDestinations, wire: WorkerWire) -> WorkerDestinations:
    """``dests`` with the pieces the worker asks the plan for, the pseudo-parameters among its via-loader ones."""
    return dataclasses.replace(dests, pieces=tuple(wire.pieces), via_loader=(*dests.via_loader, *wire.wire_params))
