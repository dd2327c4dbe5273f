"""Planner scale: a 1T-parameter-class MoE, 256 FSDP trainer ranks -> TP16 x 16 vLLM replicas.

Launch (CPU, one core, ~1 GiB; no GPU needed)::

    PYTHONPATH=src python benchmarks/plan_scale.py            # full size, ~61k tensors
    PYTHONPATH=src python benchmarks/plan_scale.py --layers 4 # quick look
    PYTHONPATH=src python benchmarks/plan_scale.py --hsdp 2   # HSDP trainer: replicated pieces

Synthetic metadata shaped like a DeepSeek/Kimi-style MoE (hidden 7168, 61 layers, the first
dense, 330 routed experts + 1 shared expert per MoE layer, GQA 64 q / 8 kv heads of 128).
Trainer: 1-D FSDP mesh of 256, ``Shard(0)`` (uneven where rows do not divide). Workers: 16
replicas of TP16; fused qkv (KV heads replicated over pairs of TP ranks) and gate_up are
column-parallel, o_proj/down_proj row-parallel (column ranges), norms/router replicated,
embed/lm_head vocab-parallel with padding. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import math
import time
from functools import cache
from statistics import mean

from weightsync.layout import (
    DestPiece,
    Region,
    Replicate,
    Shard,
    TensorSource,
    build_plan,
    mesh_coordinates,
    source_regions,
)

HIDDEN, HEAD, Q_HEADS, KV_HEADS, INTER, MOE_INTER, VOCAB = 7168, 128, 64, 8, 18432, 2048, 163845


@cache
def _fsdp(shape: tuple[int, ...], ranks: int, replicas: int) -> tuple[Region, ...]:
    """Source regions of one shape (FSDP, or HSDP when replicas > 1), shared by its tensors."""
    if replicas == 1:
        return source_regions(shape, (ranks,), [Shard(0)], mesh_coordinates((ranks,)))
    mesh = (replicas, ranks // replicas)
    return source_regions(shape, mesh, [Replicate(), Shard(0)], mesh_coordinates(mesh))


@cache
def _region(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Region:
    return Region(offsets, sizes)


def _model(layers: int, experts: int) -> list[tuple[str, tuple[int, ...], str, str]]:
    """(name, shape, kind, param) of every HF tensor; kind says how vLLM shards it."""
    embed = "model.embed_tokens.weight"
    out: list[tuple[str, tuple[int, ...], str, str]] = [(embed, (VOCAB, HIDDEN), "vocab", embed)]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", (HIDDEN,), "rep", f"{p}.input_layernorm.weight"),
            (f"{p}.post_attention_layernorm.weight", (HIDDEN,), "rep", f"{p}.post_attention_layernorm.weight"),
            (f"{p}.self_attn.q_proj.weight", (Q_HEADS * HEAD, HIDDEN), "q", f"{p}.self_attn.qkv_proj.weight"),
            (f"{p}.self_attn.k_proj.weight", (KV_HEADS * HEAD, HIDDEN), "k", f"{p}.self_attn.qkv_proj.weight"),
            (f"{p}.self_attn.v_proj.weight", (KV_HEADS * HEAD, HIDDEN), "v", f"{p}.self_attn.qkv_proj.weight"),
            (f"{p}.self_attn.o_proj.weight", (HIDDEN, Q_HEADS * HEAD), "row", f"{p}.self_attn.o_proj.weight"),
            (f"{p}.self_attn.q_norm.weight", (HEAD,), "rep", f"{p}.self_attn.q_norm.weight"),
            (f"{p}.self_attn.k_norm.weight", (HEAD,), "rep", f"{p}.self_attn.k_norm.weight"),
        ]
        mlps = [(f"{p}.mlp", INTER)] if i == 0 else [(f"{p}.mlp.shared_experts", MOE_INTER)]
        if i:
            out += [
                (f"{p}.mlp.gate.weight", (experts, HIDDEN), "rep", f"{p}.mlp.gate.weight"),
                (f"{p}.mlp.gate.e_score_correction_bias", (experts,), "rep", f"{p}.mlp.gate.e_score_correction_bias"),
            ]
            mlps += [(f"{p}.mlp.experts.{e}", MOE_INTER) for e in range(experts)]
        for m, inter in mlps:
            out += [
                (f"{m}.gate_proj.weight", (inter, HIDDEN), "gate", f"{m}.gate_up_proj.weight"),
                (f"{m}.up_proj.weight", (inter, HIDDEN), "up", f"{m}.gate_up_proj.weight"),
                (f"{m}.down_proj.weight", (HIDDEN, inter), "row", f"{m}.down_proj.weight"),
            ]
    out += [
        ("model.norm.weight", (HIDDEN,), "rep", "model.norm.weight"),
        ("lm_head.weight", (VOCAB, HIDDEN), "vocab", "lm_head.weight"),
    ]
    return out


def _piece(kind: str, shape: tuple[int, ...], tp: int, t: int) -> tuple[Region, tuple[int, ...]]:
    """Region and param offsets TP rank t takes of a tensor of this kind."""
    if kind == "rep":
        return _region((0,) * len(shape), shape), (0,) * len(shape)
    if kind == "row":
        per = shape[1] // tp
        return _region((0, per * t), (shape[0], per)), (0, 0)
    if kind == "vocab":
        padded = -(-shape[0] // 64) * 64
        per = -(-padded // tp)
        lo = min(per * t, shape[0])
        return _region((lo, 0), (min(shape[0], lo + per) - lo, shape[1])), (0, 0)
    if kind in ("k", "v"):
        reps = tp // KV_HEADS
        head = t // reps
        q_rows = Q_HEADS * HEAD // tp
        at = q_rows if kind == "k" else q_rows + HEAD
        return _region((head * HEAD, 0), (HEAD, shape[1])), (at, 0)
    per = shape[0] // tp  # q, gate, up: column-parallel row ranges
    return _region((per * t, 0), (per, shape[1])), (per if kind == "up" else 0, 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--experts", type=int, default=330)
    ap.add_argument("--trainer-ranks", type=int, default=256)
    ap.add_argument("--tp", type=int, default=16)
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--hsdp", type=int, default=1, help="trainer replica groups (HSDP); 1 = plain FSDP")
    args = ap.parse_args()

    t0 = time.perf_counter()
    model = _model(args.layers, args.experts)
    sources = [TensorSource(n, s, "bfloat16", _fsdp(s, args.trainer_ranks, args.hsdp)) for n, s, _, _ in model]
    per_tp = []
    for t in range(args.tp):
        pieces = []
        for n, s, kind, param in model:
            region, offsets = _piece(kind, s, args.tp, t)
            pieces.append(DestPiece(n, region, param, offsets))
        per_tp.append(pieces)
    # The same TP rank in every replica wants the same pieces: share the list object.
    destinations = [per_tp[t] for _ in range(args.replicas) for t in range(args.tp)]
    t_inputs = time.perf_counter() - t0

    t0 = time.perf_counter()
    plan = build_plan(sources, destinations)
    t_plan = time.perf_counter() - t0
    t0 = time.perf_counter()
    n_src0 = len(plan.items_for_src(0))  # freed before the next listing
    t_src = time.perf_counter() - t0
    t0 = time.perf_counter()
    n_dst0 = len(plan.items_for_dst(0))
    t_dst = time.perf_counter() - t0
    t0 = time.perf_counter()
    cov = plan.coverage()
    t_cov = time.perf_counter() - t0
    params = sum(math.prod(s) for _, s, _, _ in model)

    print(f"inputs built in {t_inputs:.2f} s; ~{params / 1e12:.2f}T parameters; {plan.num_items:,} items in all")
    print()
    print("| tensors | trainer ranks | workers | unique signatures | plan s | items for src rank 0 | list s "
          "| items for worker 0 | list s | coverage ratio | coverage s | send max/mean |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {plan.num_tensors:,} | {plan.num_src_ranks} | {plan.num_dst_ranks} | {plan.num_signatures} "
          f"| {t_plan:.2f} | {n_src0:,} | {t_src:.2f} | {n_dst0:,} | {t_dst:.2f} "
          f"| {cov.ratio:.2f} | {t_cov:.2f} | {max(cov.send_bytes) / mean(cov.send_bytes):.3f} |")


if __name__ == "__main__":
    main()
