"""Test-only code that runs inside trainer/receiver processes (imported there by name)."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property

import torch

from weightsync import FullTensorSource, ParamMeta, WeightSource

BAD_NAME = "model.layers.1.mlp.up_proj.weight"


class _Faulty(WeightSource):
    """Wraps a FullTensorSource and corrupts what it yields for ``BAD_NAME`` (after earlier tensors moved)."""

    def __init__(self, model: torch.nn.Module, how: str) -> None:
        self.inner, self.how = FullTensorSource(model, bucket_bytes=1 << 16), how

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return self.inner.metadata

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.inner.iter_full():
            if name == BAD_NAME:
                if self.how == "shape":
                    t = t[:-1]
                elif self.how == "dtype":
                    t = t.to(torch.float16)
                elif self.how == "name":
                    name = name + ".typo"
                elif self.how == "short":
                    return
            yield name, t


def bad_shape(model):
    return _Faulty(model, "shape")


def bad_dtype(model):
    return _Faulty(model, "dtype")


def bad_name(model):
    return _Faulty(model, "name")


def stops_early(model):
    return _Faulty(model, "short")


def engine_classes() -> dict:
    """Inside a receiver: what vLLM's factories build for every weightsync backend name."""
    import torch
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import (TrainerWeightTransferEngine, WeightTransferEngine,
                                                  WeightTransferEngineFactory, WeightTransferTrainerFactory)

    from weightsync.local.actors import STATE
    from weightsync.registry import TRANSPORTS

    out = {}
    for name in TRANSPORTS:
        engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend=name), STATE["vllm_config"],
                                                           torch.device("cpu"), STATE["model"])
        trainer = WeightTransferTrainerFactory._registry[name]()
        out[name] = {"worker": type(engine).__name__, "worker_is_vllm": isinstance(engine, WeightTransferEngine),
                     "trainer": trainer.__name__, "trainer_is_vllm": issubclass(trainer, TrainerWeightTransferEngine)}
    return out


class _Forbidden(RuntimeError):
    pass


def send_weights_without_gathers(weight_version: str) -> dict:
    """Inside a trainer: ``send_weights`` with every gathering path made to raise."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc
    from torch.distributed.tensor import DTensor

    from weightsync.local.actors import STATE

    def forbid(what):
        def boom(*a, **k):
            raise _Forbidden(f"{what} called during send_weights")
        return boom

    targets = [(DTensor, "full_tensor"), (DTensor, "redistribute"), (dist, "all_gather"),
               (dist, "all_gather_into_tensor"), (dist, "all_gather_object"), (fc, "all_gather_tensor")]
    saved = [(obj, name, getattr(obj, name)) for obj, name in targets]
    for obj, name, _ in saved:
        setattr(obj, name, forbid(f"{getattr(obj, '__name__', obj)}.{name}"))
    try:
        stats = STATE["engine"].send_weights(weight_version=weight_version)
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
    return {"received": stats.bytes_received_per_worker, "lower_bound": stats.lower_bound_per_worker}


class JsonRoundTripClient:
    """Wraps a weight-sync client; every payload must survive ``json.dumps``/``loads`` (as over HTTP)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    @staticmethod
    def _json(payload):
        import json

        return json.loads(json.dumps(payload, allow_nan=False))

    def init_weight_transfer_engine(self, init_info) -> None:
        self.inner.init_weight_transfer_engine(self._json(init_info))

    def start_weight_update(self) -> None:
        self.inner.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.inner.update_weights(self._json(update_info))

    def finish_weight_update(self, weight_version=None) -> None:
        self.inner.finish_weight_update(weight_version)


class CorruptingClient(JsonRoundTripClient):
    """Sets ``update_info["handles"][worker][field] = value`` (what one worker gets) in the ``chunk``-th
    ``update_weights`` call of each sync."""

    def __init__(self, inner, *, chunk: int, worker: int, field: str, value) -> None:
        super().__init__(inner)
        self.chunk, self.worker, self.field, self.value = chunk, worker, field, value
        self._calls = 0

    def start_weight_update(self) -> None:
        self._calls = 0
        super().start_weight_update()

    def update_weights(self, update_info) -> None:
        update_info = self._json(update_info)
        if self._calls == self.chunk:
            update_info["handles"][str(self.worker)][self.field] = self.value
        self._calls += 1
        self.inner.update_weights(update_info)


def process_resources(collect: bool = False) -> dict:
    """Inside any local process: open fds, RSS, shared-memory files mapped or open, and the
    weightsync ipc buffers this process created that are still in /dev/shm (for leak checks).
    ``collect`` runs the garbage collector first (slow in a vLLM process)."""
    import gc
    import os

    from weightsync.transport.ipc_handles import SHM_DIR, SHM_PREFIX

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


def ipc_imports() -> int | None:
    """Inside a receiver: how many buffers its ipc worker engine imported so far."""
    from weightsync.local.actors import STATE

    importer = getattr(STATE.get("engine"), "importer", None)
    return None if importer is None else importer.imports


def slow_data_plane(seconds: float) -> None:
    """Inside a process: every data-plane round/broadcast first sleeps ``seconds`` (0 restores)."""
    import time

    from weightsync.comm import Communicator

    originals = STATE_ORIGINALS.setdefault("comm", (Communicator.exchange, Communicator.broadcast))
    if not seconds:
        Communicator.exchange, Communicator.broadcast = originals
        return

    def slow(fn):
        def wrapper(*a, **k):
            time.sleep(seconds)
            return fn(*a, **k)
        return wrapper

    Communicator.exchange, Communicator.broadcast = slow(originals[0]), slow(originals[1])


STATE_ORIGINALS: dict = {}


def thread_count() -> int:
    import threading

    return threading.active_count()


class _FaultyLocal(WeightSource):
    """A DTensorModuleSource whose metadata or local shards are wrong in one way (M2N bad inputs)."""

    def __init__(self, model, how: str) -> None:
        import torch.distributed as dist

        from weightsync import DTensorModuleSource

        self.inner, self.how, self.rank = DTensorModuleSource(model, dist.get_world_size()), how, dist.get_rank()

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        import dataclasses

        metas = list(self.inner.metadata)
        if self.how == "duplicate":
            metas.append(metas[0])
        elif self.how == "rank1_differs" and self.rank == 1:
            metas = [m for m in metas if m.name != BAD_NAME]
        elif self.how == "complex":
            metas = [dataclasses.replace(m, dtype=torch.complex64) if m.name == BAD_NAME else m for m in metas]
        return metas

    def iter_local(self):
        for name, t in self.inner.iter_local():
            if name == BAD_NAME and self.how == "local_shape":
                t = t[:-1]
            if name == BAD_NAME and self.how == "local_missing":
                continue
            yield name, t


def local_shape(model):
    return _FaultyLocal(model, "local_shape")


def local_missing(model):
    return _FaultyLocal(model, "local_missing")


def duplicate(model):
    return _FaultyLocal(model, "duplicate")


def rank1_differs(model):
    return _FaultyLocal(model, "rank1_differs")


def complex_dtype(model):
    return _FaultyLocal(model, "complex")


def engine_poisoned() -> str | None:
    """Inside a receiver: why its worker engine refuses updates (None when it is healthy)."""
    from weightsync.local.actors import STATE

    return STATE["engine"].poisoned
