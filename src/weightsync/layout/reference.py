"""Single-process reference executor: the specification every real transport must match.

:func:`execute_reference` performs a :class:`~weightsync.layout.plan.TransferPlan` with plain
tensor copies, all ranks' tensors in one process. A transport is correct when, for the same
plan and inputs, its workers' params end up equal to what this writes. Two plan-free helpers
make test oracles: :func:`make_local_shards` cuts full tensors into each trainer rank's shards,
and :func:`write_destinations` writes what the destination pieces say a param must hold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from weightsync.layout.plan import TransferPlan
from weightsync.layout.records import DestPiece, TensorSource
from weightsync.layout.regions import Region, box_slices

__all__ = ["execute_reference", "make_local_shards", "shard_tensor", "write_destinations"]


def shard_tensor(full: torch.Tensor, region: Region) -> torch.Tensor:
    """The part of ``full`` (a global tensor) that ``region`` covers, as a view."""
    if full.dim() != region.ndim:
        raise ValueError(f"region {region} has ndim {region.ndim}, tensor has shape {tuple(full.shape)}")
    return full[region.slices()]


def _box(tensor: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...], what: str) -> torch.Tensor:
    """View of ``tensor`` at ``offsets`` of ``sizes``; ValueError if it does not fit."""
    if tensor.dim() != len(sizes) or any(o < 0 or o + s > n for o, s, n in zip(offsets, sizes, tensor.shape)):
        raise ValueError(
            f"{what}: box at offsets {offsets} of sizes {sizes} does not fit a tensor of shape {tuple(tensor.shape)}"
        )
    return tensor[box_slices(offsets, sizes)]


def execute_reference(
    plan: TransferPlan,
    local_shards: Mapping[int, Mapping[str, torch.Tensor]],
    params: Mapping[int, Mapping[str, torch.Tensor]],
) -> None:
    """Copy every item of ``plan`` from ``local_shards[src][name]`` into ``params[dst][param]``.

    ``local_shards[r][name]`` is trainer rank r's local shard of tensor ``name`` (the data of
    its source region); ``params[w][param]`` is worker w's parameter, written in place.
    """
    for item in plan.iter_items():
        try:
            src = local_shards[item.src_rank][item.name]
        except KeyError:
            raise ValueError(f"local_shards has no tensor {item.name!r} for trainer rank {item.src_rank}") from None
        try:
            dst = params[item.dst_rank][item.param]
        except KeyError:
            raise ValueError(f"params has no param {item.param!r} for worker {item.dst_rank}") from None
        sizes = item.region.sizes
        piece = _box(src, item.src_offsets, sizes, f"{item.name!r} on trainer rank {item.src_rank}")
        _box(dst, item.param_offsets, sizes, f"{item.param!r} on worker {item.dst_rank}").copy_(piece)


def make_local_shards(
    full: Mapping[str, torch.Tensor], sources: Sequence[TensorSource]
) -> dict[int, dict[str, torch.Tensor]]:
    """``{rank: {name: shard}}``: each trainer rank's local shard (a clone) of every source tensor."""
    shards: dict[int, dict[str, torch.Tensor]] = {}
    for src in sources:
        tensor = full.get(src.name)
        if tensor is None:
            raise ValueError(f"full has no tensor {src.name!r}")
        if tuple(tensor.shape) != src.shape:
            raise ValueError(f"full[{src.name!r}] has shape {tuple(tensor.shape)}, the source says {src.shape}")
        for rank, region in enumerate(src.regions):
            shards.setdefault(rank, {})[src.name] = shard_tensor(tensor, region).clone()
    return shards


def write_destinations(
    full: Mapping[str, torch.Tensor],
    destinations: Sequence[Sequence[DestPiece]],
    params: Mapping[int, Mapping[str, torch.Tensor]],
) -> None:
    """Write every destination piece straight from the full tensors (the plan-free oracle)."""
    for worker, pieces in enumerate(destinations):
        for piece in pieces:
            try:
                dst = params[worker][piece.param]
            except KeyError:
                raise ValueError(f"params has no param {piece.param!r} for worker {worker}") from None
            region = piece.region
            box = _box(dst, piece.param_offsets, region.sizes, f"{piece.param!r} on worker {worker}")
            box.copy_(shard_tensor(full[piece.name], region))
