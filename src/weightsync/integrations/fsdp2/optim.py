"""AdamW with no weight decay on biases and 1-D parameters, a sample-counting LR schedule, and
gradient clipping over DTensor gradients."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .config import OptimConfig

__all__ = ["param_groups", "build_optimizer", "LRSchedule", "clip_gradients"]


def _no_decay(name: str, param: torch.Tensor) -> bool:
    return name.endswith(".bias") or param.ndim <= 1


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: decayed matrices, and biases / 1-D parameters (norms) without decay.
    Empty groups are left out; order follows ``named_parameters`` (the same on every rank)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if _no_decay(name, p) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over ``param_groups``; the learning rate is set by ``LRSchedule`` before every step."""
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                             weight_decay=cfg.weight_decay)


@dataclass(frozen=True)
class LRSchedule:
    """Learning rate as a function of the number of samples consumed.

    Linear warmup from 0 to ``lr`` over ``warmup_samples``, then ``constant``, or a ``linear`` /
    ``cosine`` decay reaching ``min_lr`` at ``decay_samples`` and staying there.
    """

    lr: float
    min_lr: float = 0.0
    warmup_samples: int = 0
    decay_samples: int | None = None
    decay_style: str = "constant"

    @classmethod
    def from_config(cls, cfg: OptimConfig) -> "LRSchedule":
        return cls(cfg.lr, cfg.min_lr, cfg.warmup_samples, cfg.decay_samples, cfg.decay_style)

    def __call__(self, samples: int) -> float:
        """The learning rate after ``samples`` samples (a step uses the count including its own batch)."""
        if self.warmup_samples > 0 and samples < self.warmup_samples:
            return self.lr * samples / self.warmup_samples
        if self.decay_style == "constant" or self.decay_samples is None:
            return self.lr
        progress = min(1.0, (samples - self.warmup_samples) / (self.decay_samples - self.warmup_samples))
        if self.decay_style == "linear":
            factor = 1.0 - progress
        elif self.decay_style == "cosine":
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            raise ValueError(f"decay_style must be 'constant', 'linear' or 'cosine', got {self.decay_style!r}")
        return self.min_lr + (self.lr - self.min_lr) * factor


def clip_gradients(params: Iterable[torch.Tensor], max_norm: float | None) -> float:
    """Global L2 norm of the gradients (over every rank's shards); scales them to ``max_norm`` when
    given and exceeded. Collective on every rank (the norm of DTensor gradients is all-reduced)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)  # a DTensor for DTensor gradients
    value = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if max_norm is not None and math.isfinite(value):
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm)
    return value
