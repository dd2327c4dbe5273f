"""The rounds cut once into arrays (``PairItems.compact_rounds``) equal, message for message and
round for round, the item-by-item cut (``PairItems.rounds``), on random plans: mixed dtypes (so
alignment gaps), items split and cut into slabs, pieces apart, peer groups, tensors sharing one
signature; and they keep what they hold as arrays, not items."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_schedule import _random_plan_inputs

from oracle import item_rounds
from weightsync.plan import DestPiece, Region, TensorSource, build_plan, dtype_itemsize
from weightsync.plan.schedule import CompactRounds, LazyItems, pair_rounds


def _twins(sources, dests, seed):
    """Each tensor again under a second name (same layout: one signature, two tensors), maybe in
    another param, so the columns repeat a signature's pieces over its tensors."""
    rng = random.Random(seed)
    out_s = list(sources) + [TensorSource(s.name + "_b", s.shape, s.dtype, s.regions) for s in sources]
    out_d = []
    for pieces in dests:
        extra = [DestPiece(p.name + "_b", p.region, p.param + ("_b" if rng.random() < 0.5 else ""), p.param_offsets)
                 for p in pieces]
        out_d.append(list(pieces) + extra)
    return out_s, out_d


def _both(plan, size, rank, sender, **kw):
    pairs = plan.pairs(rank, sender=sender)
    want = list(item_rounds(pairs, itemsize_of=size, **kw))
    got = pair_rounds(pairs, itemsize_of=size, **kw)
    return want, got


@pytest.mark.parametrize("seed", range(40))
def test_compact_rounds_equal_the_item_by_item_cut(seed):
    rng = random.Random(1000 + seed)
    sources, dests, _ = _random_plan_inputs(seed)
    if seed % 2:
        sources, dests = _twins(sources, dests, seed)
    plan = build_plan(sources, dests)
    size = {s.name: dtype_itemsize(s.dtype) for s in sources}.__getitem__
    dense = {w: {p.param for p in dests[w] if rng.random() < 0.3} for w in range(len(dests))}
    for cap, alone, peers, apart in [(64, 1 << 20, 16, False), (128, 16, 2, False), (192, 1, 1, False),
                                     (1 << 12, 64, 3, True), (256, 32, 16, True)]:
        kw = dict(cap=cap, alone=alone, peers=peers)
        if apart:
            kw["apart"] = lambda item: item.param in dense[item.dst_rank]
        for sender, n in ((True, plan.num_src_ranks), (False, plan.num_dst_ranks)):
            for rank in range(n):
                want, got = _both(plan, size, rank, sender, **kw)
                assert isinstance(got, CompactRounds) and len(got) == len(want)
                for _ in range(2):  # iterable again, the same each time
                    rounds = list(got)
                    assert rounds == want, (seed, cap, alone, peers, sender, rank)
                assert got.num_items == sum(len(m.items) for r in want for m in r)
                assert got.total_bytes() == sum(m.nbytes for r in want for m in r)


def test_compact_rounds_keep_arrays_and_make_items_only_when_read():
    shape = (64, 8)
    regions = (Region((0, 0), (32, 8)), Region((32, 0), (32, 8)))
    sources = [TensorSource(f"w{i}", shape, "bfloat16", regions) for i in range(50)]
    dests = [[DestPiece(f"w{i}", Region((0, 4 * w), (64, 4)), f"p{i}", (0, 0)) for i in range(50)] for w in range(2)]
    plan = build_plan(sources, dests)
    got = pair_rounds(plan.pairs(0, sender=True), cap=1 << 10, itemsize_of=lambda n: 2, alone=1 << 20)
    assert got.num_items == 100 and len(got.pieces) == 2  # 50 tensors x 2 workers; one piece per worker
    assert all(isinstance(a, np.ndarray) for a in (got.tensor, got.pid, got.offset))
    m = next(iter(got))[0]
    assert isinstance(m.items, LazyItems) and m.items._made is None
    assert m.items.tensors() == list(range(len(m.items)))
    assert m.items[1].name == "w1" and m.items[1].param == "p1" and m.items._made is None  # that one alone
    assert [it.name for it in m.items] == [f"w{i}" for i in range(len(m.items))] and m.items._made is not None
    keys = m.items.keys()
    assert len(set(keys)) == len(keys)  # one key per (name, param) here
    assert got.kept_bytes() < 200 * 2 + 100 * 12 + 1000
