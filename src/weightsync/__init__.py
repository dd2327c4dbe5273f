"""weightsync: move model weights from RL trainers into vLLM engines, shard-to-shard and exactly.

``import weightsync`` imports neither vLLM, Ray nor nccl-extensions; transports load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from .clients import HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient, RemoteCallError, WeightSyncClient
from .protocol import (ParamMeta, SyncStats, TrainerEngine, TrainerInitInfo, WeightSource, WorkerInitInfo,
                       WorkerUpdateInfo)
from .registry import WeightTransferTrainerFactory, WorkerEngineFactory
from .sources import DTensorModuleSource, FullTensorSource

__version__ = "0.1.0"

_LAZY = {
    "NCCLTrainerInitInfo": "weightsync.transport.nccl",
    "M2NTrainerInitInfo": "weightsync.transport.m2n",
    "IPCTrainerInitInfo": "weightsync.transport.ipc",
    "LocalWeightSyncClient": "weightsync.local.client",
}

__all__ = [
    "ParamMeta", "WeightSource", "FullTensorSource", "DTensorModuleSource", "TrainerInitInfo", "WorkerInitInfo",
    "WorkerUpdateInfo", "TrainerEngine", "SyncStats", "WeightTransferTrainerFactory", "WorkerEngineFactory",
    "WeightSyncClient", "HTTPVLLMWeightSyncClient", "RayVLLMWeightSyncClient", "RemoteCallError", *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'weightsync' has no attribute {name!r}")
