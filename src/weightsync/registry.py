"""Backend registries: name -> trainer / worker engine class, resolved lazily by import path.

``import weightsync`` imports no transport module; a backend's module is imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from .protocol import TrainerEngine, TrainerInitInfo, WeightSource

__all__ = ["WeightTransferTrainerFactory", "WorkerEngineFactory", "BACKENDS"]

# Names are the ones registered into vLLM (its own ``nccl``/``ipc``/``nccl_m2n`` are taken); the
# short names (``nccl``) are accepted as aliases here.
BACKENDS: dict[str, tuple[str, str, str]] = {
    # name: (module, trainer engine class, worker engine class)
    "weightsync_nccl": ("weightsync.transport.nccl", "NCCLTrainerEngine", "NCCLWorkerEngine"),
    "weightsync_m2n": ("weightsync.transport.m2n", "M2NTrainerEngine", "M2NWorkerEngine"),
    "weightsync_ipc": ("weightsync.transport.ipc", "IPCTrainerEngine", "IPCWorkerEngine"),
}


def _load(path: str, name: str) -> Any:
    return getattr(importlib.import_module(path), name)


class _Factory:
    _kind: str
    _index: int
    _registry: dict[str, tuple[str, str]]

    @classmethod
    def register_engine(cls, name: str, module_path: str, class_name: str, *, replace: bool = False) -> None:
        """Register ``module_path:class_name`` under ``name`` (``ValueError`` on a taken name)."""
        if name in cls._registry and not replace and cls._registry[name] != (module_path, class_name):
            raise ValueError(f"{cls._kind} engine {name!r} is already registered as {cls._registry[name]}")
        cls._registry[name] = (module_path, class_name)

    @classmethod
    def engine_class(cls, name: str) -> type:
        if name not in cls._registry and f"weightsync_{name}" in cls._registry:
            name = f"weightsync_{name}"
        if name not in cls._registry:
            raise ValueError(f"unknown weight-transfer backend {name!r}; available: {sorted(cls._registry)}")
        return _load(*cls._registry[name])

    @classmethod
    def available(cls) -> list[str]:
        return sorted(cls._registry)


class WorkerEngineFactory(_Factory):
    """Worker engines by backend name."""

    _kind = "worker"
    _registry = {name: (mod, worker) for name, (mod, _, worker) in BACKENDS.items()}

    @classmethod
    def create_engine(cls, backend: str, vllm_config: Any, device: Any, model: Any, config: Any = None) -> Any:
        """Build the worker engine for ``backend`` (what vLLM's factory does for a config)."""
        return cls.engine_class(backend)(config, vllm_config, device, model)


class WeightTransferTrainerFactory(_Factory):
    """Trainer engines, dispatched on ``type(init_info).backend``."""

    _kind = "trainer"
    _registry = {name: (mod, trainer) for name, (mod, trainer, _) in BACKENDS.items()}

    @classmethod
    def trainer_init(cls, init_info: TrainerInitInfo, *, client: Any, source: WeightSource | None = None) -> TrainerEngine:
        """Build and rendezvous the trainer engine for ``init_info``; call on every trainer rank."""
        if not isinstance(init_info, TrainerInitInfo):
            raise TypeError(f"init_info must be a TrainerInitInfo, got {type(init_info).__name__}")
        return cls.engine_class(type(init_info).backend).trainer_init(init_info, client=client, source=source)

