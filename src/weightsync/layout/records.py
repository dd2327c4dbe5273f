"""Plain records the planner passes around, and the byte arithmetic they share.

:class:`TensorSource` and :class:`DestPiece` are the inputs of
:func:`weightsync.layout.plan.build_plan`; :class:`TransferItem` and :class:`PlanCoverage` are
what a :class:`~weightsync.layout.plan.TransferPlan` hands out. They live here, apart from the
planner, so every planning module imports them without importing each other.

Pure: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from weightsync.layout.regions import Region, _int_tuple

__all__ = [
    "DestPiece",
    "PlanCoverage",
    "TensorSource",
    "TransferItem",
    "align_up",
    "dtype_itemsize",
    "new_item",
]

_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1,
    "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "int16": 2, "uint16": 2, "float16": 2, "half": 2, "bfloat16": 2,
    "int32": 4, "uint32": 4, "float32": 4, "float": 4,
    "int64": 8, "uint64": 8, "float64": 8, "double": 8, "complex64": 8, "complex128": 16,
}


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named like torch (``"bfloat16"`` or ``"torch.bfloat16"``)."""
    size = _ITEMSIZE.get(dtype.removeprefix("torch.")) if isinstance(dtype, str) else None
    if size is None:
        raise ValueError(f"dtype {dtype!r} has no known itemsize; pass itemsize_of (known: {sorted(_ITEMSIZE)})")
    return size


def align_up(n: int, alignment: int) -> int:
    """``n`` rounded up to a multiple of ``alignment`` (the start of the next aligned slot)."""
    return -(-n // alignment) * alignment


@dataclass(frozen=True)
class TensorSource:
    """One HF tensor on the trainer side and the region of it each trainer rank holds.

    Regions are checked by :func:`~weightsync.layout.plan.build_plan` (once per distinct
    ``regions`` object, so share one tuple between tensors of one layout, as
    :func:`~weightsync.layout.regions.source_regions` callers naturally do).
    """

    # HF tensor name (unique among the sources)
    name: str
    # global shape of the tensor
    shape: tuple[int, ...]
    # dtype name, e.g. "bfloat16"; sizes bytes for load balancing and coverage
    dtype: str
    # regions[r]: the region trainer rank r holds (empty allowed; equal regions = replicated)
    regions: tuple[Region, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"TensorSource.name must be a str, got {self.name!r}")
        if not isinstance(self.dtype, str):
            raise TypeError(f"TensorSource.dtype of {self.name!r} must be a str, got {self.dtype!r}")
        shape = _int_tuple(self.shape, "shape")
        if any(s < 0 for s in shape):
            raise ValueError(f"TensorSource.shape of {self.name!r} must be non-negative, got {shape}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "regions", tuple(self.regions))


@dataclass(frozen=True)
class DestPiece:
    """On one worker: ``region`` of HF tensor ``name`` lands in param ``param`` at ``param_offsets``."""

    # HF tensor name (must be one of the sources)
    name: str
    # region of the global HF tensor this piece takes
    region: Region
    # vLLM parameter name on the worker
    param: str
    # where region.offsets lands in the param (same ndim; the sizes are region.sizes)
    param_offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not isinstance(self.param, str):
            raise TypeError(f"DestPiece name and param must be str, got {self.name!r} and {self.param!r}")
        if not isinstance(self.region, Region):
            raise TypeError(f"DestPiece.region of {self.name!r} must be a Region, got {self.region!r}")
        offsets = _int_tuple(self.param_offsets, "param_offsets")
        if len(offsets) != self.region.ndim or any(o < 0 for o in offsets):
            raise ValueError(
                f"DestPiece.param_offsets of {self.name!r} must be {self.region.ndim} non-negative ints "
                f"(region {self.region}), got {offsets}"
            )
        object.__setattr__(self, "param_offsets", offsets)


@dataclass(frozen=True, slots=True)
class TransferItem:
    """One contiguous-in-index-space copy: a box of one tensor from one trainer rank to one worker."""

    # trainer rank that sends
    src_rank: int
    # worker rank that receives
    dst_rank: int
    # HF tensor name
    name: str
    # the box, in the coordinates of the global HF tensor
    region: Region
    # region.offsets relative to the sender's local shard
    src_offsets: tuple[int, ...]
    # vLLM parameter on the worker that receives it
    param: str
    # where region.offsets lands in that param (sizes are region.sizes)
    param_offsets: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements moved."""
        return self.region.numel


# The slot descriptors of TransferItem's fields, for new_item below.
(_set_src_rank, _set_dst_rank, _set_name, _set_region, _set_src_offsets, _set_param,
 _set_param_offsets) = (TransferItem.__dict__[f.name].__set__ for f in fields(TransferItem))
_new_object = object.__new__


def new_item(
    src_rank: int, dst_rank: int, name: str, region: Region, src_offsets: tuple[int, ...], param: str,
    param_offsets: tuple[int, ...],
) -> TransferItem:
    """``TransferItem(...)`` for values the planner already checked, twice as fast.

    The frozen ``__init__`` calls ``object.__setattr__`` once per field; writing the slots
    directly skips that, which matters when a rank lists millions of items.
    """
    item = _new_object(TransferItem)
    _set_src_rank(item, src_rank)
    _set_dst_rank(item, dst_rank)
    _set_name(item, name)
    _set_region(item, region)
    _set_src_offsets(item, src_offsets)
    _set_param(item, param)
    _set_param_offsets(item, param_offsets)
    return item


@dataclass(frozen=True)
class PlanCoverage:
    """Bytes a plan moves, against the least it could move (what the workers ask for)."""

    # bytes each worker receives
    recv_bytes: tuple[int, ...]
    # bytes each trainer rank sends
    send_bytes: tuple[int, ...]
    # bytes each worker asks for (sum of its destination pieces)
    lower_bound: tuple[int, ...]

    @property
    def ratio(self) -> float:
        """Received over asked-for bytes: exactly 1.0 when no byte reaches a worker twice."""
        want = sum(self.lower_bound)
        return sum(self.recv_bytes) / want if want else 1.0
