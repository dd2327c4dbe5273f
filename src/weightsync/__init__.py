"""weightsync: move model weights from RL trainers into vLLM engines, shard-to-shard and exactly.

``import weightsync`` imports neither vLLM, Ray nor nccl-extensions; transports load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import configs
from .clients import HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient, WeightSyncClient
from .errors import (
    DataPlaneError,
    EngineDead,
    PoisonedError,
    Refused,
    RemoteCallError,
    SyncAborted,
    SyncFailed,
    Unauthorized,
)
from .infos import TrainerInitInfo, WorkerInitInfo, WorkerUpdateInfo
from .pausing import WeightsPartlyApplied, paused
from .protocol import ParamMeta, WeightSource
from .registry import (
    TRANSPORTS,
    Transport,
    WeightTransferTrainerFactory,
    WorkerEngineFactory,
    transport,
    transport_names,
)
from .stats import DeltaStats, SyncStats
from .trainer.engine import TrainerEngine
from .trainer.sources import DTensorModuleSource, FullTensorSource

__version__ = "0.1.0"

__all__ = [
    "ParamMeta", "WeightSource", "FullTensorSource", "DTensorModuleSource", "TrainerInitInfo", "WorkerInitInfo",
    "WorkerUpdateInfo", "TrainerEngine", "SyncStats", "DeltaStats", "WeightTransferTrainerFactory",
    "WorkerEngineFactory",
    "WeightSyncClient", "HTTPVLLMWeightSyncClient", "RayVLLMWeightSyncClient", "Transport", "transport",
    "transport_names", "SyncFailed", "PoisonedError", "DataPlaneError", "SyncAborted", "RemoteCallError", "Refused",
    "EngineDead", "Unauthorized", "WeightsPartlyApplied", "paused", "configs",
]


def __getattr__(name: str) -> Any:
    """Lazy exports: ``weightsync.M2NTrainerInitInfo`` imports the transport that declares it."""
    modules = [] if name.startswith("_") else list(TRANSPORTS.values())
    for module_name in modules:
        module = importlib.import_module(module_name)
        if name in getattr(module, "__all__", ()):
            return getattr(module, name)
    raise AttributeError(f"module 'weightsync' has no attribute {name!r}")
