"""Compiled rounds: the reshard executor's fast path for the dense syncs after the first.

After a dense sync (no checksums, no delta) over rounds kept as arrays,
:func:`compile_rounds` turns what that sync found (each message direct or staged, each staged item's
bytes in its tensor and in the message: :class:`~.packing.Spans`) into per-round parts: the ops'
peers and tags, the byte ranges of every view the round needs (deduplicated, adjacent items merged
into one copy) and the split of its staging span. A later dense sync asks ``tensor_of`` once per
tensor (not per item), checks that every tensor has the layout it had (shape, byte strides, dtype)
and that ``peer_rank`` gives the same ranks, cuts all views at once and posts each round from lists,
with one grouped copy per staged round; if anything differs it runs the general path (which compiles
anew). Decisions are the general path's own, so the ops, their order and the bytes are the same
(``tests/test_m2n_fast.py``); a sender's staged messages that are equal within a round (the same
items for each engine replica) are packed once and sent from one span, so it stages and copies less.
Nothing holding a tensor is kept across syncs.

:func:`compile_rounds` reads what the executor end found (:class:`DenseEnd`); :class:`FastRounds`
gives a later sync its views, which :meth:`~.executor._Executor.run_fast` posts.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Mapping
from itertools import chain
from typing import Protocol, cast

import numpy as np
import numpy.typing as npt
import torch

from ..plan.schedule import ALIGN, PEERS, CompactRounds, Message
from ..plan.transfer import align_up
from .packing import ByteRuns, Flat, Layout, Spans, Staging

__all__ = ["FAST_ITEMS", "WIDE", "DenseEnd", "FastRounds", "Part", "compile_rounds"]

_Shape = tuple[tuple[int, ...], tuple[int, ...], int]  # a strided view's (shape, strides, element width)
_Row = tuple[int, int, int, int]  # a view: (tensor slot, start, end, strided shape id or -1)
_Group = tuple[int, int, list[int], list[int] | None]  # a tensor's split: (slot, start, sizes, picks or None)
_Copy = tuple[int, int, int, int, int, int]  # a staged item: (slot, start, end, shape id, offset in span, bytes)
_Msg = tuple[int, int, int, int, list[_Copy] | None]  # (peer, index, nbytes, direct view id or -1, items)


class DenseEnd(Protocol):
    """What :func:`compile_rounds` reads of the executor end that ran the dense sync."""

    @property
    def sender(self) -> bool: ...

    @property
    def whole_rounds(self) -> bool:
        """Whether the data plane runs ops in issue order (a round is posted whole)."""
        ...

    @property
    def memo(self) -> Mapping[int, tuple[torch.Tensor, Flat]]:
        """An item key -> its tensor and flat bytes, that sync."""
        ...

    @property
    def spans(self) -> Spans: ...

    @property
    def staging(self) -> Staging: ...

    @property
    def relay_key(self) -> tuple[tuple[int, ...], bool] | None:
        """Its fan-out relay's children and whether it receives from a parent worker (None: no relay)."""
        ...

    def peer(self, m: Message) -> int: ...

    def tag_of(self, peer: int, index: int) -> int:
        """The tag of message ``index`` to or from plan peer ``peer``."""
        ...

    def forward_tag(self, peer: int, index: int) -> int | None:
        """The tag a relay forwards that message to its children with (None: it forwards nothing)."""
        ...


WIDE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""A strided copy goes in elements of its tensor's width (its bits as integers): half the elements
of a bf16 column slice's bytes, and about half the time where its rows are short."""

FAST_ITEMS = 1 << 18
"""Most items a rank's rounds may have to be compiled (above: the general path, kept arrays only):
every benchmark shape's rank (DeepSeek-V3 TP worker 0: ~180 k) but a 1T-class MoE with per-expert
tensors (k2: ~5 M, one tensor per item, where compiling would keep ~100 B per item and save little)."""


class _Probe:
    """What ``tensor_of`` reads of an item: its tensor name and param."""

    __slots__ = ("name", "param")

    def __init__(self, name: str, param: str) -> None:
        self.name, self.param = name, param


class _One:
    """A stand-in message of one item for ``tensor_of(m, 0)``."""

    __slots__ = ("items",)

    def __init__(self, probe: _Probe) -> None:
        self.items = (probe,)


class Part:
    """One posting of a round: ``vids`` per message (>= 0: a view of this rank's tensor, sent from /
    received into it; < 0: ``~vid``-th part of the staging span's ``msg_sizes`` split), the ops'
    ranks and tags (a relay's also its forwards' tags, ``fwd``), and the staged items' copies:
    tensor views ``item_vids``, span parts ``item_picks`` of its ``item_sizes`` split
    (``item_shapes`` for strided ones), then batches of equal items evenly spaced on both sides:
    tensor views ``batch_vids`` (one more dim) and span views ``batch_at`` (shape, strides, offset,
    width); a sender's ``reps`` (copies, elements, step, offset, width): a batch's one region copied
    from the span to the next messages'."""

    __slots__ = ("vids", "ranks", "tags", "fwd", "moved", "need", "msg_sizes", "item_vids", "item_sizes", "item_picks",
                 "item_shapes", "batch_vids", "batch_at", "reps")

    def __init__(self) -> None:
        self.vids: list[int] = []
        self.ranks: list[int] = []
        self.tags: list[int] = []
        self.fwd: list[int] = []  # a relay's: each op's tag to its children
        self.moved = self.need = 0
        self.msg_sizes: list[int] = []
        self.item_vids: list[int] = []
        self.item_sizes: list[int] = []
        self.item_picks: list[int] = []
        self.item_shapes: list[tuple[tuple[int, ...], int] | None] | None = None  # (shape, width) or None
        self.batch_vids: list[int] = []
        self.batch_at: list[tuple[tuple[int, ...], tuple[int, ...], int, int]] = []
        self.reps: list[tuple[int, int, int, int, int]] = []

    def cut(self, staging: torch.Tensor, start: int, views: list[torch.Tensor]) -> tuple[
            list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Its buffers, its copies' (tensor side, span side) views, at ``start`` of ``staging``, and
        its ``reps`` (from, to) views (after the copies)."""
        area = staging[start : start + self.need]
        mp = area.split(self.msg_sizes)  # type: ignore[no-untyped-call]  # torch's Tensor.split is unannotated
        bufs = [views[v] if v >= 0 else mp[~v] for v in self.vids]
        ip = area.split(self.item_sizes)  # type: ignore[no-untyped-call]  # (as above)
        theirs = [ip[j] for j in self.item_picks]
        if self.item_shapes is not None:
            theirs = [t if s is None else t.view(WIDE[s[1]]).view(s[0]) for t, s in zip(theirs, self.item_shapes)]
        mine = [views[v] for v in self.item_vids]
        if self.batch_vids:
            wide = {w: area.view(WIDE[w]) for w in {b[3] for b in self.batch_at}}
            base = area.storage_offset()
            mine += [views[v] for v in self.batch_vids]
            theirs += [wide[w].as_strided(shape, strides, (base + at) // w) for shape, strides, at, w in self.batch_at]
        reps: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for k, n, step, at, w in self.reps:
            t, o = area.view(WIDE[w]), (area.storage_offset() + at) // w
            reps[0].append(t.as_strided((k, n), (0, 1), o))
            reps[1].append(t.as_strided((k, n), (step, 1), o + step))
        return bufs, mine, theirs, reps

    def nbytes(self) -> int:
        lists = (self.vids, self.ranks, self.tags, self.fwd, self.msg_sizes, self.item_vids, self.item_sizes,
                 self.item_picks, self.batch_vids)
        extra = 8 * len(self.item_shapes or ()) + 200 * (len(self.batch_at) + len(self.reps))
        return 120 + 36 * sum(map(len, lists)) + extra


class FastRounds:
    """Compiled rounds (see the module docstring): per round its early and staged :class:`Part`
    (either may be None), the tensors (a stand-in message and the layout each had) and the views'
    byte ranges. View ids are renumbered so that each tensor's runs that do not overlap come
    first, in order: a sync cuts them with one ``split`` per tensor (``groups``: tensor, start,
    split sizes, the parts to keep); the other views are cut one by one from arrays (tensor,
    start, end, strided shape id or -1)."""

    slot: npt.NDArray[np.int32]
    start: npt.NDArray[np.int64]
    end: npt.NDArray[np.int64]
    sid: npt.NDArray[np.int32]

    def __init__(self, slots: list[tuple[_One, Layout]], table: list[_Row], shapes: list[_Shape],
                 rounds: list[tuple[Part | None, Part | None]], peers: dict[int, int], whole: bool, room: int,
                 relay_key: tuple[tuple[int, ...], bool] | None) -> None:
        self.slots, self.shapes, self.rounds, self.peers = slots, shapes, rounds, peers
        self.whole, self.room, self.relay_key = whole, room, relay_key
        order, self.groups = _grouped(table)
        new = [0] * len(table)
        for i, old in enumerate(order):
            new[old] = i
        for part in (p for r in rounds for p in r if p is not None):
            part.vids = [new[v] if v >= 0 else v for v in part.vids]
            part.item_vids = [new[v] for v in part.item_vids]
            part.batch_vids = [new[v] for v in part.batch_vids]
        rest = [table[v] for v in order[sum(len(g[2]) if g[3] is None else len(g[3]) for g in self.groups):]]
        cols = np.asarray(rest, dtype=np.int64).reshape(-1, 4).T
        self.slot, self.start, self.end, self.sid = cols[0].astype(np.int32), cols[1], cols[2], cols[3].astype(np.int32)

    def nbytes(self) -> int:
        """About the host bytes kept."""
        arrays = self.slot.nbytes + self.start.nbytes + self.end.nbytes + self.sid.nbytes
        groups = sum(100 + 36 * (len(g[2]) + len(g[3] or ())) for g in self.groups)
        parts = sum(p.nbytes() for r in self.rounds for p in r if p is not None)
        return arrays + groups + 200 * len(self.slots) + parts

    def views(self, tensor_of: Callable[[_One, int], torch.Tensor], runs: ByteRuns, peer_rank: Callable[[int], int],
              whole: bool, room: int, staging_offset: int,
              relay_key: tuple[tuple[int, ...], bool] | None) -> list[torch.Tensor] | None:
        """This sync's views (by view id), or None when a tensor's layout, a peer's rank, the plane's
        ordering, the staging room or the fan-out relay differ from the compiled sync's."""
        if whole != self.whole or room != self.room or staging_offset % 8 or relay_key != self.relay_key:
            return None
        if any(peer_rank(p) != r for p, r in self.peers.items()):
            return None
        flats: list[torch.Tensor] = []
        for stub, layout in self.slots:
            flat, lay = runs.flat(tensor_of(stub, 0))
            if flat is None or lay != layout:
                return None
            flats.append(flat)
        views: list[torch.Tensor] = []
        for k, lo, sizes, picks in self.groups:
            parts = flats[k][lo : lo + sum(sizes)].split(sizes)  # type: ignore[no-untyped-call]  # (unannotated)
            views += parts if picks is None else [parts[j] for j in picks]
        wide: dict[tuple[int, int], torch.Tensor]
        shapes, wide = self.shapes, {}
        for k, s, e, sid in zip(self.slot.tolist(), self.start.tolist(), self.end.tolist(), self.sid.tolist()):
            if sid < 0:
                views.append(flats[k][s:e])
                continue
            shape, strides, w = shapes[sid]
            t = wide.get((k, w))
            if t is None:
                t = wide[k, w] = flats[k].view(WIDE[w])
            views.append(t.as_strided(shape, strides, t.storage_offset() + s // w))
        return views


def _grouped(table: list[_Row]) -> tuple[list[int], list[_Group]]:
    """View ids in their new order, and per tensor its split (tensor, start, sizes, picks or None):
    each tensor's runs (not strided) sorted by start, those that do not overlap the one before first."""
    runs = sorted((v for v, row in enumerate(table) if row[3] < 0), key=lambda v: (table[v][0], table[v][1]))
    first: list[int]
    rest: list[int]
    groups: list[_Group]
    end: int | None
    sizes: list[int]
    picks: list[int]
    first, rest, groups = [], [], []
    at = 0
    while at < len(runs):
        slot, end, sizes, picks, lo, j = table[runs[at]][0], None, [], [], table[runs[at]][1], at
        while j < len(runs) and table[runs[j]][0] == slot:
            _, s, e, _ = table[runs[j]]
            if end is not None and s < end:
                rest.append(runs[j])
            else:
                if end is not None and s > end:
                    sizes.append(s - end)
                picks.append(len(sizes))
                sizes.append(e - s)
                first.append(runs[j])
                end = e
            j += 1
        groups.append((slot, lo, sizes, None if len(picks) == len(sizes) else picks))
        at = j
    rest += [v for v, row in enumerate(table) if row[3] >= 0]
    return first + rest, groups


class _Compiler:
    """What :func:`compile_rounds` builds up: tensors (slots), unique views, strided shapes."""

    def __init__(self, ex: DenseEnd, names: Callable[[int], tuple[str, str]]) -> None:
        self.ex, self.names = ex, names
        self.slot_of: dict[tuple[str, int], int] = {}  # (name or param, id of its tensor) -> slot
        self.slots: list[tuple[_One, Layout]] = []
        self.vid_of: dict[tuple[int, int, int, int], int] = {}
        self.peers: dict[int, int] = {}
        # (shape, strides, width): the spans', then the batches'
        self.shapes: list[_Shape] = [_widen(*s) for s in ex.spans.shapes]

    def slot(self, key: int) -> int | None:
        got = self.ex.memo.get(key)
        if got is None or got[1][0] is None:
            return None
        name, param = self.names(key)
        group = (name if self.ex.sender else param, id(got[0]))
        s = self.slot_of.get(group)
        if s is None:
            s = self.slot_of[group] = len(self.slots)
            self.slots.append((_One(_Probe(name, param)), got[1][1]))
        return s

    def vid(self, slot: int, start: int, end: int, sid: int) -> int:
        return self.vid_of.setdefault((slot, start, end, sid), len(self.vid_of))

    def message(self, m: Message) -> _Msg | None:
        """(peer, index, nbytes, direct view id or -1, staged items [(slot, start, end, sid, offset, n)]),
        or None where the message was not found as numbers."""
        ex = self.ex
        keys: Callable[[], list[int]] | None = getattr(m.items, "keys", None)
        if keys is None:
            return None
        found = [self.slot(k) for k in keys()]
        if None in found:
            return None
        slots = cast("list[int]", found)
        peer = ex.peer(m)
        key = (ex.sender, peer, m.index)
        if len(slots) == 1 and (d := ex.spans.direct_at(key)) is not None and d[1] >= 0 \
                and d[0] == self.slots[slots[0]][1]:
            return peer, m.index, m.nbytes, self.vid(slots[0], d[1], d[1] + m.nbytes, -1), None
        got = ex.spans.found(key)
        if not got or any(lay != self.slots[s][1] for lay, s in zip(got[0], slots)):
            return None
        sizes: array[int] | list[int]
        _, spans, sizes, picks, sids = got
        starts = np.concatenate(([0], np.cumsum(np.asarray(sizes, dtype=np.int64))[:-1])).tolist()
        sizes = sizes.tolist()
        items = []
        for j, s in enumerate(slots):
            p = j if picks is None else picks[j]
            items.append((s, spans[2 * j], spans[2 * j + 1], -1 if sids is None else sids[j], starts[p], sizes[p]))
        return peer, m.index, m.nbytes, -1, items

    def part(self, msgs: list[_Msg], peer_rank: Callable[[int], int]) -> Part:
        """A posting of ``msgs``; a sender's staged message equal to one before it in the posting
        (its items at the same offsets: a replica's) is sent from that one's span."""
        copies: list[_Copy]
        same: dict[tuple[int, tuple[_Copy, ...]], int]
        part, copies, same = Part(), [], {}
        for peer, index, nbytes, vid, items in msgs:
            rank = self.peers.setdefault(peer, peer_rank(peer))
            part.ranks.append(rank)
            part.tags.append(self.ex.tag_of(peer, index))
            if (fwd := self.ex.forward_tag(peer, index)) is not None:
                part.fwd.append(fwd)
            part.moved += nbytes
            if vid >= 0:
                part.vids.append(vid)
                continue
            items = cast("list[_Copy]", items)  # (a staged message: its items)
            if self.ex.sender:
                key = (nbytes, tuple(items))
                if key in same:
                    part.vids.append(same[key])
                    continue
                same[key] = ~len(part.msg_sizes)
            base = part.need
            part.vids.append(~len(part.msg_sizes))  # its part of the msg_sizes split
            part.msg_sizes += [nbytes, align_up(nbytes, ALIGN) - nbytes]
            part.need += align_up(nbytes, ALIGN)
            copies += [(s, a, b, sid, base + off, n) for s, a, b, sid, off, n in items]
        self._copies(part, copies)
        return part

    def _copies(self, part: Part, copies: list[_Copy]) -> None:
        merged: list[list[int]] = []
        for s, a, b, sid, off, n in copies:
            last = merged[-1] if merged else None
            if last is not None and sid < 0 and last[3] < 0 and last[0] == s and last[2] == a \
                    and last[4] + last[5] == off:
                last[2], last[5] = b, last[5] + n
            else:
                merged.append([s, a, b, sid, off, n])
        merged = self._batches(part, merged)
        shapes: list[tuple[tuple[int, ...], int] | None]
        at, shapes = 0, []
        for s, a, b, sid, off, n in merged:
            if off > at:
                part.item_sizes.append(off - at)
            part.item_picks.append(len(part.item_sizes))
            part.item_sizes.append(n)
            part.item_vids.append(self.vid(s, a, b, sid))
            shapes.append(None if sid < 0 else (self.shapes[sid][0], self.shapes[sid][2]))
            at = off + n
        if at < part.need:
            part.item_sizes.append(part.need - at)
        part.item_shapes = None if all(s is None for s in shapes) else shapes

    def _batches(self, part: Part, copies: list[list[int]]) -> list[list[int]]:
        """Copies of one tensor, size and shape whose tensor starts and span offsets step evenly (a
        norm's shards from every trainer rank, one shard sent to every worker, a column slice's rows)
        go as one copy of one more dim each; returns the others. A tensor step of 0 is allowed where
        the tensor is only read (a sender)."""
        by: dict[tuple[int, int, int], list[list[int]]] = {}
        for c in copies:
            by.setdefault((c[0], c[5], c[3]), []).append(c)
        rest = []
        for (slot, n, sid), group in by.items():
            group.sort(key=lambda c: (c[1], c[4]))
            shape, strides, w = self.shapes[sid] if sid >= 0 else _widen((n,), (1,), self.slots[slot][1][2].itemsize)
            i = 0
            while i < len(group):
                j, dt, da = i + 1, 0, 0
                if j < len(group):
                    dt, da = group[j][1] - group[i][1], group[j][4] - group[i][4]
                    while j < len(group) and group[j][1] - group[j - 1][1] == dt \
                            and group[j][4] - group[j - 1][4] == da:
                        j += 1
                first = group[i]
                span = first[2] - first[1]
                if j - i < 4 or not (dt > 0 or self.ex.sender):  # (items' regions are disjoint: distinct starts)
                    rest.append(first)
                    i += 1
                    continue
                k, (sh, st, w) = j - i, (shape, strides, w)
                if dt % w or da % w or n % w:
                    sh, st, w = ((n,), (1,), 1) if sid < 0 else (*self.ex.spans.shapes[sid], 1)
                if dt == 0:  # one region to k messages: copied once, then its copy k - 1 times (contiguous)
                    part.reps.append((k - 1, n // w, da // w, first[4], w))
                    k = 1
                self.shapes.append(((k, *sh), (dt // w, *st), w))
                part.batch_vids.append(self.vid(slot, first[1], first[1] + span, len(self.shapes) - 1))
                part.batch_at.append(((k, *sh), (da // w, *_row_major(sh)), first[4], w))
                i = j
        rest.sort(key=lambda c: c[4])
        return rest


def _widen(shape: tuple[int, ...], strides: tuple[int, ...], width: int | None = None) -> _Shape:
    """A byte view's (shape, strides) in elements of ``width`` bytes (a strided box: its last dim's
    bytes; a run: ``width``), where they divide; else as it is, width 1."""
    if width is None:  # a strided box: (*sizes, element bytes), (*byte strides, 1)
        w = shape[-1]
        if w in WIDE and strides[-1] == 1 and all(st % w == 0 for st in strides[:-1]):
            return shape[:-1], tuple(st // w for st in strides[:-1]), w
        return shape, strides, 1
    if width in WIDE and shape[0] % width == 0:
        return (shape[0] // width,), (1,), width
    return shape, strides, 1


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _fits(msgs: list[_Msg], room: int) -> bool:
    """Consecutive rounds' messages post as one: at most ``PEERS`` messages and half the staging
    (each end keeps its order per peer; on an ordered plane the round's direct messages go with it)."""
    return len(msgs) <= PEERS and sum(align_up(x[2], ALIGN) for x in msgs if x[3] < 0) <= room // 2


def compile_rounds(ex: DenseEnd, plan_rounds: Iterable[list[Message]],
                   peer_rank: Callable[[int], int]) -> FastRounds | None:
    """``plan_rounds`` (``handshake.Rounds``) compiled from what executor ``ex`` found in the dense
    sync it just ran, or None where a message was not found as numbers (a dtype cast, a tensor
    that is not contiguous) or the rounds have more than :data:`FAST_ITEMS` items."""
    compact: CompactRounds | None = getattr(plan_rounds, "compact", None)
    if compact is None or compact.num_items > FAST_ITEMS:
        return None
    if ex.spans.item_by_item() or any(g[1][0] is None for g in ex.memo.values()):
        return None  # a message goes item by item (a cast, a tensor not contiguous): known without a pass
    comp = _Compiler(ex, compact.key_names)
    rounds: list[tuple[Part | None, Part | None]]
    pending: list[_Msg]
    early: Part | None
    staged: Part | None
    rounds, pending = [], []
    for rnd in chain(plan_rounds, [None]):  # (None: flush the last)
        found = [] if rnd is None else [comp.message(m) for m in rnd]
        if None in found:
            return None
        msgs = cast("list[_Msg]", found)
        if rnd is not None and _fits(pending + msgs, ex.staging.room):
            pending += msgs  # thin rounds merge (one peer's stream, peers' last messages): fewer posts
            continue
        own, early, staged = [x[3] >= 0 for x in pending], None, None
        if (pending and all(own)) or (any(own) and not ex.whole_rounds):
            early = comp.part([x for x, o in zip(pending, own) if o], peer_rank)
            pending = [x for x, o in zip(pending, own) if not o]
        if pending:
            staged = comp.part(pending, peer_rank)
        if early or staged:
            rounds.append((early, staged))
        pending = msgs
    table = sorted(comp.vid_of, key=comp.vid_of.__getitem__)
    return FastRounds(comp.slots, table, comp.shapes, rounds, comp.peers, ex.whole_rounds, ex.staging.room,
                      ex.relay_key)
