"""Build a Hugging Face causal LM under FSDP2: one disk read on rank 0, a broadcast to the others.

Order (every rank, collectively)::

    model, hf_config = build_model(cfg, device=..., mesh=...)   # empty shards on every rank
    load_checkpoint_weights(model, cfg.path, mesh)              # rank 0 reads, every rank receives

Rank 0 reads with ``from_pretrained`` on the host (so Hugging Face's own name handling applies and
non-persistent buffers such as rotary frequencies are computed); every rank builds the module on
the meta device, shards each decoder layer and then the root with ``fully_shard``, and allocates
its shards. The full state dict then goes out from rank 0 with torch DCP's
``set_model_state_dict(..., broadcast_from_rank0=True)``, the buffers with ``broadcast``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...trainer.session import share_json
from .config import ModelConfig

__all__ = ["build_model", "load_hf_config", "apply_fsdp", "load_checkpoint_weights", "decoder_layers",
           "full_state_dict"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder blocks of a Hugging Face causal LM (``model.model.layers``)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"{type(model).__name__} has no decoder layers at model.model.layers; the FSDP2 "
                         f"trainer supports decoder-only causal LMs such as Qwen3 and Llama")
    return layers


def _check_hf_config(hf_config: Any, path: str) -> None:
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs or not all(a.endswith("ForCausalLM") for a in archs):
        raise ValueError(f"model {path!r}: architectures={archs} is not a causal LM (*ForCausalLM)")
    for name in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        p = getattr(hf_config, name, 0.0) or 0.0
        if p > 0:
            raise ValueError(f"model {path!r}: config.{name}={p}; RL log-probs must be deterministic, set it to 0")


def load_hf_config(path: str) -> Any:
    """The Hugging Face config at ``path``, checked to be a causal LM without dropout."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(path)
    _check_hf_config(hf_config, path)
    return hf_config


def apply_fsdp(model: torch.nn.Module, cfg: ModelConfig, *, mesh: Any) -> None:
    """``fully_shard`` each decoder layer, then the root, with ``cfg``'s resharding and mixed-precision
    policy (in place; ``mesh=None`` = FSDP2's default mesh over the default group). Collective-free."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    fsdp: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": cfg.reshard_after_forward}
    if cfg.param_dtype is not None:
        fsdp["mp_policy"] = MixedPrecisionPolicy(param_dtype=_DTYPES[cfg.param_dtype],
                                                 reduce_dtype=_DTYPES[cfg.reduce_dtype])
    if cfg.tp_aligned_shards:
        ranks = dist.get_world_size() if mesh is None else mesh.size()
        names = {id(m): n for n, m in model.named_modules()}
    for layer in decoder_layers(model):
        placement = {"shard_placement_fn": _row_parallel_on_dim1(layer, names[id(layer)], ranks)} \
            if cfg.tp_aligned_shards else {}
        fully_shard(layer, **fsdp, **placement)
    fully_shard(model, **fsdp)


ROW_PARALLEL = (".o_proj.weight", ".down_proj.weight")
"""Name endings of the 2-D weights vLLM shards on dim 1 (``RowParallelLinear``)."""


def _row_parallel_on_dim1(layer: torch.nn.Module, prefix: str, ranks: int) -> Any:
    """FSDP2 ``shard_placement_fn``: ``Shard(1)`` for ``layer``'s 2-D row-parallel weights, the default
    (``Shard(0)``) for the others. Raises ``ValueError`` naming a weight whose dim 1 does not divide by
    ``ranks`` (FSDP2 shards dims other than 0 only evenly)."""
    from torch.distributed.tensor import Shard

    ids = set()
    for name, p in layer.named_parameters(prefix=prefix):
        if p.dim() == 2 and name.endswith(ROW_PARALLEL):
            if p.shape[1] % ranks:
                raise ValueError(f"ModelConfig.tp_aligned_shards: parameter {name!r} has {p.shape[1]} columns, "
                                 f"which do not divide by the {ranks} FSDP ranks (FSDP2 shards dim 1 only evenly)")
            ids.add(id(p))
    return lambda p: Shard(1) if id(p) in ids else None


def build_model(cfg: ModelConfig, *, device: torch.device, mesh: Any) -> tuple[torch.nn.Module, Any]:
    """The FSDP2-sharded model with *uninitialized* shards on ``device``, and its Hugging Face config.
    Collective-free; call ``load_checkpoint_weights`` next on every rank."""
    from transformers import AutoModelForCausalLM

    hf_config = load_hf_config(cfg.path)
    kwargs = {"attn_implementation": cfg.attn_implementation} if cfg.attn_implementation else {}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, **kwargs)
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_fsdp(model, cfg, mesh=mesh)
    model.to_empty(device=device)
    return model, hf_config


def load_checkpoint_weights(model: torch.nn.Module, path: str) -> None:
    """Fill ``model``'s shards and buffers from the checkpoint at ``path``: rank 0 reads it from disk
    (the only read), every rank receives its shards. Collective on every rank of the default group."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank = dist.get_rank()
    state: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    error = None
    if rank == 0:
        try:
            from transformers import AutoModelForCausalLM

            host = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            state = host.state_dict()
            buffers = {n: b.detach() for n, b in host.named_buffers()}
            expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}  # global shapes
            if set(state) != set(expected):
                missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
                error = (f"checkpoint {path!r} does not match the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
            else:
                bad = [k for k in expected if tuple(state[k].shape) != expected[k]]
                if bad:
                    error = (f"checkpoint {path!r}: tensor {bad[0]!r} has shape {tuple(state[bad[0]].shape)}, "
                             f"the model expects {expected[bad[0]]}")
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, not only rank 0
            error = f"rank 0 could not read checkpoint {path!r}: {type(e).__name__}: {e}"
    if (error := share_json(error)) is not None:
        raise ValueError(error)
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if rank == 0:
                buf.copy_(buffers[name])
            dist.broadcast(buf, src=0)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """Every parameter gathered under its Hugging Face name, on the host, returned on rank 0 only
    (``None`` elsewhere). Collective on every rank; for checks and small models."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = t.to("cpu", copy=True)
    return out if dist.get_rank() == 0 else None
