"""Transports by name, and the factories that build their engines.

Each transport is declared once, in its own module, as a module-level ``TRANSPORT`` (a
:class:`Transport`: name, engine classes, init info, source kind, what it can do). The registry maps
each name to that module and imports it on first use, so ``import weightsync`` imports no transport
module. The demo, the CLI, the FSDP2 trainer, the benchmarks, the vLLM plugin and the tests all read
transports from here, and ask a transport what it can do by its :class:`Capabilities`, never by its
name. A new transport is its own file plus one line in ``TRANSPORTS``, or, outside this package,
:func:`register_transport` (in every process that builds engines: the trainer ranks, and vLLM's
workers through a ``vllm.general_plugins`` entry point or ``$WEIGHTSYNC_TRANSPORTS``).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .infos import TrainerInitInfo
from .protocol import WeightSource

if TYPE_CHECKING:
    from .trainer.engine import TrainerEngine

__all__ = ["Capabilities", "Transport", "TRANSPORTS", "TRANSPORTS_ENV", "register_transport", "transport",
           "transport_names", "transports_with", "WeightTransferTrainerFactory", "WorkerEngineFactory"]

TRANSPORTS_ENV = "WEIGHTSYNC_TRANSPORTS"
"""Transports registered by the environment, for processes the user does not run code in (vLLM's
workers): comma-separated ``name=module`` (each module declares ``TRANSPORT``)."""


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do; code that depends on one asks for it here, never by transport name."""

    shard_exact: bool = False
    """Every worker receives exactly its shard's bytes (the plan's lower bound), never whole tensors."""
    delta: bool = False
    """``delta=True``: syncs after the first send only what changed."""
    fp8_targets: bool = False
    """Fills block-FP8 engine weights (the workers quantize what they receive)."""
    fp8_wire: bool = False
    """``fp8_wire=True``: the trainer quantizes whole blocks and sends fp8 bytes plus scales."""
    elastic: bool = False
    """``on_engine_failure="drop"`` and ``add_engines``: one sync group per engine replica."""


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
    """What it reads: ``"local"`` FSDP2 shards (``DTensorModuleSource``) or ``"full"`` tensors
    (``FullTensorSource``)."""
    colocated: bool
    """Trainer and vLLM share devices (memory is handed over, not sent)."""
    summary: str
    """One line: what moves, for help texts."""
    capabilities: Capabilities = field(default_factory=Capabilities)
    """What it can do (:class:`Capabilities`)."""

    def __post_init__(self) -> None:
        for engine in (self.trainer_engine, self.worker_engine):
            engine.spec = self  # each engine class names its transport


TRANSPORTS: dict[str, str] = {
    "weightsync_m2n": "weightsync.transports.m2n",
    "weightsync_nccl": "weightsync.transports.nccl",
    "weightsync_ipc": "weightsync.transports.ipc",
    "weightsync_nixl": "weightsync.transports.nixl",
}
"""Transport name -> the module that declares it (as ``TRANSPORT``)."""


def register_transport(name: str, module: str) -> None:
    """Register transport ``name``, declared as ``TRANSPORT`` in ``module`` (imported on first use).
    Registering a name again with the same module is a no-op; with another module, ``ValueError``."""
    if not name or not isinstance(name, str):
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if not module or not isinstance(module, str):
        raise ValueError(f"module must be a module path (e.g. 'mypkg.my_transport'), got {module!r}")
    if TRANSPORTS.get(name, module) != module:
        raise ValueError(f"transport {name!r} is registered by module {TRANSPORTS[name]!r}, not {module!r}")
    TRANSPORTS[name] = module


def _from_env() -> None:
    for entry in filter(None, (e.strip() for e in os.environ.get(TRANSPORTS_ENV, "").split(","))):
        name, sep, module = entry.partition("=")
        if not sep:
            raise ValueError(f"${TRANSPORTS_ENV}: {entry!r} is not name=module")
        register_transport(name.strip(), module.strip())


def transport_names() -> list[str]:
    """Every registered transport name, sorted."""
    _from_env()
    return sorted(TRANSPORTS)


def transports_with(capability: str) -> list[str]:
    """The registered transports that declare ``capability`` (a :class:`Capabilities` field), sorted."""
    if capability not in Capabilities.__dataclass_fields__:
        raise ValueError(f"unknown capability {capability!r}; known: {sorted(Capabilities.__dataclass_fields__)}")
    return [n for n in transport_names() if getattr(transport(n).capabilities, capability)]


def transport(name: str) -> Transport:
    """The declaration of transport ``name`` (imports its module); ``ValueError`` listing the names."""
    _from_env()
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
    def trainer_init(cls, init_info: TrainerInitInfo, *, client: Any,
                     source: WeightSource | None = None) -> TrainerEngine:
        """Build and rendezvous the trainer engine for ``init_info``; call on every trainer rank."""
        if not isinstance(init_info, TrainerInitInfo):
            raise TypeError(f"init_info must be a TrainerInitInfo, got {type(init_info).__name__}")
        return cls.engine_class(type(init_info).backend).trainer_init(init_info, client=client, source=source)
