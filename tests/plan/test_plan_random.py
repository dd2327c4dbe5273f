"""Randomized plans (seeded): arange data through the reference executor, a naive planner as oracle."""

from __future__ import annotations

import math
import random

import pytest
import torch

from helpers import execute_reference, make_local_shards, write_destinations
from oracle import items_for_dst, items_for_src, iter_items
from weightsync.plan import (
    DestPiece,
    Region,
    Replicate,
    Shard,
    TensorSource,
    TransferItem,
    build_plan,
    dtype_itemsize,
    mesh_coordinates,
    source_regions,
)

_MESHES = [(1,), (2,), (3,), (4,), (5,), (2, 2), (2, 3), (3, 2), (1, 3)]
_DTYPES = ["float32", "bfloat16", "float64"]


def _random_sources(rng):
    mesh = rng.choice(_MESHES)
    out = []
    for i in range(rng.randint(1, 4)):
        ndim = rng.randint(1, 3)
        shape = tuple(0 if rng.random() < 0.03 else rng.randint(1, 7) for _ in range(ndim))
        placements = [rng.choice([Replicate()] + [Shard(d) for d in range(ndim)]) for _ in mesh]
        out.append((f"t{i}", shape, rng.choice(_DTYPES), mesh, placements))
    return out


def _random_regions(rng, shape, workers):
    """Per worker, the regions of one tensor it takes."""
    mode = rng.choice(["replicate", "split", "split", "boxes"])
    per_worker = [[] for _ in range(workers)]
    if mode == "replicate":
        for w in range(workers):
            if rng.random() < 0.8:
                per_worker[w].append(Region.full(shape))
    elif mode == "split":  # TP split of a random dim, maybe padded (vocab-like), maybe in two pieces
        d = rng.randrange(len(shape))
        per = math.ceil((shape[d] + rng.randint(0, 3)) / workers)
        for w in range(workers):
            lo = min(per * w, shape[d])
            offsets = [0] * len(shape)
            sizes = list(shape)
            offsets[d], sizes[d] = lo, min(shape[d], lo + per) - lo
            region = Region(tuple(offsets), tuple(sizes))
            cut_dim = rng.randrange(len(shape))
            if rng.random() < 0.3 and region.sizes[cut_dim] > 1:
                cut = rng.randint(1, region.sizes[cut_dim] - 1)
                a_sizes = list(region.sizes)
                a_sizes[cut_dim] = cut
                b_off = list(region.offsets)
                b_off[cut_dim] += cut
                b_sizes = list(region.sizes)
                b_sizes[cut_dim] -= cut
                per_worker[w] += [Region(region.offsets, tuple(a_sizes)), Region(tuple(b_off), tuple(b_sizes))]
            else:
                per_worker[w].append(region)
    else:  # arbitrary boxes, overlapping ones allowed (same bytes to two params)
        for w in range(workers):
            for _ in range(rng.randint(0, 2)):
                bounds = [sorted((rng.randint(0, n), rng.randint(0, n))) for n in shape]
                per_worker[w].append(Region(tuple(a for a, _ in bounds), tuple(b - a for a, b in bounds)))
    return per_worker


def _random_case(seed):
    """(source specs, destinations, param shapes): destinations packed at offsets of bigger params."""
    rng = random.Random(seed)
    specs = _random_sources(rng)
    workers = rng.randint(1, 4)
    dests = [[] for _ in range(workers)]
    shapes: list[dict[str, list[int]]] = [{} for _ in range(workers)]
    for name, shape, _, _, _ in specs:
        for w, regions in enumerate(_random_regions(rng, shape, workers)):
            for region in regions:
                param = f"w{w}_{len(shape)}d" if rng.random() < 0.7 else f"w{w}_{name}_{len(dests[w])}"
                cur = shapes[w].setdefault(param, [0] * len(shape))
                offsets = (cur[0] + rng.randint(0, 2), *(rng.randint(0, 2) for _ in shape[1:]))
                end = [o + s for o, s in zip(offsets, region.sizes)]
                shapes[w][param] = [end[0]] + [max(a, b) for a, b in zip(cur[1:], end[1:])]
                dests[w].append(DestPiece(name, region, param, offsets))
    param_shapes = [{p: tuple(s) for p, s in ps.items()} for ps in shapes]
    return specs, dests, param_shapes


def _sources(specs):
    return [TensorSource(n, s, dt, source_regions(s, m, p, mesh_coordinates(m))) for n, s, dt, m, p in specs]


def _naive_plan(sources, dests):
    """The documented rule, written the slow obvious way (no classes, templates or index)."""
    load = [0] * len(sources[0].regions)
    groups: dict[tuple, list] = {}
    for t, s in enumerate(sources):
        mine = tuple(tuple((p.region, p.param_offsets) for p in ps if p.name == s.name) for ps in dests)
        groups.setdefault((s.shape, s.dtype, s.regions, mine), []).append(t)
    choice_of = {}
    for key, tensors in groups.items():
        _, dtype, regions, mine = key
        holders: dict[Region, list[int]] = {}
        for r, reg in enumerate(regions):
            if not reg.is_empty:
                holders.setdefault(reg, []).append(r)
        plan = []
        for w, pieces in enumerate(mine):
            for k, (region, poff) in enumerate(pieces):
                overlaps = [(reg.intersect(region), reg) for reg in holders if reg.intersect(region) is not None]
                for inter, reg in sorted(overlaps, key=lambda x: x[0].offsets):
                    r = min(holders[reg], key=lambda x: (load[x], x))
                    load[r] += inter.numel * dtype_itemsize(dtype) * len(tensors)
                    so = tuple(a - b for a, b in zip(inter.offsets, reg.offsets))
                    po = tuple(p + a - b for p, a, b in zip(poff, inter.offsets, region.offsets))
                    plan.append((r, w, k, inter, so, po))
        for t in tensors:
            choice_of[t] = plan
    items = []
    for t, s in enumerate(sources):
        params = [[p.param for p in ps if p.name == s.name] for ps in dests]
        items += [TransferItem(r, w, s.name, inter, so, params[w][k], po) for r, w, k, inter, so, po in choice_of[t]]
    return items


def _rebuilt(specs, dests, rng):
    """Equal inputs from fresh objects: specs via a shuffled dict, worker lists shuffled across tensors."""
    by_name = {s[0]: s[1:] for s in rng.sample(specs, len(specs))}
    sources = _sources([(s[0], *by_name[s[0]]) for s in specs])  # fresh Region objects
    prio = {n: rng.random() for n in by_name}
    new_dests = [
        [DestPiece(p.name, Region(tuple(p.region.offsets), tuple(p.region.sizes)), p.param, tuple(p.param_offsets))
         for p in sorted(ps, key=lambda p: prio[p.name])]
        for ps in dests
    ]
    return sources, new_dests


@pytest.mark.parametrize("seed", range(200))
def test_random_plan(seed):
    specs, dests, param_shapes = _random_case(seed)
    sources = _sources(specs)
    plan = build_plan(sources, dests)
    items = list(iter_items(plan))
    assert items == _naive_plan(sources, dests)
    assert len(items) == plan.num_items

    # Data: reference executor over arange tensors == the plan-free oracle, padding untouched.
    full = {s.name: (torch.arange(math.prod(s.shape), dtype=torch.float64) + 1000 * i).reshape(s.shape)
            for i, s in enumerate(sources)}
    got = {w: {p: torch.full(sh, -1.0, dtype=torch.float64) for p, sh in ps.items()}
           for w, ps in enumerate(param_shapes)}
    want = {w: {p: t.clone() for p, t in ps.items()} for w, ps in got.items()}
    execute_reference(plan, make_local_shards(full, sources), got)
    write_destinations(full, dests, want)
    for w in got:
        for p in got[w]:
            assert torch.equal(got[w][p], want[w][p]), (seed, w, p)

    cov = plan.coverage()
    assert cov.ratio == 1.0 and cov.recv_bytes == cov.lower_bound
    assert sum(cov.send_bytes) == sum(cov.recv_bytes)

    # Both views list the items of every (trainer, worker) pair in one order: the global one.
    by_src = [items_for_src(plan, r) for r in range(plan.num_src_ranks)]
    by_dst = [items_for_dst(plan, d) for d in range(plan.num_dst_ranks)]
    for r in range(plan.num_src_ranks):
        assert by_src[r] == [it for it in items if it.src_rank == r]
        for d in range(plan.num_dst_ranks):
            assert [it for it in by_src[r] if it.dst_rank == d] == [it for it in by_dst[d] if it.src_rank == r]
    regions = {s.name: s.regions for s in sources}
    for it in items:
        held = regions[it.name][it.src_rank]
        assert held.contains(it.region) and it.src_offsets == it.region.shift(held.offsets).offsets

    # Digest: equal for independently rebuilt inputs, different after any change.
    rng = random.Random(seed + 10_000)
    plan2 = build_plan(*_rebuilt(specs, dests, rng))
    assert plan2.digest == plan.digest and list(iter_items(plan2)) == items
    touched = [(w, k) for w, ps in enumerate(dests) for k in range(len(ps))]
    if touched:
        w, k = rng.choice(touched)
        p = dests[w][k]
        moved = [list(ps) for ps in dests]
        moved[w][k] = DestPiece(p.name, p.region, p.param, (p.param_offsets[0] + 1, *p.param_offsets[1:]))
        assert build_plan(sources, moved).digest != plan.digest
    s0 = sources[0]
    if len(set(s0.regions)) > 1:
        a = s0.regions.index(next(r for r in s0.regions if r != s0.regions[0]))
        swapped = list(s0.regions)
        swapped[0], swapped[a] = swapped[a], swapped[0]
        changed = [TensorSource(s0.name, s0.shape, s0.dtype, tuple(swapped)), *sources[1:]]
        assert build_plan(changed, dests).digest != plan.digest


def test_shared_worker_lists_match_copies():
    """Identity-shared destination lists (the fast path) plan exactly like equal copies."""
    for seed in range(20):
        specs, dests, _ = _random_case(seed)
        sources = _sources(specs)
        shared = [dests[0]] * 3 + dests
        copied = [list(dests[0]) for _ in range(3)] + [list(ps) for ps in dests]
        a, b = build_plan(sources, shared), build_plan(sources, copied)
        assert a.digest == b.digest
        assert list(iter_items(a)) == list(iter_items(b)) == _naive_plan(sources, shared)
