"""FSDP2 reference trainer: GRPO on a Hugging Face causal LM, sharded with ``fully_shard`` over every
rank, whose weights reach vLLM through weightsync (``DTensorModuleSource`` + ``weightsync_m2n`` for
separate GPUs, ``FullTensorSource`` + ``weightsync_ipc`` colocated, or ``weightsync_nccl`` broadcast).

Modules: ``config`` (dataclasses), ``model`` (build + rank-0 load), ``data`` (samples, packing,
schedule), ``loss`` (log-probs, GRPO, KL, entropy; AdamW groups, LR schedule, clipping),
``offload`` (reference weights, sleep/wake), ``checkpoint`` (DCP, HF export), ``trainer``.
Importing this package imports torch only; transformers is imported when a model is built.
"""

from .config import LossConfig, ModelConfig, OptimConfig, TrainerConfig
from .data import Sample, dp_schedule, pack
from .loss import LRSchedule, grpo_advantages, kl_estimate, token_log_probs
from .trainer import FSDP2Trainer

__all__ = ["FSDP2Trainer", "TrainerConfig", "ModelConfig", "OptimConfig", "LossConfig", "Sample", "pack",
           "dp_schedule", "grpo_advantages", "kl_estimate", "token_log_probs", "LRSchedule"]
