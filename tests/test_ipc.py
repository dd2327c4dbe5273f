"""The colocated ``ipc`` transport: infos and handles in process; end to end on CPU (shared memory)
from FSDP2 trainer ranks into vLLM's real model classes, checked against vLLM's ``load_weights``;
CUDA IPC between two processes on one GPU (skipped without CUDA). Faulty sources: ``test_failures.py``."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing as mp
import os
import sys
import types
from contextlib import contextmanager

import pytest
import torch

from helpers import HAS_CUDA, init_info, mismatches
from weightsync.infos import parse_info
from weightsync.plan.buckets import plan_buckets
from weightsync.protocol import ParamMeta
from weightsync.reshard.packing import pack
from weightsync.testing.actors import RemoteError, gather
from weightsync.testing.cluster import Layout
from weightsync.testing.faults import CorruptingClient, JsonRoundTripClient
from weightsync.transports import ipc_handles
from weightsync.transports.ipc import IPCTrainerInitInfo, IPCUpdateInfo, IPCWorkerInitInfo
from weightsync.transports.ipc_handles import BufferImporter, ExportedBuffer

COLOCATED = Layout(trainers=2, tp=2, backend="weightsync_ipc")


def ipc_info(layout: Layout, bucket_bytes: int = 64 << 10) -> IPCTrainerInitInfo:
    return init_info("weightsync_ipc", layout, buffer_bytes=bucket_bytes)


def imports(cluster) -> list[int | None]:
    return [a.call("weightsync.testing.probes:ipc_imports") for a in cluster.active_receivers]


# --- in process ----------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"num_workers": 2, "num_trainer_ranks": 2}, "master_port is required"),
    ({"num_workers": 2, "num_trainer_ranks": 2, "master_port": 1, "worker_to_trainer": [0, 2]},
     r"worker_to_trainer must list.*num_workers=2.*num_trainer_ranks=2\), got \[0, 2\]"),
    ({"num_workers": 3, "worker_to_trainer": [0, 0]}, r"worker_to_trainer .*num_workers=3"),
    ({"num_workers": 1, "bucket_bytes": 1000}, "bucket_bytes must be a positive multiple of 256, got 1000"),
    ({"num_workers": 0}, "num_workers must be an int >= 1, got 0"),
    ({"num_workers": 1, "rank": 1}, r"rank must be in \[0, num_trainer_ranks=1\), got 1"),
    ({"num_workers": 1, "device": "tpu"}, "device must be 'cuda' or 'cpu'"),
])
def test_trainer_init_info_rejects_bad_fields_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        IPCTrainerInitInfo(**{"rank": 0, "device": "cpu", **kwargs})


def test_default_mapping_and_json_safe_worker_infos():
    info = IPCTrainerInitInfo(num_trainer_ranks=2, num_workers=4, master_port=1, device="cpu", rank=1)
    assert info.worker_to_trainer == (0, 1, 0, 1)
    with pytest.raises(ValueError, match=r"chunk must be in \[0, num_chunks=3\), got 3"):
        parse_info(IPCUpdateInfo, {"sync_id": 1, "chunk": 3, "num_chunks": 3, "digest": "d",
                                   "handles": {"0": {"trainer_rank": 0, "handle": {}}}}, "update_info")
    with pytest.raises(ValueError, match="unknown field"):
        parse_info(IPCWorkerInitInfo, {"num_workers": 1, "worker_to_trainer": [0], "num_trainer_ranks": 1,
                                       "bucket_bytes": 256, "pickled": "x", "master_address": "h",
                                       "master_port": 1}, "init_info")
    with pytest.raises(ValueError, match=r"field 'master_port' must be an int, got 'x'"):
        parse_info(IPCWorkerInitInfo, {"num_workers": 1, "worker_to_trainer": [0], "num_trainer_ranks": 1,
                                       "bucket_bytes": 256, "master_address": "h", "master_port": "x"}, "init_info")
    upd = IPCUpdateInfo(sync_id=1, chunk=0, num_chunks=1, digest="d",
                        handles={"0": {"trainer_rank": 0, "handle": {"k": {"kind": "shm"}}}})
    assert parse_info(IPCUpdateInfo, json.loads(json.dumps(upd.__dict__))) == upd


def test_shared_memory_buffer_export_import_is_cached_and_checked():
    buf = ExportedBuffer(4096, torch.device("cpu"), tag="test-")
    try:
        buf.tensor[:8] = torch.arange(8, dtype=torch.uint8)
        handle = json.loads(json.dumps(buf.export(0)))  # JSON-safe
        assert buf.export(0) is buf.export(0), "exported once per consumer"
        importer = BufferImporter(torch.device("cpu"))
        view = importer.get(handle)
        assert torch.equal(view[:8], torch.arange(8, dtype=torch.uint8))
        buf.tensor[0] = 42  # the same memory, not a copy
        assert importer.get(handle) is view and int(view[0]) == 42 and importer.imports == 1
        with pytest.raises(ValueError, match=r"handle is for \['cuda:GPU-x'\], but this worker's memory is cpu@"):
            importer.get({"cuda:GPU-x": {}})
        key = next(iter(handle))
        with pytest.raises(ValueError, match="is not a weightsync buffer"):
            importer.get({key: {"kind": "shm", "path": "/etc/passwd", "nbytes": 4096}})
        with pytest.raises(ValueError, match="nbytes 8 differs from the size 4096"):
            importer.get({key: {**handle[key], "nbytes": 8}})
        buf.unlink()  # the mapping outlives the name
        assert importer.get(handle) is view and importer.imports == 1, "a rejected handle keeps the import"
        importer.close()
    finally:
        buf.close()
    assert not os.path.exists(buf.path)
    with pytest.raises(ValueError, match="is gone"):
        BufferImporter(torch.device("cpu")).get(handle)


def test_expandable_segments_detection():
    assert ipc_handles._expandable_segments_on("max_split_size_mb:64, expandable_segments:True")
    assert not ipc_handles._expandable_segments_on("expandable_segments:True,expandable_segments:False")
    assert not ipc_handles._expandable_segments_on("")


def test_memory_saver_tracking_is_paused_only_when_active(monkeypatch):
    entered = []

    @contextmanager
    def disable():
        entered.append(True)
        yield

    def fake(active):
        cdll = types.SimpleNamespace(tms_get_interesting_region=lambda: int(active))
        impl = types.SimpleNamespace(_binary_wrapper=types.SimpleNamespace(cdll=cdll))
        return types.SimpleNamespace(torch_memory_saver=types.SimpleNamespace(_impl=impl, disable=disable))

    monkeypatch.setitem(sys.modules, "torch_memory_saver", fake(False))
    with ipc_handles.memory_saver_paused():
        assert entered == []
    monkeypatch.setitem(sys.modules, "torch_memory_saver", fake(True))
    with ipc_handles.memory_saver_paused():
        assert entered == [True]


# --- end to end on CPU: FSDP2 trainer ranks colocated with vLLM TP workers ---------------------
@pytest.mark.vllm
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_colocated_sync_is_bit_exact_against_vllm_load_weights(cluster, dtype):
    layout = Layout(trainers=2, tp=2, dtype=dtype, backend="weightsync_ipc")
    cluster.setup(layout)
    cluster.make_engines(ipc_info(layout), client=JsonRoundTripClient(cluster.client()))  # JSON-safe, as over HTTP
    stats = cluster.sync(weight_version="v1")
    assert stats["num_steps"] >= 3, "the bucket is smaller than the model"
    assert mismatches(cluster) == {}
    assert set(stats["bytes_received_per_worker"]) == {0, 1}
    assert cluster.client().weight_versions() == ["v1", "v1"]

    cluster.train_step(1)
    assert mismatches(cluster), "an optimizer step changed the trainer's weights"
    cluster.sync(weight_version="v2")
    assert mismatches(cluster) == {}
    assert cluster.client().weight_versions() == ["v2", "v2"]
    assert imports(cluster) == [1, 1], "one import per export"


@pytest.mark.vllm
def test_a_worker_rejecting_a_chunk_fails_every_rank_and_all_workers_roll_back(cluster):
    cluster.setup(COLOCATED)
    cluster.make_engines(ipc_info(COLOCATED))
    cluster.sync(weight_version="good")
    before = cluster.on_receivers("checksum")
    cluster.train_step(2)

    bad = CorruptingClient(cluster.client(), chunk=2, worker=1, field="trainer_rank", value=7)
    info = dataclasses.replace(ipc_info(COLOCATED), rollback=True)  # the opt-in restore (default: poisoned, paused)
    cluster.make_engines(info, client=bad)  # worker 0 applies chunks 0-2, worker 1 refuses chunk 2
    futures = [a.submit("weightsync.testing.trainer:send_weights", "bad", timeout_s=120)
               for a in cluster.active_trainers]
    for f in futures:
        with pytest.raises(RemoteError, match="SyncFailed: weight sync 1 failed: worker 1: ValueError: "
                                              "update_info.handles has no handle from trainer rank 1 for worker 1"):
            f.result()
    assert cluster.on_receivers("checksum") == before
    assert cluster.client().weight_versions() == ["good", "good"]


@pytest.mark.vllm
def test_50_syncs_leak_no_shared_memory_fds_or_rss(cluster):
    cluster.setup(COLOCATED)
    cluster.make_engines(ipc_info(COLOCATED, bucket_bytes=192 << 10))
    procs = cluster.active_trainers + cluster.active_receivers

    def resources(collect: bool = False) -> list[dict]:
        return gather([a.submit("weightsync.testing.probes:process_resources", collect) for a in procs])

    assert cluster.sync()["num_steps"] == 3  # the first sync creates each buffer and each import
    start = resources(collect=True)
    for i in range(50):
        cluster.sync(weight_version=f"s{i}")
        now = resources()
        for a, s, n in zip(procs, start, now):
            # no growth: an fd the process closes meanwhile (an old engine's socket collected) is fine
            assert n["fds"] <= s["fds"] and (n["shm"], n["own_buffers"]) == (s["shm"], s["own_buffers"]), \
                (i, a.name, s, n)
    end = resources(collect=True)
    assert mismatches(cluster) == {}
    assert imports(cluster) == [1, 1], "one import per export"
    assert [s["own_buffers"] for s in start] == [0, 0, 0, 0], "buffer files are removed once mapped"
    print("\n50 ipc syncs (2 FSDP2 trainer ranks, vLLM TP=2, CPU shared memory, 3 chunks each):")
    for a, s, n in zip(procs, start, end):
        growth = (n["rss"] - s["rss"]) / s["rss"]
        print(f"  {a.name}: fds {s['fds']}->{n['fds']}, /dev/shm mappings {s['shm']}->{n['shm']}, "
              f"RSS {s['rss'] / 2**20:.1f}->{n['rss'] / 2**20:.1f} MiB ({growth:+.3%})")
        assert growth < 0.01, (a.name, s, n)


# --- GPU: CUDA IPC between two processes on one device --------------------------------------
def _consumer(conn) -> None:
    importer = BufferImporter(torch.device("cuda", 0))
    baseline = None
    while True:
        msg = conn.recv()
        if msg is None:
            importer.close()
            torch.cuda.synchronize()
            conn.send(None)
            return
        handle, entries = json.loads(msg)
        buf = importer.get(handle)
        data = torch.cat([buf[o : o + n].clone() for o, n in entries]).cpu()
        torch.cuda.synchronize()
        if baseline is None:
            baseline = torch.cuda.memory_allocated()
        conn.send({"sha": hashlib.sha256(data.numpy().tobytes()).hexdigest(), "imports": importer.imports,
                   "allocated_growth": torch.cuda.memory_allocated() - baseline,
                   "fds": len(os.listdir("/proc/self/fd"))})


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_ipc_packed_buffer_is_bit_exact_and_imported_once_over_50_syncs():
    metas = [ParamMeta(f"w{i}", dt, shape) for i, (dt, shape) in
             enumerate([(torch.bfloat16, (33, 65)), (torch.float32, (7,)), (torch.float8_e4m3fn, (128, 3))] * 3)]
    (bucket,) = plan_buckets(metas, 1 << 20)
    device = torch.device("cuda", 0)
    buf = ExportedBuffer(1 << 20, device)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(child,), daemon=True)
    proc.start()
    first = None
    try:
        for step in range(50):
            g = torch.Generator(device=device).manual_seed(step)
            for m, e in zip(metas, bucket.entries):
                pack(buf.tensor, e, torch.randn(m.shape, generator=g, device=device).to(m.dtype))
            torch.cuda.synchronize()
            entries = [(e.offset, e.nbytes) for e in bucket.entries]
            expected = torch.cat([buf.tensor[o : o + n] for o, n in entries]).cpu().numpy().tobytes()
            parent.send(json.dumps([buf.export(0), entries]))
            assert parent.poll(60), "consumer did not answer"
            got = parent.recv()
            first = first or got
            assert got["sha"] == hashlib.sha256(expected).hexdigest(), step
            assert got["imports"] == 1 and got["allocated_growth"] == 0 and got["fds"] == first["fds"], (step, got)
            torch.cuda.ipc_collect()
        parent.send(None)
        assert parent.poll(60) and parent.recv() is None
    finally:
        proc.join(30)
        buf.close()
