"""The replica fan-out's trees and cost model (plan/fanout.py), worked by hand."""

from __future__ import annotations

import pytest

from weightsync.plan.fanout import LinkCost, plan_fan_out, tree_seconds

UNIT = LinkCost(latency_s=1.0, bandwidth=1.0)  # a chunk of c bytes costs 1 + c per hop: easy to work out


def test_one_replica_or_off_fans_nothing_out():
    assert plan_fan_out(1, [100], chunk_bytes=10) is None
    assert plan_fan_out(4, [100], chunk_bytes=10, mode="off") is None


def test_chain_forwards_each_replica_to_the_next_per_position():
    fan = plan_fan_out(4, [100, 100], chunk_bytes=10, mode="chain")
    assert [t.parents for t in fan.trees] == [(None, 0, 1, 2)] * 2
    # workers: replica * 2 + position
    assert fan.forwards() == [(0, 2), (2, 4), (4, 6), (1, 3), (3, 5), (5, 7)]
    assert fan.parent(0) is None and fan.parent(5) == 3 and fan.children(3) == (5,) and fan.children(7) == ()
    assert fan.trees[0].depth() == 3 and fan.trees[0].shape == "chain"


def test_binary_tree_halves_the_depth():
    fan = plan_fan_out(7, [64], chunk_bytes=8, mode="tree")
    t = fan.trees[0]
    assert t.parents == (None, 0, 0, 1, 1, 2, 2) and t.children(0) == (1, 2) and t.children(2) == (5, 6)
    assert t.depth() == 2 and t.shape == "tree" and t.degree == 2


def test_cost_model_by_hand():
    # chain over 4 replicas, 10 chunks of 10 bytes: (10 - 1) * 1 * 10 + 3 hops * (1 + 10) = 123
    assert tree_seconds(4, 1, 100, 10, UNIT) == 123.0
    # binary tree over 4: parents (-, 0, 0, 1); replica 3's path: 1 -> 3 (1 child), 0 -> 1 (2 children)
    # (10 - 1) * 2 * 10 + (1 + 10) + (1 + 20) = 212
    assert tree_seconds(4, 2, 100, 10, UNIT) == 212.0
    # one chunk: the chain pays 3 hops of 1 + 100, a 3-ary star one hop sending 3 copies: 1 + 300
    assert tree_seconds(4, 1, 100, 100, UNIT) == 303.0
    assert tree_seconds(4, 3, 100, 100, UNIT) == 301.0


def test_auto_takes_the_chain_for_many_chunks_and_a_tree_where_hops_dominate():
    many = plan_fan_out(8, [1 << 30], chunk_bytes=1 << 20)  # 1 GiB in 1 MiB rounds: bandwidth-bound
    assert many.trees[0].degree == 1
    slow_hops = LinkCost(latency_s=1.0, bandwidth=1e12)  # a hop costs a second, bytes nearly nothing
    few = plan_fan_out(8, [1 << 10], chunk_bytes=1 << 10, cost=slow_hops)
    assert few.trees[0].degree == 7 and few.trees[0].depth() == 1  # one hop: every replica from replica 0
    # per position: a large shard chains, a tiny one (one chunk) fans out wide
    mixed = plan_fan_out(8, [1 << 30, 1 << 10], chunk_bytes=1 << 20, cost=LinkCost(latency_s=1e-3))
    assert [t.shape for t in mixed.trees] == ["chain", "tree"]
    for t in mixed.trees:
        others = [tree_seconds(8, k, b, 1 << 20, LinkCost(latency_s=1e-3)) for k, b in
                  ((k, [1 << 30, 1 << 10][mixed.trees.index(t)]) for k in range(1, 8))]
        assert t.seconds == min(others)


def test_every_replica_is_reached_once_from_replica_zero():
    for r in range(1, 20):
        for mode in ("auto", "chain", "tree"):
            fan = plan_fan_out(r, [5, 0, 1 << 20], chunk_bytes=4096, mode=mode)
            if r == 1:
                assert fan is None
                continue
            for t in fan.trees:
                assert t.parents[0] is None and all(p is not None and p < i for i, p in enumerate(t.parents) if i)
                assert sorted(c for i in range(r) for c in t.children(i)) == list(range(1, r))


@pytest.mark.parametrize(("kw", "message"), [
    ({"mode": "star"}, "fan_out must be one of auto, chain, tree, off, got 'star'"),
    ({"replicas": 0}, "replicas must be a positive int, got 0"),
    ({"shard_bytes": []}, "shard_bytes must list each position's bytes"),
    ({"chunk_bytes": 0}, "chunk_bytes must be >= 1, got 0"),
])
def test_bad_input_names_the_parameter(kw, message):
    args = {"replicas": 2, "shard_bytes": [1], "chunk_bytes": 1, **kw}
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        plan_fan_out(args.pop("replicas"), args.pop("shard_bytes"), **args)
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        LinkCost(bandwidth=0)
