"""Hand-worked transfer plans: every expected item written out, plus error messages and the digest."""

from __future__ import annotations

import re

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


def _fsdp(shape, n, placements=None, mesh=None):
    mesh = mesh or (n,)
    return source_regions(shape, mesh, placements or [Shard(0)], mesh_coordinates(mesh))


def _it(src, dst, name, offsets, sizes, src_offsets, param, param_offsets):
    return TransferItem(src, dst, name, Region(offsets, sizes), src_offsets, param, param_offsets)


def _all_items(plan):
    return [it for d in range(plan.num_dst_ranks) for it in items_for_dst(plan, d)]


def _check_against_oracle(plan, sources, destinations, param_shapes):
    """Run the reference executor and compare every param with the plan-free oracle."""
    full = {
        s.name: (torch.arange(Region.full(s.shape).numel, dtype=torch.float64) + 1000 * i).reshape(s.shape)
        for i, s in enumerate(sources)
    }
    got = {w: {p: torch.full(shape, -1.0, dtype=torch.float64) for p, shape in ps.items()}
           for w, ps in enumerate(param_shapes)}
    want = {w: {p: t.clone() for p, t in ps.items()} for w, ps in got.items()}
    execute_reference(plan, make_local_shards(full, sources), got)
    write_destinations(full, destinations, want)
    for w in got:
        for p in got[w]:
            assert torch.equal(got[w][p], want[w][p]), (w, p)
    cov = plan.coverage()
    assert cov.ratio == 1.0 and cov.recv_bytes == cov.lower_bound
    assert sum(cov.send_bytes) == sum(cov.recv_bytes)
    return got


def test_8_to_4_rows():
    src = [TensorSource("w", (8, 4), "float32", _fsdp((8, 4), 8))]
    dst = [[DestPiece("w", Region((2 * d, 0), (2, 4)), "w", (0, 0))] for d in range(4)]
    plan = build_plan(src, dst)
    expected = [
        _it(0, 0, "w", (0, 0), (1, 4), (0, 0), "w", (0, 0)),
        _it(1, 0, "w", (1, 0), (1, 4), (0, 0), "w", (1, 0)),
        _it(2, 1, "w", (2, 0), (1, 4), (0, 0), "w", (0, 0)),
        _it(3, 1, "w", (3, 0), (1, 4), (0, 0), "w", (1, 0)),
        _it(4, 2, "w", (4, 0), (1, 4), (0, 0), "w", (0, 0)),
        _it(5, 2, "w", (5, 0), (1, 4), (0, 0), "w", (1, 0)),
        _it(6, 3, "w", (6, 0), (1, 4), (0, 0), "w", (0, 0)),
        _it(7, 3, "w", (7, 0), (1, 4), (0, 0), "w", (1, 0)),
    ]
    assert list(iter_items(plan)) == expected == _all_items(plan)
    assert plan.num_items == 8
    assert [items_for_src(plan, r) for r in range(8)] == [[e] for e in expected]
    assert plan.coverage().send_bytes == (16,) * 8
    assert plan.bytes_per_dst() == (32,) * 4
    _check_against_oracle(plan, src, dst, [{"w": (2, 4)}] * 4)


def test_4_to_3_uneven_rows():
    # 7 rows: FSDP over 4 -> 2/2/2/1; destinations over 3 -> 3/3/1.
    src = [TensorSource("w", (7, 2), "float32", _fsdp((7, 2), 4))]
    dst = [[DestPiece("w", Region((3 * d, 0), (min(3, 7 - 3 * d), 2)), "p", (0, 0))] for d in range(3)]
    plan = build_plan(src, dst)
    assert _all_items(plan) == [
        _it(0, 0, "w", (0, 0), (2, 2), (0, 0), "p", (0, 0)),
        _it(1, 0, "w", (2, 0), (1, 2), (0, 0), "p", (2, 0)),
        _it(1, 1, "w", (3, 0), (1, 2), (1, 0), "p", (0, 0)),
        _it(2, 1, "w", (4, 0), (2, 2), (0, 0), "p", (1, 0)),
        _it(3, 2, "w", (6, 0), (1, 2), (0, 0), "p", (0, 0)),
    ]
    assert items_for_src(plan, 1) == [
        _it(1, 0, "w", (2, 0), (1, 2), (0, 0), "p", (2, 0)),
        _it(1, 1, "w", (3, 0), (1, 2), (1, 0), "p", (0, 0)),
    ]
    _check_against_oracle(plan, src, dst, [{"p": (3, 2)}, {"p": (3, 2)}, {"p": (1, 2)}])


def test_2x2_mesh_shard_both_dims():
    # rank 2i+j holds rows 2i..2i+1, cols 2j..2j+1; worker 0 wants rows 1..2, worker 1 rows 3.
    regions = _fsdp((4, 4), 4, [Shard(0), Shard(1)], (2, 2))
    assert regions[1] == Region((0, 2), (2, 2)) and regions[2] == Region((2, 0), (2, 2))
    src = [TensorSource("w", (4, 4), "float32", regions)]
    dst = [[DestPiece("w", Region((1, 0), (2, 4)), "p", (0, 0))], [DestPiece("w", Region((3, 0), (1, 4)), "p", (1, 0))]]
    plan = build_plan(src, dst)
    assert _all_items(plan) == [
        _it(0, 0, "w", (1, 0), (1, 2), (1, 0), "p", (0, 0)),
        _it(1, 0, "w", (1, 2), (1, 2), (1, 0), "p", (0, 2)),
        _it(2, 0, "w", (2, 0), (1, 2), (0, 0), "p", (1, 0)),
        _it(3, 0, "w", (2, 2), (1, 2), (0, 0), "p", (1, 2)),
        _it(2, 1, "w", (3, 0), (1, 2), (1, 0), "p", (1, 0)),
        _it(3, 1, "w", (3, 2), (1, 2), (1, 0), "p", (1, 2)),
    ]
    _check_against_oracle(plan, src, dst, [{"p": (2, 4)}, {"p": (2, 4)}])


def test_hsdp_least_loaded_sender():
    # (Replicate, Shard(0)) over (2, 2): ranks 0 and 2 hold rows 0-1, ranks 1 and 3 rows 2-3.
    regions = _fsdp((4, 2), 4, [Replicate(), Shard(0)], (2, 2))
    full = [DestPiece("w", Region.full((4, 2)), "w", (0, 0))]
    plan = build_plan([TensorSource("w", (4, 2), "float32", regions)], [full, full])
    assert _all_items(plan) == [
        _it(0, 0, "w", (0, 0), (2, 2), (0, 0), "w", (0, 0)),
        _it(1, 0, "w", (2, 0), (2, 2), (0, 0), "w", (2, 0)),
        _it(2, 1, "w", (0, 0), (2, 2), (0, 0), "w", (0, 0)),  # rank 0 already sent 16 bytes
        _it(3, 1, "w", (2, 0), (2, 2), (0, 0), "w", (2, 0)),
    ]
    # A replicated bias planned first loads rank 0 (8 bytes), so rows 0-1 go to rank 2 first.
    bias = TensorSource("b", (2,), "float32", _fsdp((2,), 4, [Replicate(), Replicate()], (2, 2)))
    src = [bias, TensorSource("w", (4, 2), "float32", regions)]
    dst = [[DestPiece("b", Region.full((2,)), "b", (0,)), *full], full]
    plan = build_plan(src, dst)
    assert _all_items(plan) == [
        _it(0, 0, "b", (0,), (2,), (0,), "b", (0,)),
        _it(2, 0, "w", (0, 0), (2, 2), (0, 0), "w", (0, 0)),
        _it(1, 0, "w", (2, 0), (2, 2), (0, 0), "w", (2, 0)),
        _it(0, 1, "w", (0, 0), (2, 2), (0, 0), "w", (0, 0)),
        _it(3, 1, "w", (2, 0), (2, 2), (0, 0), "w", (2, 0)),
    ]
    assert plan.coverage().send_bytes == (24, 16, 16, 16)
    _check_against_oracle(plan, src, dst, [{"b": (2,), "w": (4, 2)}, {"w": (4, 2)}])


def test_row_parallel_column_destination():
    # o_proj-like: FSDP rows over 2, TP3 workers take column ranges of 2.
    src = [TensorSource("o", (4, 6), "bfloat16", _fsdp((4, 6), 2))]
    dst = [[DestPiece("o", Region((0, 2 * d), (4, 2)), "o", (0, 0))] for d in range(3)]
    plan = build_plan(src, dst)
    assert _all_items(plan) == [
        _it(src_r, d, "o", (2 * src_r, 2 * d), (2, 2), (0, 2 * d), "o", (2 * src_r, 0))
        for d in range(3) for src_r in range(2)
    ]
    assert plan.coverage().recv_bytes == (16, 16, 16)  # bfloat16: 8 elements x 2 bytes
    _check_against_oracle(plan, src, dst, [{"o": (4, 2)}] * 3)


def test_fused_qkv():
    # q 4 rows, k and v 2 rows each, FSDP over 2; TP2 lands q | k | v at param rows 0 / 2 / 3.
    shapes = {"q": (4, 2), "k": (2, 2), "v": (2, 2)}
    src = [TensorSource(n, s, "float32", _fsdp(s, 2)) for n, s in shapes.items()]
    dst = [
        [
            DestPiece("q", Region((2 * d, 0), (2, 2)), "qkv", (0, 0)),
            DestPiece("k", Region((d, 0), (1, 2)), "qkv", (2, 0)),
            DestPiece("v", Region((d, 0), (1, 2)), "qkv", (3, 0)),
        ]
        for d in range(2)
    ]
    plan = build_plan(src, dst)
    assert items_for_dst(plan, 1) == [
        _it(1, 1, "q", (2, 0), (2, 2), (0, 0), "qkv", (0, 0)),
        _it(1, 1, "k", (1, 0), (1, 2), (0, 0), "qkv", (2, 0)),
        _it(1, 1, "v", (1, 0), (1, 2), (0, 0), "qkv", (3, 0)),
    ]
    assert items_for_src(plan, 0) == [
        _it(0, 0, "q", (0, 0), (2, 2), (0, 0), "qkv", (0, 0)),
        _it(0, 0, "k", (0, 0), (1, 2), (0, 0), "qkv", (2, 0)),
        _it(0, 0, "v", (0, 0), (1, 2), (0, 0), "qkv", (3, 0)),
    ]
    got = _check_against_oracle(plan, src, dst, [{"qkv": (4, 2)}] * 2)
    q, k, v = (torch.arange(8.0).reshape(4, 2), torch.arange(4.0).reshape(2, 2) + 1000,
               torch.arange(4.0).reshape(2, 2) + 2000)
    assert torch.equal(got[1]["qkv"], torch.cat([q[2:], k[1:], v[1:]]).double())


def test_kv_head_replication():
    # TP=4, 2 KV heads of 2 rows: workers 0,1 take head 0, workers 2,3 head 1 (same bytes twice).
    src = [TensorSource("k", (4, 3), "float32", _fsdp((4, 3), 2))]
    dst = [[DestPiece("k", Region((2 * (d // 2), 0), (2, 3)), "qkv", (1, 0))] for d in range(4)]
    plan = build_plan(src, dst)
    assert _all_items(plan) == [
        _it(0, 0, "k", (0, 0), (2, 3), (0, 0), "qkv", (1, 0)),
        _it(0, 1, "k", (0, 0), (2, 3), (0, 0), "qkv", (1, 0)),
        _it(1, 2, "k", (2, 0), (2, 3), (0, 0), "qkv", (1, 0)),
        _it(1, 3, "k", (2, 0), (2, 3), (0, 0), "qkv", (1, 0)),
    ]
    cov = plan.coverage()
    assert cov.send_bytes == (48, 48) and cov.ratio == 1.0
    _check_against_oracle(plan, src, dst, [{"qkv": (3, 3)}] * 4)


def _vocab_pieces(vocab, tp, name="embed", param="embed"):
    padded = -(-vocab // 64) * 64
    per = padded // tp
    out = []
    for t in range(tp):
        lo = min(per * t, vocab)
        out.append([DestPiece(name, Region((lo, 0), (min(vocab, lo + per) - lo, 4)), param, (0, 0))])
    return out, per


def test_vocab_padding_tp2():
    src = [TensorSource("embed", (151, 4), "float32", _fsdp((151, 4), 2))]  # 76 / 75 rows
    dst, per = _vocab_pieces(151, 2)
    assert per == 96
    plan = build_plan(src, dst)
    assert _all_items(plan) == [
        _it(0, 0, "embed", (0, 0), (76, 4), (0, 0), "embed", (0, 0)),
        _it(1, 0, "embed", (76, 0), (20, 4), (0, 0), "embed", (76, 0)),
        _it(1, 1, "embed", (96, 0), (55, 4), (20, 0), "embed", (0, 0)),
    ]
    got = _check_against_oracle(plan, src, dst, [{"embed": (96, 4)}] * 2)
    assert bool((got[1]["embed"][55:] == -1).all())  # padding rows are never written


def test_vocab_padding_tp4():
    src = [TensorSource("embed", (151, 4), "float32", _fsdp((151, 4), 2))]
    dst, per = _vocab_pieces(151, 4)
    assert per == 48
    plan = build_plan(src, dst)
    assert _all_items(plan) == [
        _it(0, 0, "embed", (0, 0), (48, 4), (0, 0), "embed", (0, 0)),
        _it(0, 1, "embed", (48, 0), (28, 4), (48, 0), "embed", (0, 0)),
        _it(1, 1, "embed", (76, 0), (20, 4), (0, 0), "embed", (28, 0)),
        _it(1, 2, "embed", (96, 0), (48, 4), (20, 0), "embed", (0, 0)),
        _it(1, 3, "embed", (144, 0), (7, 4), (68, 0), "embed", (0, 0)),
    ]
    got = _check_against_oracle(plan, src, dst, [{"embed": (48, 4)}] * 4)
    assert bool((got[3]["embed"][7:] == -1).all())


def test_tied_embedding_in_sources_once():
    # lm_head is tied: only embed_tokens is a source. One param per worker...
    src = [TensorSource("model.embed_tokens.weight", (151, 4), "float32", _fsdp((151, 4), 2))]
    dst, _ = _vocab_pieces(151, 2, "model.embed_tokens.weight", "model.embed_tokens.weight")
    plan = build_plan(src, dst)
    assert {(it.name, it.param) for it in _all_items(plan)} == {("model.embed_tokens.weight",) * 2}
    assert plan.num_items == 3
    # ...or, for an untied destination model, the same source bytes land in two params per worker.
    both = [ps + [DestPiece(p.name, p.region, "lm_head.weight", (0, 0)) for p in ps] for ps in dst]
    plan2 = build_plan(src, both)
    assert plan2.num_items == 6
    assert [(it.src_rank, it.param) for it in items_for_dst(plan2, 1)] == [
        (1, "model.embed_tokens.weight"), (1, "lm_head.weight")
    ]
    _check_against_oracle(plan2, src, both, [{"model.embed_tokens.weight": (96, 4), "lm_head.weight": (96, 4)}] * 2)
    with pytest.raises(ValueError, match=re.escape("names unknown tensor 'lm_head.weight'")):
        build_plan(src, [[DestPiece("lm_head.weight", Region.full((151, 4)), "lm_head.weight", (0, 0))]])


def test_scalar_and_empty_pieces():
    src = [TensorSource("s", (), "float32", (Region((), ()), Region((), ())))]
    plan = build_plan(src, [[DestPiece("s", Region((), ()), "s", ())], []])
    assert _all_items(plan) == [_it(0, 0, "s", (), (), (), "s", ())]
    _check_against_oracle(plan, src, [[DestPiece("s", Region((), ()), "s", ())], []], [{"s": ()}, {}])
    w = TensorSource("w", (4,), "float32", _fsdp((4,), 2))
    empty = build_plan([w], [[DestPiece("w", Region((4,), (0,)), "w", (0,))]])
    assert empty.num_items == 0 and empty.coverage().ratio == 1.0


def _error_plan(piece, regions=None):
    regions = regions or _fsdp((4, 2), 2)
    return build_plan([TensorSource("w", (4, 2), "float32", regions)], [[], [piece]])


def test_error_uncovered_region():
    holes = (Region((0, 0), (2, 2)), Region((4, 0), (0, 2)))  # rank 1 holds nothing
    msg = ("destination region Region(offsets=(1, 0), sizes=(2, 2)) of tensor 'w' on worker 1 is not covered "
           "by the source regions (2 of 4 elements held by trainer ranks)")
    with pytest.raises(ValueError, match=re.escape(msg)):
        _error_plan(DestPiece("w", Region((1, 0), (2, 2)), "w", (0, 0)), holes)


def test_error_unknown_tensor():
    msg = "destination piece on worker 1 names unknown tensor 'x' (param 'p')"
    with pytest.raises(ValueError, match=re.escape(msg)):
        _error_plan(DestPiece("x", Region((0, 0), (1, 1)), "p", (0, 0)))


def test_error_out_of_bounds():
    msg = ("destination region Region(offsets=(3, 0), sizes=(2, 2)) of tensor 'w' on worker 1 is out of bounds "
           "for shape (4, 2)")
    with pytest.raises(ValueError, match=re.escape(msg)):
        _error_plan(DestPiece("w", Region((3, 0), (2, 2)), "w", (0, 0)))


def test_error_ndim_mismatch():
    msg = ("destination region Region(offsets=(0,), sizes=(4,)) of tensor 'w' on worker 1 has ndim 1, "
           "tensor has ndim 2 (shape (4, 2))")
    with pytest.raises(ValueError, match=re.escape(msg)):
        _error_plan(DestPiece("w", Region((0,), (4,)), "w", (0,)))


def test_error_sources():
    r = _fsdp((4, 2), 2)
    with pytest.raises(ValueError, match=re.escape("sources name tensor 'w' twice (at 0 and 1)")):
        build_plan([TensorSource("w", (4, 2), "float32", r)] * 2, [])
    v = TensorSource("v", (6, 2), "float32", _fsdp((6, 2), 3))
    with pytest.raises(ValueError, match=re.escape("tensor 'v' has 3 source regions, expected 2 (one per trainer")):
        build_plan([TensorSource("w", (4, 2), "float32", r), v], [])
    overlap = (Region((0, 0), (3, 2)), Region((2, 0), (2, 2)))
    msg = ("source regions of tensor 'w' overlap without being equal: trainer rank 0 holds "
           "Region(offsets=(0, 0), sizes=(3, 2)), trainer rank 1 holds Region(offsets=(2, 0), sizes=(2, 2))")
    with pytest.raises(ValueError, match=re.escape(msg)):
        build_plan([TensorSource("w", (4, 2), "float32", overlap)], [])
    msg = "source region Region(offsets=(3, 0), sizes=(2, 2)) of tensor 'w' on trainer rank 1 is out of bounds"
    with pytest.raises(ValueError, match=re.escape(msg)):
        build_plan([TensorSource("w", (4, 2), "float32", (r[0], Region((3, 0), (2, 2))))], [])
    with pytest.raises(ValueError, match=re.escape("dtype 'int3' has no known itemsize")):
        build_plan([TensorSource("w", (4, 2), "int3", r)], [[DestPiece("w", Region.full((4, 2)), "w", (0, 0))]])


def test_error_inputs_and_ranks():
    with pytest.raises(ValueError, match=re.escape("DestPiece.param_offsets of 'w' must be 2 non-negative ints")):
        DestPiece("w", Region((0, 0), (1, 1)), "w", (0,))
    with pytest.raises(TypeError, match=re.escape("DestPiece.region of 'w' must be a Region")):
        DestPiece("w", ((0,), (1,)), "w", (0,))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=re.escape("destinations[0] must hold DestPiece objects")):
        build_plan([TensorSource("w", (4,), "float32", _fsdp((4,), 2))], [["w"]])  # type: ignore[list-item]
    plan = build_plan([TensorSource("w", (4,), "float32", _fsdp((4,), 2))], [[]])
    with pytest.raises(ValueError, match=re.escape("rank must be an int in [0, 2), got 2")):
        items_for_src(plan, 2)
    with pytest.raises(ValueError, match=re.escape("rank must be an int in [0, 1), got -1")):
        items_for_dst(plan, -1)
    assert dtype_itemsize("torch.bfloat16") == 2 and dtype_itemsize("float8_e4m3fn") == 1


def _qkv_inputs(rows=8):
    """Independently constructed inputs (new objects every call) for digest checks."""
    src = [TensorSource(n, (rows, 2), "bfloat16", _fsdp((rows, 2), 4)) for n in ("q", "k", "v")]
    dst = [
        [DestPiece(n, Region((rows // 2 * d, 0), (rows // 2, 2)), "qkv", (i * rows // 2, 0))
         for i, n in enumerate(("q", "k", "v"))]
        for d in range(2)
    ]
    return src, dst


def test_digest_agreement_and_sensitivity():
    a = build_plan(*_qkv_inputs())
    b = build_plan(*_qkv_inputs())
    assert len(a.digest) == 64 and a.digest == b.digest
    assert list(iter_items(a)) == list(iter_items(b))
    src, dst = _qkv_inputs()
    # Pieces of different tensors may come in any order within a worker: same plan, same digest.
    assert build_plan(src, [list(reversed(ps)) for ps in dst]).digest == a.digest
    # One worker list shared by identity vs an equal copy: same digest.
    assert build_plan(src, [dst[0], list(dst[1])]).digest == a.digest
    changed = [dst[0], [dst[1][0], DestPiece("k", dst[1][1].region, "qkv", (5, 0)), dst[1][2]]]
    assert build_plan(src, changed).digest != a.digest
    renamed = [dst[0], [dst[1][0], DestPiece("k", dst[1][1].region, "qkv2", (4, 0)), dst[1][2]]]
    assert build_plan(src, renamed).digest != a.digest
    assert build_plan([TensorSource(s.name, s.shape, "float16", s.regions) for s in src], dst).digest != a.digest
    swapped = (src[0].regions[1], src[0].regions[0], *src[0].regions[2:])
    assert build_plan([TensorSource("q", (8, 2), "bfloat16", swapped), *src[1:]], dst).digest != a.digest
    assert build_plan(src, [*dst, []]).digest != a.digest  # one more worker


_DIGEST_SCRIPT = """
import sys, types
# Load weightsync.plan without weightsync/__init__.py, with torch made unimportable: the
# layout and plan modules must stay pure.
pkg = types.ModuleType("weightsync")
pkg.__path__ = [sys.argv[1]]
sys.modules["weightsync"] = pkg
sys.modules["torch"] = None
from weightsync.plan import DestPiece, Region, Shard, TensorSource, build_plan, mesh_coordinates, source_regions
regions = source_regions((8, 2), (4,), [Shard(0)], mesh_coordinates((4,)))
src = [TensorSource(n, (8, 2), "bfloat16", regions) for n in ("q", "k", "v")]
dst = [[DestPiece(n, Region((4 * d, 0), (4, 2)), "qkv", (4 * i, 0)) for i, n in enumerate(("q", "k", "v"))]
       for d in range(2)]
print(build_plan(src, dst).digest)
"""


def test_digest_independent_of_hash_seed_and_torch_free():
    import os
    import pathlib
    import subprocess
    import sys

    import weightsync.plan

    pkg_dir = str(pathlib.Path(weightsync.plan.__file__).resolve().parents[1])
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run([sys.executable, "-c", _DIGEST_SCRIPT, pkg_dir], env=env, capture_output=True,
                             text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        outs.add(run.stdout.strip())
    assert outs == {build_plan(*_qkv_inputs()).digest}
