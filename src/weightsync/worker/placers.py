"""The placers: where one HF tensor lands in one vLLM linear or embedding layer on this worker.

A :class:`Target` is one HF tensor with the vLLM parameter it reaches (read from the model by
:mod:`weightsync.worker.destinations`). Each placer handles one layout and returns :class:`Placed`
(block copies: HF region -> parameter offset), :class:`Unplaced` (why not: the whole tensor then goes
to the parameter's own loader, a counted fallback), or None when the layer is not its kind;
:func:`place` runs them in order. The layouts, each from the layer's own sharding attributes (no
per-model table):

* one part of a fused layer: ``QKVParallelLinear`` q/k/v (heads, KV-head replicas),
  ``MergedColumnParallelLinear`` gate/up (``output_sizes``);
* a **pre-fused** checkpoint tensor (Phi3's ``qkv_proj``, ``gate_up_proj``): the fused layer's own
  tensor, which its loader splits at the same offsets, so this worker's slice is the concatenation of
  its part slices. Only where vLLM's ``load_weights`` is seen to hand the layer's loader the
  checkpoint's tensor unchanged (:func:`~weightsync.worker.destinations.probe_prefused`;
  Falcon's regroups interleaved heads first);
* column- and row-parallel, replicated (e.g. a MoE router), vocab-parallel (padding rows excluded),
  and a parameter held whole (norms).

The fused-MoE and per-expert placers: :mod:`weightsync.worker.experts`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..plan.regions import Region
from ..plan.transfer import DestPiece

__all__ = ["Placed", "Unplaced", "Placement", "Target", "Part", "FUSED_LAYERS", "PLACERS", "place", "fused_parts"]


@dataclass(frozen=True)
class Placed:
    """The tensor lands by block copies: ``pieces`` (HF regions -> offsets in ``param``)."""

    param: str  # the vLLM parameter
    pieces: tuple[DestPiece, ...]


@dataclass(frozen=True)
class Unplaced:
    """No block copy is proven: the whole tensor goes through the parameter's loader (a fallback)."""

    reason: str
    param: str | None = None  # the vLLM parameter that loader writes (None: no parameter known)


Placement = Placed | Unplaced

FUSED_LAYERS = ("QKVParallelLinear", "MergedColumnParallelLinear")
"""The fused layers whose splitting this module knows (exact classes: a subclass may split otherwise)."""


@dataclass(frozen=True)
class Target:
    """One HF tensor and the vLLM parameter it reaches on this worker."""

    name: str  # HF tensor name
    shape: tuple[int, ...]  # its global shape (the trainer's)
    param_name: str  # the vLLM parameter
    module: Any  # its layer
    param: torch.Tensor  # the parameter as the loader writes it (checkpoint layout)
    shard: Any = None  # the loaded shard id ("q"/"k"/"v", 0/1) when the tensor is one part of a fused layer
    prefused_doubt: str | None = None  # for a pre-fused tensor: why vLLM's load_weights is not seen to pass it as is

    @property
    def cls(self) -> str:
        return type(self.module).__name__

    @property
    def out_dim(self) -> int | None:
        return getattr(self.param, "output_dim", None)

    @property
    def in_dim(self) -> int | None:
        return getattr(self.param, "input_dim", None)


def _box(shape: Sequence[int], dim: int, start: int, size: int) -> Region:
    offsets, sizes = [0] * len(shape), list(shape)
    offsets[dim], sizes[dim] = start, size
    return Region(tuple(offsets), tuple(sizes))


def _at(ndim: int, dim: int, offset: int) -> tuple[int, ...]:
    return tuple(offset if d == dim else 0 for d in range(ndim))


def _glob(param: torch.Tensor, dim: int, size: int) -> tuple[int, ...]:
    """``param``'s shape with ``dim`` widened to the global ``size`` (the HF tensor's shape)."""
    return tuple(size if d == dim else int(n) for d, n in enumerate(param.shape))


def _placed(t: Target, expected: tuple[int, ...], blocks: Sequence[tuple[Region, tuple[int, ...]]]) -> Placed:
    """``blocks`` (HF region, parameter offsets) as pieces, once the trainer's shape is the HF shape
    vLLM's layer was built for (``expected``: a larger trainer tensor is refused, never truncated)."""
    shape = t.shape
    if shape != expected:
        d = next(d for d, (a, b) in enumerate(zip(shape, expected)) if a != b)
        raise ValueError(f"parameter {t.name!r}: the trainer's shape {shape} does not match vLLM's {t.param_name} "
                         f"{tuple(t.param.shape)} on this TP rank: vLLM's model expects {expected} "
                         f"(dim {d}: {expected[d]}, the trainer's {shape[d]})")
    for region, offsets in blocks:
        if any(o + s > p for o, s, p in zip(offsets, region.sizes, t.param.shape)) or any(
                o + s > g for o, s, g in zip(region.offsets, region.sizes, shape)):
            raise ValueError(f"parameter {t.name!r}: the trainer's shape {shape} does not match vLLM's "
                             f"{t.param_name} {tuple(t.param.shape)} on this TP rank (it needs rows/cols "
                             f"{region.offsets}+{region.sizes} at {offsets})")
    return Placed(t.param_name, tuple(DestPiece(t.name, r, t.param_name, o) for r, o in blocks))


class Part(NamedTuple):
    """One part of a fused layer along its output dim, on this rank."""

    shard: Any  # the loader's shard id: "q"/"k"/"v", or the index into ``output_sizes``
    fused_offset: int  # where the part starts in the fused (pre-fused checkpoint) tensor
    total: int  # the part's global size (its own HF tensor's size)
    start: int  # where this rank's slice starts inside the part
    size: int  # this rank's slice
    offset: int  # where the slice lands in this rank's parameter


def fused_parts(module: Any) -> list[Part]:
    """Every part of a known fused layer, as its loader splits them: ``QKVParallelLinear`` q, k, v
    (heads; a KV head replicated over ``num_kv_head_replicas`` ranks), ``MergedColumnParallelLinear``
    its ``output_sizes``. A pre-fused tensor is the parts concatenated, as the loader reads it."""
    parts: list[Part] = []
    fused = 0
    if type(module).__name__ == "QKVParallelLinear":
        for s in "qkv":
            size, offset = module._get_shard_size_mapping(s), module._get_shard_offset_mapping(s)
            replicas = 1 if s == "q" else module.num_kv_head_replicas
            total = size * module.tp_size // replicas
            parts.append(Part(s, fused, total, module.tp_rank // replicas * size, size, offset))
            fused += total
        return parts
    for s, total in enumerate(int(n) for n in module.output_sizes):
        size = total // module.tp_size
        parts.append(Part(s, fused, total, module.tp_rank * size, size, sum(module.output_sizes[:s]) // module.tp_size))
        fused += total
    return parts


# --- the placers, in the order :func:`place` tries them ------------------------------------------

def place_fused_part(t: Target) -> Placement | None:
    """One part (q, k, v; gate, up) of a known fused layer: this rank's slice of it."""
    if t.cls not in FUSED_LAYERS or t.out_dim is None or t.shard is None:
        return None
    part = next(p for p in fused_parts(t.module) if p.shard == t.shard)
    dim = t.out_dim
    return _placed(t, _glob(t.param, dim, part.total),
                   [(_box(t.shape, dim, part.start, part.size), _at(len(t.shape), dim, part.offset))])


def place_prefused(t: Target) -> Placement | None:
    """A known fused layer's own tensor (pre-fused in the checkpoint): this rank's slice of each part."""
    if t.cls not in FUSED_LAYERS or t.out_dim is None or t.shard is not None:
        return None
    if t.prefused_doubt is not None:
        return Unplaced(f"pre-fused tensor: {t.prefused_doubt}", t.param_name)
    dim, parts = t.out_dim, fused_parts(t.module)
    blocks = [(_box(t.shape, dim, p.fused_offset + p.start, p.size), _at(len(t.shape), dim, p.offset)) for p in parts]
    return _placed(t, _glob(t.param, dim, sum(p.total for p in parts)), blocks)


def place_unknown_fused(t: Target) -> Placement | None:
    if t.shard is None:
        return None
    return Unplaced(f"fused into {t.cls}, which is not a known fused layer", t.param_name)


def place_parallel(t: Target) -> Placement | None:
    """Column-parallel (output dim) or row-parallel (input dim): this rank's contiguous slice."""
    if t.cls not in ("ColumnParallelLinear", "RowParallelLinear") or (t.out_dim is None and t.in_dim is None):
        return None
    dim = t.out_dim if t.cls == "ColumnParallelLinear" else t.in_dim
    if dim is None:
        return Unplaced(f"{t.cls} parameter without its sharded dim", t.param_name)
    size = t.param.shape[dim]
    region = _box(t.shape, dim, t.module.tp_rank * size, size)
    return _placed(t, _glob(t.param, dim, size * t.module.tp_size), [(region, (0,) * len(t.shape))])


def place_replicated(t: Target) -> Placement | None:
    """A ``ReplicatedLinear`` (e.g. a MoE router, ``GateLinear``): the whole tensor on every rank."""
    if "ReplicatedLinear" not in (c.__name__ for c in type(t.module).__mro__):
        return None
    return _placed(t, tuple(t.param.shape), [(Region.full(t.shape), (0,) * len(t.shape))])


def place_vocab(t: Target) -> Placement | None:
    """A vocab-parallel embedding or LM head: this rank's rows of the original vocabulary."""
    if t.cls not in ("VocabParallelEmbedding", "ParallelLMHead") or t.out_dim is None:
        return None
    idx = t.module.shard_indices
    start, end = idx.org_vocab_start_index, idx.org_vocab_end_index
    if getattr(idx, "num_added_elements", 0):
        return Unplaced("vocab embedding with added (LoRA) vocabulary", t.param_name)
    region = _box(t.shape, t.out_dim, start, end - start)
    return _placed(t, _glob(t.param, t.out_dim, int(t.module.org_vocab_size)), [(region, (0,) * len(t.shape))])


def place_whole(t: Target) -> Placement | None:
    """A parameter without sharded dims that vLLM's default loader copies whole (a norm's weight)."""
    if t.out_dim is not None or t.in_dim is not None:
        return None
    loader = getattr(t.param, "weight_loader", None)
    if loader is not None and getattr(loader, "__name__", "") != "default_weight_loader":
        return Unplaced(f"custom weight loader {getattr(loader, '__qualname__', loader)!r}", t.param_name)
    if tuple(t.param.shape) != t.shape:
        raise ValueError(f"parameter {_param_label(t)!r}: vLLM holds it whole with shape "
                         f"{tuple(t.param.shape)}, the trainer's tensor has shape {t.shape}")
    return _placed(t, t.shape, [(Region.full(t.shape), (0,) * len(t.shape))])


PLACERS: tuple[Callable[[Target], Placement | None], ...] = (
    place_fused_part, place_prefused, place_unknown_fused, place_parallel, place_replicated, place_vocab,
    place_whole)
"""Tried in this order; the first that returns a placement decides."""


def place(t: Target) -> Placement:
    """Where ``t`` lands: the first placer's answer, or an ``Unplaced`` naming the layout none knows.
    Raises ``ValueError`` naming the tensor when the trainer's shape does not fit the layer."""
    if getattr(t.param, "packed_dim", None) is not None:
        return Unplaced("packed (quantized) parameter", t.param_name)
    for placer in PLACERS:
        result = placer(t)
        if result is not None:
            return result
    return Unplaced(f"{t.cls} parameter with shape {tuple(t.param.shape)} from HF shape {t.shape} "
                    "is not a known layout", t.param_name)


def _param_label(t: Target) -> str:
    return next((f"{t.cls}.{n}" for n, p in t.module.named_parameters(recurse=False) if p is t.param), "?")
