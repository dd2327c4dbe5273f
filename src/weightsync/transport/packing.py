"""Bytes in and out of flat uint8 buffers, and the checksum both ends of a transfer fold.

:func:`pack` / :func:`unpack` move tensors into and out of the buckets that
:func:`weightsync.layout.buckets.plan_buckets` plans. :func:`fold_checksum` folds a tensor's bytes
into a running checksum for ``verify=True`` syncs, on the tensor's own device, in bounded memory.

The checksum of one tensor
--------------------------
The tensor's bytes in row-major order, zero-padded to whole rows of :data:`ROW_WORDS` words, are
read as little-endian int32 words ``X[g, j]`` (row ``g``, column ``j``). With exact integer sums

    A = sum X[g, j],   R = sum (g + 1) * X[g, j],   C = sum (j + 1) * X[g, j]

the fold is ``acc <- (((acc * P + nbytes) * P + A) * P + R) * P + C  (mod 2**61 - 1)``.
Swapping two unequal words changes R (different rows) or C (same row), swapping two bytes changes a
word, and ``nbytes`` tells trailing zero bytes from padding. Only integer sums run on the device and
every one is exact (|partial sums| < 2**63), so CPU and GPU give the same value for the same bytes
whatever their reduction order. The value is the tensor's alone: it does not depend on its strides or
on the chunks it is read in. Contract: both ends fold the same tensors in the same order (folding a
tensor in two calls gives a different value than folding it in one).

Memory: at most :data:`CHUNK_BYTES` of int64 work space plus up to two copies of half that much input
(a non-contiguous tensor's block made contiguous, a misaligned block made 4-byte aligned): peak
transient memory <= 2 x CHUNK_BYTES on the tensor's device, whatever the tensor's size.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..layout.buckets import Bucket, BucketEntry
from ..protocol import dtype_from_name

__all__ = ["CHUNK_BYTES", "ROW_WORDS", "fold_checksum", "fold_value", "pack", "unpack"]

CHUNK_BYTES = 16 << 20
"""Bytes of the int64 work buffer one :func:`fold_checksum` call allocates (bounds its memory)."""

ROW_WORDS = 4096
"""int32 words per checksum row (16 KiB of input)."""

_ROW_BYTES = ROW_WORDS * 4
_ROWS = CHUNK_BYTES // 8 // ROW_WORDS  # rows per work-buffer pass: 512 rows, 8 MiB of input
_INPUT_BYTES = _ROWS * _ROW_BYTES  # most input bytes read (and maybe copied) at once: CHUNK_BYTES / 2
_MOD = (1 << 61) - 1
_P = 1_000_003


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


def _byte_blocks(t: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """``t``'s bytes in row-major order as contiguous 1-D uint8 tensors of at most ``limit`` bytes.

    Views of a contiguous ``t``; otherwise copies of blocks of leading-dim slices, one at a time.
    """
    if t.is_contiguous():
        flat = t.reshape(-1).view(torch.uint8)
        for start in range(0, flat.numel(), limit):
            yield flat[start : start + limit]
        return
    row_bytes = t[0].numel() * t.element_size()
    if row_bytes <= limit:
        step = max(1, limit // max(row_bytes, 1))
        for start in range(0, t.shape[0], step):
            yield t[start : start + step].contiguous().reshape(-1).view(torch.uint8)
    else:
        for i in range(t.shape[0]):
            yield from _byte_blocks(t[i], limit)


class _Sums:
    """Running A, R and column sums of one tensor's rows (see the module docstring)."""

    def __init__(self, device: torch.device, nbytes: int) -> None:
        rows = min(_ROWS, max(1, -(-nbytes // _ROW_BYTES)))  # a small tensor needs a small buffer
        self.work = torch.empty(rows, ROW_WORDS, dtype=torch.int64, device=device)
        self.cols = torch.zeros(ROW_WORDS, dtype=torch.int64, device=device)
        self.tail = torch.zeros(_ROW_BYTES, dtype=torch.uint8, device=device)  # the row being filled
        self.fill = 0  # bytes in tail
        self.rows = 0  # rows folded so far
        self.a = self.r = 0

    def add_rows(self, words: torch.Tensor) -> None:
        """Fold ``words`` ((k, ROW_WORDS) int32, k <= _ROWS) as the next k rows."""
        k = words.shape[0]
        work = self.work[:k]
        work.copy_(words)
        self.cols += work.sum(0)
        row_sums = work.sum(1).tolist()
        self.a += sum(row_sums)
        self.r += sum(g * s for g, s in enumerate(row_sums, self.rows + 1))
        self.rows += k

    def add_bytes(self, block: torch.Tensor) -> None:
        """Fold ``block`` (contiguous 1-D uint8, at most _INPUT_BYTES) as the next bytes."""
        n, pos = block.numel(), 0
        if self.fill:
            pos = min(n, _ROW_BYTES - self.fill)
            self.tail[self.fill : self.fill + pos].copy_(block[:pos])
            self.fill += pos
            if self.fill < _ROW_BYTES:
                return
            self.add_rows(self.tail.view(torch.int32).view(1, ROW_WORDS))
            self.fill = 0
        whole = (n - pos) // _ROW_BYTES * _ROW_BYTES
        if whole:
            body = block[pos : pos + whole]
            if body.data_ptr() % 4:  # an int32 view needs 4-byte alignment
                body = body.clone()
            self.add_rows(body.view(torch.int32).view(-1, ROW_WORDS))
        rest = n - pos - whole
        if rest:
            self.tail[:rest].copy_(block[pos + whole :])
            self.fill = rest

    def finish(self) -> tuple[int, int, int]:
        """A, R and C, after padding the last row with zeros."""
        if self.fill:
            self.tail[self.fill :].zero_()
            self.add_rows(self.tail.view(torch.int32).view(1, ROW_WORDS))
        c = sum(j * s for j, s in enumerate(self.cols.tolist(), 1))
        return self.a, self.r, c


def fold_checksum(acc: int, t: torch.Tensor) -> int:
    """Fold ``t``'s bytes into the running checksum ``acc`` (order- and position-sensitive).

    Computed on ``t``'s device in at most 2 x :data:`CHUNK_BYTES` of transient memory; equal on CPU
    and GPU for equal bytes. Both ends of a transfer fold the same tensors in the same order.
    """
    t = t.detach()
    nbytes = t.numel() * t.element_size()
    sums = _Sums(t.device, nbytes)
    # A non-contiguous t is copied block by block: half-size blocks keep the bound (module docstring).
    for block in _byte_blocks(t, _INPUT_BYTES if t.is_contiguous() else _INPUT_BYTES // 2):
        sums.add_bytes(block)
    out = acc
    for value in (nbytes, *sums.finish()):
        out = fold_value(out, value)
    return out


def fold_value(acc: int, value: int) -> int:
    """Fold the integer ``value`` (e.g. another checksum) into the running checksum ``acc``."""
    return (acc * _P + value) % _MOD
