"""The schedule: a rank's messages and rounds for moving a plan point to point with bounded staging.

Both ends of a (trainer, worker) pair cut the pair's items (in the one order both see) into the same
messages of at most ``cap`` bytes, splitting an item along its leading dims when it alone is larger
(:func:`split_item`; a 3-D piece whose 2-D slabs are large goes slab by slab, :func:`slabs`). A piece
of at least ``alone`` bytes is a message by itself (each end can then send it from, or receive it
into, its own tensor with no staging copy); the smaller pieces follow, packed together (element
aligned). Round k carries the k-th message of every pair: each rank posts its round-k sends and
receives together, and posts and waits for its rounds in order (the executor keeps a few posted at
once). Every op of round k is matched in round k, so rounds cannot deadlock, and one round of a rank
stages at most ``peers x cap`` bytes. Above :data:`PEERS` peers a rank's peers are split into groups
(:func:`peer_group`: the same group for a pair on both ends) and the rounds go group by group.

The cut is made once into numeric arrays (:func:`pair_rounds` -> :class:`CompactRounds`): at model
scale a rank exchanges millions of items (a 1T-class MoE with per-expert 2-D tensors: ~5 M per rank),
so an item here is three numbers: its tensor, its piece (an interned (region, source offsets, piece
index, param offsets), shared by every tensor of the signature) and its byte offset in its message.
Packing walks whole runs of one dtype at a time (a cumulative sum and a ``searchsorted`` per
message), so the Python work is per message, not per item. :class:`CompactRounds` hands the rounds
out as :class:`Message` s whose ``items`` are made when first read (:class:`LazyItems`).

The item-by-item cut that this one equals, message for message, is the tests' oracle
(``tests/oracle.py``; ``tests/plan/test_schedule*.py`` check both on random plans).

Pure: numpy and plain data in, arrays out; no torch import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import TYPE_CHECKING, Protocol, cast, overload

import numpy as np

from weightsync.plan.regions import Region
from weightsync.plan.transfer import PairItems, TransferItem, align_up, new_item

if TYPE_CHECKING:
    import numpy.typing as npt

    from weightsync.plan.template import RecvProto, SendProto

    _I32 = npt.NDArray[np.int32]
    _I64 = npt.NDArray[np.int64]
    _Ints = npt.NDArray[np.int32 | np.int64]  # a column of ints: int32 where they fit, else int64
    _Proto = SendProto | RecvProto  # one planned copy, its peer first (PairItems.runs)
    _Run = tuple[int, Sequence[_Proto]]  # one signature's planned copies with a peer
    _Slice = slice[int | None, int | None, int | None]

__all__ = ["ALIGN", "ALONE", "PEERS", "CompactRounds", "LazyItems", "Message", "message_cap", "pair_rounds",
           "peer_group", "peer_groups", "slabs", "split_item"]

ALIGN = 64
"""Byte alignment of each message in staging, and the granularity of ``message_cap``."""

ALONE = 1 << 20
"""Default ``alone`` of :func:`pair_rounds`, the floor on a message's size: a smaller piece is packed
with its pair's other small pieces (up to ``cap``), so a pair moving >= 1 MiB sends messages of
>= 1 MiB but maybe its last; a piece this large goes alone (from / into its tensor where it is one run)."""

PEERS = 16
"""The most peers one round of a rank exchanges messages with (:func:`peer_groups`): bounds a round's
grouped ops and staging share per peer (``message_cap``) whatever the number of ranks."""


@dataclass(frozen=True)
class Message:
    src: int  # trainer rank that sends it
    dst: int  # worker rank that receives it
    index: int  # k: the k-th message of this pair, sent in round k
    items: tuple[TransferItem, ...]  # in plan order
    offsets: tuple[int, ...]  # byte offset of each item in the message
    nbytes: int  # message size in bytes


def _shift(item: TransferItem, dim: int, start: int, size: int) -> TransferItem:
    off, sizes = list(item.region.offsets), list(item.region.sizes)
    off[dim] += start
    sizes[dim] = size
    src, par = list(item.src_offsets), list(item.param_offsets)
    src[dim] += start
    par[dim] += start
    return replace(item, region=Region(tuple(off), tuple(sizes)), src_offsets=tuple(src), param_offsets=tuple(par))


def split_item(item: TransferItem, itemsize: int, cap: int) -> list[TransferItem]:
    """``item`` as consecutive pieces of at most ``cap`` bytes, split along the leading dims."""
    nbytes = item.region.numel * itemsize
    if nbytes <= cap:
        return [item]
    sizes = item.region.sizes
    for dim, n in enumerate(sizes):
        inner = itemsize
        for s in sizes[dim + 1 :]:
            inner *= s
        if n > 1 and inner <= cap:
            step = cap // inner
            return [_shift(item, dim, start, min(step, n - start)) for start in range(0, n, step)]
        if n > 1:  # even one slice along this dim is too big: split each slice further
            out: list[TransferItem] = []
            for start in range(n):
                out += split_item(_shift(item, dim, start, 1), itemsize, cap)
            return out
    raise ValueError(f"item of tensor {item.name!r} ({nbytes} bytes) cannot be split below cap={cap} bytes")


def slabs(item: TransferItem, itemsize: int, alone: int) -> list[TransferItem]:
    """``item`` as 2-D slabs (one index along every dim but the last two) when it has more than 2 dims
    and one slab is at least ``alone`` bytes, else ``[item]``. A slab whose last dim is whole in a
    tensor is one run of it (e.g. one expert's rows of a fused 3-D expert tensor), so it can go
    from / into that tensor with no staging copy; several experts' rows together would not."""
    sizes = item.region.sizes
    if len(sizes) <= 2 or all(n == 1 for n in sizes[:-2]):
        return [item]
    if sizes[-2] * sizes[-1] * itemsize < alone:
        return [item]
    out = [item]
    for dim in range(len(sizes) - 2):
        out = [_shift(it, dim, i, 1) for it in out for i in range(sizes[dim])]
    return out






def message_cap(staging_bytes: int, num_src: int, num_dst: int, *, buffers: int = 1, peers: int = PEERS) -> int:
    """Largest message such that a rank's round (one message per peer of its group, at most
    ``peers``: :func:`peer_groups`) fits ``staging_bytes`` split into ``buffers`` equal parts (2: one
    round on the wire while the next is packed or applied)."""
    peers = min(max(num_src, num_dst, 1), max(peers, 1))
    cap = staging_bytes // buffers // peers // ALIGN * ALIGN
    if cap < ALIGN:
        halves = "" if buffers == 1 else f" in {buffers} buffers"
        raise ValueError(f"staging_bytes={staging_bytes} is too small for {peers} peers{halves} "
                         f"(needs at least {ALIGN * peers * buffers})")
    return cap


def peer_groups(num_src: int, num_dst: int, peers: int = PEERS) -> int:
    """Number of peer groups such that no rank has more than ``peers`` peers in one group: pair
    (trainer r, worker w) is in group ``(r // b + w) % groups`` with ``b = ceil(num_src / groups)``
    (:func:`peer_group`), so each group holds ``ceil(num_dst / groups)`` workers of a trainer (every
    ``groups``-th: an engine replica's TP rank r // b of each replica) and one block of ``b``
    consecutive trainers of a worker (adjacent FSDP shards: their pieces land side by side)."""
    if peers < 1:
        raise ValueError(f"peers must be >= 1, got {peers}")
    return max(1, -(-max(num_src, num_dst) // peers))


@overload
def peer_group(src: int, dst: int, groups: int, num_src: int) -> int: ...
@overload
def peer_group(src: _Ints, dst: int, groups: int, num_src: int) -> _Ints: ...
@overload
def peer_group(src: int, dst: _Ints, groups: int, num_src: int) -> _Ints: ...
def peer_group(src: int | _Ints, dst: int | _Ints, groups: int, num_src: int) -> int | _Ints:
    """The group of pair (trainer ``src``, worker ``dst``) of ``num_src`` trainers: equal on both ends
    (either rank may be a numpy array of ranks)."""
    return (src // -(-num_src // groups) + dst) % groups






Piece = tuple[Region, tuple[int, ...], int, tuple[int, ...]]  # (region, src_offsets, piece index, param_offsets)


class ItemProbe(Protocol):
    """What ``apart`` reads of an item: its param and its worker (a :class:`TransferItem` has both;
    the cut passes a probe, not the item)."""

    @property
    def param(self) -> str: ...

    @property
    def dst_rank(self) -> int: ...


class _Pieces:
    """The interned pieces of one cut and what each planned copy (a proto) is cut into."""

    def __init__(self, cap: int, alone: int) -> None:
        self.cap, self.alone = cap, alone
        self.rows: list[Piece] = []
        self._of: dict[tuple[int, int], tuple[list[int], list[int]]] = {}  # (id(proto), itemsize) -> ids, bytes

    def of(self, proto: _Proto, itemsize: int) -> tuple[list[int], list[int]]:
        """Piece ids and bytes ``proto`` is cut into (the PairItems keep every proto alive)."""
        key = (id(proto), itemsize)
        got = self._of.get(key)
        if got is None:
            _, region, src_offsets, piece, param_offsets = proto
            nbytes = region.numel * itemsize
            if nbytes < self.alone and nbytes <= self.cap:
                parts = [(region, src_offsets, piece, param_offsets)]
            else:
                item = new_item(0, 0, "", region, src_offsets, "", param_offsets)
                parts = [(p.region, p.src_offsets, piece, p.param_offsets)
                         for slab in slabs(item, itemsize, self.alone) for p in split_item(slab, itemsize, self.cap)]
            ids = list(range(len(self.rows), len(self.rows) + len(parts)))
            self.rows += parts
            got = self._of[key] = (ids, [p[0].numel * itemsize for p in parts])
        return got


class _Probe:
    """What ``apart`` reads of an item (its param and worker), without making the item."""

    __slots__ = ("param", "dst_rank")

    def __init__(self, param: str, dst_rank: int) -> None:
        self.param, self.dst_rank = param, dst_rank


def _columns(runs: Sequence[_Run], members: Sequence[Sequence[int]], sizes: Sequence[int],
             pieces: _Pieces) -> tuple[_I32, _I32, _I64, _I64]:
    """One pair's pieces in pair order as columns: tensor, piece id (int32), bytes, itemsize (int64)."""
    cols: list[list[_Ints]] = [[], [], [], []]
    for sig, protos in runs:
        size, ts = sizes[sig], np.asarray(members[sig], dtype=np.int32)
        ids: list[int] = []
        nbs: list[int] = []
        for p in protos:
            i, b = pieces.of(p, size)
            ids += i
            nbs += b
        cols[0].append(np.repeat(ts, len(ids)))
        cols[1].append(np.tile(np.asarray(ids, dtype=np.int32), len(ts)))
        cols[2].append(np.tile(np.asarray(nbs, dtype=np.int64), len(ts)))
        cols[3].append(np.full(len(ids) * len(ts), size, dtype=np.int64))
    return cast("tuple[_I32, _I32, _I64, _I64]", tuple(np.concatenate(c) for c in cols))


def _pack(nb: _I64, isz: _I64, cap: int) -> tuple[list[int], _I64, list[int]]:
    """Pack pieces (their bytes ``nb`` and itemsizes ``isz``, in order) as the item-by-item cut does:
    each at the next offset aligned to its itemsize, a new message when it would end past ``cap``.
    Returns each message's piece count, each piece's offset in its message and each message's bytes."""
    n = len(nb)
    cum = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(nb, out=cum[1:])
    offs = np.empty(n, dtype=np.int64)
    starts: list[int] = []
    used_of: list[int] = []
    cur = used = 0
    bounds = [0, *(np.flatnonzero(isz[1:] != isz[:-1]) + 1).tolist(), n] if n else []
    for a, b in pairwise(bounds):  # runs of one itemsize: within one, pieces lie back to back
        size, k = int(isz[a]), a
        while k < b:
            start = align_up(used, size)
            if k > cur and start + int(nb[k]) > cap:
                starts.append(cur)
                used_of.append(used)
                cur, start = k, 0
            base = int(cum[k])
            j = int(np.searchsorted(cum, base + cap - start, side="right")) - 1  # last end that fits
            j = min(max(j, k + 1), b)
            offs[k:j] = cum[k:j] - (base - start)
            used, k = start + int(cum[j]) - base, j
            if k < b:  # piece k does not fit: the message ends before it
                starts.append(cur)
                used_of.append(used)
                cur, used = k, 0
    if cur < n:
        starts.append(cur)
        used_of.append(used)
    counts = np.diff(np.asarray([*starts, n], dtype=np.int64)).tolist()
    return counts, offs, used_of


def _cut_pair(nb: _I64, isz: _I64, apart: npt.NDArray[np.bool_] | None, cap: int,
              alone: int) -> tuple[_I64, ...]:
    """One pair's messages: (order of its pieces in message order, count per message, offset per
    piece, bytes per message); the pieces ``apart`` marks are cut after the others, apart from them."""
    parts = [np.arange(len(nb))] if apart is None else [np.flatnonzero(~apart), np.flatnonzero(apart)]
    order, counts, offs, sizes = [], [], [], []
    for idx in parts:
        big = nb[idx] >= alone
        alone_idx, small = idx[big], idx[~big]
        order += [alone_idx, small]
        counts.append(np.ones(len(alone_idx), dtype=np.int64))
        offs.append(np.zeros(len(alone_idx), dtype=np.int64))
        sizes.append(nb[alone_idx])
        c, o, s = _pack(nb[small], isz[small], cap)
        counts.append(np.asarray(c, dtype=np.int64))
        offs.append(o)
        sizes.append(np.asarray(s, dtype=np.int64))
    return tuple(np.concatenate(x) for x in (order, counts, offs, sizes))


def _apart_mask(runs: Sequence[_Run], members: Sequence[Sequence[int]], params: Sequence[Sequence[str]],
                pieces: _Pieces, tensor: _Ints, pid: _Ints, dst: int,
                apart: Callable[[ItemProbe], bool]) -> npt.NDArray[np.bool_]:
    """``apart`` of each piece of one pair (asked once per (tensor, piece index))."""
    seen: dict[tuple[int, int], bool]
    rows, seen, out = pieces.rows, {}, np.empty(len(tensor), dtype=bool)
    for i, (t, p) in enumerate(zip(tensor.tolist(), pid.tolist())):
        key = (t, rows[p][2])
        got = seen.get(key)
        if got is None:
            got = seen[key] = bool(apart(_Probe(params[t][key[1]], dst)))
        out[i] = got
    return out


def cut_rounds(*, rank: int, sender: bool, num_src: int, num_dst: int, names: Sequence[str],
               params: Sequence[Sequence[str]], members: Sequence[Sequence[int]],
               runs: Mapping[int, Sequence[_Run]], sig_itemsize: Sequence[int], cap: int,
               alone: int, peers: int, apart: Callable[[ItemProbe], bool] | None = None) -> CompactRounds:
    """This rank's rounds as arrays (see the module docstring); ``runs``: per peer, ascending, its
    (signature, protos) in pair order (``PairItems``); the rest as :func:`pair_rounds`."""
    if cap < ALIGN:
        raise ValueError(f"cap must be >= {ALIGN} bytes, got {cap}")
    pieces = _Pieces(cap, alone)
    small = np.int32 if cap < 1 << 31 else np.int64
    cols: list[list[_Ints]] = [[] for _ in range(7)]  # tensor, pid, offset | peer, index, count, nbytes
    tensor: _Ints  # per pair in the loop, then of all pairs (as pid, offs)
    pid: _Ints
    offs: _Ints
    peer: int | _Ints  # a rank in the loop, then the column of each message's peer
    for peer, prs in runs.items():
        tensor, pid, nb, isz = _columns(prs, members, sig_itemsize, pieces)
        mask = None
        if apart is not None:
            mask = _apart_mask(prs, members, params, pieces, tensor, pid, peer if sender else rank, apart)
        order, counts, offs, sizes = _cut_pair(nb, isz, mask, cap, alone)
        for c, v in zip(cols, (tensor[order], pid[order], offs.astype(small),
                               np.full(len(counts), peer, dtype=np.int32), np.arange(len(counts), dtype=np.int32),
                               counts, sizes)):
            c.append(v)  # type: ignore[arg-type]  # numpy's stubs: offs.astype(int32 or int64) is of "generic"
        del tensor, pid, nb, isz, order, offs
    tensor, pid, offs, peer, index, count, nbytes = (
        np.concatenate(c) if c else np.zeros(0, dtype=np.int64) for c in cols)
    del cols
    first = np.zeros(len(count), dtype=np.int64)  # each message's first item (items stay in pair order)
    np.cumsum(count[:-1], out=first[1:])
    groups = peer_groups(num_src, num_dst, peers)
    peers64 = peer.astype(np.int64)
    group = peer_group(rank, peers64, groups, num_src) if sender else peer_group(peers64, rank, groups, num_src)
    perm = np.lexsort((peer, index, group))  # round (group, k): the k-th message of its peers, ascending
    key = (group * (int(index.max(initial=0)) + 1) + index)[perm]
    bounds = np.flatnonzero(key[1:] != key[:-1]) + 1
    round_first = np.concatenate(([0], bounds, [len(perm)])).astype(np.int64) if len(perm) else np.zeros(1, np.int64)
    return CompactRounds(rank, sender, names, params, pieces.rows, tensor.astype(np.int32), pid.astype(np.int32), offs,
                         peer[perm], index[perm], nbytes[perm], first[perm], count[perm], round_first)


class LazyItems(Sequence[TransferItem]):
    """A message's items (:class:`TransferItem`), made from the arrays when first read."""

    __slots__ = ("_r", "_lo", "_hi", "_peer", "_made", "_keys")
    _made: tuple[TransferItem, ...] | None
    _keys: list[int] | None

    def __init__(self, rounds: CompactRounds, lo: int, hi: int, peer: int) -> None:
        self._r, self._lo, self._hi, self._peer, self._made, self._keys = rounds, lo, hi, peer, None, None

    def __len__(self) -> int:
        return self._hi - self._lo

    def _items(self) -> tuple[TransferItem, ...]:
        if self._made is None:
            self._made = self._r.items_of(self._lo, self._hi, self._peer)
        return self._made

    @overload
    def __getitem__(self, i: int) -> TransferItem: ...
    @overload
    def __getitem__(self, i: _Slice) -> tuple[TransferItem, ...]: ...
    def __getitem__(self, i: int | _Slice) -> TransferItem | tuple[TransferItem, ...]:
        if self._made is None and isinstance(i, int) and 0 <= i < self._hi - self._lo:  # just this one
            return self._r.items_of(self._lo + i, self._lo + i + 1, self._peer)[0]
        return self._items()[i]

    def __iter__(self) -> Iterator[TransferItem]:
        return iter(self._items())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(self._items())

    def tensors(self) -> list[int]:
        """Each item's tensor (its index in the plan's sources), with no item made."""
        return cast("list[int]", self._r.tensor[self._lo : self._hi].tolist())

    def keys(self) -> list[int]:
        """Per item one int; two items with one key have one tensor name and one param name (what
        picks an item's tensor on either end). No item is made."""
        if self._keys is None:
            self._keys = self._r.keys(self._lo, self._hi)
        return self._keys

    def __repr__(self) -> str:
        return repr(self._items())


class CompactRounds:
    """A rank's rounds as arrays (build with :func:`cut_rounds`): iterable any number of times,
    each round a list of :class:`Message` made as it is reached; ``len`` is the number of rounds."""

    def __init__(self, rank: int, sender: bool, names: Sequence[str], params: Sequence[Sequence[str]],
                 pieces: list[Piece], tensor: _I32, pid: _I32, offset: _Ints, peer: _Ints,
                 index: _Ints, nbytes: _Ints, first: _I64, count: _Ints,
                 round_first: _I64) -> None:
        self.rank, self.sender, self.names, self.params, self.pieces = rank, sender, names, params, pieces
        self.tensor, self.pid, self.offset = tensor, pid, offset  # per item: pairs ascending, each in message order
        self.peer, self.index, self.nbytes = peer, index, nbytes  # per message, in round order
        self.first, self.count = first, count  # per message: its items are [first, first + count)
        self.round_first = round_first  # per round: its first message (and the end)
        self._piece_of: _I64 | None = None  # per piece id: its piece index (for keys)
        self._piece_list: list[int] = []
        self._alone: dict[int, Message] = {}  # one-item messages, made on the first pass and kept
        self._per = 1

    def __len__(self) -> int:
        return len(self.round_first) - 1

    @property
    def num_items(self) -> int:
        return len(self.tensor)

    @property
    def num_messages(self) -> int:
        return len(self.peer)

    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    def kept_bytes(self) -> int:
        """About the host bytes this keeps: its arrays, ~200 bytes per interned piece and ~500 per
        one-item message (kept whole once made)."""
        arrays = (self.tensor, self.pid, self.offset, self.peer, self.index, self.nbytes, self.first, self.count,
                  self.round_first)
        return sum(a.nbytes for a in arrays) + 200 * len(self.pieces) + 500 * len(self._alone)

    def __iter__(self) -> Iterator[list[Message]]:
        rf = self.round_first.tolist()
        peer, index, nbytes, first, count = (a.tolist() for a in (self.peer, self.index, self.nbytes, self.first,
                                                                  self.count))
        rank, offset, new = self.rank, self.offset, object.__new__
        alone = self._alone
        for lo, hi in pairwise(rf):
            rnd = []
            for j in range(lo, hi):
                if (m := alone.get(j)) is not None:
                    rnd.append(m)
                    continue
                src, dst = (rank, peer[j]) if self.sender else (peer[j], rank)
                a, b = first[j], first[j] + count[j]
                offs = (0,) if b - a == 1 else tuple(offset[a:b].tolist())  # a first item is at 0
                m = new(Message)  # Message(...) without its frozen __init__'s per-field setattr: 3x faster
                m.__dict__.update(src=src, dst=dst, index=index[j], items=LazyItems(self, a, b, peer[j]),
                                  offsets=offs, nbytes=nbytes[j])
                rnd.append(m)
                if b - a == 1:  # a one-item message is kept whole (one per large piece: few)
                    alone[j] = m
            yield rnd

    def keys(self, lo: int, hi: int) -> list[int]:
        """See :meth:`LazyItems.keys`: tensor x (pieces per tensor) + piece index."""
        if self._piece_of is None:
            self._piece_list = [row[2] for row in self.pieces]
            self._piece_of = np.asarray(self._piece_list, dtype=np.int64)
            self._per = int(self._piece_of.max(initial=0)) + 1
        if hi - lo <= 4:  # a few items: plain ints beat numpy's per-call cost
            t, p, per, pl = self.tensor, self.pid, self._per, self._piece_list
            return [int(t[i]) * per + pl[p[i]] for i in range(lo, hi)]
        return cast("list[int]",
                    (self.tensor[lo:hi].astype(np.int64) * self._per + self._piece_of[self.pid[lo:hi]]).tolist())

    def key_names(self, key: int) -> tuple[str, str]:
        """The tensor name and param of a :meth:`keys` key."""
        t, piece = divmod(key, self._per)
        return self.names[t], self.params[t][piece]

    def items_of(self, lo: int, hi: int, peer: int) -> tuple[TransferItem, ...]:
        """Items ``lo`` to ``hi`` (in message order), exchanged with ``peer``."""
        src, dst = (self.rank, peer) if self.sender else (peer, self.rank)
        names, params, rows = self.names, self.params, self.pieces
        return tuple(new_item(src, dst, names[t], rows[p][0], rows[p][1], params[t][rows[p][2]], rows[p][3])
                     for t, p in zip(self.tensor[lo:hi].tolist(), self.pid[lo:hi].tolist()))


def pair_rounds(pairs: PairItems, *, cap: int, itemsize_of: Callable[[str], int],
                apart: Callable[[ItemProbe], bool] | None = None, alone: int = ALONE,
                peers: int = PEERS) -> CompactRounds:
    """The rounds of ``pairs``' rank (see the module docstring): ``itemsize_of`` maps a tensor name
    to bytes per element; with ``apart``, the small pieces it marks are packed after the others,
    never in one message with them (e.g. those that must go dense in a delta sync); at most
    ``peers`` peers a round (the peers' groups one after another: :func:`peer_groups`)."""
    c, members = pairs.compact, pairs.members
    sizes = [itemsize_of(c.names[m[0]]) if m else 1 for m in members]
    return cut_rounds(rank=pairs.rank, sender=pairs.sender, num_src=c.num_src, num_dst=c.num_dst, names=c.names,
                      params=c.params, members=members, runs=pairs.runs, sig_itemsize=sizes, cap=cap,
                      alone=alone, peers=peers, apart=apart)
