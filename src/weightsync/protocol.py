"""The weight-sync protocol: parameter metadata, sources, init/update infos, engines, stats.

Names mirror vLLM 0.33's trainer API (``vllm.distributed.weight_transfer``) so that users switch by
import. Nothing here imports vLLM, Ray or nccl-extensions.

Call order (every trainer rank, collectively)::

    engine = WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=source)
    stats = engine.send_weights()      # once per optimizer step; every trainer rank
    engine.shutdown()

and on every inference worker, driven by ``client`` from trainer rank 0::

    init_transfer_engine(init_info) -> (start_weight_update -> receive_weights(update_info)...
                                         -> finish_weight_update)* -> shutdown
"""

from __future__ import annotations

import dataclasses
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar, TypeVar

import torch

__all__ = [
    "ParamMeta",
    "WeightSource",
    "TrainerInitInfo",
    "WorkerInitInfo",
    "WorkerUpdateInfo",
    "SyncStats",
    "TrainerEngine",
    "parse_info",
    "check_metadata",
    "checked",
    "dtype_name",
    "dtype_from_name",
    "default_device",
]

T = TypeVar("T")

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

    def wire(self) -> dict[str, Any]:
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


def checked(source_iter: Iterator[tuple[str, torch.Tensor]], metas: list[ParamMeta]) -> Iterator[tuple[ParamMeta, torch.Tensor]]:
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


def parse_info(cls: type[T], data: Mapping[str, Any] | T, what: str = "info") -> T:
    """Build dataclass ``cls`` from a JSON-safe dict; unknown/missing fields -> ``ValueError``."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ValueError(f"{what} for {cls.__name__} must be a dict, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{what} for {cls.__name__}: unknown field(s) {unknown}; expected {sorted(names)}")
    try:
        return cls(**data)
    except TypeError as e:
        raise ValueError(f"{what} for {cls.__name__}: {e}") from e


@dataclass(kw_only=True)
class TrainerInitInfo:
    """Base of every trainer-side init info. ``backend`` selects the engine; ``rank`` is this
    trainer process's rank among the trainer ranks (rank 0 drives the client)."""

    backend: ClassVar[str] = ""
    rank: int
    """This trainer process's rank, 0 <= rank < num_trainer_ranks."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"{type(self).__name__}.rank must be an int >= 0, got {self.rank!r}")


@dataclass(kw_only=True)
class WorkerInitInfo:
    """Base of worker-side init infos (what ``init_weight_transfer_engine`` receives)."""


@dataclass(kw_only=True)
class WorkerUpdateInfo:
    """Base of worker-side update infos (what ``update_weights`` receives)."""


@dataclass
class SyncStats:
    """What one ``send_weights()`` did, as seen by this trainer rank."""

    backend: str
    rank: int
    bytes_sent: int = 0
    """Payload bytes this rank put on the wire (per destination: a broadcast counts once)."""
    bytes_received_per_worker: dict[int, int] = field(default_factory=dict)
    """Payload bytes each worker received (rank 0; measured by the workers where the transport can)."""
    lower_bound_per_worker: dict[int, int] = field(default_factory=dict)
    """Least payload bytes each worker needs (its shard of every tensor); filled by sharded transports."""
    num_tensors: int = 0
    num_chunks: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per phase: ``preflight``, ``start``, ``transfer``, ``finish``, ..."""
    weight_version: str | None = None
    verified: bool | None = None
    """True when the sync ran with ``verify=True`` and every worker's checksums matched."""

    @property
    def seconds(self) -> float:
        return sum(self.phases.values())

    @property
    def gbps(self) -> float:
        """Payload GB/s received per worker (max over workers / wall seconds)."""
        per = max(self.bytes_received_per_worker.values(), default=self.bytes_sent)
        return per / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def timed(self, phase: str) -> "_Timer":
        return _Timer(self, phase)


class _Timer:
    def __init__(self, stats: SyncStats, phase: str) -> None:
        self.stats, self.phase = stats, phase

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.stats.phases[self.phase] = self.stats.phases.get(self.phase, 0.0) + (
            time.perf_counter() - self.t0
        )


class TrainerEngine(ABC):
    """Trainer-side engine; built by ``WeightTransferTrainerFactory.trainer_init`` on every
    trainer rank. Rank 0 drives the client; every rank runs every collective."""

    init_info_cls: ClassVar[type[TrainerInitInfo]]

    def __init__(self, init_info: TrainerInitInfo, *, client: Any, source: WeightSource | None) -> None:
        self.init_info = init_info
        self.rank = init_info.rank
        self.is_sender = init_info.rank == 0
        self.client = client
        self.source = source

    @classmethod
    @abstractmethod
    def trainer_init(cls, init_info: Any, *, client: Any, source: WeightSource | None = None) -> "TrainerEngine":
        """Rendezvous with the workers and return a ready engine. Call on every trainer rank."""

    @abstractmethod
    def send_weights(self, *, weight_version: str | None = None) -> SyncStats:
        """Push the source's current weights to every worker. Call on every trainer rank."""

    def shutdown(self) -> None:
        """Release communicators and buffers. Call on every trainer rank."""
