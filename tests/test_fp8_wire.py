"""FP8 on the wire (issue 38, mode (b)), the pure planning: which blocks each trainer rank holds
whole, the derived ``X@fp8`` / ``X@scale`` sources, and how a worker's piece into a block-FP8 weight
splits between them and the trainer's dtype. The end-to-end checks (bit-exact against vLLM's load of
the reference-quantized checkpoint, bytes per worker) are in ``tests/test_fp8.py``."""

from __future__ import annotations

import pytest
import torch

from oracle import iter_items
from weightsync.plan.fp8_blocks import (
    FP8_SUFFIX,
    SCALE_SUFFIX,
    block_count,
    check_block,
    split_piece,
    whole_blocks,
    wire_sources,
)
from weightsync.plan.regions import Region, uncovered
from weightsync.plan.transfer import DestPiece, TensorSource, build_plan

B = (128, 128)


def rows(a: int, b: int, cols: int = 256) -> Region:
    return Region((a, 0), (b - a, cols))


def fsdp3(n: int = 512, cols: int = 256) -> tuple[Region, ...]:
    c = -(-n // 3)
    return tuple(rows(min(k * c, n), min((k + 1) * c, n), cols) for k in range(3))


def test_whole_blocks_are_the_blocks_inside_a_shard_edge_blocks_included():
    assert whole_blocks(rows(0, 171), (512, 256), B) == rows(0, 128)
    assert whole_blocks(rows(171, 342), (512, 256), B).is_empty  # both of its blocks are cut
    assert whole_blocks(rows(342, 512), (512, 256), B) == rows(384, 512)
    assert whole_blocks(rows(200, 300, 200), (300, 200), B) == Region((256, 0), (44, 200))  # partial edge blocks
    assert whole_blocks(Region((0, 64), (256, 192)), (256, 256), B) == Region((128 * 0, 128), (256, 128))
    assert whole_blocks(rows(0, 0), (512, 256), B).is_empty


def test_wire_sources_derive_fp8_and_scales_of_each_2d_float_tensor():
    q = TensorSource("q.weight", (512, 256), "bfloat16", fsdp3())
    norm = TensorSource("norm.weight", (256,), "bfloat16", (Region((0,), (86,)), Region((86,), (86,)),
                                                            Region((172,), (84,))))
    ids = TensorSource("ids", (4, 4), "int64", (rows(0, 4, 4), rows(4, 4, 4), rows(4, 4, 4)))
    out = wire_sources([q, norm, ids], B)
    assert [s.name for s in out] == ["q.weight", "norm.weight", "ids", "q.weight@fp8", "q.weight@scale"]
    fp8, scale = out[3:]
    assert (fp8.dtype, fp8.shape, scale.dtype, scale.shape) == ("float8_e4m3fn", (512, 256), "float32", (4, 2))
    assert fp8.regions[0] == rows(0, 128) and fp8.regions[1].is_empty and fp8.regions[2] == rows(384, 512)
    assert scale.regions[0] == Region((0, 0), (1, 2)) and scale.regions[2] == Region((3, 0), (1, 2))
    with pytest.raises(ValueError, match=r"^parameter 'q\.weight@fp8': the trainer sends a tensor of this name"):
        wire_sources([q, TensorSource("q.weight@fp8", (1,), "bfloat16", (Region((0,), (1,)),) * 3)], B)


def test_a_piece_splits_into_whole_blocks_on_the_wire_and_cut_blocks_in_the_trainer_dtype():
    """A worker's rows 0..512 of q (FSDP 3: shards cut at 171 and 342) land at rows 128.. of a fused weight."""
    src = TensorSource("q.weight", (512, 256), "bfloat16", fsdp3())
    piece = DestPiece("q.weight", rows(0, 512), "qkv.weight", (128, 0))
    wire, staged = split_piece(piece, src, B, "qkv.weight@fp8", "qkv.weight_scale_inv")
    assert wire == [DestPiece("q.weight@fp8", rows(0, 128), "qkv.weight@fp8", (128, 0)),
                    DestPiece("q.weight@scale", Region((0, 0), (1, 2)), "qkv.weight_scale_inv", (1, 0)),
                    DestPiece("q.weight@fp8", rows(384, 512), "qkv.weight@fp8", (512, 0)),
                    DestPiece("q.weight@scale", Region((3, 0), (1, 2)), "qkv.weight_scale_inv", (4, 0))]
    assert staged == [DestPiece("q.weight", rows(128, 384), "qkv.weight", (256, 0))]
    assert sum(block_count(p.region, B) for p in staged) == 4
    # every element of the piece exactly once, fp8 or staged
    assert uncovered((512, 256), [p.region for p in wire + staged if not p.name.endswith(SCALE_SUFFIX)]) == []
    # the plan moves each whole block from its holder: 1 byte per element plus a 4-byte scale
    plan = build_plan(wire_sources([src], B), [wire + staged])
    assert plan.coverage().lower_bound == (2 * 128 * 256 * 1 + 4 * 4 + 256 * 256 * 2,)
    assert {i.src_rank for i in iter_items(plan) if i.name.endswith(FP8_SUFFIX)} == {0, 2}


def test_a_piece_inside_one_shard_goes_whole_on_the_wire():
    src = TensorSource("k.weight", (256, 256), "float32", (rows(0, 128), rows(128, 256)))
    wire, staged = split_piece(DestPiece("k.weight", rows(128, 256), "qkv.weight", (0, 0)), src, B,
                               "qkv.weight@fp8", "qkv.weight_scale_inv")
    assert staged == [] and [p.region for p in wire] == [rows(128, 256), Region((1, 0), (1, 2))]


def test_block_sizes_are_checked_naming_the_field():
    assert check_block([128, 128]) == (128, 128)
    for bad in ((0, 128), (128,), "128", (128.0, 128)):
        with pytest.raises(ValueError, match=r"^fp8_block must be \(rows, cols\) of positive ints"):
            check_block(bad)
    from weightsync.transports.m2n import M2NTrainerInitInfo

    with pytest.raises(ValueError, match=r"^fp8_block must be"):
        M2NTrainerInitInfo.for_deployment(num_trainer_ranks=2, replicas=1, tp=2, device="cpu", master_port=1,
                                          fp8_wire=True, fp8_block=(128, -1))
    with pytest.raises(ValueError, match=r"^fp8_wire must be a bool, got 'yes'"):
        M2NTrainerInitInfo.for_deployment(num_trainer_ranks=2, replicas=1, tp=2, device="cpu", master_port=1,
                                          fp8_wire="yes")


def test_the_workers_quantize_only_their_staged_boxes():
    from weightsync.worker.fp8 import quantize_blocks, quantize_into

    g = torch.Generator().manual_seed(5)
    x = torch.randn(384, 256, generator=g)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.zeros(384, 256, dtype=torch.float8_e4m3fn), requires_grad=False)
    layer.weight_scale_inv = torch.nn.Parameter(torch.full((3, 2), -1.0), requires_grad=False)
    quantize_into(layer, {"weight": x}, B, {"weight": [rows(128, 256)]})
    q, s = quantize_blocks(x, B)
    assert torch.equal(layer.weight[128:256].view(torch.uint8), q[128:256].view(torch.uint8))
    assert torch.equal(layer.weight_scale_inv[1], s[1]) and bool((layer.weight_scale_inv[[0, 2]] == -1).all())
    assert not layer.weight[:128].view(torch.uint8).any() and not layer.weight[256:].view(torch.uint8).any()
