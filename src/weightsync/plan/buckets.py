"""Deterministic packing of tensors into flat byte buckets (pure: metadata in, plan out).

Both sides derive the same buckets from the same metadata, so only the metadata (or its digest)
crosses the control plane. Each tensor starts at a 256-byte-aligned offset; a bucket holds whole
tensors and never exceeds ``bucket_bytes``. Call order on every rank of a broadcast or IPC sync::

    buckets = plan_buckets(metas, bucket_bytes)      # same metas everywhere -> same buckets
    agree on metadata_digest(m.wire() for m in metas)  # before any data moves
    sender: reshard.packing.pack each entry; receiver: reshard.packing.unpack each bucket

Pure: no torch import. A meta is anything with ``name``, ``dtype`` and ``shape``
(:class:`weightsync.protocol.ParamMeta`, or a plain record with a dtype name).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypedDict

from weightsync.plan.transfer import align_up, dtype_itemsize

__all__ = ["ALIGN", "Bucket", "BucketEntry", "TensorMeta", "check_bucket_bytes", "metadata_digest", "plan_buckets"]

ALIGN = 256
"""Byte alignment of every tensor inside a bucket."""


class TensorMeta(Protocol):
    """What :func:`plan_buckets` reads of a tensor's metadata (read only: a frozen record fits)."""

    @property
    def name(self) -> str:
        """HF tensor name."""
        ...

    @property
    def dtype(self) -> object:
        """A torch.dtype, or its name ("bfloat16" / "torch.bfloat16"): read through ``str`` only, so
        plan/ needs no torch import (``tests/test_imports.py``)."""
        ...

    @property
    def shape(self) -> tuple[int, ...]:
        """Full shape."""
        ...


class WireMeta(TypedDict):
    """One tensor's JSON-safe metadata, as ``ParamMeta.wire()`` makes it and the store carries it."""

    # HF tensor name
    name: str
    # wire dtype name, e.g. "bfloat16"
    dtype: str
    # full shape (a list once it crossed JSON)
    shape: Sequence[int]


@dataclass(frozen=True)
class BucketEntry:
    """Where one tensor's bytes lie in its bucket."""

    # HF tensor name
    name: str
    # wire dtype name, e.g. "bfloat16"
    dtype: str
    # full shape
    shape: tuple[int, ...]
    # byte offset inside the bucket (multiple of ALIGN)
    offset: int
    # payload bytes
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    """One flat byte buffer's worth of whole tensors."""

    # in metadata order
    entries: tuple[BucketEntry, ...]
    # bytes used: the end of the last entry
    nbytes: int


def _dtype_name(dtype: object) -> str:
    """``torch.bfloat16`` or ``"torch.bfloat16"`` or ``"bfloat16"`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def check_bucket_bytes(name: str, n: object) -> None:
    """``ValueError`` naming the field unless ``n`` is a positive multiple of ``ALIGN``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < ALIGN or n % ALIGN:
        raise ValueError(f"{name} must be a positive multiple of {ALIGN}, got {n!r}")


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """Split ``metas`` (in order) into buckets of at most ``bucket_bytes``; call on every rank alike.

    Raises ``ValueError`` naming the tensor when one tensor alone exceeds ``bucket_bytes``, and
    naming the tensor and its dtype when the dtype has no known itemsize.
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be an int >= {ALIGN}, got {bucket_bytes!r}")
    buckets: list[Bucket] = []
    entries: list[BucketEntry] = []
    used = 0
    for m in metas:
        dtype = _dtype_name(m.dtype)
        try:
            nbytes = math.prod(m.shape) * dtype_itemsize(dtype)
        except ValueError as e:
            raise ValueError(f"parameter {m.name!r}: {e}") from None
        if nbytes > bucket_bytes:
            raise ValueError(
                f"parameter {m.name!r} has {nbytes} bytes, more than bucket_bytes={bucket_bytes}; "
                "raise bucket_bytes"
            )
        start = align_up(used, ALIGN)
        if entries and start + nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(entries), used))
            entries, start = [], 0
        entries.append(BucketEntry(m.name, dtype, tuple(m.shape), start, nbytes))
        used = start + nbytes
    if entries:
        buckets.append(Bucket(tuple(entries), used))
    return buckets


def metadata_digest(wire: Iterable[WireMeta]) -> str:
    """sha256 over JSON-safe ``{name, dtype, shape}`` records (order matters)."""
    h = hashlib.sha256()
    for rec in wire:
        h.update(json.dumps([rec["name"], rec["dtype"], list(rec["shape"])]).encode())
    return h.hexdigest()
