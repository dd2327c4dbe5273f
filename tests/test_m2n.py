"""M2N end to end on CPU: FSDP2 shards straight into live vLLM parameters (TP over gloo), checked
against vLLM's own ``load_weights`` of the trainer's full state dict, with no gather on the trainer."""

from __future__ import annotations

import pytest

from weightsync.local.actors import RemoteError
from weightsync.local.cluster import Layout, free_port
from weightsync.transport.m2n import M2NTrainerInitInfo

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def m2n_info(layout: Layout, staging_bytes: int = 1 << 16) -> M2NTrainerInitInfo:
    return M2NTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), num_trainer_ranks=layout.trainers,
                              world_size=layout.trainers + layout.num_workers, dst_mesh_dims=(layout.replicas, layout.tp),
                              staging_bytes=staging_bytes, device="cpu", timeout_s=60, rank=0)


def mismatches(cluster) -> dict[str, list[str]]:
    return {k: v for k, v in cluster.verify().items() if v}


def sync_without_gathers(cluster, version: str) -> list[dict]:
    futs = [a.submit("helpers:send_weights_without_gathers", version) for a in cluster.active_trainers]
    return [f.result() for f in futs]


def check_two_syncs(cluster, layout: Layout, seed: int) -> None:
    cluster.setup(layout)
    cluster.make_engines(m2n_info(layout), source="dtensor")
    for step in range(2):
        cluster.train_step(seed + step)
        assert mismatches(cluster), "the optimizer step changed the trainer's weights"
        stats = sync_without_gathers(cluster, f"v{step}")[0]
        assert mismatches(cluster) == {}, layout
        # each worker received exactly its shard bytes: ratio to the lower bound 1.00
        assert stats["received"] == stats["lower_bound"] and len(stats["received"]) == layout.num_workers
    assert cluster.client().weight_versions() == ["v1"] * layout.num_workers


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_m2n_fsdp_1_2_3_to_tp(cluster, tp):
    for trainers in (1, 2, 3):
        check_two_syncs(cluster, Layout(trainers=trainers, tp=tp, backend="weightsync_m2n"), seed=10 * trainers)


@pytest.mark.parametrize("layout", [
    Layout(trainers=2, tp=2, replicas=2, backend="weightsync_m2n"),
    Layout(trainers=2, tp=2, model="tiny_llama", backend="weightsync_m2n"),
    Layout(trainers=2, tp=2, dtype="bfloat16", backend="weightsync_m2n"),
    Layout(trainers=3, tp=2, dtype="bfloat16", model="tiny_llama", backend="weightsync_m2n"),
], ids=["qwen3-2x2", "llama", "qwen3-bf16", "llama-bf16-3to2"])
def test_m2n_replicas_llama_bf16(cluster, layout):
    check_two_syncs(cluster, layout, seed=7)


def test_gather_guard_catches_a_gathering_transport(cluster):
    """The guard used above is real: the broadcast path (full_tensor) trips it."""
    from weightsync.transport.nccl import NCCLTrainerInitInfo

    layout = Layout(trainers=2, tp=2)
    cluster.setup(layout)
    cluster.make_engines(NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), world_size=3,
                                             device="cpu", timeout_s=30, rank=0))
    futs = [a.submit("helpers:send_weights_without_gathers", "x") for a in cluster.active_trainers]
    for f in futs:
        with pytest.raises(RemoteError, match="full_tensor called during send_weights"):
            f.result()


def test_model_mismatch_fails_init_on_every_rank_before_data_moves(cluster):
    layout = Layout(trainers=2, tp=2, backend="weightsync_m2n", trainer_model="tiny_qwen3_kv1")
    cluster.setup(layout)
    before = cluster.on_receivers("checksum")
    info = m2n_info(layout)
    futs = [a.submit("weightsync.local.trainer:make_engine", info, cluster.client(), source="dtensor")
            for a in cluster.active_trainers]
    for f in futs:
        with pytest.raises(RemoteError, match=r"ValueError: parameter 'model.layers.0.self_attn.k_proj.weight': "
                                              r"the trainer's shape \(32, 64\) does not match vLLM's "
                                              r"model.layers.0.self_attn.qkv_proj.weight"):
            f.result()
    assert cluster.on_receivers("checksum") == before
