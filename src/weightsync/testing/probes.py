"""What tests read out of harness processes: resources for leak checks, engine state, the engine
classes vLLM's factories build, and a ``send_weights`` that fails on any gather.

Each function runs inside a trainer or receiver process (``actor.call("weightsync.testing.probes:NAME")``).
"""

from __future__ import annotations

import os
from typing import Any

from .actors import STATE

__all__ = ["process_resources", "thread_count", "ipc_imports", "engine_poisoned", "engine_classes",
           "send_weights_without_gathers"]


def process_resources(collect: bool = False) -> dict[str, int]:
    """Open fds, RSS, shared-memory files mapped or open, and the weightsync ipc buffers this process
    created that are still in /dev/shm. ``collect`` runs the garbage collector first (slow in vLLM)."""
    import gc

    from ..transports.ipc_handles import SHM_DIR, SHM_PREFIX

    if collect:
        gc.collect()
    fds = os.listdir("/proc/self/fd")
    shm = set()
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the fd listing itself, closed meanwhile
            continue
        if target.startswith(SHM_DIR + "/"):
            shm.add(target.removesuffix(" (deleted)"))
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(SHM_DIR + "/"):
                shm.add(parts[5].strip().removesuffix(" (deleted)"))
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    own = [n for n in os.listdir(SHM_DIR) if n.startswith(f"{SHM_PREFIX}{os.getpid()}-")]
    return {"pid": os.getpid(), "fds": len(fds), "rss": rss, "shm": len(shm), "own_buffers": len(own)}


def thread_count() -> int:
    import threading

    return threading.active_count()


def ipc_imports() -> int | None:
    """Inside a receiver: how many buffers its ipc worker engine imported so far."""
    importer = getattr(STATE.get("engine"), "importer", None)
    return None if importer is None else importer.imports


def engine_poisoned() -> str | None:
    """Inside a receiver: why its worker engine refuses updates (None when it is healthy)."""
    return STATE["engine"].poisoned


def engine_classes() -> dict[str, dict[str, Any]]:
    """Inside a receiver: what vLLM's factories build for every weightsync backend name."""
    import torch
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import (
        TrainerWeightTransferEngine,
        WeightTransferEngine,
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    from ..registry import transport_names

    out = {}
    for name in transport_names():
        engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend=name), STATE["vllm_config"],
                                                           torch.device("cpu"), STATE["model"])
        trainer = WeightTransferTrainerFactory._registry[name]()
        out[name] = {"worker": type(engine).__name__, "worker_is_vllm": isinstance(engine, WeightTransferEngine),
                     "trainer": trainer.__name__, "trainer_is_vllm": issubclass(trainer, TrainerWeightTransferEngine)}
    return out


class _Forbidden(RuntimeError):
    pass


def send_weights_without_gathers(weight_version: str) -> dict[str, Any]:
    """Inside a trainer: ``send_weights`` with every gathering path made to raise."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc
    from torch.distributed.tensor import DTensor

    def forbid(what: str) -> Any:
        def boom(*a: Any, **k: Any) -> Any:
            raise _Forbidden(f"{what} called during send_weights")
        return boom

    targets = [(DTensor, "full_tensor"), (DTensor, "redistribute"), (dist, "all_gather"),
               (dist, "all_gather_into_tensor"), (dist, "all_gather_object"), (fc, "all_gather_tensor")]
    saved = [(obj, name, getattr(obj, name)) for obj, name in targets]
    for obj, name, _ in saved:
        setattr(obj, name, forbid(f"{getattr(obj, '__name__', obj)}.{name}"))
    try:
        from .trainer import _paused

        with _paused(STATE["engine"]):
            stats = STATE["engine"].send_weights(weight_version=weight_version)
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
    return {"received": stats.bytes_received_per_worker, "lower_bound": stats.lower_bound_per_worker}


def m2n_staged_bytes() -> dict[str, int]:
    """An M2N trainer rank's bytes per sync that go through staging (not contiguous in its shard) and
    its total, from the live engine's plan and the source's current shards."""
    from ..reshard.executor import _direct_view

    engine = STATE["engine"]
    shards = dict(engine.source.iter_local())
    staged = total = 0
    for rnd in engine.plan.rounds:
        for m in rnd:
            total += m.nbytes
            if len(m.items) != 1 or _direct_view(m, shards[m.items[0].name], engine.plan.dtypes, True) is None:
                staged += m.nbytes
    return {"staged": staged, "total": total}
