"""Transports by name, and the factories that build their engines.

Each transport is declared once, in its own module, as a module-level ``TRANSPORT`` (a
:class:`Transport`: name, engine classes, init info, source kind, colocated or not). The registry
maps each name to that module and imports it on first use, so ``import weightsync`` imports no
transport module. The demo, the CLI, the FSDP2 trainer, the benchmarks, the vLLM plugin and the
tests all read transports from here: a new transport is its own file plus one line in
``TRANSPORTS``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .infos import TrainerInitInfo
from .protocol import WeightSource

if TYPE_CHECKING:
    from .trainer.engine import TrainerEngine

__all__ = ["Transport", "TRANSPORTS", "transport", "transport_names", "WeightTransferTrainerFactory",
           "WorkerEngineFactory"]


@dataclass(frozen=True)
class Transport:
    """One transport, as its module declares it."""

    name: str
    """Backend name, registered into vLLM's factories (vLLM's own ``nccl``/``ipc``/``nccl_m2n`` are taken)."""
    trainer_engine: type
    """Trainer-side engine class (``trainer_init`` / ``send_weights``)."""
    worker_engine: type
    """Worker-side engine class (vLLM's ``WeightTransferEngine`` API)."""
    init_info: type[TrainerInitInfo]
    """Trainer init info; ``init_info.for_deployment(...)`` builds one for a deployment."""
    source: Literal["local", "full"]
    """What it reads: ``"local"`` FSDP2 shards (``DTensorModuleSource``) or ``"full"`` tensors (``FullTensorSource``)."""
    colocated: bool
    """Trainer and vLLM share devices (memory is handed over, not sent)."""
    summary: str
    """One line: what moves, for help texts."""

    def __post_init__(self) -> None:
        for engine in (self.trainer_engine, self.worker_engine):
            engine.spec = self  # each engine class names its transport


TRANSPORTS: dict[str, str] = {
    "weightsync_m2n": "weightsync.transports.m2n",
    "weightsync_nccl": "weightsync.transports.nccl",
    "weightsync_ipc": "weightsync.transports.ipc",
}
"""Transport name -> the module that declares it (as ``TRANSPORT``)."""


def transport_names() -> list[str]:
    """Every registered transport name, sorted."""
    return sorted(TRANSPORTS)


def transport(name: str) -> Transport:
    """The declaration of transport ``name`` (imports its module); ``ValueError`` listing the names."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown weight-transfer backend {name!r}; available: {transport_names()}")
    declared = importlib.import_module(TRANSPORTS[name]).TRANSPORT
    if declared.name != name:
        raise RuntimeError(f"module {TRANSPORTS[name]} declares transport {declared.name!r}, registered as {name!r}")
    return declared


class WorkerEngineFactory:
    """Worker engines by backend name."""

    @staticmethod
    def engine_class(name: str) -> type:
        return transport(name).worker_engine

    @classmethod
    def create_engine(cls, backend: str, vllm_config: Any, device: Any, model: Any, config: Any = None) -> Any:
        """Build the worker engine for ``backend`` (what vLLM's factory does for a config)."""
        return cls.engine_class(backend)(config, vllm_config, device, model)


class WeightTransferTrainerFactory:
    """Trainer engines, dispatched on ``type(init_info).backend``."""

    @staticmethod
    def engine_class(name: str) -> type:
        return transport(name).trainer_engine

    @classmethod
    def trainer_init(cls, init_info: TrainerInitInfo, *, client: Any, source: WeightSource | None = None) -> TrainerEngine:
        """Build and rendezvous the trainer engine for ``init_info``; call on every trainer rank."""
        if not isinstance(init_info, TrainerInitInfo):
            raise TypeError(f"init_info must be a TrainerInitInfo, got {type(init_info).__name__}")
        return cls.engine_class(type(init_info).backend).trainer_init(init_info, client=client, source=source)
