"""Checkpoints: torch DCP under ``<root>/iter_<step>/`` with a tracker file, and Hugging Face export.

Layout::

    <root>/latest_checkpointed_iteration.txt     # the latest complete step, written last
    <root>/iter_0000003/                         # DCP files of model + optimizer (every rank writes its shards)
    <root>/iter_0000003/trainer_state.json       # step, samples consumed (rank 0)

A step directory only becomes "latest" after every rank finished writing it, so a crash mid-save
leaves the previous checkpoint as the one resumed from. The reference model is not saved: it is
read again from its checkpoint when the trainer is built.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TRACKER", "iter_dir", "latest_step", "save_checkpoint", "load_checkpoint", "export_hf"]

TRACKER = "latest_checkpointed_iteration.txt"
"""Name of the file holding the latest complete step (Megatron's name)."""
_STATE = "trainer_state.json"


def iter_dir(root: str, step: int) -> str:
    """The directory of step ``step``'s checkpoint."""
    return os.path.join(root, f"iter_{step:07d}")


def latest_step(root: str) -> int | None:
    """The step the tracker file names, or None when there is no complete checkpoint under ``root``."""
    try:
        with open(os.path.join(root, TRACKER)) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise ValueError(f"{os.path.join(root, TRACKER)} holds {text!r}, expected a step number")
    return int(text)


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}


def save_checkpoint(root: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any]) -> str:
    """Save model and optimizer shards with DCP, then mark ``step`` as the latest. Collective on every
    rank; returns the step directory."""
    import torch.distributed.checkpoint as dcp

    path = iter_dir(root, step)
    dcp.save(_state_dicts(model, optimizer), checkpoint_id=path)
    if dist.get_rank() == 0:
        with open(os.path.join(path, _STATE), "w") as f:
            json.dump({"step": step, **trainer_state}, f)
    dist.barrier()  # every rank's shards are on disk before the tracker names this step
    if dist.get_rank() == 0:
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(step))
        os.replace(tmp, os.path.join(root, TRACKER))
    dist.barrier()
    return path


def load_checkpoint(root: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    step: int | None = None) -> dict[str, Any]:
    """Load ``step`` (default: the tracker's) into ``model`` and ``optimizer``; returns the saved trainer
    state (``step`` and what ``save_checkpoint`` was given). Collective on every rank; the sharding may
    differ from the one that saved (DCP reshards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    if step is None:
        step = latest_step(root)
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {root!r}: {TRACKER} is missing")
    path = iter_dir(root, step)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    sd = _state_dicts(model, optimizer)
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, optimizer, sd["optim"])
    with open(os.path.join(path, _STATE)) as f:
        return json.load(f)


def export_hf(model: torch.nn.Module, hf_config: Any, out_dir: str, *, dtype: torch.dtype | None = None,
              max_shard_bytes: int = 5 << 30) -> list[str] | None:
    """Write the full model as a Hugging Face checkpoint (safetensors + ``config.json``) under ``out_dir``.

    Collective on every rank: parameters are gathered one bucket at a time (``FullTensorSource``) and
    only rank 0 keeps them, writing a file whenever ``max_shard_bytes`` are collected, so rank 0 holds
    at most one file's worth. Tied weights are written once (Hugging Face convention). Returns the
    file names on rank 0, None elsewhere.
    """
    from safetensors.torch import save_file

    from ...trainer.sources import FullTensorSource

    rank0 = dist.get_rank() == 0
    source = FullTensorSource(model, dtype=dtype, bucket_bytes=min(max_shard_bytes, 256 << 20))
    groups: list[list[str]] = [[]]
    used = 0
    for m in source.metadata:
        if groups[-1] and used + m.nbytes > max_shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(m.name)
        used += m.nbytes
    n = len(groups)
    files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    owner = {name: i for i, g in enumerate(groups) for name in g}
    if rank0:
        os.makedirs(out_dir, exist_ok=True)
    pending: dict[str, torch.Tensor] = {}
    for name, tensor in source.iter_full():
        if not rank0:
            continue
        pending[name] = tensor.detach().to("cpu").contiguous()
        i = owner[name]
        if len(pending) == len(groups[i]):
            save_file(pending, os.path.join(out_dir, files[i]), metadata={"format": "pt"})
            pending = {}
    if not rank0:
        return None
    if n > 1:
        total = sum(m.nbytes for m in source.metadata)
        index = {"metadata": {"total_size": total}, "weight_map": {k: files[i] for k, i in owner.items()}}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    config = copy.deepcopy(hf_config)
    config.dtype = dtype or torch.float32  # what the files hold (the master weights are float32)
    config.save_pretrained(out_dir)
    return files
