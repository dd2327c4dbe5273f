"""Bytes in and out of flat uint8 buffers, and the checksum both ends of a transfer fold.

:func:`pack` / :func:`unpack` move tensors into and out of the buckets that
:func:`weightsync.plan.buckets.plan_buckets` plans. :class:`Staging` hands out the M2N executor's
spans of its staging buffer; :class:`ByteRuns` views boxes of tensors as byte slices.
:func:`fold_checksum` folds a tensor's bytes into a running checksum for ``verify=True`` syncs, on
the tensor's own device, in bounded memory.

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

from array import array
from collections.abc import Callable, Iterable, Iterator
from typing import Literal, cast

import torch

from ..plan.buckets import Bucket, BucketEntry
from ..plan.schedule import ALIGN
from ..plan.transfer import align_up
from ..protocol import dtype_from_name

__all__ = ["CHUNK_BYTES", "ROW_WORDS", "ByteRuns", "Flat", "Layout", "SpanKey", "Spans", "Staging", "fold_checksum",
           "fold_value", "pack", "unpack"]

CHUNK_BYTES = 16 << 20
"""Bytes of the int64 work buffer one :func:`fold_checksum` call allocates (bounds its memory)."""

ROW_WORDS = 4096
"""int32 words per checksum row (16 KiB of input)."""

_ROW_BYTES = ROW_WORDS * 4
_ROWS = CHUNK_BYTES // 8 // ROW_WORDS  # rows per work-buffer pass: 512 rows, 8 MiB of input
_INPUT_BYTES = _ROWS * _ROW_BYTES  # most input bytes read (and maybe copied) at once: CHUNK_BYTES / 2
_MOD = (1 << 61) - 1
_P = 1_000_003

Layout = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]
"""A tensor's layout: (shape, byte strides, dtype); the same box of two tensors of one layout is the same bytes."""
Flat = tuple[torch.Tensor | None, Layout]
"""A tensor's bytes, flat (None when it is not contiguous), and its layout (:meth:`ByteRuns.flat`)."""
SpanKey = tuple[bool, int, int]
"""A message as :class:`Spans` keys it: (sender end?, peer, message index)."""
_Cached = tuple[torch.Tensor, torch.Tensor | None, tuple[int, ...], tuple[int, ...], int]  # t, flat, shape, strides, es
_ByteShape = tuple[tuple[int, ...], tuple[int, ...]]  # a strided byte view's (shape, strides)
_Found = tuple[tuple[Layout, ...], "array[int]", "array[int]", list[int] | None, "array[int] | None"]
"""A staged message's items (:meth:`Spans.pairs`): layouts, [start, end] * items in their tensors, the
message's split sizes, the parts that are items (None: all) and strided shape ids (None: no strided item)."""


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


class Staging:
    """The staging buffer's spans: a staged round takes just the bytes its slots need, aligned, at
    the lowest offset no posted round holds, so low bytes are reused first and only as much of the
    buffer is touched as the rounds in flight stage at once."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.room = buf.numel() // ALIGN * ALIGN

    def need(self, slots: list[torch.Tensor | int]) -> int:
        """Bytes a round's slots to place (their byte counts) take; ``ValueError`` above the room."""
        need = sum(align_up(b, ALIGN) for b in slots if isinstance(b, int))
        if need > self.room:
            raise ValueError(f"a round needs {need} bytes of staging, more than the {self.room} there are")
        return need

    def spot(self, need: int, held: Iterable[tuple[int, int]]) -> int | None:
        """The lowest offset with ``need`` bytes free of every ``held`` span, or None."""
        spans = [span for span in held if span[0] < span[1]]
        for at in sorted({0, *(e for _, e in spans)}):
            if at + need <= self.room and all(e <= at or at + need <= s for s, e in spans):
                return at
        return None

    def place(self, slots: list[torch.Tensor | int], start: int, need: int) -> list[torch.Tensor]:
        """The slots as buffers: each byte count becomes the next aligned span from ``start``."""
        area = self.buf[start : start + need]
        out, base = [], 0
        for b in slots:
            if isinstance(b, int):
                out.append(area[base : base + b])
                base += align_up(b, ALIGN)
            else:
                out.append(b)
        return out


class ByteRuns:
    """Boxes of tensors as bytes: each tensor's bytes are viewed flat once (per instance: one sync),
    then a box of a contiguous tensor is one view of them (one slice when the box is one run), with
    no view in the tensor's dtype and no slice per dim (the executor's per-item hot path)."""

    def __init__(self) -> None:
        self._of: dict[int, _Cached | tuple[*_Cached, Layout]] = {}  # id(t) -> t, its bytes, ... (+ its layout)
        self._strides: dict[tuple[int, ...], tuple[int, ...]] = {}  # a shape -> its row-major strides

    def box(self, t: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor | None:
        """``t[box]``'s bytes as a uint8 view of ``t``: 1-D when the box (``offsets``, ``sizes``, in
        ``t``'s index space) is one run of ``t``, else its ``sizes`` and a last dim of ``t``'s element
        bytes; None when ``t`` is not contiguous."""
        got = self._of.get(id(t))
        if got is None:  # (it holds t: no other tensor takes t's id meanwhile)
            flat = t.reshape(-1).view(torch.uint8) if t.is_contiguous() else None
            es = t.element_size()
            got = self._of[id(t)] = (t, flat, tuple(t.shape), tuple(st * es for st in t.stride()), es)
        _, flat, shape, strides, n = got[:5]
        nd = len(shape)
        if flat is None or len(sizes) != nd:
            return None
        start = 0
        for o, st in zip(offsets, strides):
            start += o * st
        j, run = 0, True
        while j < nd - 1 and sizes[j] == 1:  # one run: every dim after its first longer one whole
            j += 1
        for k in range(j + 1, nd):
            run = run and sizes[k] == shape[k]
        if run:
            for s in sizes:
                n *= s
            return flat[start : start + n]
        return flat.as_strided((*sizes, n), (*strides, 1), flat.storage_offset() + start)

    def flat(self, t: torch.Tensor) -> Flat:
        """``t``'s bytes, flat (None when ``t`` is not contiguous), and its layout: (shape, byte
        strides, dtype); the same box of two tensors of one layout is the same bytes of each."""
        got = self._of.get(id(t))
        if got is None:
            self.box(t, (), ())  # caches t (a box of no dims: nothing else)
            got = self._of[id(t)]
        if len(got) == 5:
            got = self._of[id(t)] = (*got, (got[2], got[3], t.dtype))
        return got[1], got[5]

    def likes(self, buf: torch.Tensor, offsets: tuple[int, ...],
              boxes: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """:meth:`like` of each box (None where it is None); a run of boxes of one shape that lie
        back to back in ``buf`` is one view of it, unbound (no Python call per box)."""
        out: list[torch.Tensor | None] = [None] * len(boxes)
        i, n = 0, len(boxes)
        while i < n:
            b = boxes[i]
            if b is None:
                i += 1
                continue
            shape, nb, j = b.shape, b.numel(), i + 1
            while j < n and (c := boxes[j]) is not None and c.shape == shape \
                    and offsets[j] == offsets[i] + (j - i) * nb:
                j += 1
            if j - i == 1:
                out[i] = self.like(buf, offsets[i], b)
            else:
                out[i:j] = buf[offsets[i] : offsets[i] + (j - i) * nb].view(j - i, *shape).unbind(0)
            i = j
        return out

    def like(self, buf: torch.Tensor, off: int, view: torch.Tensor) -> torch.Tensor:
        """The bytes of the uint8 ``buf`` from ``off``, in ``view``'s shape (a :meth:`box`), row-major."""
        if view.dim() == 1:
            return buf[off : off + view.numel()]
        shape = tuple(view.shape)
        strides = self._strides.get(shape)
        if strides is None:
            acc, out = 1, []
            for s in reversed(shape):
                out.append(acc)
                acc *= s
            strides = self._strides[shape] = tuple(reversed(out))
        return buf.as_strided(shape, strides, buf.storage_offset() + off)


class Spans:
    """Numbers kept across syncs: per staged message (by key), where each of its items' bytes are in
    its tensor (start and end; for an item that is not one run, e.g. a column slice, also the id of
    its interned byte view shape and strides) and in the message, computed on first use; a later sync
    uses them while each item's tensor has the layout it had then (else they are computed anew). A
    message with an item whose tensor is not contiguous in the wire dtype is marked and goes item by
    item. Per item two ints (three if its message has a strided item), a split size and a shared
    layout reference, no view: the views are cut each sync."""

    def __init__(self) -> None:
        self._of: dict[SpanKey, _Found | Literal[False]] = {}  # key -> (layouts, [start, end] * items, split
        # sizes, picks, shape ids) or False
        self._direct: dict[SpanKey, tuple[Layout, int]] = {}  # key -> (layout, start or -1: not one run)
        self._shapes: dict[_ByteShape, int] = {}  # (shape, strides) of a strided byte view -> its id
        self._shape_list: list[_ByteShape] = []

    def __len__(self) -> int:
        return len(self._of) + len(self._direct)

    @property
    def shapes(self) -> list[_ByteShape]:
        """The strided byte views' (shape, strides), by shape id."""
        return self._shape_list

    def found(self, key: SpanKey) -> _Found | Literal[False] | None:
        """A staged message's numbers (False: it goes item by item; None: not found yet)."""
        return self._of.get(key)

    def direct_at(self, key: SpanKey) -> tuple[Layout, int] | None:
        """A one-item message's layout and start in its tensor (-1: not one run), if found."""
        return self._direct.get(key)

    def item_by_item(self) -> bool:
        """Whether some staged message goes item by item (a tensor not contiguous in the wire dtype)."""
        return any(v is False for v in self._of.values())

    def nbytes(self) -> int:
        """About the host bytes kept: the arrays, a reference per item, ~200 bytes per message."""
        n = 200 * len(self) + 200 * len(self._shape_list)
        for got in self._of.values():
            if got:
                lays, spans, sizes, picks, sids = got
                n += 8 * len(lays) + spans.itemsize * len(spans) + sizes.itemsize * len(sizes) + 8 * len(picks or ())
                n += 0 if sids is None else sids.itemsize * len(sids)
        return n

    def direct(self, key: SpanKey, flat: torch.Tensor, layout: Layout, nbytes: int,
               find: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        """The ``nbytes`` of a one-item message in the tensor ``flat`` is of (one run of it), or None:
        ``find()`` gives its 1-D byte view or None, called when ``layout`` is not the one seen last.
        (torch types ``storage_offset()`` ``int | SymInt``: a SymInt only while tracing.)"""
        got = self._direct.get(key)
        if got is None or got[0] != layout:
            view = find()
            ok = view is not None and view.dim() == 1 and view.numel() == nbytes
            at: int = (view.storage_offset() - flat.storage_offset()  # type: ignore[assignment]
                       if ok and view is not None else -1)
            got = self._direct[key] = (layout, at)
        return None if got[1] < 0 else flat[got[1] : got[1] + nbytes]

    def pairs(self, key: SpanKey, runs: ByteRuns, tensors: list[torch.Tensor], buf: torch.Tensor,
              find: Callable[[int], tuple[torch.Tensor, int] | None],
              flats: list[Flat] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """(tensor side, ``buf`` side) byte views of each item, or None where an item's tensor is not
        contiguous in the wire dtype. ``find(i)``: item i's byte view of its tensor (a
        :meth:`ByteRuns.box`: 1-D when one run, else strided) and its offset in ``buf``, or None;
        ``flats``: each tensor's :meth:`ByteRuns.flat`, when the caller has them."""
        got = self._of.get(key)
        if got is False:
            return None
        if flats is None:
            flats = [runs.flat(t) for t in tensors]
        if got is None or any(f[1] != lay for f, lay in zip(flats, got[0])):
            got = self._of[key] = self._find(flats, buf, find)
            if got is False:
                return None
        lays, spans, sizes, picks, sids = got
        found = cast("list[tuple[torch.Tensor, Layout]]", flats)  # (found: every tensor is contiguous)
        parts = buf.split(sizes.tolist())  # type: ignore[no-untyped-call]  # torch's Tensor.split is unannotated
        theirs = list(parts) if picks is None else [parts[j] for j in picks]
        if sids is None:
            return [f[0][spans[j] : spans[j + 1]] for f, j in zip(found, range(0, len(spans), 2))], theirs
        shapes = self._shape_list
        mine = [f[0][s:e] if k < 0 else f[0].as_strided(*shapes[k], f[0].storage_offset() + s)
                for f, s, e, k in zip(found, spans[0::2], spans[1::2], sids)]
        return mine, [p if k < 0 else p.view(shapes[k][0]) for p, k in zip(theirs, sids)]

    def _find(self, flats: list[Flat], buf: torch.Tensor,
              find: Callable[[int], tuple[torch.Tensor, int] | None]) -> _Found | Literal[False]:
        picks: list[int]
        spans, sizes, sids, picks, at = array("q"), array("q"), array("q"), [], 0
        for i, (flat, _) in enumerate(flats):
            got = find(i) if flat is not None else None
            if got is None or flat is None:
                return False
            view, off = got
            start: int = view.storage_offset() - flat.storage_offset()  # type: ignore[assignment]  # (SymInt: see direct)
            spans.extend((start, start + view.numel()))
            shape = (tuple(view.shape), tuple(view.stride())) if view.dim() != 1 else None
            sids.append(-1 if shape is None else self._shapes.setdefault(shape, len(self._shape_list)))
            if shape is not None and sids[-1] == len(self._shape_list):
                self._shape_list.append(shape)
            if off > at:
                sizes.append(off - at)
            picks.append(len(sizes))
            sizes.append(view.numel())
            at = off + view.numel()
        if at < buf.numel():
            sizes.append(buf.numel() - at)
        return (tuple(f[1] for f in flats), spans, sizes, None if len(picks) == len(sizes) else picks,
                None if max(sids, default=-1) < 0 else sids)


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
