"""vLLM plugin: registers weightsync's engines in vLLM's two weight-transfer factories.

Worker backends: ``weightsync_m2n``, ``weightsync_nccl``, ``weightsync_ipc``, and ``weightsync``, which
serves whichever of them each trainer's init info names (:class:`AnyTransportWorkerEngine`).

Wired as a ``vllm.general_plugins`` entry point, so vLLM runs ``register()`` in every process it
starts (driver and workers). Idempotent. The classes vLLM gets are weightsync's engines with
vLLM's own ABCs mixed in (``WeightTransferEngine`` / ``TrainerWeightTransferEngine``).

Backend ``weightsync``: vLLM builds each worker's weight-transfer engine once, when it loads the model, from
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

from ..infos import WorkerInitInfo, WorkerUpdateInfo, parse_info
from ..registry import TRANSPORTS, transport, transport_names
from ..worker.engine import WorkerEngine

__all__ = ["register", "vllm_worker_class", "vllm_trainer_class", "AnyTransportWorkerEngine"]

_CACHE: dict[tuple[str, str], type] = {}
ANY = "weightsync"
"""The worker backend that serves any weightsync transport (:class:`AnyTransportWorkerEngine`)."""


def _mixed(kind: str, name: str) -> type:
    key = (kind, name)
    if key not in _CACHE:
        from vllm.distributed.weight_transfer import TrainerWeightTransferEngine, WeightTransferEngine

        if name == ANY:
            ours = AnyTransportWorkerEngine
        else:
            declared = transport(name)
            ours = declared.worker_engine if kind == "worker" else declared.trainer_engine
        vllm_base = WeightTransferEngine if kind == "worker" else TrainerWeightTransferEngine
        _CACHE[key] = type(ours.__name__, (ours, vllm_base), {"__module__": ours.__module__,
                                                               "__doc__": ours.__doc__})
    return _CACHE[key]


def vllm_worker_class(name: str) -> type:
    """Our worker engine for backend ``name``, as a subclass of vLLM's ``WeightTransferEngine``."""
    return _mixed("worker", name)


def vllm_trainer_class(name: str) -> type:
    """Our trainer engine for backend ``name``, as a subclass of vLLM's ``TrainerWeightTransferEngine``."""
    return _mixed("trainer", name)


_WORKER, _TRAINER = "VLLMWorker_", "VLLMTrainer_"


def __getattr__(attr: str) -> type:
    """``VLLMWorker_<backend>`` / ``VLLMTrainer_<backend>``: what vLLM's factories import lazily."""
    for prefix, kind in ((_WORKER, "worker"), (_TRAINER, "trainer")):
        name = attr[len(prefix):]
        if attr.startswith(prefix) and (name in TRANSPORTS or (kind == "worker" and name == ANY)):
            return _mixed(kind, name)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def _register_into(factory: Any, name: str, class_name: str) -> None:
    if name in getattr(factory, "_registry", {}):
        return  # already registered (the plugin may run several times in one process)
    factory.register_engine(name, __name__, class_name)


def register() -> None:
    """Register the ``weightsync_*`` transports in vLLM's factories, and the worker backend
    ``weightsync`` that serves any of them; lazily by import path; idempotent."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for name in TRANSPORTS:
        _register_into(WeightTransferEngineFactory, name, _WORKER + name)
        _register_into(WeightTransferTrainerFactory, name, _TRAINER + name)
    _register_into(WeightTransferEngineFactory, ANY, _WORKER + ANY)


class AnyTransportWorkerEngine(WorkerEngine[WorkerInitInfo, WorkerUpdateInfo]):
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
            if self.engine is not None:  # fenced first: a refused session leaves the bound one's engine as it is
                self.engine.fence(parse_info(cls.init_info_cls, init_dict, "init_info"))
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
