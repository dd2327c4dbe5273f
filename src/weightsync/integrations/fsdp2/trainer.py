"""``FSDP2Trainer``: a GRPO actor (and optional reference model) sharded with FSDP2 over every rank of
the default process group, which pushes its weights to vLLM through weightsync.

Call order (every rank, collectively, with the same arguments)::

    dist.init_process_group(...)                       # gloo on CPU, NCCL on GPUs
    trainer = FSDP2Trainer(TrainerConfig(model=ModelConfig(path=...), ...))
    engine = trainer.connect(init_info, client)        # once; rank 0's client drives the vLLM workers
    for batch in rollouts:                             # batch: the same list[Sample] on every rank
        metrics = trainer.train_step(batch)            # = forward_backward(batch) + optimizer_step()
        trainer.sync_weights(engine, weight_version=str(trainer.step))
        trainer.sleep(); ...; trainer.wake()           # colocated: give the device to vLLM meanwhile
        trainer.save_checkpoint(root)                  # now and then
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from ...infos import TrainerInitInfo
from ...protocol import WeightSource
from ...stats import SyncStats
from ...trainer.engine import TrainerEngine
from . import checkpoint as ckpt
from .config import TrainerConfig
from .data import Sample, dp_schedule, pack
from .loss import (
    METRICS,
    LossTerms,
    LRSchedule,
    build_optimizer,
    clip_gradients,
    grpo_advantages,
    grpo_loss,
    token_log_probs,
    token_weights,
)
from .model import build_model, full_state_dict, load_checkpoint_weights
from .offload import HostOffload, ReferenceWeights, local_tensor, reshard

__all__ = ["FSDP2Trainer"]


def _device(name: str | None) -> torch.device:
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("TrainerConfig.device='cuda' but CUDA is not available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class FSDP2Trainer:
    """Data-parallel GRPO trainer for a Hugging Face causal LM; see the module docstring for the call order.

    Attributes: ``model`` (the ``fully_shard``-ed module; parameter names are Hugging Face names),
    ``optimizer``, ``step`` (optimizer steps taken), ``consumed_samples``, ``rank``, ``world``.
    """

    def __init__(self, config: TrainerConfig) -> None:
        if not isinstance(config, TrainerConfig):
            raise TypeError(f"config must be a TrainerConfig, got {type(config).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("FSDP2Trainer needs torch.distributed's default process group: call "
                               "dist.init_process_group first (gloo on CPU, nccl on GPUs)")
        from torch.distributed.device_mesh import init_device_mesh

        self.config = config
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = _device(config.device)
        torch.manual_seed(config.seed)
        self.mesh = init_device_mesh(self.device.type, (self.world,), mesh_dim_names=("dp",))
        mc = config.model
        self.model, self.hf_config = build_model(mc, device=self.device, mesh=self.mesh)
        # MoE: the router learns from the GRPO loss alone; Hugging Face's load-balancing aux loss is not
        # part of it, so its per-layer router logits are not recorded even if the config asks for them.
        moe = hasattr(self.hf_config, "output_router_logits")
        self._forward_kwargs = {"output_router_logits": False} if moe else {}
        self.reference: ReferenceWeights | None = None
        if config.loss.use_reference:
            load_checkpoint_weights(self.model, mc.reference_path or mc.path)
            self.reference = ReferenceWeights(self.model)
        if self.reference is None or mc.reference_path not in (None, mc.path):
            load_checkpoint_weights(self.model, mc.path)
        self.optimizer = build_optimizer(self.model, config.optim)
        self.lr_schedule = LRSchedule.from_config(config.optim)
        self.step = 0
        self.consumed_samples = 0
        self._pending_samples = 0
        self._offload = HostOffload()

    # --- data ---------------------------------------------------------------------------------
    def _check_awake(self, what: str) -> None:
        if self._offload.active:
            raise RuntimeError(f"{what}: the trainer is asleep (its shards are on the host); call wake() first")

    def _validate(self, samples: Sequence[Sample]) -> list[Sample]:
        samples = list(samples)
        if not samples:
            raise ValueError("samples is empty: a step needs at least one Sample")
        bad = [type(s).__name__ for s in samples if not isinstance(s, Sample)]
        if bad:
            raise ValueError(f"samples must be Sample objects, got {bad[0]}")
        if self.config.loss.old_log_probs == "rollout":
            missing = [i for i, s in enumerate(samples) if s.rollout_log_probs is None]
            if missing:
                raise ValueError(f"LossConfig.old_log_probs='rollout' but samples {missing[:5]} have no "
                                 f"rollout_log_probs")
        return samples

    def schedule(self, samples: Sequence[Sample]) -> list[list[int]]:
        """This rank's packed rows: batch indices per micro-batch (same number of rows on every rank)."""
        return dp_schedule([len(s) for s in samples], self.world, self.config.max_tokens_per_micro_batch)[self.rank]

    def _logits(self, row: Any) -> torch.Tensor:
        out = self.model(input_ids=row.input_ids, position_ids=row.position_ids, use_cache=False,
                         **self._forward_kwargs)
        return out.logits[0, row.loss_positions]

    @torch.no_grad()
    def _log_probs(self, samples: list[Sample], rows: list[list[int]]) -> dict[int, torch.Tensor]:
        """Response log-probs of this rank's samples under the module's current weights (no grad)."""
        self.model.eval()
        out: dict[int, torch.Tensor] = {}
        try:
            for idx in rows:
                row = pack(samples, idx, self.device)
                logp, _ = token_log_probs(self._logits(row), row.targets, temperature=self.config.loss.temperature)
                out.update(zip(row.samples, logp.split(list(row.response_lengths))))
        finally:
            reshard(self.model)  # the root keeps its gathered weights after a no-grad forward
        return out

    def compute_log_probs(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """Every sample's response log-probs (float32, on the host), in batch order, on every rank.
        Collective: each rank computes its share of the packed rows, then they are all-gathered."""
        self._check_awake("compute_log_probs")
        samples = self._validate(samples)
        merged = _all_gather_rows(self._log_probs(samples, self.schedule(samples)), self.world, self.device)
        return [merged[i] for i in range(len(samples))]

    # --- one step -----------------------------------------------------------------------------
    def forward_backward(self, samples: Sequence[Sample]) -> dict[str, float]:
        """Accumulate the gradient of the GRPO loss of the whole batch (this rank's share); returns
        the loss parts, averaged over the global batch, equal on every rank. Collective."""
        self._check_awake("forward_backward")
        if self._pending_samples:
            raise RuntimeError("forward_backward was already called for this step; call optimizer_step first")
        samples = self._validate(samples)
        self.optimizer.zero_grad(set_to_none=True)  # drop what a failed earlier call may have left
        cfg = self.config.loss
        rows = self.schedule(samples)
        adv = grpo_advantages([s.reward for s in samples], [s.group for s in samples],
                              normalize=cfg.normalize_advantages)
        ref = None
        if self.reference is not None:
            with self.reference.swapped_in(self.model):
                ref = self._log_probs(samples, rows)
        total_tokens = sum(len(s.response_ids) for s in samples)
        sums = torch.zeros(len(METRICS), dtype=torch.float64)
        self.model.train()
        for idx in rows:
            row = pack(samples, idx, self.device)
            logp, ent = token_log_probs(self._logits(row), row.targets, temperature=cfg.temperature,
                                        with_entropy=True)
            if cfg.entropy_coef == 0:
                ent = ent.detach()
            lens = list(row.response_lengths)
            terms = LossTerms(
                advantages=torch.cat([adv[i].expand(n) for i, n in zip(idx, lens)] or [torch.zeros(0)]),
                old_log_probs=(torch.tensor([x for i in idx for x in samples[i].rollout_log_probs],
                                            dtype=torch.float32) if cfg.old_log_probs == "rollout" else None),
                ref_log_probs=None if ref is None else torch.cat([ref[i] for i in idx] or [torch.zeros(0)]),
                weights=token_weights(lens, cfg.aggregation, total_tokens, len(samples)))
            loss, parts = grpo_loss(logp, ent, terms, cfg)
            (loss * self.world).backward()  # FSDP2's reduce-scatter averages over the ranks
            sums += torch.stack([parts[k] for k in METRICS]).double().cpu()
        return self._finish_metrics(samples, sums)

    def _finish_metrics(self, samples: list[Sample], sums: torch.Tensor) -> dict[str, float]:
        total = sums.to(self.device)
        dist.all_reduce(total)
        metrics = dict(zip(METRICS, total.cpu().tolist()))
        self._pending_samples = len(samples)
        n = len(samples)
        metrics.update(num_samples=float(n), num_tokens=float(sum(len(s.response_ids) for s in samples)),
                       reward_mean=sum(s.reward for s in samples) / n,
                       response_length_mean=sum(len(s.response_ids) for s in samples) / n)
        return metrics

    def optimizer_step(self) -> dict[str, float]:
        """Clip the gradient, set the scheduled learning rate, step AdamW, clear the gradient. A step
        whose gradient norm is not finite is skipped (reported as ``skipped=1``). Collective."""
        self._check_awake("optimizer_step")
        if not self._pending_samples:
            raise RuntimeError("optimizer_step needs a forward_backward first")
        grad_norm = clip_gradients(self.model.parameters(), self.config.optim.grad_clip)
        lr = self.lr_schedule(self.consumed_samples + self._pending_samples)
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.consumed_samples += self._pending_samples
        self._pending_samples = 0
        return {"grad_norm": grad_norm, "lr": lr, "skipped": float(skipped), "step": float(self.step)}

    def train_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One optimizer step on a rollout batch (the same list on every rank); returns the metrics. Collective."""
        metrics = self.forward_backward(samples)
        metrics.update(self.optimizer_step())
        return metrics

    # --- weight sync --------------------------------------------------------------------------
    def weight_source(self, backend: str, *, dtype: torch.dtype | None = None,
                      bucket_bytes: int | None = None) -> WeightSource:
        """The source the registered transport ``backend`` reads (``registry.transport(backend).source``):
        local shards (``DTensorModuleSource``, e.g. ``weightsync_m2n``) or bucketed full tensors
        (``FullTensorSource``; e.g. ``weightsync_nccl``, ``weightsync_ipc``); ``dtype``: the wire dtype
        of floating-point tensors (an fp32 master sends bf16, cast on the sender)."""
        from ...registry import transport, transport_names
        from ...trainer.sources import DTensorModuleSource, FullTensorSource

        if backend not in transport_names():
            raise ValueError(f"backend {backend!r} is not a registered transport; choose one of {transport_names()}")
        if transport(backend).source == "local":
            if bucket_bytes is not None:
                raise ValueError(f"backend {backend!r} sends local shards without gathering: bucket_bytes="
                                 f"{bucket_bytes} must be None (its init info's staging size bounds its memory)")
            return DTensorModuleSource(self.model, self.world, dtype=dtype)
        return FullTensorSource(self.model, dtype=dtype, **({"bucket_bytes": bucket_bytes} if bucket_bytes else {}))

    def connect(self, init_info: TrainerInitInfo, client: Any, *, dtype: torch.dtype | None = None) -> TrainerEngine:
        """Build this rank's weightsync engine from this trainer's own source. Collective; rank 0's
        ``client`` initializes the vLLM workers."""
        from ...registry import WeightTransferTrainerFactory

        rank = getattr(init_info, "rank", None)
        if rank != self.rank:
            raise ValueError(f"init_info.rank={rank!r} but this trainer is rank {self.rank}")
        source = self.weight_source(type(init_info).backend, dtype=dtype)
        return WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=source)

    def sync_weights(self, engine: TrainerEngine, *, weight_version: str | None = None) -> SyncStats:
        """Push the current weights to every vLLM worker; returns after they applied them. Colocated
        transports (``Transport.colocated``, e.g. ``weightsync_ipc``): runs with ``torch_memory_saver``'s
        tracking paused, whose VMM memory CUDA IPC cannot export. Collective."""
        from ...transports.ipc_handles import memory_saver_paused

        self._check_awake("sync_weights")
        if getattr(getattr(engine, "source", None), "module", None) is not self.model:
            raise ValueError("engine does not read this trainer's model; build it with trainer.connect(...) "
                             "or from trainer.weight_source(...)")
        from ...registry import transport

        colocated = transport(type(engine.init_info).backend).colocated
        with memory_saver_paused() if colocated else nullcontext():
            return engine.send_weights(weight_version=weight_version)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Every parameter gathered on the host under its Hugging Face name, on rank 0 (None elsewhere). Collective."""
        self._check_awake("full_state_dict")
        return full_state_dict(self.model)

    # --- sleep / wake -------------------------------------------------------------------------
    def _device_tensors(self) -> list[torch.Tensor]:
        tensors = []
        for p in self.model.parameters():
            tensors.append(p)
            if p.grad is not None:
                tensors.append(p.grad)
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return tensors

    def sleep(self) -> int:
        """Move this rank's parameter shards, gradients and optimizer state to host memory and free them on
        the device; returns the bytes moved. No collectives."""
        self._check_awake("sleep")
        reshard(self.model)
        self._offload.offload(self._device_tensors(), self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return self._offload.nbytes

    def wake(self) -> None:
        """Bring back what ``sleep`` moved, byte for byte, into the same tensors. No collectives."""
        if not self._offload.active:
            raise RuntimeError("wake: the trainer is not asleep")
        self._offload.restore()

    @property
    def asleep(self) -> bool:
        return self._offload.active

    # --- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, root: str) -> str:
        """DCP checkpoint of model and optimizer under ``root/iter_<step>/``; the tracker names it
        once complete. Collective."""
        self._check_awake("save_checkpoint")
        return ckpt.save_checkpoint(root, self.step, self.model, self.optimizer,
                                    {"consumed_samples": self.consumed_samples})

    def load_checkpoint(self, root: str, step: int | None = None) -> int:
        """Resume from ``root`` (the tracker's step by default); returns the step. Collective."""
        self._check_awake("load_checkpoint")
        reshard(self.model)
        state = ckpt.load_checkpoint(root, self.model, self.optimizer, step)
        self.step, self.consumed_samples = int(state["step"]), int(state["consumed_samples"])
        return self.step

    def export_hf(self, out_dir: str, *, dtype: torch.dtype | None = None,
                  max_shard_bytes: int = 5 << 30) -> list[str] | None:
        """Write the full model as a Hugging Face checkpoint (safetensors files of at most
        ``max_shard_bytes``, optionally cast to ``dtype``) to ``out_dir``; returns the file names on
        rank 0. Collective."""
        self._check_awake("export_hf")
        return ckpt.export_hf(self.model, self.hf_config, out_dir, dtype=dtype, max_shard_bytes=max_shard_bytes)

    def local_shards(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every parameter (aliases; for checks). No collectives."""
        return {n: local_tensor(p) for n, p in self.model.named_parameters()}


def _all_gather_rows(local: dict[int, torch.Tensor], world: int, device: torch.device) -> dict[int, torch.Tensor]:
    """Every rank's ``{sample index: 1-D tensor}``, merged, as float32 on the host of every rank. As
    tensors (indices and lengths, then the values, padded to the longest rank's), never pickled."""
    keys = sorted(local)
    head = torch.tensor([[i, local[i].numel()] for i in keys], dtype=torch.int64, device=device).reshape(-1, 2)
    flat = torch.cat([local[i].reshape(-1).float() for i in keys]) if keys else torch.empty(0, device=device)
    sizes = [torch.zeros(2, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(keys), flat.numel()], dtype=torch.int64, device=device))
    counts = [(int(n), int(m)) for n, m in (s.tolist() for s in sizes)]
    rows, cols = max(1, *(n for n, _ in counts)), max(1, *(m for _, m in counts))
    heads = [torch.empty(rows, 2, dtype=torch.int64, device=device) for _ in range(world)]
    flats = [torch.empty(cols, dtype=torch.float32, device=device) for _ in range(world)]
    dist.all_gather(heads, torch.cat([head, head.new_zeros(rows - len(keys), 2)]))
    dist.all_gather(flats, torch.cat([flat.to(device), flat.new_zeros(cols - flat.numel(), device=device)]))
    merged = {}
    for (n, m), h, f in zip(counts, heads, flats):
        index = h[:n].tolist()
        merged.update(zip((i for i, _ in index), f[:m].cpu().split([k for _, k in index])))
    return merged
