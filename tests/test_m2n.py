"""M2N end to end on CPU: FSDP2 shards straight into live vLLM parameters (TP over gloo), checked
against vLLM's own ``load_weights`` of the trainer's full state dict, with no gather on the trainer.
Bad inputs and faulty sources: ``test_failures.py``."""

from __future__ import annotations

import pytest

from helpers import init_info, mismatches
from weightsync.testing.actors import RemoteError
from weightsync.testing.cluster import Layout

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def sync_without_gathers(cluster, version: str) -> list[dict]:
    return cluster.on_trainers("weightsync.testing.probes:send_weights_without_gathers", version)


def check_two_syncs(cluster, layout: Layout, seed: int) -> None:
    cluster.setup(layout)
    cluster.make_engines(init_info("weightsync_m2n", layout), source="local")
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


def test_tp_aligned_shards(cluster):
    """FSDP2 shards the row-parallel weights on dim 1 (``ModelConfig.tp_aligned_shards``): bit-exact,
    and with as many trainer ranks as TP only the small messages that pack several items go through
    staging, against over a tenth of the bytes with dim-0 shards."""
    layout = Layout(trainers=2, tp=2, tp_aligned=True, model="small_qwen3", backend="weightsync_m2n")
    check_two_syncs(cluster, layout, seed=3)  # (small: pieces big enough to go alone)
    aligned = cluster.on_trainers("weightsync.testing.probes:m2n_staged_bytes")
    default = Layout(trainers=2, tp=2, model="small_qwen3", backend="weightsync_m2n")
    cluster.setup(default)
    cluster.make_engines(init_info("weightsync_m2n", default), source="local")
    rows = cluster.on_trainers("weightsync.testing.probes:m2n_staged_bytes")
    assert all(s["staged"] < s["total"] / 100 for s in aligned), aligned
    assert all(s["staged"] > s["total"] / 10 for s in rows), rows


def test_tp_aligned_shards_need_even_columns(cluster):
    with pytest.raises(RemoteError, match="ModelConfig.tp_aligned_shards: parameter 'model.layers.0.self_attn.o_proj"
                                          ".weight' has 128 columns, which do not divide by the 3 FSDP ranks"):
        cluster.setup(Layout(trainers=3, tp=2, tp_aligned=True, backend="weightsync_m2n"))


def test_gather_guard_catches_a_gathering_transport(cluster):
    """The guard used above is real: the broadcast path (full_tensor) trips it."""
    layout = Layout(trainers=2, tp=2)
    cluster.setup(layout)
    cluster.make_engines(init_info("weightsync_nccl", layout, timeout_s=30))
    futs = [a.submit("weightsync.testing.probes:send_weights_without_gathers", "x") for a in cluster.active_trainers]
    for f in futs:
        with pytest.raises(RemoteError, match="full_tensor called during send_weights"):
            f.result()


@pytest.mark.parametrize("backend", ["weightsync_m2n", "weightsync_nccl", "weightsync_ipc"])
def test_workers_report_their_own_phases(cluster, backend):
    """``SyncStats.worker_phases``: every worker's own start / receive / finish seconds, from the
    engines (no instrumentation); receiving the weights is most of a worker's sync here. Rank 0's
    phases add up to no more than its sync."""
    from helpers import SOURCES, init_info

    layout = Layout(trainers=2, tp=2, backend=backend)
    cluster.setup(layout)
    cluster.make_engines(init_info(backend, layout), source=SOURCES[backend])
    stats = cluster.sync("phases")
    assert sorted(stats["worker_phases"]) == list(range(layout.num_workers))
    for w, phases in stats["worker_phases"].items():
        assert set(phases) == {"start", "receive", "finish"}, (w, phases)
        assert all(0 <= s < stats["seconds"] for s in phases.values()), (w, phases, stats["seconds"])
        assert phases["receive"] > 0
    # rank 0's own: the wait for the engines' start counts once, in "start" (a sender packs meanwhile)
    assert set(stats["phases"]) == {"preflight", "start", "transfer", "finish"}, stats["phases"]
    assert all(s >= 0 for s in stats["phases"].values()) and sum(stats["phases"].values()) <= stats["seconds"]
