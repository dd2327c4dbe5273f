"""A trainer model whose routed experts are per-expert modules, as remote model code (DeepSeek-V3,
Kimi-K2) and transformers 4 build them: ``...mlp.experts.{e}.gate_proj.weight`` [I, H],
``up_proj`` [I, H], ``down_proj`` [H, I], where transformers 5 holds one fused ``gate_up_proj`` /
``down_proj`` per layer. :func:`split_experts` swaps every fused experts module of a transformers 5
model for the per-expert form with the same weights and the same forward."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["PerExpertExperts", "split_experts"]


class _Expert(nn.Module):
    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(gate.shape[1], gate.shape[0], bias=False, dtype=gate.dtype)
        self.up_proj = nn.Linear(up.shape[1], up.shape[0], bias=False, dtype=up.dtype)
        self.down_proj = nn.Linear(down.shape[1], down.shape[0], bias=False, dtype=down.dtype)
        with torch.no_grad():
            for lin, w in ((self.gate_proj, gate), (self.up_proj, up), (self.down_proj, down)):
                lin.weight.copy_(w)


class PerExpertExperts(nn.Module):
    """transformers 5's fused experts module (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I],
    ``act_fn``) as a list of per-expert MLPs; ``forward(hidden, top_k_index, top_k_weights)`` as the
    fused one's, running every expert (one no token picked on zero rows) so that every rank's
    backward reduces the same FSDP2 gradients."""

    def __init__(self, fused: Any) -> None:
        super().__init__()
        inter = fused.gate_up_proj.shape[1] // 2
        self.experts = [_Expert(gu[:inter], gu[inter:], d) for gu, d in zip(fused.gate_up_proj.detach(),
                                                                           fused.down_proj.detach())]
        for e, expert in enumerate(self.experts):
            self.add_module(str(e), expert)  # experts.{e}.gate_proj.weight
        self.act_fn = fused.act_fn

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e, expert in enumerate(self.experts):
            pos, tok = torch.where(top_k_index.T == e)  # (rank among the token's top k, token)
            x = hidden[tok]
            y = expert.down_proj(self.act_fn(expert.gate_proj(x)) * expert.up_proj(x))
            out.index_add_(0, tok, (y * top_k_weights[tok, pos, None]).to(out.dtype))
        return out


def split_experts(model: nn.Module) -> int:
    """Swap every fused experts module (one with ``gate_up_proj`` and ``down_proj`` 3-D parameters)
    of ``model`` for :class:`PerExpertExperts`, in place; returns how many."""
    fused = [(n, m) for n, m in model.named_modules()
             if isinstance(getattr(m, "gate_up_proj", None), nn.Parameter) and m.gate_up_proj.dim() == 3
             and isinstance(getattr(m, "down_proj", None), nn.Parameter)]
    for name, m in fused:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, PerExpertExperts(m))
    return len(fused)
