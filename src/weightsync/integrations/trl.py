"""TRL's ``GRPOTrainer`` (server mode) syncing its weights through weightsync.

TRL 1.16 in server mode generates through ``vllm serve``'s OpenAI routes (``VLLMClient.generate`` posts
``/v1/completions``) and pushes weights with vLLM's NCCL weight-transfer engine, which needs CUDA
(``VLLMClient.init_communicator`` refuses any other device). This adapter keeps TRL's generation as it is
and replaces only the two weight-sync steps of TRL's ``VLLMGeneration``: ``_init_vllm`` opens a
weightsync ``weightsync_nccl`` engine (broadcast from the one trainer process, gloo on CPU, NCCL on
CUDA) over ``HTTPVLLMWeightSyncClient``; ``sync_weights`` calls ``send_weights`` (generation paused) and resets
the prefix cache. The server runs with ``--weight-transfer-config '{"backend": "weightsync"}'``::

    with weightsync.integrations.trl.weightsync_sync(timeout_s=120.0):
        trainer = trl.GRPOTrainer(model=model, args=GRPOConfig(use_vllm=True, vllm_mode="server", ...), ...)
    trainer.train()

(``examples/trl_grpo.py`` is the complete script.) Only a single-process, non-PEFT trainer is supported (a
plain module: ``FullTensorSource`` reads it). Importing this module imports neither TRL nor vLLM: TRL is
imported by ``weightsync_sync`` and by the first access to ``WeightsyncVLLMGeneration`` (extra ``engine``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

__all__ = ["WeightsyncVLLMGeneration", "weightsync_sync"]  # noqa: F822 (WeightsyncVLLMGeneration: __getattr__)


def _trl() -> Any:
    """TRL's ``grpo_trainer`` module (imported here, not at module import)."""
    try:
        import trl.trainer.grpo_trainer as grpo
    except ImportError as e:
        raise ImportError(f"weightsync.integrations.trl needs TRL (pip install 'weightsync[engine]', which pins "
                          f"trl==1.16.0): {e}") from e
    return grpo


@functools.cache
def _generation_class() -> type:
    """``WeightsyncVLLMGeneration``: TRL's ``VLLMGeneration`` subclassed once TRL is imported."""
    _trl()
    from trl.generation.vllm_client import VLLMClient
    from trl.generation.vllm_generation import VLLMGeneration

    class WeightsyncVLLMGeneration(VLLMGeneration):
        """TRL's ``VLLMGeneration`` with weight sync through weightsync (server mode only).

        ``weightsync_options`` (class attribute, set by ``weightsync_sync``): ``timeout_s``, ``bucket_bytes``,
        ``master_address``, ``weight_version`` (a format string with ``{step}``, the sync count from 1).
        """

        weightsync_options: dict[str, Any] = {}

        def _init_vllm(self) -> None:
            _check_trainer(self)
            base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
            self.vllm_client = VLLMClient(base_url=base_url, connection_timeout=self.server_timeout)
            if self.vllm_client.get_server_info()["weight_transfer_config"] is None:
                raise RuntimeError(f"the vLLM server at {base_url} has no weight-transfer engine; start it with "
                                   """--weight-transfer-config '{"backend": "weightsync"}'""")
            _open_engine(self, base_url, dict(self.weightsync_options))
            self.accelerator.wait_for_everyone()

        def sync_weights(self) -> None:
            from ..clients import paused

            self._weightsync_syncs += 1
            with paused(self.weightsync_engine.client):  # generation paused for the sync (required by default)
                self.last_sync_stats = self.weightsync_engine.send_weights(
                    weight_version=self._weightsync_version.format(step=self._weightsync_syncs))
            self.vllm_client.reset_prefix_cache()

    WeightsyncVLLMGeneration.__module__ = __name__
    WeightsyncVLLMGeneration.__qualname__ = "WeightsyncVLLMGeneration"
    return WeightsyncVLLMGeneration


def _check_trainer(gen: Any) -> None:
    if gen.mode != "server":
        raise ValueError(f"weightsync's TRL adapter needs vllm_mode='server', got vllm_mode={gen.mode!r}")
    if gen.accelerator.num_processes != 1:
        raise ValueError("weightsync's TRL adapter supports one trainer process, got "
                         f"num_processes={gen.accelerator.num_processes}")
    if gen._dist.is_fsdp or hasattr(gen.model, "peft_config"):
        raise ValueError("weightsync's TRL adapter supports a plain (not FSDP, not PEFT) model, got "
                         f"{type(gen.model).__name__} (fsdp={gen._dist.is_fsdp})")


def _open_engine(gen: Any, base_url: str, opts: dict[str, Any]) -> None:
    """A ``weightsync_nccl`` trainer engine (broadcast from this one process) into the server at ``base_url``."""
    from .. import FullTensorSource, HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory
    from ..transports.nccl import NCCLTrainerInitInfo

    gen._weightsync_version = opts.pop("weight_version", "trl-step{step}")
    gen._weightsync_syncs = 0
    bucket_bytes = opts.pop("bucket_bytes", None)
    info = NCCLTrainerInitInfo.for_deployment(
        num_trainer_ranks=1, replicas=1, tp=gen.vllm_client.get_world_size(), rank=0,
        buffer_bytes=bucket_bytes, device="cuda" if gen.accelerator.device.type == "cuda" else "cpu", **opts)
    source_kw = {"bucket_bytes": bucket_bytes} if bucket_bytes is not None else {}
    gen.weightsync_engine = WeightTransferTrainerFactory.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(base_url, timeout_s=info.timeout_s),
        source=FullTensorSource(gen.model, **source_kw))


def __getattr__(name: str) -> Any:
    if name == "WeightsyncVLLMGeneration":
        return _generation_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@contextlib.contextmanager
def weightsync_sync(**options: Any) -> Iterator[type]:
    """Within the block, a ``trl.GRPOTrainer`` built in server mode syncs through weightsync.

    ``options``: ``NCCLTrainerInitInfo`` fields (``timeout_s``, ``master_address``, ...), ``bucket_bytes``
    and ``weight_version`` (see ``WeightsyncVLLMGeneration``). The trainer keeps its engine after the block.
    """
    grpo, base = _trl(), _generation_class()
    cls = type("WeightsyncVLLMGeneration", (base,), {"weightsync_options": options, "__module__": __name__})
    previous = grpo.VLLMGeneration
    grpo.VLLMGeneration = cls
    try:
        yield cls
    finally:
        grpo.VLLMGeneration = previous
