"""Failure semantics on CPU: bad input is rejected on every rank before data moves, a dead peer
wakes everyone within the timeout, failed syncs leave the weights and the version as they were,
a re-init recovers, and verified syncs do not leak."""

from __future__ import annotations

import re
import time

import pytest

from weightsync import RemoteCallError
from weightsync.local.actors import RemoteError
from weightsync.local.cluster import Layout, free_port
from weightsync.transport.m2n import M2NTrainerInitInfo
from weightsync.transport.nccl import NCCLTrainerInitInfo

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

TIMEOUT = 10.0
M2N = Layout(trainers=2, tp=2, backend="weightsync_m2n")
NCCL = Layout(trainers=2, tp=2, backend="weightsync_nccl")
BAD = "model.layers.1.mlp.up_proj.weight"


def m2n_info(**kw) -> M2NTrainerInitInfo:
    args = dict(master_address="127.0.0.1", master_port=free_port(), num_trainer_ranks=2, world_size=4,
                dst_mesh_dims=(1, 2), device="cpu", timeout_s=TIMEOUT, staging_bytes=1 << 14, rank=0)
    return M2NTrainerInitInfo(**{**args, **kw})


def nccl_info(**kw) -> NCCLTrainerInitInfo:
    args = dict(master_address="127.0.0.1", master_port=free_port(), world_size=3, device="cpu",
                timeout_s=TIMEOUT, bucket_bytes=1 << 16, rank=0)
    return NCCLTrainerInitInfo(**{**args, **kw})


def on_every_trainer(cluster, fn: str, *args, **kwargs) -> list[str]:
    """Run ``fn`` on every trainer rank; return each rank's error text (all must fail)."""
    futs = [a.submit(fn, *args, **kwargs) for a in cluster.active_trainers]
    errors = []
    for f in futs:
        with pytest.raises(RemoteError) as e:
            f.result(timeout=3 * TIMEOUT)
        errors.append(str(e.value).split("\nTraceback")[0])
    return errors


def make(info, source):
    return lambda cluster: on_every_trainer(cluster, "weightsync.local.trainer:make_engine", info(), cluster.client(),
                                            source=source)


def sync_with(info, source):
    def run(cluster):
        cluster.make_engines(info(), source=source)
        return on_every_trainer(cluster, "weightsync.local.trainer:send_weights", "bad")
    return run


def construct(**kw):
    def run(cluster):
        with pytest.raises(ValueError) as e:
            m2n_info(**kw)
        return [str(e.value)] * 2  # built on every trainer rank from the same values
    return run


BAD_INPUTS = {
    "nccl: tensor larger than the bucket": (
        NCCL, sync_with(lambda: nccl_info(bucket_bytes=4096), "full"),
        r"parameter 'model.embed_tokens.weight' has 38656 bytes, more than bucket_bytes=4096"),
    "nccl: source yields a wrong shape": (
        NCCL, sync_with(nccl_info, "helpers:bad_shape"), rf"parameter '{BAD}': metadata says .* source yielded"),
    "nccl: source yields a wrong dtype": (
        NCCL, sync_with(nccl_info, "helpers:bad_dtype"), rf"parameter '{BAD}': metadata says .*torch.float16"),
    "nccl: source yields a wrong name": (
        NCCL, sync_with(nccl_info, "helpers:bad_name"), rf"parameter '{BAD}': .*'{BAD}.typo'"),
    "nccl: source stops early": (
        NCCL, sync_with(nccl_info, "helpers:stops_early"), rf"parameter '{BAD}': source stopped after"),
    "m2n: local shard of the wrong shape": (
        M2N, sync_with(m2n_info, "helpers:local_shape"),
        rf"parameter '{BAD}': expected a local shard torch.float32 \(64, 64\), source yielded torch.float32 \(63, 64\)"),
    "m2n: local shard missing": (
        M2N, sync_with(m2n_info, "helpers:local_missing"), rf"parameter '{BAD}': the source yielded no local shard"),
    "m2n: duplicate name in metadata": (
        M2N, make(m2n_info, "helpers:duplicate"), r"parameter 'model.embed_tokens.weight' appears twice"),
    "m2n: trainer ranks disagree on metadata": (
        M2N, make(m2n_info, "helpers:rank1_differs"), r"trainer rank 1's metadata differs from trainer rank 0's"),
    "m2n: unsupported dtype": (
        M2N, make(m2n_info, "helpers:complex_dtype"), rf"parameter '{BAD}': dtype torch.complex64 is not supported"),
    "m2n: trainer model differs from vLLM's": (
        Layout(trainers=2, tp=2, backend="weightsync_m2n", trainer_model="tiny_qwen3_kv1"),
        make(m2n_info, "dtensor"), r"parameter 'model.layers.0.self_attn.k_proj.weight': the trainer's shape"),
    "m2n: dst_mesh_dims smaller than the deployment": (
        M2N, make(lambda: m2n_info(dst_mesh_dims=(1, 1), world_size=3), "dtensor"),
        r"the trainer's dst_mesh_dims=\(1, 1\) describes 1 worker\(s\), but the client drives 1 engine\(s\) of 2 "
        r"worker\(s\) each"),
    "m2n: staging too small for the peers": (
        M2N, construct(staging_bytes=64), r"staging_bytes=64 is too small for 2 peers"),
    "m2n: world_size inconsistent with the meshes": (
        M2N, construct(world_size=5), r"world_size must be num_trainer_ranks \+ replicas \* tp = 4, got 5"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_rejected_on_every_rank_fast_weights_unchanged(cluster, case):
    layout, action, message = BAD_INPUTS[case]
    cluster.setup(layout)
    before = cluster.on_receivers("checksum")
    versions = cluster.client().weight_versions()
    t0 = time.perf_counter()
    errors = action(cluster)
    elapsed = time.perf_counter() - t0
    assert len(errors) == layout.trainers
    for err in errors:
        assert re.search(message, err), (case, err)
    assert elapsed < 5, f"{case}: rejected after {elapsed:.1f} s"
    assert cluster.on_receivers("checksum") == before
    assert cluster.client().weight_versions() == versions


def test_worker_init_info_with_an_unknown_field_is_rejected_by_every_worker(cluster):
    cluster.setup(M2N)
    with pytest.raises(RemoteCallError, match=r"failed on 2 worker\(s\).*unknown field\(s\) \['bogus'\]"):
        cluster.client().init_weight_transfer_engine({"bogus": 1})


def kill_mid_sync(cluster, layout, info, source, pick) -> float:
    cluster.setup(layout, fresh=True)
    victim = pick(cluster)
    cluster.make_engines(info, source=source)
    cluster.sync(weight_version="good")
    cluster.train_step(1)
    cluster.on_trainers("helpers:slow_data_plane", 0.3)
    futs = [a.submit("weightsync.local.trainer:send_weights", "bad") for a in cluster.active_trainers]
    time.sleep(1.0)
    t0 = time.perf_counter()
    victim.kill()
    survivors = [(a, f) for a, f in zip(cluster.active_trainers, futs) if a is not victim]
    for _, f in survivors:
        with pytest.raises((RemoteError, OSError, EOFError)):
            f.result(timeout=2 * TIMEOUT)
    return time.perf_counter() - t0


def recover_and_verify(cluster, layout, make_info, source) -> None:
    assert cluster.replace_dead()
    cluster.setup(layout, fresh=True)
    cluster.make_engines(make_info(), source=source)
    cluster.train_step(2)
    cluster.sync(weight_version="recovered", verify=True)
    assert {k: v for k, v in cluster.verify().items() if v} == {}
    assert cluster.client().weight_versions() == ["recovered"] * layout.num_workers


@pytest.mark.parametrize("layout, make_info, source", [(M2N, m2n_info, "dtensor"), (NCCL, nccl_info, "full")],
                         ids=["m2n", "nccl"])
def test_killing_a_receiver_mid_sync(cluster, layout, make_info, source):
    elapsed = kill_mid_sync(cluster, layout, make_info(), source, pick=lambda c: c.receivers[1])
    assert elapsed < 2 * TIMEOUT
    assert cluster.receivers[0].call("weightsync.local.receiver:weight_version") == "good"
    assert cluster.receivers[0].call("helpers:engine_poisoned")  # it raised, rolled back, refuses updates
    recover_and_verify(cluster, layout, make_info, source)


def test_killing_a_trainer_rank_mid_m2n_sync(cluster):
    elapsed = kill_mid_sync(cluster, M2N, m2n_info(), "dtensor", pick=lambda c: c.trainers[1])
    assert elapsed < 2 * TIMEOUT
    assert [a.call("weightsync.local.receiver:weight_version") for a in cluster.receivers[:2]] == ["good", "good"]
    assert all(a.call("helpers:engine_poisoned") for a in cluster.receivers[:2])  # both workers raised
    recover_and_verify(cluster, M2N, m2n_info, "dtensor")


def test_verified_syncs_do_not_leak(cluster):
    cluster.setup(M2N)
    cluster.make_engines(m2n_info(), source="dtensor")
    procs = cluster.active_trainers + cluster.active_receivers

    def snapshot():
        res = [a.call("helpers:process_resources", collect=True) for a in procs]
        return res, [a.call("helpers:thread_count") for a in procs]

    for i in range(3):
        cluster.sync(weight_version=f"warm{i}", verify=True)
    (r0, t0) = snapshot()
    for i in range(20):  # benchmarks/soak.py runs 200
        stats = cluster.sync(weight_version=f"soak{i}", verify=True)
        assert stats["verified"] is True
    (r1, t1) = snapshot()
    assert {k: v for k, v in cluster.verify().items() if v} == {}
    growth = [(b["rss"] - a["rss"]) / a["rss"] for a, b in zip(r0, r1)]
    print("RSS growth per process over 20 verified syncs:", [f"{g:+.2%}" for g in growth],
          "fds", [(a["fds"], b["fds"]) for a, b in zip(r0, r1)], "threads", list(zip(t0, t1)))
    assert max(growth) < 0.01
    assert all(b["fds"] <= a["fds"] for a, b in zip(r0, r1))  # no growth
    assert all(b <= a for a, b in zip(t0, t1))
