"""vLLM plugin: registers weightsync's engines in vLLM's two weight-transfer factories.

Wired as a ``vllm.general_plugins`` entry point, so vLLM runs ``register()`` in every process it
starts (driver and workers). Idempotent. The classes vLLM gets are weightsync's engines with
vLLM's own ABCs mixed in (``WeightTransferEngine`` / ``TrainerWeightTransferEngine``).
"""

from __future__ import annotations

from typing import Any

from ..registry import TRANSPORTS, transport

__all__ = ["register", "vllm_worker_class", "vllm_trainer_class"]

_CACHE: dict[tuple[str, str], type] = {}


def _mixed(kind: str, name: str) -> type:
    key = (kind, name)
    if key not in _CACHE:
        from vllm.distributed.weight_transfer import TrainerWeightTransferEngine, WeightTransferEngine

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
        if attr.startswith(prefix) and attr[len(prefix):] in TRANSPORTS:
            return _mixed(kind, attr[len(prefix):])
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def _register_into(factory: Any, name: str, class_name: str) -> None:
    if name in getattr(factory, "_registry", {}):
        return  # already registered (the plugin may run several times in one process)
    factory.register_engine(name, __name__, class_name)


def register() -> None:
    """Register ``weightsync_*`` backends in vLLM's factories, lazily by import path; idempotent."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for name in TRANSPORTS:
        _register_into(WeightTransferEngineFactory, name, _WORKER + name)
        _register_into(WeightTransferTrainerFactory, name, _TRAINER + name)
