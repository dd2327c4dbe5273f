"""A PEFT LoRA adapter as a weight source: ``lora_A`` / ``lora_B`` (and an embedding's ``lora_embedding_A`` /
``_B``) local shards, never gathered (issue 39).

``LoRASource(model, num_trainer_ranks)`` reads one adapter of a PEFT model (plain, or ``fully_shard``-ed
by FSDP2: then each rank holds a DTensor shard of every ``lora_A`` / ``lora_B``) and names each tensor
as PEFT saves it (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``: the adapter name
dropped), which is what vLLM's LoRA loader parses. ``metadata`` carries every tensor's full shape and
FSDP2 layout (the same ``ParamMeta`` as :class:`~weightsync.trainer.sources.DTensorModuleSource`);
``config`` the ``LoraConfig`` fields vLLM's loader reads (rank, alpha, rsLoRA, patterns).

For the reshard core (:mod:`weightsync.reshard`), ``sources`` are the adapter's tensors as the plan's
``TensorSource`` s (every rank's region of each, from the same layout as ``metadata``) and ``shards()``
this rank's local shards by name, views of the model's own storage (never gathered): the plan picks
which rank sends each element, once, and the executor reads it from these shards.

``base_metadata`` / ``base_fingerprints`` describe the base model the adapter was trained on (its
parameters under vLLM's names, ``.base_layer`` dropped): a sync sends the adapter only, so the engine
must serve that base; ``LoRASync`` compares fingerprints (:mod:`weightsync.fingerprint`) of this rank's
parts of the base's 1-D tensors (norms: whole on every TP rank, never repacked) with the workers'.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

import torch

from ..fingerprint import fingerprint
from ..plan.regions import Region, source_regions
from ..plan.transfer import TensorSource
from ..protocol import ParamMeta
from .sources import DTensorModuleSource, _local, _named, tensor_sources

__all__ = ["LoRASource", "sender_regions", "peft_saved_name", "peft_base_name", "unsynced_adapter_tensors",
           "CONFIG_KEYS"]

CONFIG_KEYS = ("r", "lora_alpha", "target_modules", "use_rslora", "rank_pattern", "alpha_pattern", "bias")
"""The ``LoraConfig`` fields an adapter sync carries (vLLM's ``PEFTHelper`` reads them)."""


_PARTS = ("lora_A", "lora_B")
_EMBEDDING_PARTS = ("lora_embedding_A", "lora_embedding_B")
_REFUSED_FIELDS = {"use_dora": (False, "DoRA adapters (their lora_magnitude_vector)"),
                   "lora_bias": (False, "LoRA biases (lora_B.bias)"),
                   "bias": ("none", "trained base-layer biases"),
                   "modules_to_save": (None, "modules_to_save (full copies of modules)")}
"""``LoraConfig`` fields whose non-default values add tensors this sync does not carry (nor vLLM serve for
a causal LM): refused at init, on every rank."""


def peft_saved_name(name: str, adapter: str) -> str | None:
    """PEFT's saved name of a ``lora_A`` / ``lora_B`` weight or ``lora_embedding_A`` / ``_B`` of adapter
    ``adapter`` (``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``,
    ``...embed_tokens.lora_embedding_A.default`` -> ``...embed_tokens.lora_embedding_A``); None for any
    other parameter."""
    for part in _PARTS:
        infix = f".{part}.{adapter}."
        if infix in name and name.endswith(f"{infix}weight"):
            return name.replace(infix, f".{part}.")
    for part in _EMBEDDING_PARTS:
        if name.endswith(f".{part}.{adapter}"):
            return name[: -len(adapter) - 1]
    return None


def peft_base_name(name: str, adapter: str) -> str | None:
    """A PEFT model's base parameter under vLLM's name (``base_model.model.`` and ``.base_layer`` dropped:
    ``base_model.model.model.norm.weight`` -> ``model.norm.weight``); None for an adapter's tensor."""
    if peft_saved_name(name, adapter) is not None or ".lora_" in name or f".{adapter}." in name:
        return None
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def unsynced_adapter_tensors(model: torch.nn.Module, adapter: str) -> list[str]:
    """The adapter's own parameters (PEFT names them with ``.<adapter>``) that are not synced: a DoRA
    magnitude vector, a LoRA bias, a ``modules_to_save`` copy, an adapter kind this module does not know."""
    return [n for n, _ in _named(model, None) if (f".{adapter}." in n or n.endswith(f".{adapter}"))
            and peft_saved_name(n, adapter) is None]


def _check_config(cfg: Any, adapter: str) -> None:
    """Refuse (``ValueError`` naming the field) an adapter whose config adds tensors no sync carries."""
    for key, (default, what) in _REFUSED_FIELDS.items():
        value = getattr(cfg, key, default)
        if value != default and value not in (None, False, [], ()):
            raise ValueError(f"{key}: adapter {adapter!r} has {key}={value!r}: {what} are not synced (vLLM "
                             f"serves plain LoRA on linear and embedding layers); train without it")


def sender_regions(meta: ParamMeta) -> tuple[Region | None, ...]:
    """Per trainer rank, the region of the full tensor it sends (None: a lower rank holds the same)."""
    regions = source_regions(meta.shape, meta.mesh_shape, meta.placements, meta.rank_coordinates)
    first: dict[Region, int] = {}
    return tuple(reg if first.setdefault(reg, r) == r else None for r, reg in enumerate(regions))


class LoRASource:
    """One PEFT adapter's ``lora_A`` / ``lora_B`` (see the module docstring).

    Args:
        model: a ``peft.PeftModel`` (or its ``base_model``), plain or ``fully_shard``-ed.
        num_trainer_ranks: ranks of the trainer mesh every DTensor is laid out on.
        adapter: the PEFT adapter name (``"default"`` unless named).
        rank: this trainer rank (which shard it holds; 0 for a plain model).
    """

    def __init__(self, model: torch.nn.Module, num_trainer_ranks: int = 1, *, adapter: str = "default",
                 rank: int = 0) -> None:
        configs = getattr(model, "peft_config", None)
        if not isinstance(configs, dict) or adapter not in configs:
            have = sorted(configs) if isinstance(configs, dict) else "none (not a PEFT model)"
            raise ValueError(f"adapter: {adapter!r} is not an adapter of this model (its adapters: {have})")
        if not isinstance(rank, int) or not 0 <= rank < num_trainer_ranks:
            raise ValueError(f"rank must be in [0, num_trainer_ranks={num_trainer_ranks}), got {rank!r}")
        self.model, self.adapter, self.rank = model, adapter, rank
        _check_config(configs[adapter], adapter)
        if unsynced := unsynced_adapter_tensors(model, adapter):
            raise ValueError(f"adapter {adapter!r}: tensor {unsynced[0]!r} is not synced (weightsync syncs "
                             f"lora_A / lora_B and lora_embedding_A / _B only; {len(unsynced)} such tensor(s))")
        self._source = DTensorModuleSource(model, num_trainer_ranks, name_map=lambda n: peft_saved_name(n, adapter))
        if not self.metadata:
            raise ValueError(f"adapter: {adapter!r} has no lora_A / lora_B / lora_embedding_A / _B parameters")
        dtypes = {m.dtype for m in self.metadata}
        if len(dtypes) != 1:
            raise ValueError(f"dtype: the adapter's tensors must share one dtype, got {sorted(map(str, dtypes))}")

    @property
    def num_trainer_ranks(self) -> int:
        return self._source.num_trainer_ranks

    @cached_property
    def config(self) -> dict[str, Any]:
        cfg = self.model.peft_config[self.adapter]
        out: dict[str, Any] = {}
        for key in CONFIG_KEYS:
            value = getattr(cfg, key, None)
            if isinstance(value, (set, frozenset, tuple)):
                value = sorted(value)
            if value is not None:
                out[key] = dict(value) if isinstance(value, dict) else value
        return out

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return self._source.metadata

    @cached_property
    def _locals(self) -> dict[str, torch.Tensor]:
        return {peft_saved_name(n, self.adapter): p for n, p in _named(self.model, None)
                if peft_saved_name(n, self.adapter) is not None}

    @cached_property
    def _base(self) -> DTensorModuleSource:
        return DTensorModuleSource(self.model, self.num_trainer_ranks,
                                   name_map=lambda n: peft_base_name(n, self.adapter))

    @cached_property
    def base_metadata(self) -> list[tuple[str, list[int]]]:
        """``(vLLM name, full shape)`` of the base model's 1-D tensors (what ``LoRASync`` checks)."""
        return [(m.name, list(m.shape)) for m in self._base.metadata if len(m.shape) == 1]

    def base_fingerprints(self, wanted: Sequence[tuple[str, torch.dtype]]) -> list[int]:
        """Per ``(base tensor, dtype)``: the fingerprint of the part of it this rank is the sender of
        (0 for none); summed over the trainer ranks, the whole tensor's. No collective."""
        metas = {m.name: m for m in self._base.metadata}
        params = dict(_named(self.model, lambda n: peft_base_name(n, self.adapter)))
        out = []
        for name, dtype in wanted:
            region = sender_regions(metas[name])[self.rank]
            local = _local(params[name])
            out.append(0 if region is None else fingerprint(local, region.offsets, metas[name].shape, dtype))
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of the whole adapter (every tensor, full)."""
        return sum(int(torch.Size(m.shape).numel()) * m.dtype.itemsize for m in self.metadata)

    @cached_property
    def sources(self) -> list[TensorSource]:
        """The adapter's tensors as the reshard plan's sources (each trainer rank's region of each)."""
        return tensor_sources(self.metadata)

    def shards(self) -> dict[str, torch.Tensor]:
        """This rank's local shard of every adapter tensor, by name: views of the model's storage."""
        return {name: _local(p).detach() for name, p in self._locals.items()}
