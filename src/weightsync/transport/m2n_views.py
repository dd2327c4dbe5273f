"""Where a message's items are, as tensor views: the M2N executor's item-level half
(:class:`ItemViews`, mixed into :class:`~.m2n_rounds._Executor`).

A staged message is copied as two lists of views (this rank's tensors' side, the staging span's
side) in one grouped copy; a one-item message that is one run of its tensor goes from / into it
directly. Where each item's bytes are is found on the first sync and kept (:class:`~.packing.Spans`).
An item's tensor comes from the caller's ``tensor_of(m, i)``, asked once per sync for each distinct
(tensor name, param) key when the message's items say theirs without being made
(:class:`~weightsync.layout.schedule_compact.LazyItems`: rounds kept as arrays), so a sync makes no
item object for a message whose spans are known.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..layout.regions import box_slices
from ..layout.schedule import Message
from ..protocol import dtype_from_name
from .packing import ByteRuns, Spans

__all__ = ["ItemViews", "TensorOf", "item_view", "itemsize_of_message", "numels"]

TensorOf = Callable[[Message, int], torch.Tensor]


class ItemViews:
    """The executor's views of its messages' items (needs ``sender``, ``peer``, ``tensor_of``,
    ``dtypes``, ``runs``, ``spans``, ``wire``, ``memo`` on the instance)."""

    sender: bool
    tensor_of: TensorOf
    dtypes: Mapping[str, str]
    runs: ByteRuns
    spans: Spans
    wire: dict[str, torch.dtype]
    memo: dict[int, tuple[torch.Tensor, Any]]

    def peer(self, m: Message) -> int:
        raise NotImplementedError

    def _wire(self, name: str) -> torch.dtype:
        dt = self.wire.get(name)
        if dt is None:
            dt = self.wire[name] = dtype_from_name(self.dtypes[name])
        return dt

    def _at(self, item: Any) -> tuple[int, ...]:
        return item.src_offsets if self.sender else item.param_offsets

    def _tensors(self, m: Message) -> tuple[list[torch.Tensor], list[Any] | None]:
        """Each item's tensor and, where the items give keys, its :meth:`ByteRuns.flat` (else None):
        ``tensor_of`` is then asked once per key and sync (it picks a tensor by the item's name or
        param only), else once per item."""
        keys = getattr(m.items, "keys", None)
        if keys is None:
            return [self.tensor_of(m, i) for i in range(len(m.items))], None
        memo, ks = self.memo, keys()
        got = list(map(memo.get, ks))
        for i, t in enumerate(got):
            if t is None:
                tensor = self.tensor_of(m, i)
                got[i] = memo[ks[i]] = (tensor, self.runs.flat(tensor))
        return [g[0] for g in got], [g[1] for g in got]

    def _pairs(self, m: Message, buf: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(this rank's side, ``buf``'s side) of each item of staged message ``m``: byte views where
        its tensor is contiguous in the wire dtype, else views in the item's shape (the tensor's side
        may then differ in dtype: the copy casts)."""
        runs, wire = self.runs, self._wire
        tensors, flats = self._tensors(m)

        def find(i: int) -> tuple[torch.Tensor, int] | None:
            t, item = tensors[i], m.items[i]
            box = runs.box(t, self._at(item), item.region.sizes) if t.dtype == wire(item.name) else None
            return None if box is None else (box, m.offsets[i])

        got = self.spans.pairs((self.sender, self.peer(m), m.index), runs, tensors, buf, find, flats)
        if got is not None:
            return got
        items = tuple(m.items)
        mine = [runs.box(t, self._at(item), item.region.sizes) if t.dtype == wire(item.name) else None
                for item, t in zip(items, tensors)]
        theirs = runs.likes(buf, m.offsets, mine)
        for i, box in enumerate(mine):
            if box is None:
                item = items[i]
                mine[i] = tensors[i][box_slices(self._at(item), item.region.sizes)]
                theirs[i] = item_view(buf, m.offsets[i], item, self.dtypes)
        return mine, theirs

    def _direct(self, m: Message) -> torch.Tensor | None:
        """The bytes of message ``m`` in this rank's own tensor, when ``m`` is one item contiguous
        there in the wire dtype: sent from the shard or received into the parameter with no
        staging copy. Each end decides for itself; the bytes on the wire are the same either way.
        Where it is in the tensor is kept (``Spans``) while the tensor's layout stays the same."""
        if len(m.items) != 1:
            return None
        item, tensor = m.items[0], self._tensors(m)[0][0]
        if tensor.dtype != self._wire(item.name):
            return None
        flat, layout = self.runs.flat(tensor)
        if flat is None:  # not contiguous: the item's own view may still be
            return _direct_view(m, tensor, self.dtypes, self.sender)
        at = self._at(item)
        return self.spans.direct((self.sender, self.peer(m), m.index), flat, layout, m.nbytes,
                                 lambda: self.runs.box(tensor, at, item.region.sizes))


def itemsize_of_message(m: Message, dtypes: Mapping[str, str]) -> int:
    return dtype_from_name(dtypes[m.items[0].name]).itemsize


def numels(m: Message) -> list[int]:
    return [item.region.numel for item in m.items]


def _direct_view(m: Message, tensor: torch.Tensor, dtypes: Mapping[str, str], sender: bool) -> torch.Tensor | None:
    """The bytes of one-item message ``m`` in ``tensor``, when its region is contiguous there in the
    wire dtype (``ItemViews._direct`` without its byte views: any tensor)."""
    item = m.items[0]
    if tensor.dtype != dtype_from_name(dtypes[item.name]):
        return None
    view = tensor[box_slices(item.src_offsets if sender else item.param_offsets, item.region.sizes)]
    if not view.is_contiguous() or view.numel() * view.element_size() != m.nbytes:
        return None
    return view.reshape(-1).view(torch.uint8)


def item_view(buf: torch.Tensor, off: int, item: Any, dtypes: Mapping[str, str]) -> torch.Tensor:
    """``item``'s bytes at ``off`` of the uint8 ``buf``, in its wire dtype and shape."""
    dtype = dtype_from_name(dtypes[item.name])
    n = item.region.numel * dtype.itemsize
    return buf[off : off + n].view(dtype).view(item.region.sizes)
