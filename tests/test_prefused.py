"""Checkpoints whose HF tensors are already fused (Phi3: ``qkv_proj`` and ``gate_up_proj`` are HF tensors),
on the harness (vLLM's model classes, no engine).

vLLM's fused layers split such a tensor themselves (``QKVParallelLinear`` at the q/k/v head offsets,
``MergedColumnParallelLinear`` at its ``output_sizes``), so each worker's slice of it is the
concatenation of its q/k/v (gate/up) shard slices: M2N sends each worker exactly those bytes, with no
fallback, bit-exact against vLLM's own ``load_weights`` of the trainer's full state dict. Where the
model's ``load_weights`` rewrites the fused tensor before the layer's loader sees it (Falcon's
interleaved heads), the tensor still goes whole through the loader.
"""

from __future__ import annotations

import pytest

from helpers import init_info
from weightsync.testing.cluster import Layout

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

_ME = "test_prefused:"
QKV, GATE_UP = "model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"


# --- inside a receiver -------------------------------------------------------------------------

def shard_bytes() -> int:
    """Bytes of this worker's share of the checkpoint: every live parameter, less the vocabulary's
    padding rows (vLLM zeroes them; no tensor carries them)."""
    from weightsync.testing.receiver import STATE

    total = 0
    for m in STATE["model"].modules():
        idx = getattr(m, "shard_indices", None)
        for p in m.parameters(recurse=False):
            rows = p.shape[0] if idx is None else idx.org_vocab_end_index - idx.org_vocab_start_index
            total += rows * (p.numel() // p.shape[0]) * p.element_size()
    return total


def fused_pieces(metas: list) -> dict:
    """``{HF name: [(HF rows start, rows, param row offset)]}`` of the two fused tensors of layer 1,
    and whether every parameter keeps its own loader (the probe of ``load_weights`` puts them back)."""
    from weightsync.testing.receiver import STATE, destinations

    loaders = {n: p.__dict__.get("weight_loader") for n, p in STATE["model"].named_parameters()}
    dests = destinations(metas)
    out = {n: [(p.region.offsets[0], p.region.sizes[0], p.param_offsets[0]) for p in dests.pieces if p.name == n]
           for n in (QKV, GATE_UP)}
    out["loaders_kept"] = loaders == {n: p.__dict__.get("weight_loader") for n, p in STATE["model"].named_parameters()}
    return out


def fallbacks_when_load_weights_rewrites_qkv(metas: list) -> list:
    """The fallbacks when the model's ``load_weights`` hands the layer's loader a rewritten fused
    tensor (as Falcon's regroups its interleaved heads): the placement could not be proven."""
    import torch

    from weightsync.testing.receiver import STATE, destinations

    model = STATE["model"]
    plain = type(model).load_weights

    def rewriting(self, weights):
        return plain(self, ((n, torch.cat([w[:1], w[1:]]) if "qkv_proj" in n else w) for n, w in weights))

    model.load_weights = rewriting.__get__(model)
    try:
        dests = destinations(metas)
    finally:
        del model.load_weights
    return [(f.name, f.reason) for f in dests.fallbacks]


# --- the tests ---------------------------------------------------------------------------------

def _metas(cluster) -> list:
    sources = cluster.on_trainers("local_shards")[0][0]
    return [(s.name, s.dtype, list(s.shape)) for s in sources]


def test_fused_tensor_slices_are_the_layers_shard_slices(cluster):
    cluster.setup(Layout(trainers=2, tp=2, model="tiny_phi3", backend="weightsync_m2n"))
    got = cluster.on_receivers(_ME + "fused_pieces", _metas(cluster))
    # qkv: 4 q heads + 2 kv heads of 16 rows, [q 0:64 | k 64:96 | v 96:128]; each rank its 2 q heads, 1 k, 1 v
    assert [g[QKV] for g in got] == [[(0, 32, 0), (64, 16, 32), (96, 16, 48)],
                                     [(32, 32, 0), (80, 16, 32), (112, 16, 48)]]
    # gate_up: output_sizes [128, 128]; each rank its half of gate, then its half of up
    assert [g[GATE_UP] for g in got] == [[(0, 64, 0), (128, 64, 64)], [(64, 64, 0), (192, 64, 64)]]
    assert [g["loaders_kept"] for g in got] == [True, True]


@pytest.mark.parametrize("tp", [2, 1])
def test_prefused_checkpoint_gets_shard_bytes_and_no_fallback(cluster, tp):
    layout = Layout(trainers=2, tp=tp, model="tiny_phi3", backend="weightsync_m2n")
    cluster.setup(layout)
    cluster.make_engines(init_info("weightsync_m2n", layout), source="local")
    want = dict(enumerate(cluster.on_receivers(_ME + "shard_bytes")))
    for step in range(2):
        cluster.train_step(5 + step)
        stats = cluster.sync(f"v{step}")
        assert stats["fallbacks_per_worker"] == {w: 0 for w in range(layout.num_workers)}
        assert stats["bytes_received_per_worker"] == want
        assert cluster.verify() == {a.name: [] for a in cluster.active_receivers}, f"sync v{step}"


def test_a_fused_tensor_load_weights_rewrites_falls_back(cluster):
    cluster.setup(Layout(trainers=1, tp=2, model="tiny_phi3", backend="weightsync_m2n"))
    got = cluster.on_receivers(_ME + "fallbacks_when_load_weights_rewrites_qkv", _metas(cluster))
    qkv = [f"model.layers.{i}.self_attn.qkv_proj.weight" for i in range(2)]
    assert [[n for n, _ in g] for g in got] == [qkv, qkv]
    assert all(r == "pre-fused tensor: vLLM's load_weights hands QKVParallelLinear's loader another tensor "
                    "than the checkpoint's" for g in got for _, r in g)
