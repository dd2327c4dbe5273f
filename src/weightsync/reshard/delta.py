"""Delta sync: a message as the positions and values that changed since the last version sent.

A sparse message carries, for its items in order::

    [counts: int32 x items][where: positions or bitmaps][values: n words of the wire dtype's size]

(values aligned to their size). ``counts`` says how many changes belong to each item; ``where`` is,
whichever is smaller for the message, their positions (int32, flat row-major within each item's
region) or one bitmap per item (bit j of byte i: value 8 i + j changed); both ends derive which
from the items' sizes and the number of changes. Values are compared and written as integers of the
element's size, so the receiver's tensor ends bit-exact (``-0.0`` vs ``0.0`` and NaN payloads count
as changes). A message goes sparse only when that is smaller than its dense bytes: in bf16, below
about 1/3 of its values changed with positions, and with bitmaps up to (2 - 1/8) / 2, about 94 %.

Trainer side, :class:`Baseline`: per local tensor, the last version this rank sent, in the wire
dtype (host memory by default). :meth:`Baseline.encode` compares the source's shards with it, builds
the sparse payloads of one sync's M2N messages, then makes the new values the baseline (the broadcast
transport uses :func:`diff` and :func:`encode` per full tensor). Worker side: :func:`decode`, then
:func:`patch` (an M2N item's region) or :func:`patch_pieces` / :func:`write_pieces` (a full tensor onto
the worker's destination pieces). Which workers take a delta is decided before any data moves, from
the sync each worker reports it holds (``WorkerEngine.held``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from ..infos import TrainerInitInfo
from ..plan.regions import box_slices
from ..plan.schedule import Message
from ..plan.transfer import DestPiece, align_up
from ..protocol import dtype_from_name

__all__ = ["sparse_nbytes", "diff", "encode", "decode", "patch", "Baseline", "Encoded", "write_pieces", "patch_pieces"]

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_POSITION = 2**31 - 1


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size (same storage, any strides)."""
    return t.view(_INT[t.element_size()])


def _layout(numels: Sequence[int], n: int, itemsize: int) -> tuple[bool, int, int]:
    """(bitmap?, byte offset of the values, total bytes) of a sparse message of items with ``numels``
    values and ``n`` changes of ``itemsize``: positions or bitmaps, whichever is smaller."""
    head = 4 * len(numels)
    by_positions = align_up(head + 4 * n, itemsize)
    by_bitmap = align_up(head + sum((k + 7) // 8 for k in numels), itemsize)
    bitmap = by_bitmap < by_positions
    values_at = by_bitmap if bitmap else by_positions
    return bitmap, values_at, values_at + n * itemsize


def sparse_nbytes(numels: Sequence[int], n: int, itemsize: int, names: Sequence[str] = ()) -> int:
    """Bytes of a sparse message of items with ``numels`` values and ``n`` changes of ``itemsize``
    (``names``: the items' parameters, for the ``ValueError`` when ``n`` is not in [0, their size],
    e.g. a count read from the store)."""
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= sum(numels):
        raise ValueError(f"{_who(names)}: a sparse delta message announces {n!r} changed values, not in "
                         f"[0, {sum(numels)}] (the region's size)")
    return _layout(numels, n, itemsize)[2]


def _who(names: Sequence[str], i: int | None = None) -> str:
    if not names:
        return "sparse message" if i is None else f"sparse message item {i}"
    return f"parameter {names[0 if i is None else i]!r}" + (f" (and {len(names) - 1} more)" if i is None and
                                                               len(names) > 1 else "")


def diff(new: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ``new`` differs bitwise from ``base`` (same shape and dtype, any strides): a bool mask
    of their shape, and the bits of the values there (row-major)."""
    a = _bits(new)
    changed = a != _bits(base)
    return changed, a[changed]


_BIT: dict[torch.device, torch.Tensor] = {}  # device -> the weights of a byte's 8 bits


def _bit_weights(device: torch.device) -> torch.Tensor:
    if device not in _BIT:
        _BIT[device] = (1 << torch.arange(8, dtype=torch.int32, device=device)).to(torch.uint8)
    return _BIT[device]


def encode(parts: list[tuple[torch.Tensor, torch.Tensor]], itemsize: int) -> torch.Tensor:
    """One sparse message (uint8, on the parts' device) from each item's ``diff`` (mask, value bits)."""
    numels = [mask.numel() for mask, _ in parts]
    n, device = sum(v.numel() for _, v in parts), parts[0][0].device
    bitmap, values_at, total = _layout(numels, n, itemsize)
    out = torch.empty(total, dtype=torch.uint8, device=device)
    head = 4 * len(parts)
    out[:head].view(torch.int32).copy_(torch.tensor([v.numel() for _, v in parts], dtype=torch.int32))
    values, at, k = out[values_at:].view(_INT[itemsize]), head, 0
    for (mask, vals), numel in zip(parts, numels):
        if bitmap:  # bit j of byte i: value 8 i + j changed
            nb = (numel + 7) // 8
            bits = torch.zeros(nb * 8, dtype=torch.uint8, device=device)
            bits[:numel] = mask.reshape(-1)
            out[at : at + nb].copy_((bits.view(nb, 8) * _bit_weights(device)).sum(1, dtype=torch.uint8))
            at += nb
        else:
            out[at : at + 4 * vals.numel()].view(torch.int32).copy_(mask.reshape(-1).nonzero().squeeze(1))
            at += 4 * vals.numel()
        values[k : k + vals.numel()].copy_(vals)
        k += vals.numel()
    return out


def decode(buf: torch.Tensor, numels: Sequence[int], n: int, itemsize: int,
           names: Sequence[str] = ()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(positions, value bits)`` per item of the sparse message in ``buf`` (uint8), items of ``numels``
    values (of the parameters ``names``). The whole message is validated first, so that nothing is
    patched from a malformed one: ``n`` and each item's count in [0, its size], positions strictly
    increasing and below the item's size, bitmaps marking exactly the announced changes and no bit
    past the item's end; else a ``ValueError`` naming the parameter."""
    sparse_nbytes(numels, n, itemsize, names)  # n in [0, the region's size]
    bitmap, values_at, total = _layout(numels, n, itemsize)
    if buf.numel() < total:
        raise ValueError(f"{_who(names)}: a sparse delta message of {buf.numel()} bytes cannot hold the {n} "
                         f"values announced ({total} bytes)")
    head = 4 * len(numels)
    counts = buf[:head].view(torch.int32).tolist()
    for i, (c, numel) in enumerate(zip(counts, numels)):
        if not 0 <= c <= numel:
            raise ValueError(f"{_who(names, i)}: a sparse delta message counts {c} changed values, not in "
                             f"[0, {numel}] (the region's size)")
    if sum(counts) != n:
        raise ValueError(f"{_who(names)}: a sparse delta message's item counts {counts[:8]} do not add up to "
                         f"the {n} values announced")
    values = buf[values_at:total].view(_INT[itemsize])
    out, at, k = [], head, 0
    for i, (c, numel) in enumerate(zip(counts, numels)):
        if bitmap:
            nb = (numel + 7) // 8
            bits = buf[at : at + nb].unsqueeze(1).bitwise_and(_bit_weights(buf.device)).ne(0).reshape(-1)
            pos = bits[:numel].nonzero().squeeze(1)
            at += nb
            if pos.numel() != c or bool(bits[numel:].any()):
                raise ValueError(f"{_who(names, i)}: a sparse delta message's bitmap marks {int(bits.sum())} "
                                 f"changes in {numel} values where {c} were announced")
        else:
            pos = buf[at : at + 4 * c].view(torch.int32)
            at += 4 * c
            _check_positions(pos, numel, names, i)
        out.append((pos, values[k : k + c]))
        k += c
    return out


def _check_positions(pos: torch.Tensor, numel: int, names: Sequence[str], i: int) -> None:
    """Positions strictly increasing, in [0, numel): else ``patch`` would fail midway, wrap around a
    non-contiguous region (``unravel_index``) or write one value twice."""
    if pos.numel() == 0:
        return
    ends = torch.stack([pos[0], pos[-1]]).tolist()
    rising = pos.numel() == 1 or bool((pos[1:] > pos[:-1]).all())
    if ends[0] < 0 or ends[1] >= numel or not rising:
        raise ValueError(f"{_who(names, i)}: a sparse delta message's positions are not strictly increasing "
                         f"in [0, {numel}) (first {ends[0]}, last {ends[1]})")


def patch(target: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` (bits) at flat row-major ``positions`` of ``target`` (any strided view), in place."""
    if positions.numel() == 0:
        return
    bits, idx = _bits(target), positions.to(torch.int64)
    if bits.is_contiguous():
        bits.view(-1).index_copy_(0, idx, values)
    else:
        bits.index_put_(torch.unravel_index(idx, tuple(bits.shape)), values)


@dataclass
class Encoded:
    """One sync's sparse messages on one trainer rank."""

    payloads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    """(worker, message index) -> the sparse message; every other message goes dense."""
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    """JSON-safe ``{worker: {message index: changed values}}`` of the sparse messages (what the
    workers need to post their receives)."""
    changed: int = 0
    """Values that differ from the baseline, over the messages compared."""
    compared: int = 0
    """Values compared (the items of messages to workers that hold the baseline's version)."""


class Baseline:
    """The last version one trainer rank sent of each local tensor, in the wire dtype, on ``device``."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        """The sync whose values ``tensors`` hold, once that sync completed everywhere (else None)."""

    @classmethod
    def for_engine(cls, info: TrainerInitInfo) -> Baseline | None:
        """The baseline a trainer init info asks for (``delta``, ``delta_baseline``), or None."""
        return cls("cpu" if info.delta_baseline == "cpu" else info.device) if info.delta else None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def keep(self, name: str, new: torch.Tensor) -> torch.Tensor:
        """Make ``new`` (in the wire dtype) the baseline of ``name``, in place when it fits; returns it."""
        base = self.tensors.get(name)
        if base is None or base.shape != new.shape or base.dtype != new.dtype:
            base = self.tensors[name] = new.to(self.device, copy=True)
        else:
            base.copy_(new)
        return base

    def encode(self, rounds: Iterable[list[Message]], shards: Mapping[str, torch.Tensor], dtypes: Mapping[str, str],
               *, eligible: Callable[[Message], bool]) -> Encoded:
        """Compare the ``eligible`` messages' items with the baseline, keep the sparse payloads of
        those smaller sparse than dense, then make ``shards`` (cast to ``dtypes``) the baseline.
        With no baseline version (the first sync), every message goes dense. The baseline has no
        version afterwards: the caller sets it once every worker holds this sync."""
        enc, against, self.version = Encoded(), self.version, None
        todo: dict[str, list[tuple[Message, int]]] = {}
        parts: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor] | None]] = {}  # (worker, index) -> per
        # item diff(), until the message is encoded
        left: dict[tuple[int, int], int] = {}  # items not compared yet
        size: dict[tuple[int, int], int] = {}
        numels: dict[tuple[int, int], list[int]] = {}
        if against is not None:
            for msgs in rounds:
                for m in msgs:
                    if eligible(m) and _uniform(m, dtypes):
                        key = (m.dst, m.index)
                        parts[key], size[key], left[key] = [None] * len(m.items), 0, len(m.items)
                        numels[key] = [it.region.numel for it in m.items]
                        for i, item in enumerate(m.items):
                            todo.setdefault(item.name, []).append((m, i))
        for name, shard in shards.items():
            wire = dtype_from_name(dtypes[name])
            new = shard if shard.dtype == wire else shard.to(wire)
            base = self.tensors.get(name)
            for m, i in todo.get(name, ()):
                item = m.items[i]
                sl = box_slices(item.src_offsets, item.region.sizes)
                a = _bits(new[sl])
                changed = a != _bits(cast(torch.Tensor, base)[sl].to(new.device))  # (a versioned baseline has it)
                n = int(changed.count_nonzero())
                enc.changed += n
                enc.compared += item.region.numel
                key = (m.dst, m.index)
                if key not in parts:
                    continue
                size[key] += n
                if sparse_nbytes(numels[key], size[key], wire.itemsize) >= m.nbytes:
                    del parts[key]  # dense is smaller: keep counting, stop extracting
                    continue
                parts[key][i] = (changed, a[changed])
                left[key] -= 1
                if not left[key]:  # every item compared: encode now, keep only the payload
                    done = cast("list[tuple[torch.Tensor, torch.Tensor]]", parts.pop(key))  # (no None left)
                    enc.payloads[key] = encode(done, wire.itemsize)
                    enc.counts.setdefault(str(key[0]), {})[str(key[1])] = size[key]
            self.keep(name, new)
        return enc


def _uniform(m: Message, dtypes: Mapping[str, str]) -> bool:
    """A message can go sparse: one wire itemsize for all its items, positions fit in int32."""
    sizes = {dtype_from_name(dtypes[item.name]).itemsize for item in m.items}
    return len(sizes) == 1 and all(item.region.numel <= _MAX_POSITION for item in m.items)


# ---- whole tensors onto a worker's destination pieces (the broadcast transport) ----------------
def write_pieces(full: torch.Tensor, pieces: Iterable[DestPiece], params: Mapping[str, torch.Tensor]) -> None:
    """Copy each piece's region of the full tensor ``full`` into its place in ``params``."""
    for p in pieces:
        params[p.param][box_slices(p.param_offsets, p.region.sizes)].copy_(full[p.region.slices()])


def patch_pieces(shape: tuple[int, ...], positions: torch.Tensor, values: torch.Tensor, pieces: Iterable[DestPiece],
                 params: Mapping[str, torch.Tensor]) -> None:
    """Write the changed values of a full tensor of ``shape`` (flat ``positions``, value bits) that
    fall in each piece's region into its place in ``params``."""
    idx = positions.to(torch.int64)
    coords = torch.unravel_index(idx, shape)
    for p in pieces:
        inside = torch.ones_like(idx, dtype=torch.bool)
        for c, o, s in zip(coords, p.region.offsets, p.region.sizes):
            inside &= (c >= o) & (c < o + s)
        at = tuple(c[inside] - o + po for c, o, po in zip(coords, p.region.offsets, p.param_offsets))
        _bits(params[p.param]).index_put_(at, values[inside])
