"""``FSDP2Trainer`` rank processes: ``FSDP2Ranks`` (caller side) and the functions that run in them.

The caller runs a function on every rank concurrently (``ranks.run("build", config)``: a function of
this module, or any ``"module:function"``); functions keep the trainer and its engine in ``STATE``::

    ranks = FSDP2Ranks(2)
    ranks.init(2)                                   # (re)form the default gloo group
    ranks.build(TrainerConfig(...))                 # FSDP2Trainer on every rank
    ranks.run("connect", init_info, client)         # trainer.connect: its weightsync engine
    ranks.run("call", "train_step", samples)        # any trainer method
    ranks.run("sync", "v1")                         # trainer.sync_weights(engine)
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from .actors import STATE, Actor, gather
from .cluster import free_port, model_config_dir

__all__ = ["FSDP2Ranks", "write_checkpoint", "init_group", "build", "call", "full_grads", "connect", "sync",
           "shutdown_engine"]

_M = "weightsync.testing.fsdp2:"


class FSDP2Ranks:
    """``n`` long-lived trainer rank processes; ``run`` calls a function on the given ranks at once."""

    def __init__(self, n: int = 2) -> None:
        self.actors = [Actor(f"fsdp2-rank{r}", {"OMP_NUM_THREADS": "1"}) for r in range(n)]
        self.world = 0

    def run(self, fn: str, *args: Any, ranks: list[int] | None = None, **kwargs: Any) -> list[Any]:
        """``fn`` (a function of this module, or ``"module:function"``) on ``ranks`` (default: all of the group)."""
        fn = fn if ":" in fn else _M + fn
        ranks = list(range(self.world)) if ranks is None else ranks
        return gather([self.actors[r].submit(fn, *args, **kwargs) for r in ranks])

    def init(self, world: int) -> None:
        """(Re)form the default process group over the first ``world`` processes."""
        if not 1 <= world <= len(self.actors):
            raise ValueError(f"world must be in [1, {len(self.actors)}], got {world}")
        port = free_port()
        gather([a.submit(_M + "init_group", world, r, port) for r, a in enumerate(self.actors[:world])])
        self.world = world

    def build(self, config: Any) -> None:
        self.run("build", config)

    def close(self) -> None:
        for a in self.actors:
            a.close()


def write_checkpoint(path: str, *, seed: int, config: str = "tiny_qwen3") -> str:
    """A seeded random Hugging Face checkpoint (``save_pretrained``) of a shipped config."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" on stderr
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_config_dir(config)),
                                             dtype=torch.float32)
    model.save_pretrained(path)
    return path


# --- inside a rank process ------------------------------------------------------------------
def init_group(world: int, rank: int, port: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    STATE.pop("trainer", None)
    if dist.is_initialized():
        dist.destroy_process_group()
    from ..sealed import loopback_store

    timeout = timedelta(seconds=120)  # (the store listens on loopback only: see ``loopback_store``)
    dist.init_process_group("gloo", store=loopback_store(port, is_master=rank == 0, timeout=timeout), rank=rank,
                            world_size=world, timeout=timeout)


def build(config: Any) -> None:
    from ..integrations.fsdp2 import FSDP2Trainer

    STATE.pop("trainer", None)
    STATE["trainer"] = FSDP2Trainer(config)


def call(method: str, *args: Any, **kwargs: Any) -> Any:
    """``trainer.<method>(*args, **kwargs)``."""
    return getattr(STATE["trainer"], method)(*args, **kwargs)


def full_grads() -> dict[str, torch.Tensor] | None:
    """Every parameter's gradient, gathered, on rank 0 (collective)."""
    import torch.distributed as dist

    out = {}
    for name, p in STATE["trainer"].model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()
    return out if dist.get_rank() == 0 else None


def connect(init_info: Any, client: Any) -> None:
    """``trainer.connect`` with this rank's copy of ``init_info`` (collective)."""
    import dataclasses

    t = STATE["trainer"]
    STATE["engine"] = t.connect(dataclasses.replace(init_info, rank=t.rank), client)


def sync(weight_version: str) -> int:
    """``trainer.sync_weights(engine)`` (rank 0 inside ``clients.paused``); returns the bytes this rank sent."""
    from .trainer import _paused

    with _paused(STATE["engine"]):
        return STATE["trainer"].sync_weights(STATE["engine"], weight_version=weight_version).bytes_sent


def shutdown_engine() -> None:
    engine = STATE.pop("engine", None)
    if engine is not None:
        engine.shutdown()
