"""Configuration of the FSDP2 reference trainer: frozen, keyword-only dataclasses, checked on construction.

The trainer is pure data parallel (every rank holds an FSDP2 shard of every parameter). Requests it
does not implement (tensor/pipeline/context parallel, a critic) raise here, before any process
builds a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["ModelConfig", "OptimConfig", "LossConfig", "TrainerConfig", "UNSUPPORTED"]

_PARAM_DTYPES = ("float32", "bfloat16", "float16")
_DEVICES = ("cpu", "cuda")


def _check_number(owner: str, name: str, value: object, *, low: float | None = None, high: float | None = None,
                  low_open: bool = False, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        raise ValueError(f"{owner}.{name} must be a finite {'int' if integer else 'number'}, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{owner}.{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{owner}.{name} must be <= {high}, got {value!r}")


def _check_choice(owner: str, name: str, value: object, choices: tuple[object, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{owner}.{name} must be one of {choices}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which Hugging Face causal LM to train and how FSDP2 shards it."""

    path: str
    """Hugging Face checkpoint: a directory with ``config.json`` and safetensors files, or a hub id.
    Only rank 0 reads the weights; the other ranks build on the meta device and receive them by broadcast."""
    reference_path: str | None = None
    """Checkpoint of the reference model for the KL term; None = ``path`` (the initial policy).
    Used only when ``LossConfig.kl_coef > 0``."""
    param_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Compute dtype of FSDP2's ``MixedPrecisionPolicy``; None = compute in float32 (no policy). The
    sharded master weights and the optimizer state are always float32."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the gradient reduce-scatter when ``param_dtype`` is set."""
    reshard_after_forward: bool = True
    """Free each decoder layer's gathered weights after its forward (FSDP2's ZeRO-3 behaviour)."""
    activation_checkpointing: bool = False
    """Recompute decoder-layer activations in backward (Hugging Face gradient checkpointing, non-reentrant)."""
    tp_aligned_shards: bool = False
    """Shard the row-parallel weights (every 2-D ``o_proj`` / ``down_proj`` weight) on dim 1, the dim
    vLLM's tensor parallelism splits them on, instead of dim 0. With as many trainer ranks as vLLM's TP
    size each rank's shard is then one worker's whole piece, so ``weightsync_m2n`` sends it from the
    shard with no staging copy (dim 0: each rank copies its rows' column halves into staging). FSDP2
    gathers dim-1 shards with one extra copy per all-gather."""
    attn_implementation: str | None = None
    """Hugging Face attention implementation (``"sdpa"``, ``"flash_attention_2"``, ...); None = its default.
    It must honour packed rows (restarting ``position_ids``); sdpa, eager and flash attention do."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"ModelConfig.path must be a non-empty str, got {self.path!r}")
        if self.reference_path is not None and (not isinstance(self.reference_path, str) or not self.reference_path):
            raise ValueError(f"ModelConfig.reference_path must be None or a non-empty str, got {self.reference_path!r}")
        if self.param_dtype is not None:
            _check_choice("ModelConfig", "param_dtype", self.param_dtype, _PARAM_DTYPES)
        _check_choice("ModelConfig", "reduce_dtype", self.reduce_dtype, ("float32", "bfloat16"))


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW and its learning-rate schedule. The schedule counts samples, not steps."""

    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay (and after it)."""
    warmup_samples: int = 0
    """Samples over which the learning rate rises linearly from 0 to ``lr``."""
    decay_samples: int | None = None
    """Sample count at which the decay reaches ``min_lr``; None = no decay (``lr`` after warmup)."""
    decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Shape of the decay between ``warmup_samples`` and ``decay_samples``."""
    weight_decay: float = 0.0
    """Decoupled weight decay; never applied to biases and 1-D parameters (norms)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW's epsilon."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value; None = no clipping (the norm is still reported)."""

    def __post_init__(self) -> None:
        o = "OptimConfig"
        _check_number(o, "lr", self.lr, low=0.0)
        _check_number(o, "min_lr", self.min_lr, low=0.0, high=self.lr)
        _check_number(o, "warmup_samples", self.warmup_samples, low=0, integer=True)
        _check_choice(o, "decay_style", self.decay_style, ("constant", "linear", "cosine"))
        if self.decay_samples is not None:
            _check_number(o, "decay_samples", self.decay_samples, low=0, integer=True)
            if self.decay_samples <= self.warmup_samples:
                raise ValueError(f"OptimConfig.decay_samples={self.decay_samples} must exceed "
                                 f"warmup_samples={self.warmup_samples}")
        if self.decay_style != "constant" and self.decay_samples is None:
            raise ValueError(f"OptimConfig.decay_style={self.decay_style!r} needs decay_samples, got None")
        _check_number(o, "weight_decay", self.weight_decay, low=0.0)
        if not isinstance(self.betas, tuple) or len(self.betas) != 2:
            raise ValueError(f"OptimConfig.betas must be a tuple of two floats, got {self.betas!r}")
        for i, b in enumerate(self.betas):
            _check_number(o, f"betas[{i}]", b, low=0.0, high=1.0)
        _check_number(o, "eps", self.eps, low=0.0, low_open=True)
        if self.grad_clip is not None:
            _check_number(o, "grad_clip", self.grad_clip, low=0.0, low_open=True)


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """GRPO policy loss with optional KL-to-reference and entropy terms."""

    clip_low: float = 0.2
    """Lower clip range of the importance ratio: ``ratio >= 1 - clip_low``."""
    clip_high: float = 0.2
    """Upper clip range: ``ratio <= 1 + clip_high`` (larger than ``clip_low`` = DAPO's clip-higher)."""
    old_log_probs: Literal["current", "rollout"] = "current"
    """Denominator of the ratio. ``"current"``: the trainer's own log-probs before this step (one step per
    rollout batch: the ratio is 1 and the gradient is the plain policy gradient). ``"rollout"``: each
    sample's ``rollout_log_probs`` from the inference engine (corrects for the trainer/engine mismatch)."""
    kl_coef: float = 0.0
    """Weight of the KL-to-reference term; > 0 builds the reference model (host copies of the shards)."""
    kl_type: Literal["k1", "k3"] = "k3"
    """Per-token KL estimator: ``k1 = logp - ref``; ``k3 = exp(ref - logp) - (ref - logp) - 1``."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts; logits are divided by it before every log-prob."""
    aggregation: Literal["token_mean", "sample_mean"] = "token_mean"
    """``token_mean``: every response token of the global batch weighs the same (per-token loss).
    ``sample_mean``: mean over each sample's tokens, then over samples."""
    normalize_advantages: bool = True
    """Divide group-centred rewards by the group's standard deviation (GRPO); False = centring only (Dr. GRPO)."""

    def __post_init__(self) -> None:
        o = "LossConfig"
        _check_number(o, "clip_low", self.clip_low, low=0.0, high=1.0)
        _check_number(o, "clip_high", self.clip_high, low=0.0)
        _check_choice(o, "old_log_probs", self.old_log_probs, ("current", "rollout"))
        _check_number(o, "kl_coef", self.kl_coef, low=0.0)
        _check_choice(o, "kl_type", self.kl_type, ("k1", "k3"))
        _check_number(o, "entropy_coef", self.entropy_coef, low=0.0)
        _check_number(o, "temperature", self.temperature, low=0.0, low_open=True)
        _check_choice(o, "aggregation", self.aggregation, ("token_mean", "sample_mean"))

    @property
    def use_reference(self) -> bool:
        return self.kl_coef > 0


UNSUPPORTED = {
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "context_parallel_size": 1,
    "expert_parallel_size": 1,
    "critic": False,
}
"""Fields of ``TrainerConfig`` that exist only to reject requests this trainer does not implement."""


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """Everything ``FSDP2Trainer`` needs; give the same value on every rank."""

    model: ModelConfig
    """The model and its sharding."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and the learning-rate schedule."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The GRPO loss."""
    max_tokens_per_micro_batch: int = 8192
    """Token budget of one packed micro-batch row; a longer sample gets a row of its own."""
    device: Literal["cpu", "cuda"] | None = None
    """Where the shards live and compute runs; None = ``cuda`` when available, else ``cpu``. On CUDA the
    current device (``torch.cuda.set_device``) is used."""
    seed: int = 0
    """Seed for torch's generators on every rank."""
    tensor_parallel_size: int = 1
    """Must be 1: the FSDP2 reference trainer is pure data parallel."""
    pipeline_parallel_size: int = 1
    """Must be 1 (no pipeline parallelism)."""
    context_parallel_size: int = 1
    """Must be 1 (no context parallelism; long samples get a micro-batch of their own instead)."""
    expert_parallel_size: int = 1
    """Must be 1 (dense models only)."""
    critic: bool = False
    """Must be False: GRPO needs no value model, and this trainer has none."""

    def __post_init__(self) -> None:
        for name, want in UNSUPPORTED.items():
            got = getattr(self, name)
            if got != want or type(got) is not type(want):
                raise ValueError(f"TrainerConfig.{name}={got!r} is not supported by the FSDP2 reference trainer "
                                 f"(pure data parallel, actor and reference only); it must be {want!r}")
        for name, cls in (("model", ModelConfig), ("optim", OptimConfig), ("loss", LossConfig)):
            value = getattr(self, name)
            if not isinstance(value, cls):
                raise TypeError(f"TrainerConfig.{name} must be a {cls.__name__}, got {type(value).__name__}")
        _check_number("TrainerConfig", "max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, low=1,
                      integer=True)
        if self.device is not None:
            _check_choice("TrainerConfig", "device", self.device, _DEVICES)
        _check_number("TrainerConfig", "seed", self.seed, low=0, integer=True)
