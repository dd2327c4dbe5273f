"""What runs inside a harness trainer process: a tiny HF causal LM under FSDP2 over gloo (built and
sharded by ``weightsync.integrations.fsdp2.model``), an optimizer step, and a weightsync trainer engine.
Called through ``weightsync.testing.actors``.

A trainer whose routed experts are per-expert modules, as remote model code (DeepSeek-V3, Kimi-K2)
and transformers 4 build them (``...mlp.experts.{e}.gate_proj.weight`` [I, H], ``up_proj``,
``down_proj`` [H, I]; transformers 5 holds one fused ``gate_up_proj`` / ``down_proj`` per layer):
:func:`split_experts` (``setup(per_expert=True)``), same weights and forward.
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .actors import STATE

__all__ = ["setup", "teardown", "train_step", "full_state_dict", "make_engine", "send_weights", "shutdown_engine",
           "add_engines", "remove_engines", "PerExpertExperts", "split_experts", "fused_state_dict"]


def setup(model_dir: str, *, world: int, rank: int, port: int, dtype: str, seed: int = 0, fsdp: bool = True,
          tp_aligned: bool = False, per_expert: bool = False) -> None:
    """Init the trainer's own default group (gloo), build the model from ``model_dir/config.json``
    with seeded random weights (same on every rank), shard it the way ``FSDP2Trainer`` does
    (``weightsync.integrations.fsdp2.model.apply_fsdp``; ``tp_aligned``: ``ModelConfig.tp_aligned_shards``;
    ``per_expert``: routed experts as per-expert modules, :func:`split_experts`), make AdamW."""
    teardown()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from ..integrations.fsdp2.config import ModelConfig
    from ..integrations.fsdp2.model import apply_fsdp, load_hf_config
    from ..sealed import loopback_store

    timeout = timedelta(seconds=300)  # (the store listens on loopback only: see ``loopback_store``)
    store = loopback_store(port, is_master=rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    cfg = load_hf_config(model_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    if per_expert:
        split_experts(model)
    if fsdp:
        apply_fsdp(model, ModelConfig(path=model_dir, tp_aligned_shards=tp_aligned), mesh=None)
    STATE.update(model=model, optim=torch.optim.AdamW(model.parameters(), lr=1e-2), rank=rank, world=world,
                 vocab=cfg.vocab_size)


def teardown() -> None:
    shutdown_engine()
    for k in ("model", "optim"):
        STATE.pop(k, None)
    if dist.is_initialized():
        dist.destroy_process_group()


def train_step(seed: int, lr: float | None = None) -> float:
    """One forward/backward/AdamW step on random tokens (every rank, collective), at learning rate
    ``lr`` (default 1e-2)."""
    model, optim = STATE["model"], STATE["optim"]
    for group in optim.param_groups:
        group["lr"] = 1e-2 if lr is None else lr
    g = torch.Generator().manual_seed(seed * 100 + STATE["rank"])
    ids = torch.randint(0, STATE["vocab"], (2, 16), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    return float(loss.detach())


def full_state_dict() -> dict[str, torch.Tensor] | None:
    """Every parameter gathered under its HF name; returned on rank 0 (collective)."""
    from ..integrations.fsdp2.model import full_state_dict as gather

    return gather(STATE["model"])


def local_shards(fuse_experts: bool = False) -> tuple[list[Any], dict[str, torch.Tensor]]:
    """This rank's ``DTensorModuleSource`` view: planner sources (same on every rank) and local shards."""
    from ..trainer.sources import DTensorModuleSource, tensor_sources

    src = DTensorModuleSource(STATE["model"], STATE["world"], fuse_experts=fuse_experts)
    return tensor_sources(src.metadata), {n: t.clone() for n, t in src.iter_local()}


def make_engine(init_info: Any, client: Any, *, source: str = "full", fault: str | None = None,
                bucket_bytes: int | None = None, factory: str = "weightsync", wire_dtype: str | None = None,
                fuse_experts: bool = False, drafter: bool = False) -> None:
    """Build the source (``"full"``: ``FullTensorSource``, gathering ``bucket_bytes`` at a time;
    ``"local"``: ``DTensorModuleSource``), wrap it in ``weightsync.testing.faults.faulty(source, fault)``
    when ``fault`` is given, and ``trainer_init`` the engine (every rank, collective).
    ``factory="vllm"`` dispatches through vLLM's own ``WeightTransferTrainerFactory`` (after loading
    vLLM's plugins). ``wire_dtype`` (e.g. ``"bfloat16"``): the sources' ``dtype=``; ``fuse_experts``:
    ``DTensorModuleSource``'s; ``drafter``: the sources' ``drafter=`` is the module
    ``weightsync.testing.drafter.setup_trainer_drafter`` made."""
    from .. import DTensorModuleSource, FullTensorSource, WeightTransferTrainerFactory

    if source not in ("full", "local"):
        raise ValueError(f"source must be 'full' or 'local', got {source!r}")
    if factory == "vllm":
        from .receiver import VLLM_CPU_ENV

        os.environ.update({k: v for k, v in VLLM_CPU_ENV.items() if k not in os.environ})
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory  # noqa: F811
        from vllm.plugins import load_general_plugins

        load_general_plugins()
    shutdown_engine()
    model, head = STATE["model"], STATE["drafter"] if drafter else None
    dtype = getattr(torch, wire_dtype) if wire_dtype else None
    if source == "full":
        src = FullTensorSource(model, dtype=dtype, drafter=head,
                               **({"bucket_bytes": bucket_bytes} if bucket_bytes else {}))
    else:
        src = DTensorModuleSource(model, STATE["world"], dtype=dtype, fuse_experts=fuse_experts, drafter=head)
    if fault is not None:
        from .faults import faulty

        src = faulty(src, fault)
    init_info = dataclasses.replace(init_info, rank=STATE["rank"], num_trainer_ranks=STATE["world"])
    STATE["engine"] = WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=src)


def send_weights(weight_version: str | None = None, verify: bool = False, pause: bool = True) -> dict[str, Any]:
    """``send_weights`` as a training loop runs it: on rank 0 inside ``clients.paused(client)``
    (generation paused for the sync; ``pause=False``: not paused, which the engines refuse by default)."""
    kwargs = {"verify": True} if verify else {}
    engine = STATE["engine"]
    with _paused(engine) if pause else nullcontext():
        stats = engine.send_weights(weight_version=weight_version, **kwargs)
    d = dataclasses.asdict(stats)
    d["seconds"], d["gbps"] = stats.seconds, stats.gbps
    return d


def add_engines(engines: Any) -> list[int]:
    """``add_engines`` on this rank's (elastic) engine: rank 0 names ``engines``, the others follow."""
    engine = STATE["engine"]
    return engine.add_engines(engines if engine.rank == 0 else None)


def remove_engines(engines: Any) -> list[int]:
    """``remove_engines`` on this rank's (elastic) engine: rank 0 names ``engines``, the others follow."""
    engine = STATE["engine"]
    return engine.remove_engines(engines if engine.rank == 0 else None)


def _paused(engine: Any) -> Any:
    """``clients.paused(engine.client)`` on the rank that drives the client; nothing on the others."""
    from ..clients import paused

    return paused(engine.client) if engine.rank == 0 else nullcontext()


def shutdown_engine() -> None:
    engine = STATE.pop("engine", None)
    if engine is not None:
        engine.shutdown()


def pid() -> int:
    return os.getpid()


class _Expert(nn.Module):
    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(gate.shape[1], gate.shape[0], bias=False, dtype=gate.dtype)
        self.up_proj = nn.Linear(up.shape[1], up.shape[0], bias=False, dtype=up.dtype)
        self.down_proj = nn.Linear(down.shape[1], down.shape[0], bias=False, dtype=down.dtype)
        with torch.no_grad():
            for lin, w in ((self.gate_proj, gate), (self.up_proj, up), (self.down_proj, down)):
                lin.weight.copy_(w)


class PerExpertExperts(nn.Module):
    """transformers 5's fused experts module (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I],
    ``act_fn``) as a list of per-expert MLPs; ``forward(hidden, top_k_index, top_k_weights)`` as the
    fused one's, running every expert (one no token picked on zero rows) so that every rank's
    backward reduces the same FSDP2 gradients."""

    def __init__(self, fused: Any) -> None:
        super().__init__()
        inter = fused.gate_up_proj.shape[1] // 2
        self.experts = [_Expert(gu[:inter], gu[inter:], d) for gu, d in zip(fused.gate_up_proj.detach(),
                                                                           fused.down_proj.detach())]
        for e, expert in enumerate(self.experts):
            self.add_module(str(e), expert)  # experts.{e}.gate_proj.weight
        self.act_fn = fused.act_fn

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e, expert in enumerate(self.experts):
            pos, tok = torch.where(top_k_index.T == e)  # (rank among the token's top k, token)
            x = hidden[tok]
            y = expert.down_proj(self.act_fn(expert.gate_proj(x)) * expert.up_proj(x))
            out.index_add_(0, tok, (y * top_k_weights[tok, pos, None]).to(out.dtype))
        return out


def split_experts(model: nn.Module) -> int:
    """Swap every fused experts module (one with ``gate_up_proj`` and ``down_proj`` 3-D parameters)
    of ``model`` for :class:`PerExpertExperts`, in place; returns how many."""
    fused = [(n, m) for n, m in model.named_modules()
             if isinstance(getattr(m, "gate_up_proj", None), nn.Parameter) and m.gate_up_proj.dim() == 3
             and isinstance(getattr(m, "down_proj", None), nn.Parameter)]
    for name, m in fused:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, PerExpertExperts(m))
    return len(fused)


def fused_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with per-expert weights (``<layer>.experts.{e}.gate_proj.weight``, ``up_proj``,
    ``down_proj``) stacked into transformers 5's ``<layer>.experts.gate_up_proj`` / ``down_proj``."""
    from ..trainer.sources import PER_EXPERT

    out, groups = {}, {}
    for name, t in state.items():
        hit = PER_EXPERT.match(name)
        if hit is None:
            out[name] = t
        else:
            groups.setdefault(hit["layer"], {}).setdefault(hit["leaf"], {})[int(hit["id"])] = t
    for layer, leaves in groups.items():
        stack = {leaf: torch.stack([by_id[e] for e in sorted(by_id)]) for leaf, by_id in leaves.items()}
        out[f"{layer}.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)
        out[f"{layer}.down_proj"] = stack["down_proj"]
    return out
