"""TRL's ``GRPOTrainer`` (server mode) syncing its weights through weightsync.

TRL 1.16 in server mode generates through ``vllm serve``'s OpenAI routes (``VLLMClient.generate`` posts
``/v1/completions``) and pushes weights with vLLM's NCCL weight-transfer engine, which needs CUDA
(``VLLMClient.init_communicator`` refuses any other device). This adapter keeps TRL's generation as it is
and replaces only the two weight-sync steps of TRL's ``VLLMGeneration``: ``_init_vllm`` opens a
weightsync ``weightsync_nccl`` engine (broadcast from the one trainer process, gloo on CPU, NCCL on
CUDA) over ``HTTPVLLMWeightSyncClient``; ``sync_weights`` calls ``send_weights`` and resets the prefix
cache. The server runs with ``--weight-transfer-config '{"backend": "weightsync"}'``::

    with weightsync.integrations.trl.weightsync_sync(timeout_s=120.0):
        trainer = trl.GRPOTrainer(model=..., args=GRPOConfig(use_vllm=True, vllm_mode="server", ...), ...)
    trainer.train()

Only a single-process, non-PEFT trainer is supported (a plain module: ``FullTensorSource`` reads it).
Importing this module imports TRL (and through it vLLM).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import trl.trainer.grpo_trainer as _grpo
from trl.generation.vllm_client import VLLMClient
from trl.generation.vllm_generation import VLLMGeneration

__all__ = ["WeightsyncVLLMGeneration", "weightsync_sync"]


class WeightsyncVLLMGeneration(VLLMGeneration):
    """TRL's ``VLLMGeneration`` with weight sync through weightsync (server mode only).

    ``weightsync_options`` (class attribute, set by ``weightsync_sync``): ``timeout_s``, ``bucket_bytes``,
    ``master_address``, ``weight_version`` (a format string with ``{step}``, the sync count from 1).
    """

    weightsync_options: dict[str, Any] = {}

    def _init_vllm(self) -> None:
        from weightsync import FullTensorSource, HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory
        from weightsync.transport.nccl import NCCLTrainerInitInfo

        if self.mode != "server":
            raise ValueError(f"weightsync's TRL adapter needs vllm_mode='server', got vllm_mode={self.mode!r}")
        if self.accelerator.num_processes != 1:
            raise ValueError("weightsync's TRL adapter supports one trainer process, got "
                             f"num_processes={self.accelerator.num_processes}")
        if self._dist.is_fsdp or hasattr(self.model, "peft_config"):
            raise ValueError("weightsync's TRL adapter supports a plain (not FSDP, not PEFT) model, got "
                             f"{type(self.model).__name__} (fsdp={self._dist.is_fsdp})")
        opts = dict(self.weightsync_options)
        base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
        self.vllm_client = VLLMClient(base_url=base_url, connection_timeout=self.server_timeout)
        if self.vllm_client.get_server_info()["weight_transfer_config"] is None:
            raise RuntimeError(f"the vLLM server at {base_url} has no weight-transfer engine; start it with "
                               """--weight-transfer-config '{"backend": "weightsync"}'""")
        self._weightsync_version = opts.pop("weight_version", "trl-step{step}")
        self._weightsync_syncs = 0
        bucket_bytes = opts.pop("bucket_bytes", None)
        info = NCCLTrainerInitInfo.for_deployment(
            num_trainer_ranks=1, replicas=1, tp=self.vllm_client.get_world_size(), rank=0,
            buffer_bytes=bucket_bytes, device="cuda" if self.accelerator.device.type == "cuda" else "cpu", **opts)
        source_kw = {"bucket_bytes": bucket_bytes} if bucket_bytes is not None else {}
        self.weightsync_engine = WeightTransferTrainerFactory.trainer_init(
            info, client=HTTPVLLMWeightSyncClient(base_url, timeout_s=info.timeout_s),
            source=FullTensorSource(self.model, **source_kw))
        self.accelerator.wait_for_everyone()

    def sync_weights(self) -> None:
        self._weightsync_syncs += 1
        self.last_sync_stats = self.weightsync_engine.send_weights(
            weight_version=self._weightsync_version.format(step=self._weightsync_syncs))
        self.vllm_client.reset_prefix_cache()


@contextlib.contextmanager
def weightsync_sync(**options: Any) -> Iterator[type[WeightsyncVLLMGeneration]]:
    """Within the block, a ``trl.GRPOTrainer`` built in server mode syncs through weightsync.

    ``options``: ``NCCLTrainerInitInfo`` fields (``timeout_s``, ``master_address``, ...), ``bucket_bytes``
    and ``weight_version`` (see ``WeightsyncVLLMGeneration``). The trainer keeps its engine after the block.
    """
    cls = type("WeightsyncVLLMGeneration", (WeightsyncVLLMGeneration,), {"weightsync_options": options})
    previous = _grpo.VLLMGeneration
    _grpo.VLLMGeneration = cls
    try:
        yield cls
    finally:
        _grpo.VLLMGeneration = previous
