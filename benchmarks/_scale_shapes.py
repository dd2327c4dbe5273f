"""The shapes ``scale.py`` measures: each model's tensors (true names, shapes and TP / EP layout), the
byte scaling ``S``, and each worker's pieces of them."""

from __future__ import annotations

from functools import cache

import torch
from plan_scale import _dsv3_model, _linear_experts, _model, _region

from weightsync.plan import DestPiece, Shard
from weightsync.plan.regions import mesh_coordinates, source_regions
from weightsync.protocol import ParamMeta
from weightsync.trainer.sources import fuse_expert_metas
from weightsync.worker.experts import W1, W2, W3, W13, fused_expert_pieces

S = 64
"""Byte scale: the last dim of every tensor of >= 2 dims is divided by it (divides every shape here)."""

Model = list[tuple[str, tuple[int, ...], str, str]]


def _dense(layers: int, hidden: int, heads: tuple[int, int, int], inter: int, vocab: int,
           moe: tuple[int, int] | None = None) -> Model:
    """(name, shape, kind, param) of a Llama-style model (``moe``: (experts, moe inter), fused 3-D
    experts and a router on every layer, no shared expert: Qwen3-MoE)."""
    q, kv, hd = heads
    out: Model = [("model.embed_tokens.weight", (vocab, hidden), "vocab", "model.embed_tokens.weight")]
    for i in range(layers):
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        out += [(f"{p}.input_layernorm.weight", (hidden,), "rep", f"{p}.input_layernorm.weight"),
                (f"{p}.post_attention_layernorm.weight", (hidden,), "rep", f"{p}.post_attention_layernorm.weight"),
                (f"{a}.q_proj.weight", (q * hd, hidden), "q", f"{a}.qkv_proj.weight"),
                (f"{a}.k_proj.weight", (kv * hd, hidden), "k", f"{a}.qkv_proj.weight"),
                (f"{a}.v_proj.weight", (kv * hd, hidden), "v", f"{a}.qkv_proj.weight"),
                (f"{a}.o_proj.weight", (hidden, q * hd), "row", f"{a}.o_proj.weight")]
        if moe is None:
            m = f"{p}.mlp"
            out += [(f"{m}.gate_proj.weight", (inter, hidden), "gate", f"{m}.gate_up_proj.weight"),
                    (f"{m}.up_proj.weight", (inter, hidden), "up", f"{m}.gate_up_proj.weight"),
                    (f"{m}.down_proj.weight", (hidden, inter), "row", f"{m}.down_proj.weight")]
            continue
        experts, mi = moe
        e, r = f"{p}.mlp.experts", f"{p}.mlp.experts.routed_experts"
        out += [(f"{a}.q_norm.weight", (hd,), "rep", f"{a}.q_norm.weight"),
                (f"{a}.k_norm.weight", (hd,), "rep", f"{a}.k_norm.weight"),
                (f"{p}.mlp.gate.weight", (experts, hidden), "rep", f"{p}.mlp.gate.weight"),
                (f"{e}.gate_up_proj", (experts, 2 * mi, hidden), W13, f"{r}.w13_weight"),
                (f"{e}.down_proj", (experts, hidden, mi), W2, f"{r}.w2_weight")]
    out += [("model.norm.weight", (hidden,), "rep", "model.norm.weight"),
            ("lm_head.weight", (vocab, hidden), "vocab", "lm_head.weight")]
    return out


# name -> (model(layers), full layers, heads (q, kv, head dim), trainer ranks, tp, replicas, ep, anchors)
SHAPES = {
    "qwen3-tp": (lambda n: _dense(n, 4096, (64, 4, 128), 0, 151936, (128, 1536)), 94, (64, 4, 128), 64, 8, 8,
                 False, True),
    "qwen3-ep": (lambda n: _dense(n, 4096, (64, 4, 128), 0, 151936, (128, 1536)), 94, (64, 4, 128), 64, 8, 8,
                 True, True),
    "dsv3-tp": (lambda n: _dsv3_model(n, 256), 61, (128, 128, 128), 256, 8, 16, False, False),
    "dsv3-ep": (lambda n: _dsv3_model(n, 256), 61, (128, 128, 128), 256, 8, 16, True, False),
    "k2-tp": (lambda n: _model(n, 330), 61, (64, 8, 128), 256, 16, 16, False, False),
    "dense70b-tp": (lambda n: _dense(n, 8192, (64, 8, 128), 28672, 128256), 80, (64, 8, 128), 64, 8, 8,
                    False, False),
}
LABELS = {"qwen3-tp": "Qwen3-235B-A22B FSDP 64 -> TP 8 x 8", "qwen3-ep": "Qwen3-235B-A22B FSDP 64 -> EP 8 x 8",
          "dsv3-tp": "DeepSeek-V3 FSDP 256 -> TP 8 x 16", "dsv3-ep": "DeepSeek-V3 FSDP 256 -> EP 8 x 16",
          "k2-tp": "k2 (per-expert, fused) FSDP 256 -> TP 16 x 16", "dense70b-tp": "dense 70B FSDP 64 -> TP 8 x 8"}


def _scaled(model: Model) -> Model:
    out = []
    for n, s, kind, param in model:
        if len(s) > 1:
            if s[-1] % S:
                raise ValueError(f"{n}: last dim {s[-1]} is not divisible by S={S}")
            s = (*s[:-1], s[-1] // S)
        out.append((n, s, kind, param))
    return out


_FUSED = {"gate": (W1, "w13_weight"), "up": (W3, "w13_weight"), "row": (W2, "w2_weight")}


def _fused(model: Model) -> tuple[Model, dict[str, list[str]]]:
    """``model`` as ``DTensorModuleSource(fuse_experts=True)`` sends it (k2's per-expert weights one
    [E, ...] tensor per layer and projection, into vLLM's fused experts), and the fused ones' members."""
    fused, members = fuse_expert_metas([ParamMeta(n, torch.bfloat16, s, mesh_shape=(1,), placements=(Shard(0),),
                                                  rank_coordinates=((0,),)) for n, s, _, _ in model])
    params = {n: (k, p) for n, _, k, p in model}
    kinds = {f: _FUSED[params[ms[0]][0]] for f, ms in members.items()}
    return [(m.name, m.shape, *params[m.name]) if m.name not in kinds else
            (m.name, m.shape, kinds[m.name][0], f"{m.name.rpartition('.')[0]}.{kinds[m.name][1]}")
            for m in fused], members


@cache
def _fsdp_rows(shape: tuple[int, ...], ranks: int) -> tuple:
    """A fused tensor's regions: its members' FSDP rows (``Shard(0)`` of each: dim 1 of the fused)."""
    return source_regions(shape, (ranks,), [Shard(1)], mesh_coordinates((ranks,)))


def _piece(kind: str, shape: tuple[int, ...], tp: int, t: int, heads: tuple[int, int, int]):
    """Region and param offsets TP rank t takes of a tensor of this kind (plan_scale's, any head counts)."""
    q, kv, hd = heads
    if kind == "rep":
        return _region((0,) * len(shape), shape), (0,) * len(shape)
    if kind.startswith("rep@"):
        return _region((0,) * len(shape), shape), (int(kind[4:]),) + (0,) * (len(shape) - 1)
    if kind == "row":
        per = shape[1] // tp
        return _region((0, per * t), (shape[0], per)), (0, 0)
    if kind == "vocab":
        per = -(-(-(-shape[0] // 64) * 64) // tp)
        lo = min(per * t, shape[0])
        return _region((lo, 0), (min(shape[0], lo + per) - lo, shape[1])), (0, 0)
    if kind in ("k", "v"):
        kv_per, reps = max(1, kv // tp), max(1, tp // kv)
        first = (t // reps) * kv_per
        at = q * hd // tp + (0 if kind == "k" else kv_per * hd)
        return _region((first * hd, 0), (kv_per * hd, shape[1])), (at, 0)
    per = shape[0] // tp  # q, gate, up, col: column-parallel row ranges
    return _region((per * t, 0), (per, shape[1])), (per if kind == "up" else 0, 0)


def _worker_pieces(model: Model, tp: int, t: int, ep: bool, heads: tuple[int, int, int]) -> list[DestPiece]:
    pieces: list[DestPiece] = []
    for n, s, kind, param in model:
        if kind in (W13, W2, W1, W3):
            experts, rows, cols = s
            local_of = _linear_experts(experts, tp, t) if ep else [(e, e) for e in range(experts)]
            mt = 1 if ep else tp
            rows *= 2 if kind in (W1, W3) else 1  # a gate or an up alone: half of w13
            pshape = (len(local_of), rows, cols // mt) if kind == W2 else (len(local_of), rows // mt, cols)
            pieces += fused_expert_pieces(n, s, kind, param, pshape, local_of=local_of,
                                          tp_rank=0 if ep else t, tp_size=mt)
        else:
            region, offsets = _piece(kind, s, tp, t, heads)
            pieces.append(DestPiece(n, region, param, offsets))
    return pieces
