"""Destinations read from vLLM's real model classes + the transfer plan, executed by the reference
executor from the trainers' FSDP2 local shards, give every vLLM parameter exactly what vLLM's own
``load_weights`` of the full state dict gives; no byte falls back."""

from __future__ import annotations

import pytest
import torch

from weightsync.layout import build_plan
from helpers import execute_reference
from weightsync.testing.cluster import Layout

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MODELS = ["tiny_qwen3", "tiny_qwen3_kv1", "tiny_llama", "tiny_qwen2"]


def plan_and_check(cluster, layout: Layout) -> dict:
    cluster.setup(layout)
    per_rank = cluster.on_trainers("local_shards")
    sources = per_rank[0][0]
    assert all(r[0] == sources for r in per_rank), "every trainer rank derives the same sources"
    shards = {rank: r[1] for rank, r in enumerate(per_rank)}
    wire = [(s.name, s.dtype, list(s.shape)) for s in sources]
    dests = cluster.on_receivers("destinations", wire)
    assert [d.fallbacks for d in dests] == [()] * layout.num_workers
    plan = build_plan(sources, [d.pieces for d in dests])
    assert plan.coverage().ratio == 1.0
    params = {w: {n: torch.zeros(shape, dtype=getattr(torch, d.param_dtypes[n])) for n, shape in d.param_shapes.items()}
              for w, d in enumerate(dests)}
    execute_reference(plan, shards, params)
    full = cluster.on_trainers("full_state_dict")[0]
    bad = [a.call("weightsync.testing.receiver:compare_tensors_with_oracle", params[w], full)
           for w, a in enumerate(cluster.active_receivers)]
    assert bad == [[]] * layout.num_workers
    return {"dests": dests, "plan": plan, "full": full}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_plan_matches_vllm_load_weights(cluster, model, tp):
    for trainers in (1, 2, 3):
        out = plan_and_check(cluster, Layout(trainers=trainers, tp=tp, model=model))
    dests, full = out["dests"], out["full"]
    # Tied embeddings (Qwen3): no lm_head in the source, so nothing is sent twice.
    assert ("lm_head.weight" in full) == (model in ("tiny_llama", "tiny_qwen2"))
    # Every byte of every destination piece is shard-sized, never the full tensor, when TP > 1:
    if tp > 1:
        q = [p for p in dests[0].pieces if p.name.endswith("self_attn.q_proj.weight")][0]
        assert q.region.sizes[0] * tp == full[q.name].shape[0]


def test_kv_head_replication_and_vocab_padding_at_tp4(cluster):
    out = plan_and_check(cluster, Layout(trainers=2, tp=4, model="tiny_qwen3"))
    dests = out["dests"]
    k = "model.layers.0.self_attn.k_proj.weight"  # 2 KV heads of 32 over TP 4: ranks 0,1 head 0; 2,3 head 1
    rows = [[p.region.offsets[0] for p in d.pieces if p.name == k] for d in dests]
    assert rows == [[0], [0], [32], [32]]
    emb = "model.embed_tokens.weight"  # vocab 151 padded to 192: 48 rows per rank, the last gets 7 real rows
    spans = [[(p.region.offsets[0], p.region.sizes[0]) for p in d.pieces if p.name == emb] for d in dests]
    assert spans == [[(0, 48)], [(48, 48)], [(96, 48)], [(144, 7)]]
