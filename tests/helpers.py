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
    """Inside a receiver: what vLLM's factories hold for ``weightsync_nccl`` after plugin loading."""
    from vllm.distributed.weight_transfer import (TrainerWeightTransferEngine, WeightTransferEngine,
                                                  WeightTransferTrainerFactory)

    from weightsync.local.actors import STATE

    mro = [c.__name__ for c in type(STATE["engine"]).__mro__
           if c.__name__ in ("NCCLWorkerEngine", "WorkerEngine") or c is WeightTransferEngine]
    trainer = WeightTransferTrainerFactory._registry["weightsync_nccl"]()
    return {"worker": mro, "trainer_registered": trainer.__name__,
            "trainer_is_vllm_trainer": issubclass(trainer, TrainerWeightTransferEngine)}


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

