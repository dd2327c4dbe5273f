"""Failure semantics on CPU: bad input is rejected on every rank before data moves (or, mid-sync,
rolled back), a dead peer wakes everyone within the timeout, failed syncs leave the weights and the
version as they were, a re-init recovers, and verified syncs do not leak."""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import tempfile
import time

import pytest

from helpers import SOURCES, TRANSPORTS, init_info, mismatches
from weightsync import RemoteCallError
from weightsync.registry import transport
from weightsync.testing.actors import RemoteError
from weightsync.testing.cluster import Layout
from weightsync.testing.faults import BAD_NAME as BAD
from weightsync.testing.faults import EXTRA_NAME as EXTRA

pytestmark = [pytest.mark.timeout(900)]
vllm = pytest.mark.vllm

TIMEOUT = 10.0
"""timeout_s of the syncs a killed peer fails: a peer that is gone may be noticed only at the timeout."""
FAST_TIMEOUT = 60.0
"""timeout_s of the syncs that fail fast (bad input, a source error): each must fail well before it (in
under half of it), which still holds on a loaded machine, where a fast failure has taken over 5 s."""
M2N = Layout(trainers=2, tp=2, backend="weightsync_m2n")
NCCL = Layout(trainers=2, tp=2, backend="weightsync_nccl")


def info(backend: str, **kw):
    """An init info for 2 trainer ranks -> TP 2 (small buffers: a sync takes several rounds or buckets),
    ``timeout_s=FAST_TIMEOUT``, with the fields in ``kw`` replaced (validated again)."""
    buffer = 1 << 14 if SOURCES[backend] == "local" else 1 << 16  # the reshard core: several rounds
    return dataclasses.replace(init_info(backend, Layout(trainers=2, tp=2), buffer_bytes=buffer,
                                         timeout_s=FAST_TIMEOUT), **kw)


def m2n_info(**kw):
    return info("weightsync_m2n", **kw)


def nccl_info(**kw):
    return info("weightsync_nccl", **kw)


def failed_before_the_timeout(elapsed: float, what: str = "") -> None:
    """A failure every rank reports at once comes back in under half of ``timeout_s`` (FAST_TIMEOUT): no
    rank waited it out (stated relative to the timeout, not in absolute seconds: the suite runs on loaded
    machines)."""
    assert elapsed < FAST_TIMEOUT / 2, f"{what}failed after {elapsed:.1f} s: a rank waited for timeout_s={FAST_TIMEOUT}"


def on_every_trainer(cluster, fn: str, *args, **kwargs) -> list[str]:
    """Run ``fn`` on every trainer rank; return each rank's error text (all must fail)."""
    futs = [a.submit(fn, *args, **kwargs) for a in cluster.active_trainers]
    errors = []
    for f in futs:
        with pytest.raises(RemoteError) as e:
            f.result(timeout=2 * FAST_TIMEOUT)
        errors.append(str(e.value).split("\nTraceback")[0])
    return errors


# --- built in the test process: no cluster ---------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    ({"staging_bytes": 64}, r"staging_bytes=64 is too small for 2 peers"),
    ({"world_size": 5}, r"world_size must be num_trainer_ranks \+ replicas \* tp = 4, got 5"),
], ids=["staging too small for the peers", "world_size inconsistent with the meshes"])
def test_m2n_init_info_inconsistent_with_the_deployment_is_rejected_at_construction(kw, message):
    with pytest.raises(ValueError, match=message):
        m2n_info(**kw)


# --- faulty sources, every transport ----------------------------------------------------------
FAULT_MESSAGES = {
    ("full", "shape"): rf"parameter '{BAD}': metadata says '{BAD}' torch.float32 \(128, 64\), "
                       rf"source yielded '{BAD}' torch.float32 \(127, 64\)",
    ("full", "dtype"): rf"parameter '{BAD}': metadata says .*torch.float32.* source yielded .*torch.float16",
    ("full", "name"): rf"parameter '{BAD}': .*source yielded '{BAD}.typo'",
    ("full", "stops_early"): rf"parameter '{BAD}': source stopped after",
    ("local", "shape"): rf"parameter '{BAD}': expected a local shard torch.float32 \(64, 64\), "
                        rf"source yielded torch.float32 \(63, 64\)",
    ("local", "dtype"): rf"parameter '{BAD}': expected a local shard torch.float32 \(64, 64\), "
                        rf"source yielded torch.float16 \(64, 64\)",
    ("local", "name"): rf"parameter '{BAD}.typo': the source yielded it but its metadata does not list it",
    ("local", "stops_early"): rf"parameter '{BAD}': the source yielded no local shard for it",
}


@vllm
@pytest.mark.parametrize("fault", ["shape", "dtype", "name", "stops_early"])
@pytest.mark.parametrize("backend", TRANSPORTS)
def test_source_disagreeing_with_metadata_fails_every_rank_fast_and_workers_roll_back(cluster, backend, fault):
    layout, source = Layout(trainers=2, tp=2, backend=backend), SOURCES[backend]
    cluster.setup(layout)
    cluster.make_engines(info(backend), source=source)
    cluster.sync(weight_version="good")
    before = cluster.on_receivers("checksum")
    cluster.train_step(1)

    t0 = time.perf_counter()  # earlier tensors move first: the source gathers 64 KiB at a time
    cluster.make_engines(info(backend, rollback=True), source=source, fault=fault, bucket_bytes=1 << 16)
    errors = on_every_trainer(cluster, "weightsync.testing.trainer:send_weights", "bad")
    elapsed = time.perf_counter() - t0
    assert len(errors) == layout.trainers
    for err in errors:  # every trainer rank raises, naming the parameter
        assert re.search(FAULT_MESSAGES[source, fault], err), err
    failed_before_the_timeout(elapsed)
    assert cluster.on_receivers("checksum") == before
    assert cluster.client().weight_versions() == ["good"] * layout.num_workers

    cluster.make_engines(info(backend), source=source)  # the workers take the next sync
    cluster.sync(weight_version="after")
    assert mismatches(cluster) == {}


@vllm
@pytest.mark.parametrize("backend", TRANSPORTS)
def test_a_source_raising_on_one_rank_fails_every_rank_fast_with_its_error(cluster, backend):
    """Not a ValueError of ours: the source's own failure (e.g. a collective of the trainer's) on rank 1."""
    layout, source = Layout(trainers=2, tp=2, backend=backend), SOURCES[backend]
    cluster.setup(layout)
    cluster.make_engines(info(backend), source=source)
    cluster.sync(weight_version="good")
    cluster.train_step(1)
    cluster.make_engines(info(backend), source=source, fault="rank1_raises")
    t0 = time.perf_counter()
    errors = on_every_trainer(cluster, "weightsync.testing.trainer:send_weights", "bad")
    elapsed = time.perf_counter() - t0
    assert "RuntimeError: the source's own collective failed" in errors[1], errors[1]
    assert "trainer rank 1: RuntimeError: the source's own collective failed" in errors[0], errors[0]
    failed_before_the_timeout(elapsed)
    assert cluster.client().weight_versions() == ["good"] * layout.num_workers
    poisoned = [a.call("weightsync.testing.probes:engine_poisoned") for a in cluster.active_receivers]
    # the reshard core reads its local shards in the preflight: nothing moved, the engines were not asked to update
    assert [p is not None for p in poisoned] == [SOURCES[backend] != "local"] * layout.num_workers, poisoned
    cluster.make_engines(info(backend), source=source)
    cluster.sync(weight_version="after", verify=True)
    assert mismatches(cluster) == {}
    assert cluster.client().weight_versions() == ["after"] * layout.num_workers


@vllm
@pytest.mark.parametrize("backend", TRANSPORTS)
def test_by_default_a_failed_sync_poisons_without_a_model_copy_and_a_reinit_verifies(cluster, backend):
    """``rollback=False`` (the default): no snapshot. A failure after data moved (the full-tensor
    transports gather and send earlier tensors first) says the weights may be partly updated; the
    version stays the last complete one and the engines refuse syncs until re-initialized. M2N checks
    every local shard before anything moves, so the same fault leaves it restored."""
    layout, source = Layout(trainers=2, tp=2, backend=backend), SOURCES[backend]
    cluster.setup(layout)
    cluster.make_engines(info(backend), source=source)
    cluster.sync(weight_version="good")
    cluster.train_step(4)
    cluster.make_engines(info(backend), source=source, fault="shape", bucket_bytes=1 << 16)
    errors = on_every_trainer(cluster, "weightsync.testing.trainer:send_weights", "bad")
    assert len(errors) == layout.trainers and all(re.search(FAULT_MESSAGES[source, "shape"], e) for e in errors)
    torn = "the engines' weights may be partly updated (rollback=False)"
    assert all((torn in e) == (source == "full") for e in errors), errors
    assert cluster.client().weight_versions() == ["good"] * layout.num_workers
    if source == "full":
        assert all(a.call("weightsync.testing.probes:engine_poisoned") for a in cluster.active_receivers)
    cluster.make_engines(info(backend), source=source)
    cluster.sync(weight_version="after", verify=True)
    assert mismatches(cluster) == {}


# --- other bad inputs -------------------------------------------------------------------------
def make(info, source, fault=None):
    return lambda cluster: on_every_trainer(cluster, "weightsync.testing.trainer:make_engine", info(), cluster.client(),
                                            source=source, fault=fault)


def sync_with(info, source, fault=None):
    def run(cluster):
        cluster.make_engines(info(), source=source, fault=fault)
        return on_every_trainer(cluster, "weightsync.testing.trainer:send_weights", "bad")
    return run


BAD_INPUTS = {
    "nccl: tensor larger than the bucket": (
        NCCL, sync_with(lambda: nccl_info(bucket_bytes=4096), "full"),
        r"parameter 'model.embed_tokens.weight' has 38656 bytes, more than bucket_bytes=4096"),
    "m2n: local shard missing": (
        M2N, sync_with(m2n_info, "local", "missing"), rf"parameter '{BAD}': the source yielded no local shard"),
    "m2n: duplicate name in metadata": (
        M2N, make(m2n_info, "local", "duplicate"), r"parameter 'model.embed_tokens.weight' appears twice"),
    "m2n: trainer ranks disagree on metadata": (
        M2N, make(m2n_info, "local", "rank1_differs"), r"trainer rank 1's metadata differs from trainer rank 0's"),
    "m2n: unsupported dtype": (
        M2N, make(m2n_info, "local", "complex"), rf"parameter '{BAD}': dtype torch.complex64 is not supported"),
    "m2n: trainer model differs from vLLM's": (
        Layout(trainers=2, tp=2, backend="weightsync_m2n", trainer_model="tiny_qwen3_kv1"),
        make(m2n_info, "local"), r"ValueError: parameter 'model.layers.0.self_attn.k_proj.weight': the trainer's "
                                 r"shape \(32, 64\) does not match vLLM's model.layers.0.self_attn.qkv_proj.weight"),
    "m2n: dst_mesh_dims smaller than the deployment": (
        M2N, make(lambda: m2n_info(dst_mesh_dims=(1, 1), world_size=3), "local"),
        r"the trainer's dst_mesh_dims=\(1, 1\) describes 1 worker\(s\), but the client drives 1 engine\(s\) of 2 "
        r"worker\(s\) each"),
}


@vllm
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
    failed_before_the_timeout(elapsed, f"{case}: ")
    assert cluster.on_receivers("checksum") == before
    assert cluster.client().weight_versions() == versions


# --- sources that do not fit the engine's model, every transport -------------------------------
DIFFERS = r"parameter '[\w.]+': trainer rank 1's metadata differs from trainer rank 0's"
MODEL_MISMATCHES = {  # case: (changes to the trainer's side of the layout, source fault, message)
    "consistent source omits one half of a fused param": (
        {}, "omitted", r"parameter 'model.layers.1.mlp.gate_up_proj.weight': no tensor of this sync writes "
                       r"\[64:128, 0:64\] of its \(128, 64\) on this TP rank \(the trainer's metadata has no "
                       rf"'{BAD}'\)"),
    "extra tensor": ({}, "extra", rf"parameter '{EXTRA}': the trainer sends it, but vLLM's Qwen3ForCausalLM has no "
                                 r"parameter or fused layer for it"),
    "tensor missing on one rank only": ({}, "rank1_differs", DIFFERS),
    "order swapped on one rank": ({}, "rank1_swapped", DIFFERS),
    "dtype of the model vs the engine": (
        {"trainer_dtype": "bfloat16"}, None,
        r"parameter 'model.embed_tokens.weight': the trainer sends bfloat16, vLLM's model.embed_tokens.weight "
        r"holds float32"),
    "vocab size": ({"trainer_model": "tiny_qwen3_vocab160"}, None,
                   r"parameter 'model.embed_tokens.weight': the trainer's shape \(160, 64\) does not match vLLM's "
                   r"model.embed_tokens.weight .*\(dim 0: 151, the trainer's 160\)"),
    "larger trainer model": ({"trainer_model": "tiny_qwen3_wide"}, None,
                             r"parameter 'model.layers.0.mlp.gate_proj.weight': the trainer's shape \(160, 64\) "
                             r"does not match vLLM's model.layers.0.mlp.gate_up_proj.weight .*\(dim 0: 128, the "
                             r"trainer's 160\)"),
}


@vllm
@pytest.mark.parametrize("backend, case", [(b, c) for b in TRANSPORTS for c in MODEL_MISMATCHES])
def test_source_not_fitting_the_engine_fails_at_init_on_every_rank_then_a_good_sync_verifies(cluster, backend, case):
    changes, fault, message = MODEL_MISMATCHES[case]
    good = Layout(trainers=2, tp=2, backend=backend)
    cluster.setup(good)
    before, versions = cluster.on_receivers("checksum"), cluster.client().weight_versions()
    cluster.setup(dataclasses.replace(good, **changes))
    cluster.on_trainers("shutdown_engine")  # the last test's group is not part of what is timed
    cluster.on_receivers("shutdown_weight_transfer_engine")
    refused = info(backend)
    t0 = time.perf_counter()
    errors = make(lambda: refused, SOURCES[backend], fault)(cluster)
    elapsed = time.perf_counter() - t0
    assert len(errors) == good.trainers
    for err in errors:  # every trainer rank raises, naming the parameter
        assert re.search(message, err), (case, err)
        if fault not in ("rank1_differs", "rank1_swapped"):  # the engine's refusal: always ``Refused`` (issue 58)
            assert err.split(" failed: ", 1)[1].startswith("Refused: "), (case, err)
    if case == "dtype of the model vs the engine":  # the hint names the source the transport reads
        hint = {"full": "FullTensorSource(dtype=...)", "local": "DTensorModuleSource(..., dtype=...)"}[SOURCES[backend]]
        assert all(f"(send the engine's dtype ({hint}) or set cast_dtypes=True" in e for e in errors), errors
    print(f"{backend} {case}: rejected after {elapsed:.2f} s")
    failed_before_the_timeout(elapsed, f"{case}: ")
    with pytest.raises(ConnectionRefusedError):  # rank 0's store closed as the init failed: nothing listens
        socket.create_connection(("127.0.0.1", refused.master_port), timeout=10).close()
    assert cluster.on_receivers("checksum") == before
    assert cluster.client().weight_versions() == versions

    cluster.setup(good)  # the engines take a correct sync right after, on the refused init's port (left free)
    cluster.make_engines(dataclasses.replace(info(backend), master_port=refused.master_port), source=SOURCES[backend])
    assert cluster.sync(weight_version="after", verify=True)["verified"] is True
    assert mismatches(cluster) == {}


@vllm
def test_cast_dtypes_lets_a_trainer_in_another_float_dtype_sync(cluster):
    layout = dataclasses.replace(M2N, trainer_dtype="bfloat16")  # into the float32 engine, cast on receive
    cluster.setup(layout)
    cluster.make_engines(m2n_info(cast_dtypes=True), source="local")
    assert cluster.sync(weight_version="cast", verify=True)["verified"] is True
    assert mismatches(cluster) == {}


@vllm
def test_a_parameter_named_in_partial_may_be_left_unwritten(cluster):
    cluster.setup(M2N)
    cluster.make_engines(m2n_info(partial=("model.layers.1.mlp.gate_up_proj",)), source="local", fault="omitted")


@vllm
def test_worker_init_info_with_an_unknown_field_is_rejected_by_every_worker(cluster):
    cluster.setup(M2N)
    with pytest.raises(RemoteCallError, match=r"failed on 2 worker\(s\).*unknown field\(s\) \['bogus'\]"):
        cluster.client().init_weight_transfer_engine({"bogus": 1})


def kill_mid_sync(cluster, layout, info, source, pick) -> float:
    cluster.setup(layout, fresh=True)
    victim = pick(cluster)
    # a trainer victim: gather 64 KiB at a time, so every trainer rank takes part until the sync ends
    cluster.make_engines(info, source=source, bucket_bytes=(1 << 16) if victim in cluster.trainers else None)
    cluster.sync(weight_version="good")
    cluster.train_step(1)
    counts = [os.path.join(tempfile.mkdtemp(), a.name) for a in cluster.active_trainers]
    plane = transport(layout.backend).trainer_engine.data_plane  # the plane this transport's posts go through
    plane_path = f"{plane.__module__}:{plane.__qualname__}"
    for a, path in zip(cluster.active_trainers, counts):
        a.call("weightsync.testing.faults:slow_data_plane", 0.3, path, plane_path)
    futs = [a.submit("weightsync.testing.trainer:send_weights", "bad") for a in cluster.active_trainers]
    deadline = time.monotonic() + 60  # a trainer rank is 3 slowed calls (0.9 s) into the sync
    while not any(os.path.exists(p) and os.path.getsize(p) >= 3 for p in counts):
        assert time.monotonic() < deadline, "the sync did not get under way"
        time.sleep(0.05)
    t0 = time.perf_counter()
    victim.kill()
    survivors = [(a, f) for a, f in zip(cluster.active_trainers, futs) if a is not victim]
    for _, f in survivors:
        with pytest.raises((RemoteError, OSError, EOFError)):
            f.result(timeout=2 * TIMEOUT)
    elapsed = time.perf_counter() - t0
    for a, _ in survivors:  # the next test's syncs run at full speed
        a.call("weightsync.testing.faults:slow_data_plane", 0, None, plane_path)
    return elapsed


def recover_and_verify(cluster, layout, make_info, source) -> None:
    assert cluster.replace_dead()
    cluster.setup(layout, fresh=True)
    cluster.make_engines(make_info(), source=source)
    cluster.train_step(2)
    cluster.sync(weight_version="recovered", verify=True)
    assert mismatches(cluster) == {}
    assert cluster.client().weight_versions() == ["recovered"] * layout.num_workers


KILLS = {name: (Layout(trainers=2, tp=2, backend=name), lambda name=name: info(name, timeout_s=TIMEOUT))
         for name in TRANSPORTS}


@vllm
@pytest.mark.parametrize("backend", TRANSPORTS)
def test_killing_a_receiver_mid_sync(cluster, backend):
    layout, make_info = KILLS[backend]
    elapsed = kill_mid_sync(cluster, layout, make_info(), SOURCES[backend], pick=lambda c: c.receivers[1])
    assert elapsed < 2 * TIMEOUT
    assert cluster.receivers[0].call("weightsync.testing.receiver:weight_version") == "good"
    # it raised, rolled back, refuses updates
    assert cluster.receivers[0].call("weightsync.testing.probes:engine_poisoned")
    recover_and_verify(cluster, layout, make_info, SOURCES[backend])


@vllm
@pytest.mark.parametrize("backend", TRANSPORTS)
def test_killing_a_trainer_rank_mid_sync(cluster, backend):
    layout, make_info = KILLS[backend]
    elapsed = kill_mid_sync(cluster, layout, make_info(), SOURCES[backend], pick=lambda c: c.trainers[1])
    assert elapsed < 2 * TIMEOUT
    assert [a.call("weightsync.testing.receiver:weight_version") for a in cluster.receivers[:2]] == ["good", "good"]
    assert all(a.call("weightsync.testing.probes:engine_poisoned") for a in cluster.receivers[:2])  # both raised
    recover_and_verify(cluster, layout, make_info, SOURCES[backend])


@vllm
def test_verified_syncs_do_not_leak(cluster):
    cluster.setup(M2N)
    cluster.make_engines(m2n_info(), source="local")
    procs = cluster.active_trainers + cluster.active_receivers

    def snapshot():
        res = [a.call("weightsync.testing.probes:process_resources", collect=True) for a in procs]
        return res, [a.call("weightsync.testing.probes:thread_count") for a in procs]

    for i in range(3):
        cluster.sync(weight_version=f"warm{i}", verify=True)
    (r0, t0) = snapshot()
    for i in range(20):  # benchmarks/soak.py runs 200
        stats = cluster.sync(weight_version=f"soak{i}", verify=True)
        assert stats["verified"] is True
    (r1, t1) = snapshot()
    assert mismatches(cluster) == {}
    growth = [(b["rss"] - a["rss"]) / a["rss"] for a, b in zip(r0, r1)]
    print("RSS growth per process over 20 verified syncs:", [f"{g:+.2%}" for g in growth],
          "fds", [(a["fds"], b["fds"]) for a, b in zip(r0, r1)], "threads", list(zip(t0, t1)))
    assert max(growth) < 0.01
    # a finish call sent while the update call returns may take one more client thread and connection
    # (and a worker thread serving it), once; a leak per sync would add 20
    assert all(b["fds"] <= a["fds"] + 2 for a, b in zip(r0, r1))
    assert all(b <= a + 2 for a, b in zip(t0, t1))
