"""Worker-side engine base (mirrors vLLM's ``WeightTransferEngine``) and the layerwise-reload applier.

vLLM's worker calls, in order: ``init_transfer_engine(parse_init_info(d))``, then per sync
``start_weight_update()``, ``update_weights(d)`` (one or more), ``finish_weight_update()``;
``shutdown()`` at the end. When vLLM is installed the plugin mixes vLLM's ABC into these classes
(``weightsync.integrations.vllm_plugin``); this module never imports vLLM at import time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from .engine import WorkerInitInfo, WorkerUpdateInfo, parse_info

__all__ = ["WorkerEngine", "LayerwiseApplier", "PoisonedError"]


class PoisonedError(RuntimeError):
    """The engine saw a failed sync and refuses updates until ``init_transfer_engine`` runs again."""


class LayerwiseApplier:
    """Applies HF-named tensors to a vLLM model through vLLM's layerwise reload.

    ``start`` -> ``load(...)``* -> ``finish``; or ``abort`` to put every parameter back as it was
    before ``start`` (from a host snapshot taken at ``start`` when ``rollback`` is on). Parameter
    storage is kept, so CUDA graphs stay valid.
    """

    def __init__(self, model: torch.nn.Module, model_config: Any, *, rollback: bool = True) -> None:
        self.model, self.model_config, self.rollback = model, model_config, rollback
        self._snapshot: dict[str, torch.Tensor] | None = None
        self.active = False

    def start(self, *, layerwise: bool = True) -> None:
        """Take the rollback snapshot; with ``layerwise``, also enter layerwise reload (else call
        ``begin_layerwise`` later, once in-place writes are done)."""
        if self.rollback:
            self._snapshot = {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}
        if layerwise:
            self.begin_layerwise()

    def begin_layerwise(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self.active = True

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Hand tensors to ``model.load_weights``; the caller must keep them unmodified until
        ``finish`` (layerwise reload may hold them until a layer is complete)."""
        try:
            from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        except ImportError:  # pragma: no cover - older vLLM
            from contextlib import nullcontext as disable_mtp_completeness_check
        with disable_mtp_completeness_check():
            return set(self.model.load_weights(weights) or ())

    def finish(self) -> None:
        if self.active:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
        self.active, self._snapshot = False, None

    def abort(self) -> None:
        """Undo a partial update: finalize (re-places kept storage), then restore the snapshot."""
        snapshot = self._snapshot
        self.finish()
        if snapshot is not None:
            with torch.no_grad():
                for n, p in self.model.named_parameters():
                    p.data.copy_(snapshot[n])


class WorkerEngine(ABC):
    """Base of weightsync's worker engines; constructor and methods match vLLM's ABC."""

    init_info_cls: ClassVar[type[WorkerInitInfo]]
    update_info_cls: ClassVar[type[WorkerUpdateInfo]]
    supports_draft_weight_update: ClassVar[bool] = False
    defers_processing: ClassVar[bool] = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.parallel_config = getattr(vllm_config, "parallel_config", None)
        self.model_config = getattr(vllm_config, "model_config", None)
        self.device = torch.device(device)
        self.model = model
        self._default_model, self._default_model_config = model, self.model_config
        self.poisoned: str | None = None

    # --- vLLM worker plumbing -------------------------------------------------------------
    def set_weight_update_target(self, model: torch.nn.Module, model_config: Any) -> None:
        self.model, self.model_config = model, model_config

    def reset_weight_update_target(self) -> None:
        self.model, self.model_config = self._default_model, self._default_model_config

    def drain_pending(self) -> None:
        """Nothing is deferred: ``update_weights`` returns after the weights are applied."""

    def parse_init_info(self, init_dict: dict[str, Any]) -> Any:
        return parse_info(self.init_info_cls, init_dict, "init_info")

    def parse_update_info(self, update_dict: dict[str, Any]) -> Any:
        return parse_info(self.update_info_cls, update_dict, "update_info")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def worker_rank(self) -> int:
        """This worker's rank over all replicas: replica index * (TP x PP) + rank in replica."""
        pc = self.parallel_config
        if pc is None:
            return 0
        return int(getattr(pc, "data_parallel_index", 0) or 0) * int(pc.world_size) + int(pc.rank)

    def _check_not_poisoned(self) -> None:
        if self.poisoned is not None:
            raise PoisonedError(f"{type(self).__name__} refuses updates after a failed sync "
                                f"({self.poisoned}); call init_weight_transfer_engine again")

    # --- the engine's own lifecycle -------------------------------------------------------
    @abstractmethod
    def init_transfer_engine(self, init_info: Any) -> None: ...

    @abstractmethod
    def start_weight_update(self) -> None: ...

    @abstractmethod
    def receive_weights(self, update_info: Any) -> None: ...

    @abstractmethod
    def finish_weight_update(self) -> None: ...

    @abstractmethod
    def shutdown(self) -> None: ...
