"""The M2N round schedule: hand-worked cuts and rounds, then randomized plans checked for the
properties the executor relies on (equal cuts on both ends, exact cover, cap, deadlock-free rounds,
determinism)."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from oracle import item_rounds, items_for_dst, items_for_src, pair_messages, peer_messages, rounds
from weightsync.plan import (
    DestPiece,
    Region,
    Replicate,
    Shard,
    TensorSource,
    TransferItem,
    align_up,
    build_plan,
    dtype_itemsize,
    mesh_coordinates,
    source_regions,
)
from weightsync.plan.schedule import ALIGN, ALONE, Message, message_cap, peer_group, peer_groups, slabs, split_item


def _it(name, offsets, sizes, src_offsets=None, param_offsets=None, src=0, dst=0, param="p"):
    zeros = (0,) * len(offsets)
    return TransferItem(src, dst, name, Region(offsets, sizes), src_offsets or zeros, param, param_offsets or zeros)


# --- hand-worked -----------------------------------------------------------------------------------


def test_split_item_that_fits_is_itself():
    item = _it("t", (0, 0), (2, 3))
    assert split_item(item, 4, 24) == [item]


def test_split_item_takes_whole_rows_when_a_row_fits():
    # 4 x 6 float32 rows of 24 bytes, cap 48: two rows per piece; all three offsets move along.
    item = _it("t", (2, 0), (4, 6), src_offsets=(1, 0), param_offsets=(10, 3))
    assert split_item(item, 4, 48) == [
        _it("t", (2, 0), (2, 6), src_offsets=(1, 0), param_offsets=(10, 3)),
        _it("t", (4, 0), (2, 6), src_offsets=(3, 0), param_offsets=(12, 3)),
    ]


def test_split_item_splits_each_row_when_one_row_is_too_big():
    # 2 x 10 float32: a row is 40 bytes > cap 16, so each row goes in pieces of 4, 4 and 2 columns.
    item = _it("t", (0, 5), (2, 10), param_offsets=(0, 1))
    got = [(p.region.offsets, p.region.sizes, p.src_offsets, p.param_offsets) for p in split_item(item, 4, 16)]
    assert got == [
        ((0, 5), (1, 4), (0, 0), (0, 1)), ((0, 9), (1, 4), (0, 4), (0, 5)), ((0, 13), (1, 2), (0, 8), (0, 9)),
        ((1, 5), (1, 4), (1, 0), (1, 1)), ((1, 9), (1, 4), (1, 4), (1, 5)), ((1, 13), (1, 2), (1, 8), (1, 9)),
    ]


def test_split_item_below_one_element_is_an_error():
    with pytest.raises(ValueError, match=r"item of tensor 't' \(128 bytes\) cannot be split below cap=64 bytes"):
        split_item(_it("t", (0,), (1,)), 128, 64)


def test_pair_messages_packs_element_aligned_items_up_to_the_cap():
    # a: 10 float32 = 40 B at 0; b: 3 bfloat16 = 6 B at 40; c: 20 float32 at 48 (4-aligned) ends at 128 = cap;
    # d: 1 float32 would start at 128 -> next message. Items of one dtype are never padded.
    items = [_it("a", (0,), (10,), dst=1), _it("b", (0,), (3,), dst=1), _it("c", (0,), (20,), dst=1),
             _it("d", (0,), (1,), dst=1), _it("a", (0,), (2,), dst=2)]
    size = {"a": 4, "b": 2, "c": 4, "d": 4}
    got = pair_messages(items, by="dst", cap=128, itemsize_of=size.__getitem__)
    assert got == {
        1: [Message(0, 1, 0, tuple(items[:3]), (0, 40, 48), 128), Message(0, 1, 1, (items[3],), (0,), 4)],
        2: [Message(0, 2, 0, (items[4],), (0,), 8)],
    }
    assert rounds(got) == [[got[1][0], got[2][0]], [got[1][1]]]


def test_pieces_of_at_least_alone_bytes_go_first_each_alone_then_the_small_ones_packed():
    # alone=40: a (40 B) and c's first piece (c is 80 B, split by cap=64 into 64 + 16 B) are messages of
    # their own, in order; b (6 B), c's 16 B rest and d (4 B) follow, packed (4-aligned: 0, 8, 24).
    items = [_it("a", (0,), (10,)), _it("b", (0,), (3,)), _it("c", (0,), (20,)), _it("d", (0,), (1,))]
    size = {"a": 4, "b": 2, "c": 4, "d": 4}
    got = pair_messages(items, by="dst", cap=64, itemsize_of=size.__getitem__, alone=40)[0]
    c0, c1 = split_item(items[2], 4, 64)
    assert got == [Message(0, 0, 0, (items[0],), (0,), 40), Message(0, 0, 1, (c0,), (0,), 64),
                   Message(0, 0, 2, (items[1], c1, items[3]), (0, 8, 24), 28)]
    assert pair_messages(items, by="dst", cap=64, itemsize_of=size.__getitem__)[0][0].items == (items[0], items[1])


def test_pieces_marked_apart_are_packed_after_the_others_never_with_them():
    """Small pieces into params that always go dense in a delta sync (``apart``) would make any
    message they share dense: they are cut after the others (alone-sized ones too), indexes running on."""
    items = [_it("a", (0,), (2,), param="live"), _it("b", (0,), (2,), param="kept"), _it("c", (0,), (2,), param="live"),
             _it("d", (0,), (10,), param="kept"), _it("e", (0,), (2,), param="kept")]
    size = dict.fromkeys("abcde", 4)
    got = list(peer_messages(lambda: items, cap=64, itemsize_of=size.__getitem__, alone=40,
                             apart=lambda it: it.param == "kept"))
    assert got == [Message(0, 0, 0, (items[0], items[2]), (0, 8), 16), Message(0, 0, 1, (items[3],), (0,), 40),
                   Message(0, 0, 2, (items[1], items[4]), (0, 8), 16)]
    together = list(peer_messages(lambda: items, cap=64, itemsize_of=size.__getitem__, alone=40))
    assert [m.items for m in together] == [(items[3],), (items[0], items[1], items[2], items[4])]


def test_pair_messages_validates_by_and_cap():
    with pytest.raises(ValueError, match="by must be 'src' or 'dst', got 'peer'"):
        pair_messages([], by="peer", cap=128, itemsize_of=len)
    with pytest.raises(ValueError, match=f"cap must be >= {ALIGN} bytes, got 32"):
        pair_messages([], by="src", cap=32, itemsize_of=len)


def test_message_cap_is_the_aligned_share_of_staging_per_peer():
    assert message_cap(1000, 3, 5) == 192  # 1000 // 5 = 200 -> 192
    assert message_cap(1 << 20, 1, 1) == 1 << 20
    with pytest.raises(ValueError, match=r"staging_bytes=100 is too small for 2 peers \(needs at least 128\)"):
        message_cap(100, 2, 1)


def test_rounds_take_the_kth_message_of_every_peer_in_peer_order():
    def msg(dst, k):
        return Message(0, dst, k, (), (), 0)

    assert rounds({3: [msg(3, 0)], 1: [msg(1, 0), msg(1, 1), msg(1, 2)]}) == [
        [msg(1, 0), msg(3, 0)], [msg(1, 1)], [msg(1, 2)]]
    assert rounds({}) == []


# --- randomized ------------------------------------------------------------------------------------

_DTYPES = ["float32", "bfloat16", "float64", "uint8"]


def _random_plan_inputs(seed):
    """Sources on a random trainer mesh; workers take TP-style row or column ranges, or everything."""
    rng = random.Random(seed)
    mesh = rng.choice([(1,), (2,), (3,), (4,), (2, 2), (3, 2)])
    workers = rng.randint(1, 5)
    sources, dests = [], [[] for _ in range(workers)]
    for i in range(rng.randint(1, 4)):
        shape = tuple(rng.randint(1, 13) for _ in range(rng.randint(1, 3)))
        placements = [rng.choice([Replicate()] + [Shard(d) for d in range(len(shape))]) for _ in mesh]
        name = f"t{i}"
        sources.append(TensorSource(name, shape, rng.choice(_DTYPES),
                                    source_regions(shape, mesh, placements, mesh_coordinates(mesh))))
        d = rng.randrange(len(shape))
        split = rng.random() < 0.7
        for w in range(workers):
            offsets, sizes = [0] * len(shape), list(shape)
            if split:
                per = -(-shape[d] // workers)
                offsets[d] = min(per * w, shape[d])
                sizes[d] = min(shape[d], offsets[d] + per) - offsets[d]
            dests[w].append(DestPiece(name, Region(tuple(offsets), tuple(sizes)), f"{name}_param", (0,) * len(shape)))
    return sources, dests, rng.choice([1, 2, 3, 8]) * ALIGN * max(mesh[0] * (mesh[1:] or (1,))[0], workers)


def _schedule(sources, dests, staging, alone):
    plan = build_plan(sources, dests)
    cap = message_cap(staging, plan.num_src_ranks, plan.num_dst_ranks)
    size = {s.name: dtype_itemsize(s.dtype) for s in sources}.__getitem__
    send = [pair_messages(items_for_src(plan, r), by="dst", cap=cap, itemsize_of=size, alone=alone)
            for r in range(plan.num_src_ranks)]
    recv = [pair_messages(items_for_dst(plan, w), by="src", cap=cap, itemsize_of=size, alone=alone)
            for w in range(plan.num_dst_ranks)]
    return plan, cap, size, send, recv


def _cells(region):
    return set(itertools.product(*(range(o, o + s) for o, s in zip(region.offsets, region.sizes))))


def _cell_map(item):
    """(name, param, src, dst, global cell) -> (source cell, param cell) for every element of ``item``."""
    out = {}
    for cell in _cells(item.region):
        shift = [c - o for c, o in zip(cell, item.region.offsets)]
        out[(item.name, item.param, item.src_rank, item.dst_rank, cell)] = (
            tuple(o + d for o, d in zip(item.src_offsets, shift)),
            tuple(o + d for o, d in zip(item.param_offsets, shift)))
    return out


@pytest.mark.parametrize("alone", [ALONE, 16, 1], ids=["alone-default", "alone-16", "alone-1"])
@pytest.mark.parametrize("seed", range(60))
def test_random_schedule(seed, alone):
    sources, dests, staging = _random_plan_inputs(seed)
    plan, cap, size, send, recv = _schedule(sources, dests, staging, alone)

    for r, w in itertools.product(range(plan.num_src_ranks), range(plan.num_dst_ranks)):
        # (a) both ends cut the pair's items into the same messages
        assert send[r].get(w, []) == recv[w].get(r, []), (r, w)
        msgs = send[r].get(w, [])
        # (b) every element of every item is in exactly one piece, at the same source and param place;
        # pieces of >= alone bytes each make a message alone, before the messages of smaller ones
        items = [it for it in items_for_src(plan, r) if it.dst_rank == w]
        want, got = {}, {}
        for item in items:
            want.update(_cell_map(item))
        for m in msgs:
            for piece in m.items:
                cells = _cell_map(piece)
                assert not cells.keys() & got.keys()
                got.update(cells)
        assert got == want
        big = [len(m.items) == 1 and m.nbytes >= alone for m in msgs]
        assert big == sorted(big, reverse=True)
        assert all(piece.region.numel * size(piece.name) < alone for m, b in zip(msgs, big) if not b
                   for piece in m.items)

    for side in (send, recv):
        for peers in side:
            for msgs in peers.values():
                for k, m in enumerate(msgs):
                    # (c) no message exceeds the cap; items element-aligned, packed without gaps
                    # between items of one dtype, in bounds and disjoint
                    assert m.index == k and 0 < m.nbytes <= cap
                    end = 0
                    for item, off in zip(m.items, m.offsets):
                        assert off % size(item.name) == 0 and off == align_up(end, size(item.name))
                        end = off + item.region.numel * size(item.name)
                    assert end == m.nbytes

    # (d) round k: one message per pair, every posted op matched in round k, a rank's round fits its staging
    send_rounds = [rounds(s) for s in send]
    recv_rounds = [rounds(r) for r in recv]
    for rank_rounds, by in ((send_rounds, "dst"), (recv_rounds, "src")):
        for rnds in rank_rounds:
            for k, msgs in enumerate(rnds):
                peers = [getattr(m, by) for m in msgs]
                assert len(set(peers)) == len(peers) and all(m.index == k for m in msgs)
                assert sum(align_up(m.nbytes, ALIGN) for m in msgs) <= staging
    for r, rnds in enumerate(send_rounds):
        for k, msgs in enumerate(rnds):
            for m in msgs:
                assert m in recv_rounds[m.dst][k], (r, k, m.dst)
    for w, rnds in enumerate(recv_rounds):
        for k, msgs in enumerate(rnds):
            for m in msgs:
                assert m in send_rounds[m.src][k], (w, k, m.src)

    # (e) deterministic: rebuilt from equal inputs, the same schedule
    again = _schedule(*_random_plan_inputs(seed), alone)
    assert (again[3], again[4]) == (send, recv)


def test_random_schedules_do_split_items():
    """The randomized cases exercise splitting (caps below item sizes), not only packing."""
    split = 0
    for seed in range(60):
        sources, dests, staging = _random_plan_inputs(seed)
        plan, cap, size, send, _ = _schedule(sources, dests, staging, ALONE)
        n_items = sum(len(items_for_src(plan, r)) for r in range(plan.num_src_ranks))
        n_pieces = sum(len(m.items) for s in send for msgs in s.values() for m in msgs)
        split += n_pieces > n_items
    assert split >= 10


@pytest.mark.parametrize("seed", range(40))
def test_pairs_give_each_pairs_items_once_in_the_same_order_on_both_ends(seed):
    sources, dests, _ = _random_plan_inputs(seed)
    plan = build_plan(sources, dests)
    size = {s.name: dtype_itemsize(s.dtype) for s in sources}
    senders = [plan.pairs(r, sender=True) for r in range(plan.num_src_ranks)]
    receivers = [plan.pairs(w, sender=False) for w in range(plan.num_dst_ranks)]
    for r, sp in enumerate(senders):
        listed = items_for_src(plan, r)
        assert sp.peers == tuple(sorted({it.dst_rank for it in listed}))
        assert sp.count() == len(listed) and sp.nbytes(dtype_itemsize) == sum(it.numel * size[it.name] for it in listed)
        for w in range(plan.num_dst_ranks):
            got = list(sp.items(w))
            assert got == list(receivers[w].items(r))  # one sequence on both ends
            assert Counter(got) == Counter(it for it in listed if it.dst_rank == w) and sp.count(w) == len(got)
    for w, rp in enumerate(receivers):
        assert rp.count() == len(items_for_dst(plan, w))
    with pytest.raises(ValueError, match="rank must be an int"):
        plan.pairs(plan.num_src_ranks, sender=True)


def test_slabs_cut_a_3d_item_into_one_index_slabs_only_when_a_slab_is_at_least_alone():
    item = _it("e", (2, 4, 0), (3, 4, 8), src_offsets=(0, 4, 0), param_offsets=(5, 0, 0))
    got = slabs(item, 2, 64)  # a slab: 4 x 8 x 2 = 64 bytes
    assert [(p.region.offsets, p.region.sizes, p.src_offsets, p.param_offsets) for p in got] == [
        ((2 + i, 4, 0), (1, 4, 8), (i, 4, 0), (5 + i, 0, 0)) for i in range(3)]
    assert slabs(item, 2, 65) == [item]  # small slabs: packed whole
    flat = _it("f", (0, 0), (6, 8))
    one = _it("g", (0, 0, 0), (1, 4, 8))
    assert slabs(flat, 2, 1) == [flat] and slabs(one, 2, 1) == [one]


def test_message_cap_and_peer_groups_bound_the_peers_of_a_round():
    assert message_cap(1 << 20, 256, 128, peers=16) == (1 << 20) // 16
    assert message_cap(1 << 20, 3, 5, peers=16) == message_cap(1 << 20, 3, 5)  # few peers: their share
    assert peer_groups(256, 128, 16) == 16 and peer_groups(3, 5, 16) == 1 and peer_groups(3, 5, 2) == 3
    with pytest.raises(ValueError, match="peers must be >= 1"):
        peer_groups(3, 5, 0)
    # 40 trainers -> 24 workers, 16 peers: 3 groups; a trainer's workers in a group are every 3rd, a
    # worker's trainers one block of 14 consecutive ones (the last block 12)
    groups = peer_groups(40, 24, 16)
    of = {(r, w): peer_group(r, w, groups, 40) for r in range(40) for w in range(24)}
    assert groups == 3 and all(sorted(w for w in range(24) if of[0, w] == g) == list(range(g, 24, 3))
                               for g in range(3))
    assert [sorted(r for r in range(40) if of[r, 5] == g) for g in range(3)] == [
        list(range(14, 28)), list(range(28, 40)), list(range(0, 14))]


@pytest.mark.parametrize("peers", [1, 2, 3])
@pytest.mark.parametrize("seed", range(30))
def test_rounds_by_peer_group_hold_at_most_peers_and_follow_one_order_on_every_rank(seed, peers):
    """Each round is one (group, k): the k-th message of the rank's peers in one group, at most
    ``peers`` of them, the rounds in ascending (group, k) on every rank, and both ends of a pair put
    its k-th message in the round of the same key: the order deadlock freedom rests on."""
    sources, dests, _ = _random_plan_inputs(seed)
    plan = build_plan(sources, dests)
    size = {s.name: dtype_itemsize(s.dtype) for s in sources}.__getitem__
    groups = peer_groups(plan.num_src_ranks, plan.num_dst_ranks, peers)
    keyed = {}
    for sender, n in ((True, plan.num_src_ranks), (False, plan.num_dst_ranks)):
        for rank in range(n):
            keys = []
            for rnd in item_rounds(plan.pairs(rank, sender=sender), cap=128, itemsize_of=size, alone=64, peers=peers):
                key = {(peer_group(m.src, m.dst, groups, plan.num_src_ranks), m.index) for m in rnd}
                assert len(key) == 1 and len(rnd) <= peers
                assert len({m.dst if sender else m.src for m in rnd}) == len(rnd)
                keys += key
                for m in rnd:
                    keyed.setdefault((m.src, m.dst, m.index), []).append((keys[-1], m))
            assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert keyed and all(len(v) == 2 and v[0] == v[1] for v in keyed.values())
