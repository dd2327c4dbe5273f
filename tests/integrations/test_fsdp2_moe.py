"""The FSDP2 trainer on a tiny Qwen3-MoE (5 experts, top-2; transformers' fused 3-D expert tensors):
FSDP2 shards the experts over the expert dim (unevenly over 2 ranks), dp=1 and dp=2 take the same
GRPO step, and the trained weights sync shard to shard into vLLM's fused-MoE layers bit for bit.

Shares the two FSDP2 rank processes (``helpers.ranks()``) and the cluster with the other modules.
Checkpoints: seeded random ``tiny_qwen3_moe`` models (``actor``: seed 0, ``other``: seed 1)."""

from __future__ import annotations

import pytest
import torch

from helpers import config, init_info, make_samples, ranks, write_checkpoint
from weightsync.testing.cluster import Layout

pytestmark = pytest.mark.timeout(600)

MODEL = "tiny_qwen3_moe"
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
FUSED = {f"model.layers.{i}.mlp.experts.routed_experts.{w}" for i in (0, 1) for w in ("w13_weight", "w2_weight")}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp2-moe")
    return {name: write_checkpoint(str(root / name), seed=seed, config=MODEL)
            for name, seed in (("actor", 0), ("other", 1))}


def load_plain(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def check_expert_shards(shards: list[dict[str, torch.Tensor]], full: dict[str, torch.Tensor]) -> None:
    """5 experts over 2 ranks: Shard(0) gives rank 0 experts 0-2 and rank 1 experts 3-4; the router
    and the other matrices shard their first dim; the ranks' shards are the checkpoint's rows."""
    experts = [n for n in full if n.endswith(EXPERTS)]
    assert len(experts) == 4 and any(n.endswith("mlp.gate.weight") for n in shards[0])
    for name in experts:
        assert [s[name].shape[0] for s in shards] == [3, 2], name
    for name, t in full.items():
        if name in shards[0]:  # not the tied lm_head
            assert torch.equal(torch.cat([shards[0][name], shards[1][name]]), t), name


def test_moe_dp1_and_dp2_take_the_same_step(ckpts):
    """As ``test_dp1_and_dp2_take_the_same_step`` on the MoE (clipped ratios, k3 KL to a different
    reference, entropy, several micro-batches per rank), every expert of every layer routed to and moved;
    at dp=2 the experts are sharded unevenly over the expert dim (``check_expert_shards``).

    Tolerances: gradients atol 1e-6 x the tensor's max (observed 2e-7; a lost or double-counted token
    of ~100 would be ~1e-2). Params after the step atol 5e-6 (observed 7e-9) wherever |grad| >= 1e-6:
    there AdamW's first step is lr * sign(grad). Where |grad| is near eps = 1e-8 (0.25% of the
    elements here, e.g. a q_proj entry with |grad| 2e-8 that moved 6e-6 apart), lr * g / (|g| + eps)
    turns fp32 reduction-order noise into differences of up to lr; the gradient check covers them."""
    procs = ranks()
    samples = make_samples(4, 4, seed=2, with_rollout_log_probs=True)
    cfg = config(ckpts, ref="other", max_tokens=30, kl_coef=0.1, kl_type="k3", entropy_coef=0.01,
                 old_log_probs="rollout", clip_low=0.2, clip_high=0.28)
    initial = load_plain(ckpts["actor"]).state_dict()
    results = {}
    for world in (1, 2):
        procs.init(world)
        procs.build(cfg)
        if world == 2:
            check_expert_shards(procs.run("call", "local_shards"), initial)
        rows = procs.run("call", "schedule", samples)
        metrics = procs.run("call", "forward_backward", samples)
        grads = procs.run("full_grads")[0]
        for m, step in zip(metrics, procs.run("call", "optimizer_step")):
            m.update(step)
        assert all(m == metrics[0] for m in metrics)
        results[world] = (metrics[0], grads, procs.run("call", "full_state_dict")[0], [len(r) for r in rows])
    assert results[2][3][0] > 1  # micro-batching on every rank
    m1, g1, p1, _ = results[1]
    m2, g2, p2, _ = results[2]
    assert 0 < m1["clip_frac"] < 1, m1  # the clip is exercised
    for k in ("loss", "pg_loss", "kl", "entropy", "clip_frac", "grad_norm"):
        assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), k
    for name, t in p1.items():
        torch.testing.assert_close(g2[name], g1[name], rtol=0, atol=1e-6 * float(g1[name].abs().max()), msg=name)
        assert not torch.equal(t, initial[name]), name
        steady = g1[name].abs() >= 1e-6
        assert steady.float().mean() > 0.9, name
        torch.testing.assert_close(p2[name][steady], t[steady], atol=5e-6, rtol=1e-5, msg=name)
        if name.endswith(EXPERTS):
            assert all(not torch.equal(t[e], initial[name][e]) for e in range(t.shape[0])), name


@pytest.mark.vllm
def test_moe_sync_weights_into_vllm_model_classes(cluster, ckpts):
    """``weightsync_m2n`` from FSDP2 dp=2 (uneven expert shards) into vLLM TP=2 bf16: after a sync,
    and again after a training step, every vLLM rank equals vLLM's ``load_weights`` of the trainer's
    full weights, bit for bit."""
    backend = "weightsync_m2n"
    procs = ranks()
    cluster.setup(Layout(trainers=0, tp=2, dtype="bfloat16", model=MODEL, backend=backend))
    procs.init(2)
    procs.build(config(ckpts))
    info = init_info(backend, Layout(trainers=2, tp=2), cast_dtypes=True)  # float32 masters, cast on receipt
    procs.run("connect", info, cluster.client(timeout_s=60))
    try:
        for step in range(2):
            if step:
                procs.run("call", "train_step", make_samples(2, 4, seed=20 + step))
            weights = procs.run("call", "full_state_dict")[0]
            stale = cluster.on_receivers("compare_with_oracle", weights)
            for names in stale:  # the experts of both layers differ from vLLM's until the sync
                assert {n for n in names if n.endswith(("w13_weight", "w2_weight"))} == FUSED, names
            procs.run("sync", f"v{step}")
            assert cluster.on_receivers("compare_with_oracle", weights) == [[], []]
        assert cluster.client().weight_versions() == ["v1", "v1"]
    finally:
        procs.run("shutdown_engine")
