"""FSDP2 trainer pieces that need no processes: config validation, packing, the DP schedule, the loss
functions and the learning-rate schedule."""

from __future__ import annotations

import math
import re

import pytest
import torch

from weightsync.integrations.fsdp2 import (
    LossConfig,
    LRSchedule,
    ModelConfig,
    OptimConfig,
    Sample,
    TrainerConfig,
    dp_schedule,
    grpo_advantages,
    kl_estimate,
    pack,
    token_log_probs,
)
from weightsync.integrations.fsdp2.loss import LossTerms, grpo_loss, token_weights

MODEL = ModelConfig(path="/nonexistent/checkpoint")


@pytest.mark.parametrize("field,value", [("tensor_parallel_size", 2), ("pipeline_parallel_size", 4),
                                         ("context_parallel_size", 2), ("expert_parallel_size", 8),
                                         ("critic", True)])
def test_unsupported_requests_fail_at_construction(field, value):
    with pytest.raises(ValueError, match=rf"TrainerConfig\.{field}={value!r} is not supported .* it must be"):
        TrainerConfig(model=MODEL, **{field: value})


@pytest.mark.parametrize("make,match", [
    (lambda: ModelConfig(path=""), r"ModelConfig\.path must be a non-empty str, got ''"),
    (lambda: ModelConfig(path="x", param_dtype="int8"), r"ModelConfig\.param_dtype must be one of .* got 'int8'"),
    (lambda: OptimConfig(lr=-1.0), r"OptimConfig\.lr must be >= 0.0, got -1.0"),
    (lambda: OptimConfig(lr=1e-3, min_lr=1e-2), r"OptimConfig\.min_lr must be <= 0.001, got 0.01"),
    (lambda: OptimConfig(warmup_samples=10, decay_samples=5, decay_style="linear"),
     r"decay_samples=5 must exceed warmup_samples=10"),
    (lambda: OptimConfig(decay_style="cosine"), r"decay_style='cosine' needs decay_samples, got None"),
    (lambda: OptimConfig(grad_clip=0.0), r"OptimConfig\.grad_clip must be > 0.0, got 0.0"),
    (lambda: LossConfig(kl_type="k2"), r"LossConfig\.kl_type must be one of \('k1', 'k3'\), got 'k2'"),
    (lambda: LossConfig(temperature=0), r"LossConfig\.temperature must be > 0.0, got 0"),
    (lambda: LossConfig(clip_low=1.5), r"LossConfig\.clip_low must be <= 1.0, got 1.5"),
    (lambda: TrainerConfig(model=MODEL, max_tokens_per_micro_batch=0),
     r"TrainerConfig\.max_tokens_per_micro_batch must be >= 1, got 0"),
    (lambda: TrainerConfig(model=MODEL, device="tpu"), r"TrainerConfig\.device must be one of .* got 'tpu'"),
    (lambda: Sample([], [1], 0.0, 0), r"Sample\.prompt_ids must be a non-empty sequence"),
    (lambda: Sample([1], [2, 3], 0.0, 0, [-1.0]), r"rollout_log_probs has 1 values for 2 response tokens"),
])
def test_config_errors_name_the_field_and_value(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_configs_are_frozen_and_keyword_only():
    cfg = TrainerConfig(model=MODEL)
    with pytest.raises(AttributeError):
        cfg.seed = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        ModelConfig("path")  # type: ignore[misc]


def test_pack_restarts_positions_and_aligns_targets():
    batch = [Sample([5, 6], [7, 8, 9], 1.0, 0), Sample([1], [2], 0.0, 0), Sample([3, 4, 4], [1, 2], 0.5, 1)]
    row = pack(batch, [0, 2])
    assert row.input_ids.tolist() == [[5, 6, 7, 8, 9, 3, 4, 4, 1, 2]]
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]]
    # position t predicts token t + 1: the responses' tokens, from the last prompt token on
    assert row.loss_positions.tolist() == [1, 2, 3, 7, 8]
    assert row.targets.tolist() == [7, 8, 9, 1, 2]
    assert row.targets.tolist() == [row.input_ids[0, p + 1].item() for p in row.loss_positions.tolist()]
    assert row.samples == (0, 2) and row.response_lengths == (3, 2)
    filler = pack(batch, [])
    assert filler.input_ids.tolist() == [[0]] and filler.targets.numel() == 0 and filler.samples == ()


def test_dp_schedule_covers_every_sample_once_with_equal_row_counts():
    lengths = [9, 3, 17, 5, 5, 12, 2, 30, 7, 4, 1]
    for dp in (1, 2, 3, 4, 16):
        for budget in (1, 8, 20, 64, 1000):
            sched = dp_schedule(lengths, dp, budget)
            assert len(sched) == dp
            assert len({len(rows) for rows in sched}) == 1, (dp, budget, sched)  # collective forwards match
            flat = sorted(i for rows in sched for row in rows for i in row)
            assert flat == list(range(len(lengths)))
            for rows in sched:
                for row in rows:
                    assert row == sorted(row)
                    assert len(row) <= 1 or sum(lengths[i] for i in row) <= budget
    assert dp_schedule(lengths, 2, 20) == dp_schedule(list(lengths), 2, 20)  # deterministic
    assert dp_schedule([4, 4], 3, 100)[2] == [[]]  # a rank without samples runs a filler row


def test_dp_schedule_balances_tokens_over_ranks():
    lengths = [10] * 7 + [1] * 6
    loads = [sum(lengths[i] for row in rows for i in row) for rows in dp_schedule(lengths, 2, 1000)]
    assert sorted(loads) == [36, 40]  # the best split: 38/38 needs eight 1-token samples


def test_token_log_probs_and_entropy_match_a_direct_computation():
    torch.manual_seed(0)
    logits, targets = torch.randn(6, 11), torch.randint(0, 11, (6,))
    logp, ent = token_log_probs(logits, targets, temperature=0.7, with_entropy=True)
    ref = torch.log_softmax(logits / 0.7, -1)
    torch.testing.assert_close(logp, ref[torch.arange(6), targets])
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1))


def test_grpo_advantages_are_group_normalized():
    adv = grpo_advantages([1.0, 0.0, 1.0, 0.0, 3.0, 5.0], [0, 0, 0, 0, 1, 1])
    torch.testing.assert_close(adv[:4], torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(adv[4:], torch.tensor([-1.0, 1.0]), atol=1e-5, rtol=0)
    assert grpo_advantages([2.0], [7]).tolist() == [0.0]
    assert grpo_advantages([1.0, 3.0], [0, 0], normalize=False).tolist() == [-1.0, 1.0]


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([0.5, -1.0]))
    d = ref - logp
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), torch.exp(d) - d - 1)
    assert kl_estimate(logp, logp, "k3").abs().max() == 0


def test_grpo_loss_clips_the_ratio_like_ppo():
    cfg = LossConfig(clip_low=0.2, clip_high=0.3)
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([0.5, 1.5, 1.1, 0.7])).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    w = torch.full((4,), 0.25)
    loss, m = grpo_loss(logp, None, LossTerms(adv, old, None, w), cfg)
    # ratio 0.5, A>0: unclipped -0.5 beats clipped -0.8 (pessimistic max); 1.5, A>0: clipped at 1.3
    # 1.1, A<0: unclipped 1.1; 0.7, A<0: clipped at 0.8 -> 0.8
    torch.testing.assert_close(loss, torch.tensor((-0.5 - 1.3 + 1.1 + 0.8) / 4))
    torch.testing.assert_close(m["clip_frac"], torch.tensor(0.5))
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([-0.5, 0.0, 1.1, 0.0]) / 4)


def test_token_weights_sum_to_one_over_the_global_batch():
    lens = [3, 1, 4]
    assert float(token_weights(lens, "token_mean", 8, 3).sum()) == pytest.approx(1.0)
    w = token_weights(lens, "sample_mean", 8, 3)
    assert float(w.sum()) == pytest.approx(1.0) and w[0] == pytest.approx(1 / 9) and w[3] == pytest.approx(1 / 3)


def test_lr_schedule_counts_samples():
    s = LRSchedule(lr=1.0, min_lr=0.1, warmup_samples=10, decay_samples=110, decay_style="cosine")
    assert [s(0), s(5), s(10)] == [0.0, 0.5, 1.0]
    assert s(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s(110) == pytest.approx(0.1) and s(10_000) == pytest.approx(0.1)
    lin = LRSchedule(lr=1.0, warmup_samples=0, decay_samples=100, decay_style="linear")
    assert lin(25) == pytest.approx(0.75)
    assert LRSchedule.from_config(OptimConfig(lr=3e-6))(12345) == 3e-6


def test_adamw_groups_leave_biases_and_norms_undecayed():
    from transformers import AutoConfig, AutoModelForCausalLM

    from weightsync.integrations.fsdp2.loss import build_optimizer
    from weightsync.testing.cluster import model_config_dir

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_config_dir("tiny_qwen2")))
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0.1 for p in g["params"]}
    undecayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    assert decayed | undecayed == set(names.values()) and not decayed & undecayed
    assert "model.layers.0.self_attn.q_proj.bias" in undecayed  # Qwen2 has qkv biases
    assert "model.layers.0.input_layernorm.weight" in undecayed and "model.norm.weight" in undecayed
    assert "model.layers.0.mlp.down_proj.weight" in decayed and "model.embed_tokens.weight" in decayed


@pytest.mark.parametrize("name", ["nccl", "m2n", "nccl_m2n", "ipc", "weightsync_bogus"])
def test_weight_source_accepts_only_registered_transport_names(name):
    from weightsync.integrations.fsdp2 import FSDP2Trainer
    from weightsync.registry import transport_names

    with pytest.raises(ValueError, match=re.escape(f"backend {name!r} is not a registered transport; choose one of "
                                                   f"{transport_names()}")):
        FSDP2Trainer.weight_source(object(), name)  # raises before it touches the trainer
