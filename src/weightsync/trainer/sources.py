"""Weight sources over a torch module: FSDP2 (DTensor) or plain.

* ``FullTensorSource`` yields full tensors under HF names, gathering DTensors with
  ``full_tensor()`` one bucket at a time (collective on every trainer rank).
* ``DTensorModuleSource`` yields each rank's local shard plus its layout; it never gathers.

Per-expert weights fused (``DTensorModuleSource(fuse_experts=True)``): trainers built from remote
model code (DeepSeek-V3, Kimi-K2) or transformers 4 hold each routed expert as its own modules,
``...mlp.experts.{e}.gate_proj.weight`` [I, H], ``up_proj``, ``down_proj`` [H, I], FSDP2 sharding
each on its rows: at 1T scale ~70 k tensors per rank and millions of (tensor, worker) items per sync.
Fused, one layer's E experts of one projection are one tensor ``...mlp.experts.gate_proj``
[E, I, H] (``.weight`` dropped, as in transformers 5's ``experts.gate_up_proj``), laid out as its
members with every sharded dim moved up one: a rank's rows of every expert are one region, so the
plan has a few items per layer and worker, and a TP slice of all E experts moves as one strided
copy; the worker places them in vLLM's fused-MoE ``w13_weight`` / ``w2_weight`` directly. The cost:
each sync stacks the rank's local shards of every group (one copy of its expert bytes, held while
the sync runs). A group fuses only when its ids are exactly 0..E-1 (E >= 2), its name is free and
every member has the same shape, dtype and layout; the others stay per-expert.

Both iterate ``module.named_parameters()`` order (tied parameters once), which is the same on
every trainer rank; that order is the metadata order. Names leave out the segments torch's wrappers
add (``torch.compile``, ``checkpoint_wrapper``, FSDP1): a compiled or checkpoint-wrapped model sends
the names its unwrapped self would.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from functools import cached_property

import torch

from ..plan.regions import Replicate, Shard, placements_from_torch, source_regions
from ..plan.transfer import TensorSource
from ..protocol import ParamMeta, WeightSource, check_metadata, dtype_name

__all__ = ["FullTensorSource", "DTensorModuleSource", "tensor_sources", "PER_EXPERT", "fuse_expert_metas",
           "WRAPPERS", "unwrapped_name"]

DEFAULT_BUCKET_BYTES = 256 << 20
_log = logging.getLogger(__name__)


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "placements")


WRAPPERS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
"""Module path segments torch's wrappers insert (``torch.compile``, ``checkpoint_wrapper``, FSDP1's
wrapper), left out of the names a source sends, as ``torch.distributed.checkpoint`` leaves them out."""


def unwrapped_name(name: str) -> str:
    """``name`` without :data:`WRAPPERS` segments
    (``_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.weight`` -> ``model.layers.0.mlp.weight``)."""
    if "_orig_mod" not in name and "_wrapped_module" not in name:
        return name
    return ".".join(part for part in name.split(".") if part not in WRAPPERS)


def _named(module: torch.nn.Module, name_map: Callable[[str], str | None] | None,
           drafter: torch.nn.Module | None = None) -> list[tuple[str, torch.Tensor]]:
    """(name sent, parameter): ``named_parameters()`` names without torch's wrapper segments, through
    ``name_map`` (None skips a parameter); then the ``drafter``'s (its own names, same ``name_map``)."""
    out = []
    for part in (module, drafter):
        for name, p in part.named_parameters() if part is not None else ():
            name = unwrapped_name(name)
            hf = name_map(name) if name_map is not None else name
            if hf is not None:
                out.append((hf, p))
    names = [n for n, _ in out]
    if drafter is not None and len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"the drafter's parameter name(s) {dup} are also the model's: send the drafter's under "
                         "'drafter.<name>' (name_map=) so the engine tells them apart")
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"name_map maps several parameters to the same name(s): {dup} (names as "
                         "named_parameters() gives them, torch's wrapper segments such as _orig_mod left out)")
    return out


class FullTensorSource(WeightSource):
    """Full tensors under HF names from a plain or FSDP2 module.

    Args:
        module: the trainer's model (plain ``nn.Module`` or ``fully_shard``-ed).
        bucket_bytes: gathered tensors are produced in groups of at most this many bytes; at most
            one group is alive at a time (the previous group is released before the next gather).
        name_map: optional ``module name -> HF name`` (return None to skip a parameter); module names
            come without torch's wrapper segments (:data:`WRAPPERS`: ``torch.compile``'s ``_orig_mod``,
            ``checkpoint_wrapper``'s ``_checkpoint_wrapped_module``), so a wrapped model sends HF names.
        dtype: optional wire dtype (e.g. ``torch.bfloat16`` from an fp32 master copy).
        drafter: optional speculative-decoding drafter the trainer trains (an EAGLE head, MTP layers
            held apart from ``module``): its parameters are sent after the model's, under its own names
            (those of its checkpoint), through ``name_map`` too (docs/drafter.md).
    """

    def __init__(self, module: torch.nn.Module, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 name_map: Callable[[str], str | None] | None = None, dtype: torch.dtype | None = None,
                 drafter: torch.nn.Module | None = None) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        self.module, self.bucket_bytes, self.name_map, self.dtype = module, bucket_bytes, name_map, dtype
        self.drafter = _checked_drafter(drafter)

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, self.dtype or p.dtype, tuple(p.shape))
                for n, p in _named(self.module, self.name_map, self.drafter)]

    def _full(self, p: torch.Tensor) -> torch.Tensor:
        t = p.detach()
        t = t.full_tensor() if _is_dtensor(t) else t
        return t.to(self.dtype) if self.dtype is not None and t.dtype != self.dtype else t

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective on every trainer rank: yields every tensor, gathered, in metadata order."""
        # No grad-mode context here: a suspended generator would leak it into the caller's thread;
        # the tensors are detached before gathering instead.
        group: list[tuple[str, torch.Tensor]] = []
        used = 0
        for name, p in _named(self.module, self.name_map, self.drafter):
            nbytes = p.numel() * (self.dtype or p.dtype).itemsize
            if group and used + nbytes > self.bucket_bytes:
                yield from group
                group, used = [], 0
            group.append((name, self._full(p)))
            used += nbytes
        yield from group


class DTensorModuleSource(WeightSource):
    """Local FSDP2 shards and their layout; never gathers.

    Args:
        module: the ``fully_shard``-ed model.
        num_trainer_ranks: ranks of the trainer mesh; every DTensor's mesh must cover exactly
            these ranks (checked here, on every rank, before anything moves).
        name_map: optional ``module name -> HF name`` (None skips a parameter); module names come
            without torch's wrapper segments, as for ``FullTensorSource``.
        dtype: optional wire dtype for floating-point tensors (e.g. ``torch.bfloat16`` from an fp32
            master copy): the metadata says ``dtype`` and each piece is cast as it is packed (no
            cast copy of the shard); the local shards keep their own dtype.
        fuse_experts: send per-expert weights (``...experts.{e}.gate_proj.weight``) as fused 3-D
            tensors (``...experts.gate_proj`` [E, ...]), stacked from the local shards on each sync
            (see the module doc): a few plan items per layer instead of per expert, for one extra
            copy of the rank's expert shards while a sync runs.
        drafter: optional speculative-decoding drafter the trainer trains (an EAGLE head, MTP layers
            held apart from ``module``; plain or ``fully_shard``-ed on the same mesh): its parameters
            are sent after the model's, under its own names, through ``name_map`` too (docs/drafter.md).
    """

    def __init__(self, module: torch.nn.Module, num_trainer_ranks: int, *,
                 name_map: Callable[[str], str | None] | None = None, dtype: torch.dtype | None = None,
                 fuse_experts: bool = False, drafter: torch.nn.Module | None = None) -> None:
        if not isinstance(num_trainer_ranks, int) or num_trainer_ranks < 1:
            raise ValueError(f"num_trainer_ranks must be an int >= 1, got {num_trainer_ranks!r}")
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
        if not isinstance(fuse_experts, bool):
            raise ValueError(f"fuse_experts must be a bool, got {fuse_experts!r}")
        self.module, self.num_trainer_ranks, self.name_map, self.dtype = module, num_trainer_ranks, name_map, dtype
        self.fuse_experts = fuse_experts
        self.drafter = _checked_drafter(drafter)

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """What a tensor of ``dtype`` is sent as."""
        return self.dtype if self.dtype is not None and dtype.is_floating_point else dtype

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        metas, self._members = self._metas(), {}
        fused, members = fuse_expert_metas(metas)
        if self.fuse_experts:
            metas, self._members = fused, members
        elif members:
            _log.warning("%d per-expert weights (e.g. %r) could go as %d fused expert tensors, a few plan items "
                         "per layer instead of per expert: DTensorModuleSource(..., fuse_experts=True)",
                         sum(map(len, members.values())), next(iter(members.values()))[0], len(members))
        return metas

    def _metas(self) -> list[ParamMeta]:
        metas = []
        for name, p in _named(self.module, self.name_map, self.drafter):
            if not _is_dtensor(p):
                coords = tuple((r,) for r in range(self.num_trainer_ranks))
                metas.append(ParamMeta(name, self.wire_dtype(p.dtype), tuple(p.shape),
                                       mesh_shape=(self.num_trainer_ranks,), placements=(Replicate(),),
                                       rank_coordinates=coords))
                continue
            mesh = p.device_mesh.mesh
            if mesh.numel() != self.num_trainer_ranks or sorted(mesh.flatten().tolist()) != list(
                    range(self.num_trainer_ranks)):
                raise ValueError(f"parameter {name!r}: its device mesh holds ranks {mesh.flatten().tolist()}, "
                                 f"expected all of num_trainer_ranks={self.num_trainer_ranks}")
            coords: list[tuple[int, ...]] = [()] * self.num_trainer_ranks
            for idx in torch.cartesian_prod(*[torch.arange(s) for s in mesh.shape]).reshape(mesh.numel(), -1):
                coord = tuple(int(i) for i in idx)
                coords[int(mesh[coord])] = coord
            placements = placements_from_torch(p.placements)
            if any(not isinstance(pl, (Shard, Replicate)) for pl in placements):
                raise ValueError(f"parameter {name!r}: placements {p.placements} are not Shard/Replicate")
            metas.append(ParamMeta(name, self.wire_dtype(p.dtype), tuple(p.shape), mesh_shape=tuple(mesh.shape),
                                   placements=tuple(placements), rank_coordinates=tuple(coords)))
        return metas

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's shard of every tensor, in metadata order (no collectives); a fused expert
        tensor's is its members' stacked."""
        metas = self.metadata  # (sets self._members)
        named = _named(self.module, self.name_map, self.drafter)
        if not self._members:
            yield from ((name, _local(p).detach()) for name, p in named)
            return
        members, local = self._members, dict(named)
        for m in metas:
            group = members.get(m.name)
            if group is None:
                yield m.name, _local(local[m.name]).detach()
            else:
                yield m.name, torch.stack([_local(local[n]).detach() for n in group])


def _checked_drafter(drafter: torch.nn.Module | None) -> torch.nn.Module | None:
    if drafter is not None and not isinstance(drafter, torch.nn.Module):
        raise TypeError(f"drafter must be a torch.nn.Module or None, got {type(drafter).__name__}")
    return drafter


def _local(p: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor ``to_local()`` returns a view of, without running
    ``to_local``'s autograd function: ~25x cheaper), or ``p`` itself."""
    if not _is_dtensor(p):
        return p
    local = getattr(p, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else p.to_local()


def tensor_sources(metas: list[ParamMeta]) -> list[TensorSource]:
    """The planner's view of sharded metadata: every trainer rank's region of every tensor."""
    check_metadata(metas)
    out = []
    for m in metas:
        if m.mesh_shape is None or m.rank_coordinates is None:
            raise ValueError(f"parameter {m.name!r} has no layout; use DTensorModuleSource metadata")
        regions = source_regions(m.shape, m.mesh_shape, m.placements, m.rank_coordinates)
        out.append(TensorSource(m.name, m.shape, dtype_name(m.dtype), regions))
    return out


PER_EXPERT = re.compile(r"^(?P<layer>.+\.experts)\.(?P<id>\d+)\.(?P<leaf>[A-Za-z_]\w*)\.weight$")
"""A per-expert weight's HF name: ``<layer>.experts.<id>.<leaf>.weight``."""


def _layout(m: ParamMeta) -> tuple:
    return m.dtype, m.shape, m.mesh_shape, m.placements, m.rank_coordinates


def _fused(first: ParamMeta, name: str, experts: int) -> ParamMeta:
    placements = None if first.placements is None else tuple(
        Shard(p.dim + 1) if isinstance(p, Shard) and p.dim >= 0 else p for p in first.placements)
    return replace(first, name=name, shape=(experts, *first.shape), placements=placements)


def fuse_expert_metas(metas: Sequence[ParamMeta]) -> tuple[list[ParamMeta], dict[str, list[str]]]:
    """``metas`` with every fusable per-expert group replaced, at its first member's place, by one
    fused tensor; and each fused name's members in expert order."""
    groups: dict[str, dict[int, ParamMeta]] = {}
    for m in metas:
        hit = PER_EXPERT.match(m.name)
        if hit is not None:
            groups.setdefault(f"{hit['layer']}.{hit['leaf']}", {})[int(hit["id"])] = m
    members: dict[str, list[str]] = {}
    fused_of: dict[str, str] = {}
    taken = {m.name for m in metas}
    for name, by_id in groups.items():
        ids = sorted(by_id)
        first = by_id[ids[0]]
        if len(ids) < 2 or ids != list(range(len(ids))) or name in taken or any(
                _layout(m) != _layout(first) for m in by_id.values()):
            continue
        members[name] = [by_id[e].name for e in ids]
        fused_of.update((by_id[e].name, name) for e in ids)
    out: list[ParamMeta] = []
    for m in metas:
        name = fused_of.get(m.name)
        if name is None:
            out.append(m)
        elif members[name][0] == m.name:
            out.append(_fused(m, name, len(members[name])))
    return out, members
