"""vLLM backend ``weightsync``: one worker engine that serves whichever weightsync transport a trainer names.

vLLM builds each worker's weight-transfer engine once, when it loads the model, from
``WeightTransferConfig(backend=...)``. With ``backend="weightsync"`` the worker reads the transport
from every init info (its ``transport`` field, which weightsync's trainer engines fill in) and builds
that transport's worker engine, shutting the previous one down: one vLLM engine can be synced over
M2N by one trainer and over broadcast or IPC by another, without a restart::

    LLM(model, weight_transfer_config=WeightTransferConfig(backend="weightsync"))

Everything else is the chosen transport's own engine, unchanged (the calls are delegated).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..engine import WorkerInitInfo, WorkerUpdateInfo
from ..registry import transport, transport_names
from ..worker import WorkerEngine

__all__ = ["AnyTransportWorkerEngine"]


class AnyTransportWorkerEngine(WorkerEngine):
    """Delegates to the worker engine of the transport each init info names."""

    init_info_cls = WorkerInitInfo
    update_info_cls = WorkerUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.engine: WorkerEngine | None = None
        """The current transport's engine (None before the first init)."""

    def _current(self) -> WorkerEngine:
        if self.engine is None:
            raise RuntimeError("init_weight_transfer_engine must run first: the 'weightsync' backend serves the "
                               "transport its init info names")
        return self.engine

    def parse_init_info(self, init_dict: dict[str, Any]) -> Any:
        """Build (or keep) the engine of ``init_dict["transport"]`` and parse the info with it."""
        name = init_dict.get("transport") if isinstance(init_dict, Mapping) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"init_info.transport must name a weightsync transport for vLLM's 'weightsync' backend "
                             f"(one of {transport_names()}), got {name!r}")
        cls = transport(name).worker_engine
        if type(self.engine) is not cls:
            if self.engine is not None:
                self.engine.shutdown()
            self.engine = cls(self.config, self.vllm_config, self.device, self._default_model)
            if self.model is not self._default_model:
                self.engine.set_weight_update_target(self.model, self.model_config)
        return self.engine.parse_init_info(init_dict)

    def init_transfer_engine(self, init_info: Any) -> None:
        self._current().init_transfer_engine(init_info)

    def parse_update_info(self, update_dict: dict[str, Any]) -> Any:
        return self._current().parse_update_info(update_dict)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._current().update_weights(update_info)

    def start_weight_update(self) -> None:
        self._current().start_weight_update()

    def receive_weights(self, update_info: Any) -> None:
        self._current().receive_weights(update_info)

    def finish_weight_update(self) -> None:
        self._current().finish_weight_update()

    def set_weight_update_target(self, model: torch.nn.Module, model_config: Any) -> None:
        super().set_weight_update_target(model, model_config)
        if self.engine is not None:
            self.engine.set_weight_update_target(model, model_config)

    def reset_weight_update_target(self) -> None:
        super().reset_weight_update_target()
        if self.engine is not None:
            self.engine.reset_weight_update_target()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
