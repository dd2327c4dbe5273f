"""The item-by-item plan and schedule: the oracle the compact ones are checked against.

Production never lists a plan item by item (at model scale that is hundreds of millions of objects):
it cuts a rank's rounds once into arrays (:func:`weightsync.plan.schedule.pair_rounds`). Here is the
plain form of the same thing, written for clarity, not speed: every item of a plan in the global
order (:func:`iter_items`, :func:`items_for_src`, :func:`items_for_dst`), each pair's messages
(:func:`peer_messages`, :func:`pair_messages`) and a rank's rounds (:func:`iter_rounds`,
:func:`item_rounds`). The compact cut must equal these message for message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from functools import partial

from weightsync.plan.schedule import ALIGN, ALONE, PEERS, Message, peer_group, peer_groups, slabs, split_item
from weightsync.plan.transfer import PairItems, TransferItem, TransferPlan, align_up, new_item


def _listed(plan: TransferPlan, rank: int, *, sender: bool) -> list[TransferItem]:
    n = plan.num_src_ranks if sender else plan.num_dst_ranks
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < n:
        raise ValueError(f"rank must be an int in [0, {n}), got {rank!r}")
    c = plan.compact
    out = []
    for name, sig, params in zip(c.names, c.tensor_sig, c.params):
        tpl = c.templates[sig]
        for peer, region, src_offsets, piece, param_offsets in (
                tpl.protos_for_src(rank, c.worker_class) if sender else tpl.protos_for_dst(rank, c.worker_class)):
            src, dst = (rank, peer) if sender else (peer, rank)
            out.append(new_item(src, dst, name, region, src_offsets, params[piece], param_offsets))
    return out


def items_for_src(plan: TransferPlan, rank: int) -> list[TransferItem]:
    """Everything trainer ``rank`` sends, in the global order."""
    return _listed(plan, rank, sender=True)


def items_for_dst(plan: TransferPlan, rank: int) -> list[TransferItem]:
    """Everything worker ``rank`` receives, in the global order."""
    return _listed(plan, rank, sender=False)


def iter_items(plan: TransferPlan) -> Iterator[TransferItem]:
    """Every item of ``plan``, in the global order (tensors, then workers, then each worker's pieces)."""
    c = plan.compact
    for name, sig, params in zip(c.names, c.tensor_sig, c.params):
        for w in range(c.num_dst):
            for src, region, src_offsets, piece, param_offsets in c.templates[sig].protos_for_dst(w, c.worker_class):
                yield new_item(src, w, name, region, src_offsets, params[piece], param_offsets)


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
        count = 0  # the messages before the ``apart`` ones
        for m in first:
            yield m
            count += 1
        for m in peer_messages(lambda: (it for it in items() if apart(it)), cap=cap, itemsize_of=itemsize_of,
                               alone=alone):
            yield replace(m, index=count + m.index)
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


def item_rounds(pairs: PairItems, *, cap: int, itemsize_of: Callable[[str], int],
                apart: Callable[[TransferItem], bool] | None = None,
                alone: int = ALONE, peers: int = PEERS) -> Iterator[list[Message]]:
    """``pairs``' rank's rounds, item by item: what :func:`weightsync.plan.schedule.pair_rounds` cuts."""
    groups = peer_groups(pairs.compact.num_src, pairs.compact.num_dst, peers)
    n = pairs.compact.num_src
    group = None if groups == 1 else (lambda p: peer_group(*((pairs.rank, p) if pairs.sender else (p, pairs.rank)),
                                                            groups, n))
    return iter_rounds({p: peer_messages(partial(pairs.items, p), cap=cap, itemsize_of=itemsize_of, apart=apart,
                                         alone=alone) for p in pairs.peers}, group)
