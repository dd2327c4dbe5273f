"""Deterministic packing of tensors into flat byte buckets (pure: metadata in, plan out).

Both sides derive the same buckets from the same metadata, so only the metadata (or its digest)
crosses the control plane. Each tensor starts at a 256-byte-aligned offset; a bucket holds whole
tensors and never exceeds ``bucket_bytes``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .protocol import ParamMeta, dtype_from_name, dtype_name

__all__ = ["ALIGN", "BucketEntry", "Bucket", "plan_buckets", "metadata_digest", "pack", "unpack", "fold_checksum"]

ALIGN = 256
"""Byte alignment of every tensor inside a bucket."""


@dataclass(frozen=True)
class BucketEntry:
    name: str  # HF tensor name
    dtype: str  # wire dtype name
    shape: tuple[int, ...]  # full shape
    offset: int  # byte offset inside the bucket (multiple of ALIGN)
    nbytes: int  # payload bytes


@dataclass(frozen=True)
class Bucket:
    entries: tuple[BucketEntry, ...]  # in metadata order
    nbytes: int  # bytes used, end of the last entry


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(metas: Sequence[ParamMeta], bucket_bytes: int) -> list[Bucket]:
    """Split ``metas`` (in order) into buckets of at most ``bucket_bytes``.

    Raises ``ValueError`` naming the tensor when one tensor alone exceeds ``bucket_bytes``.
    """
    if not isinstance(bucket_bytes, int) or bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be an int >= {ALIGN}, got {bucket_bytes!r}")
    buckets: list[Bucket] = []
    entries: list[BucketEntry] = []
    used = 0
    for m in metas:
        if m.nbytes > bucket_bytes:
            raise ValueError(
                f"parameter {m.name!r} has {m.nbytes} bytes, more than bucket_bytes={bucket_bytes}; "
                "raise bucket_bytes"
            )
        start = _align(used)
        if entries and start + m.nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(entries), used))
            entries, start = [], 0
        entries.append(BucketEntry(m.name, dtype_name(m.dtype), m.shape, start, m.nbytes))
        used = start + m.nbytes
    if entries:
        buckets.append(Bucket(tuple(entries), used))
    return buckets


def metadata_digest(wire: Iterable[dict]) -> str:
    """sha256 over JSON-safe ``{name, dtype, shape}`` records (order matters)."""
    h = hashlib.sha256()
    for rec in wire:
        h.update(json.dumps([rec["name"], rec["dtype"], list(rec["shape"])]).encode())
    return h.hexdigest()


def pack(buffer: torch.Tensor, entry: BucketEntry, tensor: torch.Tensor) -> None:
    """Copy ``tensor`` into the uint8 ``buffer`` at ``entry``'s offset (bit-exact, any dtype)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    buffer[entry.offset : entry.offset + entry.nbytes].copy_(flat, non_blocking=True)


def unpack(buffer: torch.Tensor, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """Zero-copy views ``(name, tensor)`` of every entry in the uint8 ``buffer``."""
    out = []
    for e in bucket.entries:
        raw = buffer[e.offset : e.offset + e.nbytes]
        out.append((e.name, raw.view(dtype_from_name(e.dtype)).view(e.shape)))
    return out


_MOD = (1 << 61) - 1


def fold_checksum(acc: int, t: torch.Tensor) -> int:
    """Fold ``t``'s bytes into the running checksum ``acc`` (order- and position-sensitive; computed
    on ``t``'s device). Both ends of a transfer fold the same tensors in the same order."""
    b = t.contiguous().view(-1).view(torch.uint8).to(torch.int64)
    weights = torch.arange(1, b.numel() + 1, device=b.device, dtype=torch.int64) % 65521 + 1
    return (acc * 1_000_003 + int((b * weights).sum()) + b.numel()) % _MOD
