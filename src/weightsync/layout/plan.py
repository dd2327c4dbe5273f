"""The M2N transfer plan: which trainer rank sends which piece of which tensor to which worker.

Inputs are plain data: one :class:`TensorSource` per HF tensor (the region each trainer rank
holds) and, per worker, the :class:`DestPiece` list of where regions of HF tensors land in its
vLLM parameters. :func:`build_plan` intersects them into a :class:`TransferPlan` of
:class:`TransferItem` s. Call order on every rank of a sync group::

    plan = build_plan(sources, destinations)   # same inputs everywhere -> same plan
    agree on plan.digest over the control plane   # before any data moves
    trainer rank r: plan.items_for_src(r); worker d: plan.items_for_dst(d)

Pure: no torch import; the plan is built from compact per-layout templates
(:mod:`weightsync.layout.plan_compact`) so model-scale plans take seconds, not hours.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

from weightsync.layout.plan_compact import Compact, compact_plan
from weightsync.layout.regions import Region, _int_tuple

__all__ = [
    "DestPiece",
    "PlanCoverage",
    "TensorSource",
    "TransferItem",
    "TransferPlan",
    "build_plan",
    "dtype_itemsize",
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


@dataclass(frozen=True)
class TensorSource:
    """One HF tensor on the trainer side and the region of it each trainer rank holds.

    Regions are checked by :func:`build_plan` (once per distinct ``regions`` object, so share
    one tuple between tensors of one layout, as :func:`source_regions` callers naturally do).
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


_new_object = object.__new__
_SET_ITEM = tuple(TransferItem.__dict__[f.name].__set__ for f in fields(TransferItem))


def _item(
    src_rank: int, dst_rank: int, name: str, region: Region, src_offsets: tuple[int, ...], param: str,
    param_offsets: tuple[int, ...],
) -> TransferItem:
    """``TransferItem(...)`` without the frozen ``__init__``'s per-field ``object.__setattr__`` (2x faster)."""
    item = _new_object(TransferItem)
    s0, s1, s2, s3, s4, s5, s6 = _SET_ITEM
    s0(item, src_rank)
    s1(item, dst_rank)
    s2(item, name)
    s3(item, region)
    s4(item, src_offsets)
    s5(item, param)
    s6(item, param_offsets)
    return item


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while millions of acyclic items are allocated (its passes would rescan them)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


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


class TransferPlan:
    """A deterministic M2N plan; build it with :func:`build_plan`, read it on any rank.

    All item listings follow one global order: tensors in ``sources`` order, then worker
    rank, then the worker's piece order for that tensor, then the piece's overlaps by offset.
    So the items between one (trainer, worker) pair come in the same sequence from
    :meth:`items_for_src` and :meth:`items_for_dst`: both sides post point-to-point ops in it.
    """

    def __init__(self, compact: Compact, itemsize_of: Callable[[str], int]) -> None:
        self._c = compact
        self._itemsize_of = itemsize_of

    @property
    def digest(self) -> str:
        """Hex sha256 of the canonical inputs; equal on ranks with equal inputs, else different."""
        return self._c.digest

    @property
    def num_src_ranks(self) -> int:
        """Number of trainer ranks."""
        return self._c.num_src

    @property
    def num_dst_ranks(self) -> int:
        """Number of workers."""
        return self._c.num_dst

    @property
    def num_tensors(self) -> int:
        """Number of HF tensors in the sources."""
        return len(self._c.names)

    @property
    def num_signatures(self) -> int:
        """Number of distinct layouts, each planned once."""
        return len(self._c.templates)

    @property
    def num_items(self) -> int:
        """Total number of items over all ranks."""
        c = self._c
        return sum(t.count * n for t, n in zip(c.templates, c.sig_tensors))

    def __repr__(self) -> str:
        return (
            f"TransferPlan(tensors={self.num_tensors}, src_ranks={self.num_src_ranks}, "
            f"dst_ranks={self.num_dst_ranks}, items={self.num_items}, digest={self.digest[:12]})"
        )

    def _check(self, rank: int, n: int, what: str) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < n:
            raise ValueError(f"{what} must be an int in [0, {n}), got {rank!r}")

    def items_for_src(self, rank: int) -> list[TransferItem]:
        """Everything trainer ``rank`` sends, in the global order."""
        self._check(rank, self.num_src_ranks, "rank")
        c = self._c
        wc = c.worker_class
        memo: dict[int, tuple[tuple[Any, ...], ...]] = {}
        out: list[TransferItem] = []
        with _gc_paused():
            for name, sig, params in zip(c.names, c.tensor_sig, c.params):
                protos = memo.get(sig)
                if protos is None:
                    protos = memo[sig] = c.templates[sig].protos_for_src(rank, wc)
                if protos:
                    out += [_item(rank, w, name, reg, so, params[f], po) for w, reg, so, f, po in protos]
        return out

    def items_for_dst(self, rank: int) -> list[TransferItem]:
        """Everything worker ``rank`` receives, in the global order."""
        self._check(rank, self.num_dst_ranks, "rank")
        c = self._c
        wc = c.worker_class
        memo: dict[int, list[tuple[Any, ...]]] = {}
        out: list[TransferItem] = []
        with _gc_paused():
            for name, sig, params in zip(c.names, c.tensor_sig, c.params):
                protos = memo.get(sig)
                if protos is None:
                    protos = memo[sig] = c.templates[sig].protos_for_dst(rank, wc)
                if protos:
                    out += [_item(r, rank, name, reg, so, params[f], po) for r, reg, so, f, po in protos]
        return out

    def iter_items(self) -> Iterator[TransferItem]:
        """Every item of the plan, in the global order (lazy; model-scale plans are huge)."""
        c = self._c
        wc = c.worker_class
        for name, sig, params in zip(c.names, c.tensor_sig, c.params):
            tpl = c.templates[sig]
            for w in range(c.num_dst):
                for r, reg, so, f, po in tpl.protos_for_dst(w, wc):
                    yield _item(r, w, name, reg, so, params[f], po)

    def coverage(self, itemsize_of: Callable[[str], int] | None = None) -> PlanCoverage:
        """Bytes received per worker, sent per trainer rank, and asked for per worker."""
        size_of = itemsize_of or self._itemsize_of
        c = self._c
        recv = [0] * c.num_dst
        send = [0] * c.num_src
        want = [0] * c.num_dst
        for tpl, n, dtype, numels in zip(c.templates, c.sig_tensors, c.sig_dtype, c.sig_dst_numel):
            scale = n * size_of(dtype)
            for w, choice in enumerate(tpl.choices):
                want[w] += numels[w] * scale
                for r, p in zip(choice, tpl.protos[c.worker_class[w]]):
                    recv[w] += p[4] * scale
                    send[r] += p[4] * scale
        return PlanCoverage(tuple(recv), tuple(send), tuple(want))

    def bytes_per_dst(self, itemsize_of: Callable[[str], int] | None = None) -> tuple[int, ...]:
        """Bytes each worker receives."""
        return self.coverage(itemsize_of).recv_bytes


def build_plan(
    sources: Sequence[TensorSource],
    destinations: Sequence[Sequence[DestPiece]],
    *,
    itemsize_of: Callable[[str], int] | None = None,
) -> TransferPlan:
    """Plan every byte every worker asks for; call with equal inputs on every rank, then agree on the digest.

    ``destinations[w]`` lists worker w's pieces. Every byte of every piece becomes exactly one
    item. A piece held by several trainer ranks (equal source regions) goes to the holder that
    sends the fewest bytes so far, ties to the lowest rank (as torch DCP's ``dedup_save_plans``).
    Tensors sharing a layout (shape, dtype, source regions, per-worker destination regions and
    param offsets; names aside) are planned once, in order of first appearance, their bytes
    counted once per tensor. The order of pieces of *different* tensors in a worker's list does
    not matter. Equal destination lists are recognized by identity first: pass one list object
    for workers with identical layouts (e.g. one TP rank in several replicas) at model scale.

    Raises ValueError (naming the tensor, worker or trainer rank and both values) for an unknown
    tensor name, a piece whose ndim or bounds do not fit the tensor, a piece not covered by the
    source regions, source regions that overlap without being equal, or disagreeing rank counts.
    ``itemsize_of`` maps a dtype name to bytes per element (default :func:`dtype_itemsize`).
    """
    size_of = itemsize_of or dtype_itemsize
    return TransferPlan(compact_plan(sources, destinations, size_of), size_of)
