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
