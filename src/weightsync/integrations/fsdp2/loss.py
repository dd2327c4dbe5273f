"""Per-token log-probs from packed rows and the GRPO loss (clipped ratio, KL k1/k3, entropy); the
optimizer: AdamW with no weight decay on biases and 1-D parameters, a sample-counting LR schedule, and
gradient clipping over DTensor gradients.

Loss scaling: every term is a weighted sum over the response tokens of the *global* batch, with
weights that sum to 1 over all ranks (``token_weights``). Each rank back-propagates its own part
times the data-parallel size, because FSDP2's reduce-scatter averages gradients over ranks; the
sum over ranks is then exactly the loss of the whole batch, whatever the split.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .config import LossConfig, OptimConfig

__all__ = ["token_log_probs", "grpo_advantages", "kl_estimate", "token_weights", "LossTerms", "grpo_loss",
           "METRICS", "param_groups", "build_optimizer", "LRSchedule", "clip_gradients"]

METRICS = ("loss", "pg_loss", "kl", "entropy", "clip_frac", "ratio")
"""Per-token metrics ``grpo_loss`` returns (weighted like the loss, so their global sums are means)."""


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                    with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits / temperature)[targets]`` per row, in float32, and optionally the entropy.

    ``logits``: ``[N, V]``; ``targets``: ``[N]``. Returns ``(log_probs [N], entropy [N] or None)``.
    """
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    logz = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - logz
    if not with_entropy:
        return logp, None
    entropy = logz - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logp, entropy


def grpo_advantages(rewards: Sequence[float], groups: Sequence[int], *, normalize: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages: ``(r - mean_group) / (std_group + eps)`` (population std), or only
    centred when not ``normalize``. A group of one gets advantage 0. Float32, one per sample."""
    r = torch.tensor(list(rewards), dtype=torch.float64)
    g = torch.tensor(list(groups), dtype=torch.long)
    if r.shape != g.shape:
        raise ValueError(f"{len(r)} rewards but {len(g)} group ids")
    adv = torch.zeros_like(r)
    for key in torch.unique(g):
        sel = g == key
        centred = r[sel] - r[sel].mean()
        if normalize:
            centred = centred / (r[sel].std(unbiased=False) + eps)
        adv[sel] = centred
    return adv.float()


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens: ``k1`` or ``k3`` (Schulman)."""
    if kind == "k1":
        return log_probs - ref_log_probs
    if kind == "k3":
        d = ref_log_probs - log_probs
        return torch.expm1(d) - d
    raise ValueError(f"kl kind must be 'k1' or 'k3', got {kind!r}")


def token_weights(response_lengths: Sequence[int], aggregation: str, total_tokens: int,
                  total_samples: int) -> torch.Tensor:
    """Weight of each response token of some samples, such that weights over the global batch sum to 1.

    ``token_mean``: ``1 / total_tokens``; ``sample_mean``: ``1 / (total_samples * len(response))``.
    """
    if aggregation == "token_mean":
        return torch.full((sum(response_lengths),), 1.0 / total_tokens)
    if aggregation == "sample_mean":
        return torch.cat([torch.full((n,), 1.0 / (total_samples * n)) for n in response_lengths]
                         or [torch.zeros(0)])
    raise ValueError(f"aggregation must be 'token_mean' or 'sample_mean', got {aggregation!r}")


@dataclass(frozen=True)
class LossTerms:
    """Per-token inputs of ``grpo_loss`` for one packed row (all ``[N]``, aligned with its targets)."""

    advantages: torch.Tensor
    """Each token's sample advantage."""
    old_log_probs: torch.Tensor | None
    """Denominator of the ratio; None = the current log-probs, detached (ratio 1)."""
    ref_log_probs: torch.Tensor | None
    """The reference model's log-probs; None when there is no KL term."""
    weights: torch.Tensor
    """Aggregation weights (``token_weights``)."""


def grpo_loss(log_probs: torch.Tensor, entropy: torch.Tensor | None, terms: LossTerms,
              cfg: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted GRPO loss of one row and its weighted metric sums (detached, keys ``METRICS``).

    ``loss = sum_t w_t * (max(-A r_t, -A clip(r_t)) + kl_coef * KL_t - entropy_coef * H_t)``.
    """
    w = terms.weights.to(log_probs.device)
    adv = terms.advantages.to(log_probs.device)
    old = log_probs.detach() if terms.old_log_probs is None else terms.old_log_probs.to(log_probs.device)
    ratio = torch.exp(log_probs - old)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = torch.maximum(unclipped, clipped)
    total = pg
    zero = torch.zeros_like(log_probs)
    kl = zero
    if terms.ref_log_probs is not None:
        kl = kl_estimate(log_probs, terms.ref_log_probs.to(log_probs.device), cfg.kl_type)
        if cfg.kl_coef > 0:
            total = total + cfg.kl_coef * kl
    ent = zero if entropy is None else entropy
    if cfg.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the entropy (token_log_probs(..., with_entropy=True))")
        total = total - cfg.entropy_coef * entropy
    loss = (w * total).sum()
    with torch.no_grad():
        metrics = {"loss": loss.detach(), "pg_loss": (w * pg).sum(), "kl": (w * kl).sum(),
                   "entropy": (w * ent).sum(), "clip_frac": (w * (clipped > unclipped).float()).sum(),
                   "ratio": (w * ratio).sum()}
    return loss, metrics


# --- the optimizer -----------------------------------------------------------------------------------

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
    def from_config(cls, cfg: OptimConfig) -> LRSchedule:
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
