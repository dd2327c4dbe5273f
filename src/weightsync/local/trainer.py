"""What runs inside a local trainer process: a tiny HF causal LM under FSDP2 over gloo, an
optimizer step, and a weightsync trainer engine. Called through ``weightsync.local.actors``.
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .actors import STATE

__all__ = ["setup", "teardown", "train_step", "full_state_dict", "make_engine", "send_weights", "shutdown_engine"]


def setup(model_dir: str, *, world: int, rank: int, port: int, dtype: str, seed: int = 0, fsdp: bool = True) -> None:
    """Init the trainer's own default group (gloo), build the model from ``model_dir/config.json``
    with seeded random weights (same on every rank), shard it with FSDP2, make AdamW."""
    teardown()
    torch.set_num_threads(1)
    from transformers import AutoConfig, AutoModelForCausalLM

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    torch.manual_seed(seed)
    cfg = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    STATE.update(model=model, optim=torch.optim.AdamW(model.parameters(), lr=1e-2), rank=rank, world=world,
                 vocab=cfg.vocab_size)


def teardown() -> None:
    shutdown_engine()
    for k in ("model", "optim"):
        STATE.pop(k, None)
    if dist.is_initialized():
        dist.destroy_process_group()


def train_step(seed: int) -> float:
    """One forward/backward/AdamW step on random tokens (every rank, collective)."""
    model, optim = STATE["model"], STATE["optim"]
    g = torch.Generator().manual_seed(seed * 100 + STATE["rank"])
    ids = torch.randint(0, STATE["vocab"], (2, 16), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    return float(loss.detach())


def full_state_dict() -> dict[str, torch.Tensor] | None:
    """Every parameter gathered under its HF name; returned on rank 0 (collective)."""
    out = {}
    for name, p in STATE["model"].named_parameters():
        t = p.detach()
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = t.clone()
    return out if STATE["rank"] == 0 else None


def local_shards() -> tuple[list[Any], dict[str, torch.Tensor]]:
    """This rank's ``DTensorModuleSource`` view: planner sources (same on every rank) and local shards."""
    from ..sources import DTensorModuleSource, tensor_sources

    src = DTensorModuleSource(STATE["model"], STATE["world"])
    return tensor_sources(src.metadata), {n: t.clone() for n, t in src.iter_local()}


def make_engine(init_info: Any, client: Any, *, source: str = "full", bucket_bytes: int | None = None,
                factory: str = "weightsync") -> None:
    """Build the source and ``trainer_init`` the engine (every rank, collective). ``factory="vllm"``
    dispatches through vLLM's own ``WeightTransferTrainerFactory`` (after loading vLLM's plugins)."""
    from .. import DTensorModuleSource, FullTensorSource, WeightTransferTrainerFactory

    if factory == "vllm":
        from .receiver import VLLM_CPU_ENV

        os.environ.update({k: v for k, v in VLLM_CPU_ENV.items() if k not in os.environ})
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory  # noqa: F811
        from vllm.plugins import load_general_plugins

        load_general_plugins()
    shutdown_engine()
    model = STATE["model"]
    if source == "full":
        src = FullTensorSource(model, **({"bucket_bytes": bucket_bytes} if bucket_bytes else {}))
    elif source == "dtensor":
        src = DTensorModuleSource(model, STATE["world"])
    else:
        src = source_factory(source)(model)
    init_info = dataclasses.replace(init_info, rank=STATE["rank"], num_trainer_ranks=STATE["world"])
    STATE["engine"] = WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=src)


def source_factory(path: str) -> Any:
    """``"module:callable"`` that builds a source from the model (tests use it for faulty sources)."""
    import importlib

    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def send_weights(weight_version: str | None = None, verify: bool = False) -> dict[str, Any]:
    kwargs = {"verify": True} if verify else {}
    stats = STATE["engine"].send_weights(weight_version=weight_version, **kwargs)
    d = dataclasses.asdict(stats)
    d["seconds"], d["gbps"] = stats.seconds, stats.gbps
    return d


def shutdown_engine() -> None:
    engine = STATE.pop("engine", None)
    if engine is not None:
        engine.shutdown()


def pid() -> int:
    return os.getpid()
