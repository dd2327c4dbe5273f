"""Per-expert tensors sent as fused 3-D expert tensors (``DTensorModuleSource(fuse_experts=True)``).

Trainers built from remote model code (DeepSeek-V3, Kimi-K2) or transformers 4 hold each routed
expert as its own modules: ``...mlp.experts.{e}.gate_proj.weight`` [I, H], ``up_proj`` [I, H],
``down_proj`` [H, I], FSDP2 sharding every one of them on its rows. At 1T scale that is ~70 k
tensors per trainer rank and millions of (tensor, worker) items per sync, each a copy of its own.

Fused, the E experts of one layer and projection are one tensor ``...mlp.experts.gate_proj``
[E, I, H] (``up_proj``, ``down_proj`` alike, ``.weight`` dropped as in transformers 5's fused
``experts.gate_up_proj``), laid out as its members are with every sharded dim moved up by one:
trainer rank r's rows of every expert are one region, so the plan has a few items per layer and
worker instead of a few per expert, and a TP slice of all E experts moves as one strided copy.
The worker places them in vLLM's fused-MoE ``w13_weight`` / ``w2_weight`` directly
(``worker.experts``). The cost: each sync stacks the rank's local shards of every fused group
(``torch.stack``, one copy of the rank's expert bytes, held until the sync ends).

A group fuses only when its ids are exactly 0..E-1 (E >= 2) and every member has the same shape,
dtype and layout; the others stay per-expert. :func:`fuse_expert_metas` is pure.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

from ..layout.regions import Shard
from ..protocol import ParamMeta

__all__ = ["PER_EXPERT", "fuse_expert_metas"]

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
    by_name = {m.name: m for m in metas}
    for m in metas:
        name = fused_of.get(m.name)
        if name is None:
            out.append(m)
        elif members[name][0] == m.name:
            out.append(_fused(by_name[m.name], name, len(members[name])))
    return out, members
