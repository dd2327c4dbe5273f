"""The FSDP2 trainer on two gloo ranks (tiny random Qwen3) against plain, unsharded fp32 computations.

Two rank processes are started once (``helpers.ranks()``) and reused; each test re-forms the
process group and builds the trainers it needs. Checkpoints are seeded random models written with
``save_pretrained`` (``actor``: seed 0, ``other``: seed 1).

Then ``FSDP2Trainer.sync_weights`` into vLLM's real model classes (TP=2 over gloo) for every transport:
after a sync, and again after a training step, every vLLM rank equals vLLM's own ``load_weights`` of
the trainer's full weights, bit for bit. And ``examples/grpo_fsdp2.py``: what it tells a user (its
``--cpu`` run is in ``tests/engine/test_examples.py``)."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

from helpers import TRANSPORTS, checkpoints, config, init_info, make_samples, ranks, write_checkpoint
from weightsync.integrations.fsdp2 import LossConfig, ModelConfig, OptimConfig, TrainerConfig, dp_schedule
from weightsync.testing.actors import RemoteError
from weightsync.testing.cluster import Layout

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def ckpts():
    return checkpoints()


@pytest.fixture(scope="module")
def procs():
    return ranks()


def load_plain(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def plain_response_log_probs(model, sample, *, temperature=1.0, grad=False):
    """One sample alone (no packing): log-probs and entropy of its response tokens."""
    ids = torch.tensor([list(sample.prompt_ids) + list(sample.response_ids)])
    p = len(sample.prompt_ids)
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=ids).logits[0, p - 1: -1] / temperature
        logq = torch.log_softmax(logits.float(), -1)
        logp = logq.gather(-1, ids[0, p:, None]).squeeze(-1)
        return logp, -(logq.exp() * logq).sum(-1)


def plain_grads(ckpts, samples, *, ref: str | None, kl_coef=0.0, kl_type="k1", entropy_coef=0.0):
    """The same loss as the trainer's (token mean over the batch), written out directly on one process."""
    actor = load_plain(ckpts["actor"])
    reference = load_plain(ckpts[ref or "actor"]) if kl_coef > 0 else None
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    groups = torch.tensor([s.group for s in samples])
    adv = torch.zeros_like(rewards)
    for g in groups.unique():
        r = rewards[groups == g]
        adv[groups == g] = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
    n_tokens = sum(len(s.response_ids) for s in samples)
    total = 0.0
    for s, a in zip(samples, adv.float()):
        logp, ent = plain_response_log_probs(actor, s, grad=True)
        term = -a * torch.exp(logp - logp.detach()) - entropy_coef * ent
        if reference is not None:
            ref_logp, _ = plain_response_log_probs(reference, s)
            kl = logp - ref_logp if kl_type == "k1" else torch.expm1(ref_logp - logp) - (ref_logp - logp)
            term = term + kl_coef * kl
        total = total + term.sum() / n_tokens
    total.backward()
    return {n: p.grad for n, p in actor.named_parameters()}


def test_rank0_alone_reads_the_checkpoint_and_every_rank_gets_its_weights(procs, ckpts):
    procs.init(2)
    assert procs.run("helpers:build_counting_checkpoint_reads", config(ckpts)) == [1, 0]
    assert procs.run("helpers:build_counting_checkpoint_reads", config(ckpts, ref="other", kl_coef=0.1)) == [2, 0]
    weights = procs.run("call", "full_state_dict")[0]
    expected = load_plain(ckpts["actor"]).state_dict()
    assert weights.keys() == {n for n, _ in load_plain(ckpts["actor"]).named_parameters()}
    assert all(torch.equal(t, expected[n]) for n, t in weights.items())


def test_a_bad_reference_checkpoint_fails_on_every_rank(procs, ckpts, tmp_path):
    procs.init(2)
    kv1 = write_checkpoint(str(tmp_path / "kv1"), seed=0, config="tiny_qwen3_kv1")
    for path, match in [(kv1, r"tensor 'model.layers.0.self_attn.k_proj.weight' has shape \(32, 64\), the model "
                              r"expects \(64, 64\)"),
                        (str(tmp_path / "missing"), r"rank 0 could not read checkpoint .*missing")]:
        cfg = TrainerConfig(model=ModelConfig(path=ckpts["actor"], reference_path=path), device="cpu",
                            loss=LossConfig(kl_coef=0.1))
        futures = [a.submit("weightsync.testing.fsdp2:build", cfg) for a in procs.actors[:2]]
        for f in futures:
            with pytest.raises(RemoteError, match=match):
                f.result()


def test_packed_log_probs_equal_unpacked_unsharded(procs, ckpts):
    """Tolerance: fp32, atol 2e-5 / rtol 1e-5 (observed ~5e-7); cross-sample attention would be off by ~0.4."""
    samples = make_samples(4, 3, seed=1)
    sched = dp_schedule([len(s) for s in samples], 2, 40)
    assert max(len(row) for rows in sched for row in rows) >= 3  # several samples share a row
    procs.init(2)
    procs.build(config(ckpts))
    got0, got1 = procs.run("call", "compute_log_probs", samples)
    plain = load_plain(ckpts["actor"])
    for s, a, b in zip(samples, got0, got1):
        expected, _ = plain_response_log_probs(plain, s)
        assert torch.equal(a, b)
        torch.testing.assert_close(a, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("aggregation", ["token_mean", "sample_mean"])
def test_dp1_and_dp2_take_the_same_step(procs, ckpts, aggregation):
    """GRPO with clipped ratios (rollout log-probs), per-token loss, k3 KL to a different reference,
    several micro-batches per rank: params after one step agree (atol 5e-6, observed 1e-6; AdamW's first step
    moves each weight by ~lr = 1e-3, so any lost or double-counted token would show)."""
    samples = make_samples(4, 4, seed=2, with_rollout_log_probs=True)
    cfg = config(ckpts, ref="other", max_tokens=30, kl_coef=0.1, kl_type="k3", entropy_coef=0.01,
                 old_log_probs="rollout", clip_low=0.2, clip_high=0.28, aggregation=aggregation)
    results = {}
    for world in (1, 2):
        procs.init(world)
        procs.build(cfg)
        rows = procs.run("call", "schedule", samples)
        metrics = procs.run("call", "train_step", samples)
        assert all(m == metrics[0] for m in metrics)
        results[world] = (metrics[0], procs.run("call", "full_state_dict")[0], [len(r) for r in rows])
    assert results[2][2][0] > 1  # micro-batching on every rank
    m1, p1, _ = results[1]
    m2, p2, _ = results[2]
    assert 0 < m1["clip_frac"] < 1, m1  # the clip is exercised
    for k in ("loss", "pg_loss", "kl", "entropy", "clip_frac", "grad_norm"):
        assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), k
    initial = load_plain(ckpts["actor"]).state_dict()
    for name, t in p1.items():
        assert not torch.equal(t, initial[name]), name
        torch.testing.assert_close(p2[name], t, atol=5e-6, rtol=1e-5)


def test_bf16_mixed_precision_with_activation_checkpointing_trains(procs, ckpts):
    """The GPU example's settings on CPU: bf16 compute (fp32 masters), recomputed activations."""
    samples = make_samples(3, 4, seed=9)
    procs.init(2)
    procs.build(config(ckpts))
    fp32 = procs.run("call", "compute_log_probs", samples)[0]
    cfg = config(ckpts, kl_coef=0.05, entropy_coef=0.01)
    procs.build(replace(cfg, model=replace(cfg.model, param_dtype="bfloat16", activation_checkpointing=True)))
    bf16 = procs.run("call", "compute_log_probs", samples)[0]
    for a, b in zip(fp32, bf16):
        torch.testing.assert_close(b, a, atol=0.1, rtol=0.02)  # bf16 logits, fp32 log-softmax
    assert any(not torch.equal(a, b) for a, b in zip(fp32, bf16))  # it did compute in bf16
    metrics = procs.run("call", "train_step", samples)[0]
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()) and metrics["grad_norm"] > 0
    weights = procs.run("call", "full_state_dict")[0]
    assert all(t.dtype == torch.float32 for t in weights.values())


GRAD_CASES = {
    "entropy_only": dict(ref=None, entropy_coef=0.1),
    "kl_ref_equals_actor": dict(ref=None, kl_coef=0.1, kl_type="k1", entropy_coef=0.01),
    "kl_ref_differs": dict(ref="other", kl_coef=0.1, kl_type="k1", entropy_coef=0.01),
}


def trainer_step0_grads(procs, ckpts, case: dict, samples, *, break_swap_back=False):
    procs.init(2)
    loss = {k: v for k, v in case.items() if k != "ref"}
    procs.build(config(ckpts, ref=case["ref"], max_tokens=25, **loss))
    if break_swap_back:
        procs.run("helpers:break_reference_swap_back")
    procs.run("call", "forward_backward", samples)
    return procs.run("full_grads")[0]


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_step0_gradient_matches_plain_fp32(procs, ckpts, case):
    """Zero rewards: the gradient comes from the entropy and KL terms alone; with k1 it does not depend
    on the reference log-probs, so a reference that differs from the actor must not change it."""
    samples = make_samples(3, 4, seed=3, zero_rewards=True)
    got = trainer_step0_grads(procs, ckpts, GRAD_CASES[case], samples)
    expected = plain_grads(ckpts, samples, **GRAD_CASES[case])
    assert sum(float(g.norm()) for g in expected.values()) > 0
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-4 * float(g.abs().max()), msg=name)


def test_step0_gradient_full_loss_with_rewards_and_k3(procs, ckpts):
    """All terms at once: GRPO advantages from rewards, k3 KL to a different reference, entropy."""
    case = dict(ref="other", kl_coef=0.2, kl_type="k3", entropy_coef=0.01)
    samples = make_samples(3, 4, seed=4)
    got = trainer_step0_grads(procs, ckpts, case, samples)
    expected = plain_grads(ckpts, samples, **case)
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-4 * float(g.abs().max()), msg=name)


def test_step0_gradient_check_catches_a_trainer_that_keeps_the_reference_weights(procs, ckpts):
    samples = make_samples(3, 4, seed=3, zero_rewards=True)
    case = GRAD_CASES["kl_ref_differs"]
    got = trainer_step0_grads(procs, ckpts, case, samples, break_swap_back=True)
    expected = plain_grads(ckpts, samples, **case)
    bad = [n for n, g in expected.items()
           if not torch.allclose(got[n], g, rtol=1e-4, atol=1e-4 * float(g.abs().max()))]
    assert len(bad) > len(expected) // 2, bad


def test_sleep_wake_keeps_params_and_optimizer_state_bit_identical(procs, ckpts):
    procs.init(2)
    procs.build(config(ckpts, ref="other", kl_coef=0.1))
    procs.run("call", "train_step", make_samples(2, 4, seed=5))  # optimizer state exists
    for r in procs.run("helpers:sleep_wake_round_trip"):
        assert r["differ"] == [] and r["tensors"] > 48, r  # params + exp_avg, exp_avg_sq, step
        assert r["moved"] > 0 and r["allocated_while_asleep"] == 0, r
        assert "asleep" in r["refused"]


def test_dcp_save_then_new_trainer_resumes_with_identical_next_step(procs, ckpts, tmp_path):
    root = str(tmp_path / "ckpt")
    cfg = config(ckpts, ref="other", kl_coef=0.05, optim=OptimConfig(lr=1e-3, warmup_samples=12, decay_samples=100,
                                                                   decay_style="cosine", weight_decay=0.1))
    first, second = make_samples(2, 4, seed=6), make_samples(3, 3, seed=7)
    procs.init(2)
    procs.build(cfg)
    procs.run("call", "train_step", first)
    paths = procs.run("call", "save_checkpoint", root)
    assert paths[0] == paths[1] == os.path.join(root, "iter_0000001")
    assert open(os.path.join(root, "latest_checkpointed_iteration.txt")).read() == "1"
    assert json.load(open(os.path.join(paths[0], "trainer_state.json"))) == {"step": 1, "consumed_samples": 8}
    procs.run("call", "sleep")
    procs.run("call", "wake")
    expected_metrics = procs.run("call", "train_step", second)[0]
    expected = procs.run("call", "full_state_dict")[0]

    procs.build(cfg)  # a new trainer from the initial checkpoint
    assert procs.run("call", "load_checkpoint", root) == [1, 1]
    metrics = procs.run("call", "train_step", second)[0]
    got = procs.run("call", "full_state_dict")[0]
    assert metrics == expected_metrics
    assert all(torch.equal(got[n], t) for n, t in expected.items())


def test_tp_aligned_shards_train_checkpoint_and_sleep_like_the_default(procs, ckpts, tmp_path):
    """``ModelConfig.tp_aligned_shards``: the 2-D ``o_proj`` / ``down_proj`` weights are dim-1 shards, the
    others dim 0; one step on 2 ranks moves the weights as the default layout does (atol 5e-6); a DCP
    save and a new trainer's load resume to the identical next step; sleep/wake is bit-identical."""
    samples, later = make_samples(2, 4, seed=8), make_samples(2, 3, seed=9)
    cfg = config(ckpts, ref="other", kl_coef=0.05)
    aligned = replace(cfg, model=replace(cfg.model, tp_aligned_shards=True))
    procs.init(2)
    procs.build(cfg)
    default_metrics = procs.run("call", "train_step", samples)[0]
    default = procs.run("call", "full_state_dict")[0]
    procs.build(aligned)
    shards = procs.run("helpers:placements")[0]
    assert {n for n, p in shards.items() if p == "S(1)"} == {
        f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.o_proj.weight", "mlp.down_proj.weight")}
    metrics = procs.run("call", "train_step", samples)[0]
    for k in ("loss", "kl", "grad_norm"):
        assert metrics[k] == pytest.approx(default_metrics[k], rel=1e-5, abs=1e-7), k
    for name, t in procs.run("call", "full_state_dict")[0].items():
        torch.testing.assert_close(t, default[name], atol=5e-6, rtol=1e-5)
    root = str(tmp_path / "ckpt")
    procs.run("call", "save_checkpoint", root)
    for r in procs.run("helpers:sleep_wake_round_trip"):
        assert r["differ"] == [] and r["moved"] > 0, r
    expected_metrics = procs.run("call", "train_step", later)[0]
    expected = procs.run("call", "full_state_dict")[0]
    procs.build(aligned)
    assert procs.run("call", "load_checkpoint", root) == [1, 1]
    assert procs.run("call", "train_step", later)[0] == expected_metrics
    got = procs.run("call", "full_state_dict")[0]
    assert all(torch.equal(got[n], t) for n, t in expected.items())


def test_hf_export_reloads_in_transformers_with_equal_tensors(procs, ckpts, tmp_path):
    from transformers import AutoModelForCausalLM

    procs.init(2)
    procs.build(config(ckpts))
    procs.run("call", "train_step", make_samples(2, 3, seed=8))
    trained = procs.run("call", "full_state_dict")[0]
    out = str(tmp_path / "hf")
    files = procs.run("call", "export_hf", out)
    assert files == [["model.safetensors"], None]
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    sd = reloaded.state_dict()
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight  # tied, written once
    for name, t in trained.items():
        assert torch.equal(sd[name], t), name
    sharded = str(tmp_path / "hf-sharded")  # several files + index; bf16 on request
    files = procs.run("call", "export_hf", sharded, dtype=torch.bfloat16, max_shard_bytes=60_000)[0]
    assert len(files) > 2 and os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    reloaded = AutoModelForCausalLM.from_pretrained(sharded)
    assert reloaded.dtype == torch.bfloat16
    sd = reloaded.state_dict()
    for name, t in trained.items():
        assert torch.equal(sd[name], t.to(torch.bfloat16)), name


def test_sync_weights_pauses_the_memory_saver_only_for_ipc(procs, ckpts):
    procs.init(2)
    procs.build(config(ckpts))
    assert procs.run("helpers:memory_saver_use", "weightsync_ipc") == [[True], [True]]
    for backend in ("weightsync_m2n", "weightsync_nccl"):
        assert procs.run("helpers:memory_saver_use", backend) == [[False], [False]]


# --- sync_weights into vLLM's model classes ---------------------------------------------------------

@pytest.mark.vllm
@pytest.mark.parametrize("backend", TRANSPORTS)
def test_sync_weights_into_vllm_model_classes(cluster, backend):
    procs = ranks()  # starts (or reuses) the two trainer processes while the receivers come up
    cluster.setup(Layout(trainers=0, tp=2, backend=backend))  # the receivers; the trainer ranks are ours
    procs.init(2)
    procs.build(config(checkpoints()))
    procs.run("connect", init_info(backend, Layout(trainers=2, tp=2)), cluster.client(timeout_s=60))
    try:
        for step in range(2):
            if step:
                procs.run("call", "train_step", make_samples(2, 4, seed=20 + step))
            weights = procs.run("call", "full_state_dict")[0]
            assert any(cluster.on_receivers("compare_with_oracle", weights)), "vLLM already had these weights"
            procs.run("sync", f"v{step}")
            assert cluster.on_receivers("compare_with_oracle", weights) == [[], []]
        assert cluster.client().weight_versions() == ["v1", "v1"]
    finally:
        procs.run("shutdown_engine")


# --- examples/grpo_fsdp2.py ---------------------------------------------------------------------------

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "grpo_fsdp2.py")


def test_example_opens_with_its_launch_commands():
    text = open(EXAMPLE).read()
    head = text[: text.index('"""', 3)]
    assert "4xH100" in head and "python examples/grpo_fsdp2.py --model Qwen/Qwen3-0.6B" in head
    assert "python examples/grpo_fsdp2.py --cpu --steps 3" in head
    assert len(text.splitlines()) <= 300
