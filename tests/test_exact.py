"""The engine equals vLLM's load of the trainer's weights in every position, vocabulary padding
included, after a worker lost its weights: an untied Llama over 2 replicas of TP 2 (TP rank 1 holds
vocabulary padding rows of ``embed_tokens`` and ``lm_head``, which vLLM's loader zeroes), delta
syncs; one worker is re-initialized with dummy weights (padding too, as vLLM's dummy loader does)
and says so (``drop_held``). Its next sync is a dense write of every parameter it holds, which must
leave the padding as vLLM's loader does, and the delta syncs that follow keep it so."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import init_info, mismatches
from weightsync.registry import transport, transports_with
from weightsync.testing.actors import STATE
from weightsync.testing.cluster import Layout

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

M2N = Layout(trainers=2, tp=2, replicas=2, dtype="bfloat16", trainer_dtype="float32", model="tiny_llama",
             backend="weightsync_m2n")
BROADCAST = Layout(trainers=2, tp=2, dtype="bfloat16", trainer_dtype="float32", model="tiny_llama",
                   backend="weightsync_nccl")


def dummy_reinit(seed: int) -> list[str]:
    """Inside a receiver: every value re-drawn as vLLM's dummy loader does (uniform in [-1e-3, 1e-3],
    padding rows too); its engine says it no longer holds a sync. Returns the parameters whose
    vocabulary padding (rows past this rank's vocabulary) is now nonzero."""
    g = torch.Generator().manual_seed(seed)
    padded = []
    for name, p in STATE["model"].named_parameters():
        p.data.copy_(torch.rand(p.shape, generator=g).mul_(2e-3).sub_(1e-3).to(p.dtype))
        shard = getattr(_module_of(name), "shard_indices", None)
        if shard is not None and p[shard.num_org_elements : shard.num_org_elements_padded].count_nonzero():
            padded.append(name)
    STATE["engine"].drop_held()
    return padded


def _module_of(name: str) -> torch.nn.Module:
    return STATE["model"].get_submodule(name.rsplit(".", 1)[0])


LAYOUTS = {**{b.removeprefix("weightsync_"): dataclasses.replace(M2N, backend=b)
              for b in transports_with("delta") if transport(b).source == "local"},
           "broadcast": BROADCAST}


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_a_worker_reinitialized_with_dummy_weights_gets_padding_zeroed_by_its_dense_sync(cluster, layout):
    cluster.setup(layout, fresh=True)
    cluster.make_engines(init_info(layout.backend, layout, delta=True), wire_dtype="bfloat16")
    cluster.sync("v0")
    cluster.train_step(1, lr=1e-5)
    cluster.sync("v1")
    lost = layout.num_workers - 1  # TP rank 1: holds vocabulary padding rows
    padded = cluster.receivers[lost].call("test_exact:dummy_reinit", 7)
    assert padded == ["model.embed_tokens.weight", "lm_head.weight"]
    cluster.train_step(2, lr=1e-5)
    stats = cluster.sync("v2", verify=True)
    assert stats["verified"]
    if transport(layout.backend).source == "local":  # the reshard core: per worker
        assert lost not in stats["delta"]["workers"]  # its sync was dense
    assert mismatches(cluster) == {}
    cluster.train_step(3, lr=1e-5)
    stats = cluster.sync("v3", verify=True)
    assert stats["delta"]["workers"] == list(range(layout.num_workers)) and stats["verified"]
    assert mismatches(cluster) == {}
