"""Per-expert trainer weights (``experts.{e}.gate_proj.weight``, as DeepSeek-V3 / Kimi-K2 remote code
holds them) fused at the source (``DTensorModuleSource(fuse_experts=True)``) into one 3-D tensor
per layer and projection, placed shard to shard in vLLM's fused-MoE ``w13_weight`` / ``w2_weight``;
bit-exact against vLLM's own ``load_weights`` of the trainer's per-expert state dict."""

from __future__ import annotations

import pytest
import torch

from helpers import init_info, mismatches
from weightsync.plan import Replicate, Shard
from weightsync.protocol import ParamMeta
from weightsync.testing.cluster import Layout
from weightsync.trainer.sources import fuse_expert_metas

_EXPERTS = "model.layers.0.mlp.experts"
_W13 = f"{_EXPERTS}.routed_experts.w13_weight"
_ROWS = (Shard(0),)


def _meta(name: str, shape=(8, 4), placements=_ROWS, dtype=None) -> ParamMeta:
    return ParamMeta(name, dtype or torch.bfloat16, shape, mesh_shape=(2,), placements=placements,
                     rank_coordinates=((0,), (1,)))


def test_fuse_expert_metas_stacks_groups_of_ids_0_to_e_and_leaves_the_rest():
    p = "model.layers.1.mlp.experts"
    metas = [_meta("model.norm.weight", (4,), (Replicate(),))]
    metas += [_meta(f"{p}.{e}.{leaf}.weight", (8, 4) if leaf != "down_proj" else (4, 8), (Shard(0),))
              for e in (1, 0, 2) for leaf in ("gate_proj", "up_proj", "down_proj")]
    metas += [_meta(f"{p}.3.gate_proj.weight")]  # id 3 of gate: 0..3, fused; up / down stop at 2
    metas += [_meta(f"model.layers.2.mlp.experts.{e}.gate_proj.weight", dtype=torch.float32 if e else None)
              for e in range(2)]  # dtypes differ: stays per-expert
    metas += [_meta(f"model.layers.3.mlp.experts.{e}.gate_proj.weight") for e in (0, 2)]  # a gap: stays
    out, members = fuse_expert_metas(metas)
    assert members == {f"{p}.gate_proj": [f"{p}.{e}.gate_proj.weight" for e in range(4)],
                       f"{p}.up_proj": [f"{p}.{e}.up_proj.weight" for e in range(3)],
                       f"{p}.down_proj": [f"{p}.{e}.down_proj.weight" for e in range(3)]}
    names = [m.name for m in out]
    assert names[:4] == ["model.norm.weight", f"{p}.gate_proj", f"{p}.up_proj", f"{p}.down_proj"]  # at id 0's place
    assert names[4:] == [m.name for m in metas[-4:]]
    gate, down = out[1], out[3]
    assert (gate.shape, gate.placements, gate.dtype) == ((4, 8, 4), (Shard(1),), torch.bfloat16)
    assert (down.shape, down.placements, down.rank_coordinates) == ((3, 4, 8), (Shard(1),), ((0,), (1,)))


def test_a_fused_name_that_exists_already_is_not_made_twice():
    taken = [_meta("m.experts.gate_proj", (2, 8, 4))] + [_meta(f"m.experts.{e}.gate_proj.weight") for e in range(2)]
    out, members = fuse_expert_metas(taken)
    assert members == {} and out == taken


def _per_expert_module(experts: int = 3):
    layer = torch.nn.Module()
    layer.experts = torch.nn.ModuleList(torch.nn.ModuleDict(
        {k: torch.nn.Linear(4, 6, bias=False) if k != "down_proj" else torch.nn.Linear(6, 4, bias=False)
         for k in ("gate_proj", "up_proj", "down_proj")}) for _ in range(experts))
    root = torch.nn.Module()
    root.mlp = layer
    return root


def test_the_source_stacks_local_experts_and_suggests_fusing_when_off(caplog):
    from weightsync.trainer.sources import DTensorModuleSource

    module = _per_expert_module()
    fused = DTensorModuleSource(module, 1, fuse_experts=True)
    assert [m.name for m in fused.metadata] == ["mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj"]
    local = dict(fused.iter_local())
    assert torch.equal(local["mlp.experts.down_proj"], torch.stack([e["down_proj"].weight for e in module.mlp.experts]))
    with caplog.at_level("WARNING", logger="weightsync.trainer.sources"):
        plain = DTensorModuleSource(module, 1).metadata
    assert len(plain) == 9 and "9 per-expert weights (e.g. 'mlp.experts.0.gate_proj.weight') could go as 3 fused" \
        in caplog.text and "fuse_experts=True" in caplog.text
    with pytest.raises(ValueError, match="fuse_experts must be a bool, got 'yes'"):
        DTensorModuleSource(module, 1, fuse_experts="yes")


def check_per_expert_sync(cluster, layout: Layout, seed: int, *, fuse: bool = True) -> list:
    cluster.setup(layout)
    metas = [(s.name, s.dtype, list(s.shape)) for s in cluster.on_trainers("local_shards", fuse)[0][0]]
    dests = cluster.on_receivers("destinations", metas)
    cluster.make_engines(init_info("weightsync_m2n", layout), fuse_experts=fuse)
    for step in range(2):
        cluster.train_step(seed + step)
        assert mismatches(cluster), "the optimizer step changed the trainer's weights"
        stats = cluster.sync(f"v{step}")
        assert mismatches(cluster) == {}, (layout, step)
        if fuse:
            assert stats["bytes_received_per_worker"] == stats["lower_bound_per_worker"]
            assert stats["fallbacks_per_worker"] == {w: 0 for w in range(layout.num_workers)}
    return dests


@pytest.mark.vllm
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("tp", [1, 2])
def test_per_expert_trainer_fused_at_the_source_lands_shard_to_shard(cluster, tp):
    """5 per-expert MLPs of 32 x 64, FSDP 1/2/3 (rows of every expert; uneven at 3), TP 1 and 2."""
    for trainers in (1, 2, 3):
        dests = check_per_expert_sync(cluster, Layout(trainers=trainers, tp=tp, dtype="bfloat16",
                                                      model="tiny_qwen3_moe", backend="weightsync_m2n",
                                                      per_expert=True), seed=60 + trainers)
        assert all(d.fallbacks == () for d in dests)
    pieces = {p.name: p for p in dests[-1].pieces if p.param == _W13}
    half = 32 // tp  # the last worker: TP rank tp - 1
    assert {n: (p.region.offsets, p.region.sizes, p.param_offsets) for n, p in pieces.items()} == {
        f"{_EXPERTS}.gate_proj": ((0, (tp - 1) * half, 0), (5, half, 64), (0, 0, 0)),
        f"{_EXPERTS}.up_proj": ((0, (tp - 1) * half, 0), (5, half, 64), (0, half, 0))}


@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_per_expert_trainer_fused_with_expert_parallelism_and_tp_aligned_shards(cluster):
    """EP 2: each worker holds some experts whole; tp-aligned FSDP shards down_proj on its dim 1."""
    for trainers, aligned in ((2, False), (2, True), (3, False)):
        check_per_expert_sync(cluster, Layout(trainers=trainers, tp=2, ep=True, dtype="bfloat16", tp_aligned=aligned,
                                              model="tiny_qwen3_moe", backend="weightsync_m2n", per_expert=True),
                              seed=70 + trainers)


@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_per_expert_trainer_without_fusing_goes_through_the_loader(cluster):
    """Without ``fuse_experts`` each expert's tensors take vLLM's loader path: exact, not shard to shard."""
    dests = check_per_expert_sync(cluster, Layout(trainers=2, tp=2, dtype="bfloat16", model="tiny_qwen3_moe",
                                                  backend="weightsync_m2n", per_expert=True), seed=80, fuse=False)
    assert _W13 in dests[0].reached and dests[0].fallbacks  # whole tensors through load_weights
