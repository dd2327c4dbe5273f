"""Messages and rounds for executing a TransferPlan point-to-point with bounded staging memory.

Both ends of a (trainer, worker) pair cut the pair's items (in the one order both see) into the same
messages of at most ``cap`` bytes, splitting an item along its leading dims when it alone is larger.
A piece of at least ``alone`` bytes is a message by itself (each end can then send it from, or
receive it into, its own tensor with no staging copy); the smaller pieces follow, packed together.
Round k carries the k-th message of every pair: each rank posts its round-k sends and receives
together, and posts and waits for its rounds in order (the executor keeps a few posted at once).
Every op of round k is matched in round k, so rounds cannot deadlock, and one round of a rank
stages at most ``peers x cap`` bytes. Above :data:`PEERS` peers a rank's peers are split into
groups (:func:`peer_group`: the same group for a pair on both ends) and the rounds go group by
group, so a round has at most ``PEERS`` peers and ``cap`` need not shrink with the peer count.

Pure: plain data in, frozen dataclasses out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace

from weightsync.layout.records import TransferItem, align_up
from weightsync.layout.regions import Region

__all__ = ["ALIGN", "ALONE", "PEERS", "Message", "slabs", "split_item", "peer_messages", "pair_messages", "message_cap",
           "peer_groups", "peer_group", "iter_rounds", "rounds"]

ALIGN = 64
"""Byte alignment of each message in staging, and the granularity of ``message_cap``."""

ALONE = 1 << 20
"""Default ``alone`` of :func:`pair_messages`, the floor on a message's size: a smaller piece is packed
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


def peer_messages(items: Callable[[], Iterable[TransferItem]], *, cap: int, itemsize_of: Callable[[str], int],
                  alone: int = ALONE, apart: Callable[[TransferItem], bool] | None = None) -> Iterator[Message]:
    """One pair's messages, made as they are consumed. ``items()`` gives the pair's items in order
    (it is called again for each pass: the pieces of at least ``alone`` bytes, each a message of its
    own, then the smaller pieces, packed in order into messages of at most ``cap`` bytes). With
    ``apart``, the small pieces it marks are packed after the others, never in one message with them
    (e.g. those that must go dense in a delta sync: one would make its whole message dense)."""
    if cap < ALIGN:
        raise ValueError(f"cap must be >= {ALIGN} bytes, got {cap}")
    if apart is not None:
        first = peer_messages(lambda: (it for it in items() if not apart(it)), cap=cap, itemsize_of=itemsize_of,
                              alone=alone)
        index = -1
        for index, m in enumerate(first):
            yield m
        for m in peer_messages(lambda: (it for it in items() if apart(it)), cap=cap, itemsize_of=itemsize_of,
                               alone=alone):
            yield replace(m, index=index + 1 + m.index)
        return

    def pieces() -> Iterator[tuple[TransferItem, int, int]]:  # (piece, itemsize, bytes), in order
        for item in items():
            size = itemsize_of(item.name)
            for slab in slabs(item, size, alone):
                for piece in split_item(slab, size, cap):
                    yield piece, size, piece.region.numel * size

    index = 0
    for piece, _, nbytes in pieces():
        if nbytes >= alone:
            yield Message(piece.src_rank, piece.dst_rank, index, (piece,), (0,), nbytes)
            index += 1
    cur: list[TransferItem] = []
    offs: list[int] = []
    used = 0
    for piece, size, nbytes in pieces():
        if nbytes >= alone:
            continue
        start = align_up(used, size)  # element-aligned: viewable in place, no padding within one dtype
        if cur and start + nbytes > cap:
            yield Message(cur[0].src_rank, cur[0].dst_rank, index, tuple(cur), tuple(offs), used)
            index += 1
            cur, offs, start = [], [], 0
        cur.append(piece)
        offs.append(start)
        used = start + nbytes
    if cur:
        yield Message(cur[0].src_rank, cur[0].dst_rank, index, tuple(cur), tuple(offs), used)


def pair_messages(items: Iterable[TransferItem], *, by: str, cap: int, itemsize_of: Callable[[str], int],
                  alone: int = ALONE) -> dict[int, list[Message]]:
    """One rank's messages, per peer (:func:`peer_messages` of each peer's items). ``items`` is the
    rank's plan view in order (``items_for_src`` with ``by="dst"``, ``items_for_dst`` with ``by="src"``)."""
    if by not in ("src", "dst"):
        raise ValueError(f"by must be 'src' or 'dst', got {by!r}")
    if cap < ALIGN:
        raise ValueError(f"cap must be >= {ALIGN} bytes, got {cap}")
    per_peer: dict[int, list[TransferItem]] = {}
    for item in items:
        per_peer.setdefault(getattr(item, f"{by}_rank"), []).append(item)
    return {peer: list(peer_messages(lambda lst=lst: lst, cap=cap, itemsize_of=itemsize_of, alone=alone))
            for peer, lst in per_peer.items()}


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


def peer_group(src: int, dst: int, groups: int, num_src: int) -> int:
    """The group of pair (trainer ``src``, worker ``dst``) of ``num_src`` trainers: equal on both ends
    (either rank may be a numpy array of ranks)."""
    return (src // -(-num_src // groups) + dst) % groups


def iter_rounds(messages: Mapping[int, Iterable[Message]],
                group: Callable[[int], int] | None = None) -> Iterator[list[Message]]:
    """Round k = the k-th message of every peer (peers in ascending order), made as consumed. With
    ``group`` (peer -> its :func:`peer_group`), the rounds go group by group (groups ascending): all
    the rounds of the peers in the lowest group, then the next; a round holds one group's peers only.
    Both ends of a pair put its k-th message in the round (group, k): the rounds of every rank follow
    one order, so a rank never waits for a round its peer posts after one it waits for itself."""
    peers = sorted(messages)
    if group is None:
        parts = [peers]
    else:
        by: dict[int, list[int]] = {}
        for p in peers:
            by.setdefault(group(p), []).append(p)
        parts = [by[g] for g in sorted(by)]
    for part in parts:
        its = [iter(messages[p]) for p in part]
        while its:
            rnd, live = [], []
            for it in its:
                m = next(it, None)
                if m is not None:
                    rnd.append(m)
                    live.append(it)
            its = live
            if rnd:
                yield rnd


def rounds(messages: Mapping[int, Iterable[Message]]) -> list[list[Message]]:
    """``iter_rounds`` as a list."""
    return list(iter_rounds(messages))
