"""Mixture-of-experts models shard to shard: FSDP2 shards of transformers' fused 3-D expert tensors
(``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) into vLLM's fused-MoE ``w13_weight`` /
``w2_weight``, with TP and with expert parallelism, bit-exact against vLLM's own ``load_weights``
of the trainer's full state dict; no tensor falls back, every worker receives its shard bytes.

The harness's vLLM (the GPU wheel) has no CPU MoE kernels: ``receiver`` stands in a prepack that
moves the contents (same shape), so a write that skipped vLLM's processing would be caught here."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from helpers import init_info, mismatches
from weightsync.testing.cluster import Layout

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

_EXPERTS = "model.layers.0.mlp.experts"


def check_moe_sync(cluster, layout: Layout, seed: int, backend: str = "weightsync_m2n") -> list:
    cluster.setup(layout)
    metas = [(s.name, s.dtype, list(s.shape)) for s in cluster.on_trainers("local_shards")[0][0]]
    dests = cluster.on_receivers("destinations", metas)
    assert [d.fallbacks for d in dests] == [()] * layout.num_workers, layout
    cluster.make_engines(init_info(backend, layout))
    for step in range(2):
        cluster.train_step(seed + step)
        assert mismatches(cluster), "the optimizer step changed the trainer's weights"
        stats = cluster.sync(f"v{step}")
        assert mismatches(cluster) == {}, (layout, step)
        if backend == "weightsync_m2n":
            assert stats["bytes_received_per_worker"] == stats["lower_bound_per_worker"]
            assert stats["fallbacks_per_worker"] == {w: 0 for w in range(layout.num_workers)}
    return dests


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qwen3_moe_fsdp_1_2_3_to_tp(cluster, tp):
    """5 experts: uneven over FSDP 2 and 3 (Shard(0) of the expert dim); TP slices of every expert."""
    for trainers in (1, 2, 3):
        dests = check_moe_sync(cluster, Layout(trainers=trainers, tp=tp, dtype="bfloat16", model="tiny_qwen3_moe",
                                               backend="weightsync_m2n"), seed=20 + trainers)
    w13 = [p for p in dests[-1].pieces if p.name == f"{_EXPERTS}.gate_up_proj"]
    assert [(p.param, p.region.sizes) for p in w13] == \
        [(f"{_EXPERTS}.routed_experts.w13_weight", (5, 32 // tp, 64))] * 2
    assert f"{_EXPERTS}.routed_experts.w13_weight" in dests[-1].via_loader  # vLLM's processing re-runs


@pytest.mark.parametrize("tp", [2, 4])
def test_qwen3_moe_expert_parallel(cluster, tp):
    """EP: each worker holds some of the 5 experts whole (uneven at EP 2 and 4)."""
    for trainers in (2, 3):
        dests = check_moe_sync(cluster, Layout(trainers=trainers, tp=tp, ep=True, dtype="bfloat16",
                                               model="tiny_qwen3_moe", backend="weightsync_m2n"), seed=30 + trainers)
    held = [sorted({e for p in d.pieces if p.name == f"{_EXPERTS}.down_proj"
                    for e in range(p.region.offsets[0], p.region.offsets[0] + p.region.sizes[0])}) for d in dests]
    assert sorted(e for h in held for e in h) == list(range(5)), held  # every expert on exactly one worker
    assert all(p.region.sizes[1:] == (64, 32) for d in dests for p in d.pieces if p.name == f"{_EXPERTS}.down_proj")


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_qwen2_moe_shared_experts(cluster, ep):
    """A second family: Qwen2-MoE, routed experts plus a shared expert and its gate."""
    for trainers in (2, 3):
        dests = check_moe_sync(cluster, Layout(trainers=trainers, tp=2, ep=ep, dtype="bfloat16",
                                               model="tiny_qwen2_moe", backend="weightsync_m2n"), seed=40 + trainers)
    names = {p.name for p in dests[0].pieces}
    assert {"model.layers.0.mlp.shared_expert.gate_proj.weight", "model.layers.0.mlp.shared_expert_gate.weight",
            f"{_EXPERTS}.gate_up_proj"} <= names


@pytest.mark.parametrize("backend", ["weightsync_nccl", "weightsync_ipc"])
def test_full_tensor_transports_reprocess_moe_layers(cluster, backend):
    """The full-tensor transports load fused experts through vLLM's loader; each layer is processed
    as on its first load (vLLM's update path would skip the experts' prepack)."""
    check_moe_sync(cluster, Layout(trainers=2, tp=2, dtype="bfloat16", model="tiny_qwen3_moe", backend=backend),
                   seed=50, backend=backend)


def test_trainer_with_more_experts_is_refused_at_init(cluster, tmp_path):
    """A trainer MoE with more experts than the engine's fails init naming the tensor, weights unchanged."""
    from weightsync.testing.actors import RemoteError

    config = json.loads((resources.files("weightsync") / "configs/tiny_qwen3_moe/config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_experts": 6}))
    layout = Layout(trainers=2, tp=2, dtype="bfloat16", model="tiny_qwen3_moe", trainer_model=str(tmp_path),
                    backend="weightsync_m2n")
    cluster.setup(layout)
    before = cluster.on_receivers("checksum")
    with pytest.raises(RemoteError, match=r"parameter 'model\.layers\.0\.mlp\.(experts\.gate_up_proj|gate\.weight)'"):
        cluster.make_engines(init_info("weightsync_m2n", layout, timeout_s=30))
    assert cluster.on_receivers("checksum") == before
