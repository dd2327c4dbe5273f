"""The weight-sync protocol, data side: parameter metadata, the dtypes that move, weight sources.

The engine side (init/update infos, stats, the trainer engine) is :mod:`weightsync.infos`,
:mod:`weightsync.stats` and :mod:`weightsync.trainer.engine`.
Nothing here imports vLLM, Ray or nccl-extensions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from .plan.buckets import WireMeta

__all__ = ["ParamMeta", "WeightSource", "check_metadata", "checked", "dtype_name", "dtype_from_name",
           "default_device"]

# dtypes the transports can move bit-exactly (fp8 travels as bytes).
_DTYPES = {
    name: getattr(torch, name)
    for name in (
        "float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64",
        "bool", "float8_e4m3fn", "float8_e5m2",
    )
    if hasattr(torch, name)
}


def default_device() -> str:
    """``"cuda"`` when a GPU is visible (NCCL data plane), else ``"cpu"`` (gloo)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; raises ``ValueError`` for a dtype no transport moves."""
    name = str(dtype).removeprefix("torch.")
    if _DTYPES.get(name) is not dtype:
        raise ValueError(f"dtype {dtype} is not supported; supported: {sorted(_DTYPES)}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; raises ``ValueError`` naming the bad value."""
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype name {name!r}; supported: {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class ParamMeta:
    """One tensor as the trainer exports it, under its Hugging Face name."""

    name: str
    """Hugging Face tensor name, e.g. ``model.layers.0.self_attn.q_proj.weight``."""
    dtype: torch.dtype
    """Wire dtype: the dtype the source yields."""
    shape: tuple[int, ...]
    """Full (global, unsharded) shape."""
    mesh_shape: tuple[int, ...] | None = field(default=None, kw_only=True)
    """Shape of the trainer mesh the tensor is laid out on; None for a plain (replicated) tensor."""
    placements: tuple[Any, ...] | None = field(default=None, kw_only=True)
    """One ``layout.Shard``/``layout.Replicate`` per mesh dim; None for a plain tensor."""
    rank_coordinates: tuple[tuple[int, ...], ...] | None = field(default=None, kw_only=True)
    """Mesh coordinate of every trainer rank (index = trainer rank); None for a plain tensor."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ParamMeta.name must be a non-empty str, got {self.name!r}")
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if any(s < 0 for s in self.shape):
            raise ValueError(f"parameter {self.name!r}: negative size in shape {self.shape}")
        try:
            dtype_name(self.dtype)
        except ValueError as e:
            raise ValueError(f"parameter {self.name!r}: {e}") from None
        if (self.mesh_shape is None) != (self.placements is None):
            raise ValueError(f"parameter {self.name!r}: mesh_shape and placements go together")

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def wire(self) -> WireMeta:
        """JSON-safe ``{name, dtype, shape}``."""
        return {"name": self.name, "dtype": dtype_name(self.dtype), "shape": list(self.shape)}


class WeightSource(ABC):
    """The trainer's weights: metadata that never moves data, plus iteration.

    Collective rule: every trainer rank iterates in the same order (metadata order), or ranks
    deadlock in the collectives a source may run (FSDP all-gathers). ``metadata`` must be a
    ``functools.cached_property`` and identical on every trainer rank.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        meta = cls.__dict__.get("metadata")
        if meta is not None and not isinstance(meta, cached_property):
            raise TypeError(f"{cls.__name__}.metadata must be a functools.cached_property")

    @property
    @abstractmethod
    def metadata(self) -> list[ParamMeta]:
        """Every tensor, in iteration order; moves no data."""

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full tensor)`` in metadata order. Collective on every trainer rank."""
        raise NotImplementedError(f"{type(self).__name__} does not implement iter_full")

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, this rank's shard)`` in metadata order; never gathers."""
        raise NotImplementedError(f"{type(self).__name__} does not implement iter_local")


def check_metadata(metas: list[ParamMeta]) -> None:
    """Preflight on every trainer rank: names are unique (a duplicate would be sent twice or
    overwrite another tensor)."""
    seen: set[str] = set()
    for m in metas:
        if m.name in seen:
            raise ValueError(f"parameter {m.name!r} appears twice in the source's metadata")
        seen.add(m.name)


def checked(source_iter: Iterator[tuple[str, torch.Tensor]],
            metas: list[ParamMeta]) -> Iterator[tuple[ParamMeta, torch.Tensor]]:
    """Yield ``(meta, tensor)``; ``ValueError`` naming the parameter when iteration and metadata differ."""
    i = 0
    for name, t in source_iter:
        if i >= len(metas):
            raise ValueError(f"source yielded {name!r} beyond the {len(metas)} parameters in its metadata")
        m = metas[i]
        if name != m.name or t.dtype != m.dtype or tuple(t.shape) != m.shape:
            raise ValueError(f"parameter {m.name!r}: metadata says {m.name!r} {m.dtype} {m.shape}, "
                             f"source yielded {name!r} {t.dtype} {tuple(t.shape)}")
        i += 1
        yield m, t
    if i != len(metas):
        raise ValueError(f"parameter {metas[i].name!r}: source stopped after {i} of {len(metas)} parameters")
