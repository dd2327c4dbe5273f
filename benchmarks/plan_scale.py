"""Planner scale: model-scale MoE plans from 256 FSDP trainer ranks to 128-256 vLLM workers.

Launch (CPU, one core, ~1-2 GiB; no GPU needed)::

    PYTHONPATH=src python benchmarks/plan_scale.py            # 1T-class, per-expert tensors, TP16 x 16
    PYTHONPATH=src python benchmarks/plan_scale.py --layers 4 # quick look
    PYTHONPATH=src python benchmarks/plan_scale.py --hsdp 2   # HSDP trainer: replicated pieces
    PYTHONPATH=src python benchmarks/plan_scale.py --model dsv3 [--ep]   # fused 3-D experts, TP8 / EP8 x 16
    PYTHONPATH=src python benchmarks/plan_scale.py --all      # the three rows above, each in its own
                                                              # process; writes results/plan_scale.json

``k2``: synthetic metadata shaped like a DeepSeek/Kimi-style MoE with per-expert 2-D tensors (hidden
7168, 61 layers, the first dense, 330 routed experts + 1 shared expert per MoE layer, GQA 64 q / 8 kv
heads of 128). Workers: 16 replicas of TP16; fused qkv (KV heads replicated over pairs of TP ranks)
and gate_up are column-parallel, o_proj/down_proj row-parallel (column ranges), norms/router
replicated, embed/lm_head vocab-parallel with padding.

``dsv3``: DeepSeek-V3's public shapes (see ``_dsv3_model``) with transformers 5's fused 3-D experts
(``gate_up_proj`` [256, 4096, 7168], ``down_proj`` [256, 7168, 2048]); workers: 16 replicas of TP8,
routed experts TP-sliced (default) or, with ``--ep``, expert-parallel (32 experts whole per worker,
linear placement), their pieces from :func:`weightsync.worker.experts.fused_expert_pieces`.

Trainer: 1-D FSDP mesh of 256, ``Shard(0)`` (the expert dim of 3-D expert tensors; uneven where rows
do not divide). Each rank builds the whole plan, then its compact per-peer listing
(``TransferPlan.pairs``, what the M2N executor keeps): the table reports both, and the process's peak
RSS over the plan and the listings above its RSS before (``/proc`` VmHWM). ``--cut`` also times
cutting trainer rank 0's rounds from that listing into arrays (``weightsync.plan.schedule.pair_rounds``: what
a rank does once at init, ``reshard.handshake.Rounds``) and its peak memory.
The plan is built ``--repeats`` times (median reported; the machine may be shared). Prints a
markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from functools import cache
from statistics import mean, median

from weightsync.plan import (
    DestPiece,
    Region,
    Replicate,
    Shard,
    TensorSource,
    build_plan,
    mesh_coordinates,
    source_regions,
)
from weightsync.plan.schedule import message_cap, pair_rounds
from weightsync.plan.transfer import PairItems
from weightsync.worker.experts import W2, W13, fused_expert_pieces

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
    if kind.startswith("rep@"):  # replicated, at a row offset of a merged parameter
        return _region((0,) * len(shape), shape), (int(kind[4:]),) + (0,) * (len(shape) - 1)
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


# DeepSeek-V3 (public config): MLA with q_lora_rank 1536, kv_lora_rank 512, 128 heads of qk 128 + 64
# (rope) and v 128; the first 3 layers dense (18432), then 58 MoE layers of 256 routed experts (2048)
# and 1 shared expert (2048); vocab 129280; the MTP layer (61) left out.
V3_HEADS, V3_QR, V3_KVR, V3_NOPE, V3_ROPE, V3_V, V3_DENSE, V3_VOCAB = 128, 1536, 512, 128, 64, 128, 3, 129280


def _dsv3_model(layers: int, experts: int) -> list[tuple[str, tuple[int, ...], str, str]]:
    """(name, shape, kind, param) of every HF tensor of DeepSeek-V3 with fused 3-D experts.

    The attention is modelled from vLLM's MLA layer types, not read from a live vLLM model:
    q_a_proj and kv_a_proj_with_mqa replicated into one merged ``fused_qkv_a_proj``, q_b_proj and
    kv_b_proj column-parallel, o_proj row-parallel, the two latent norms replicated."""
    embed = "model.embed_tokens.weight"
    out: list[tuple[str, tuple[int, ...], str, str]] = [(embed, (V3_VOCAB, HIDDEN), "vocab", embed)]
    for i in range(layers):
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        out += [
            (f"{p}.input_layernorm.weight", (HIDDEN,), "rep", f"{p}.input_layernorm.weight"),
            (f"{p}.post_attention_layernorm.weight", (HIDDEN,), "rep", f"{p}.post_attention_layernorm.weight"),
            (f"{a}.q_a_proj.weight", (V3_QR, HIDDEN), "rep@0", f"{a}.fused_qkv_a_proj.weight"),
            (f"{a}.kv_a_proj_with_mqa.weight", (V3_KVR + V3_ROPE, HIDDEN), f"rep@{V3_QR}",
             f"{a}.fused_qkv_a_proj.weight"),
            (f"{a}.q_a_layernorm.weight", (V3_QR,), "rep", f"{a}.q_a_layernorm.weight"),
            (f"{a}.kv_a_layernorm.weight", (V3_KVR,), "rep", f"{a}.kv_a_layernorm.weight"),
            (f"{a}.q_b_proj.weight", (V3_HEADS * (V3_NOPE + V3_ROPE), V3_QR), "col", f"{a}.q_b_proj.weight"),
            (f"{a}.kv_b_proj.weight", (V3_HEADS * (V3_NOPE + V3_V), V3_KVR), "col", f"{a}.kv_b_proj.weight"),
            (f"{a}.o_proj.weight", (HIDDEN, V3_HEADS * V3_V), "row", f"{a}.o_proj.weight"),
        ]
        mlps = [(f"{p}.mlp", INTER)] if i < V3_DENSE else [(f"{p}.mlp.shared_experts", MOE_INTER)]
        for m, inter in mlps:
            out += [
                (f"{m}.gate_proj.weight", (inter, HIDDEN), "gate", f"{m}.gate_up_proj.weight"),
                (f"{m}.up_proj.weight", (inter, HIDDEN), "up", f"{m}.gate_up_proj.weight"),
                (f"{m}.down_proj.weight", (HIDDEN, inter), "row", f"{m}.down_proj.weight"),
            ]
        if i >= V3_DENSE:
            e, r = f"{p}.mlp.experts", f"{p}.mlp.experts.routed_experts"
            out += [
                (f"{p}.mlp.gate.weight", (experts, HIDDEN), "rep", f"{p}.mlp.gate.weight"),
                (f"{p}.mlp.gate.e_score_correction_bias", (experts,), "rep", f"{p}.mlp.gate.e_score_correction_bias"),
                (f"{e}.gate_up_proj", (experts, 2 * MOE_INTER, HIDDEN), W13, f"{r}.w13_weight"),
                (f"{e}.down_proj", (experts, HIDDEN, MOE_INTER), W2, f"{r}.w2_weight"),
            ]
    out += [
        ("model.norm.weight", (HIDDEN,), "rep", "model.norm.weight"),
        ("lm_head.weight", (V3_VOCAB, HIDDEN), "vocab", "lm_head.weight"),
    ]
    return out


def _linear_experts(experts: int, ep: int, rank: int) -> list[tuple[int, int]]:
    """(global id, local slot) of the experts EP rank ``rank`` holds under vLLM's linear placement
    (contiguous ranges; the first ``experts % ep`` ranks hold one more)."""
    base, extra = divmod(experts, ep)
    start = rank * base + min(rank, extra)
    return [(start + i, i) for i in range(base + (rank < extra))]


def _worker_pieces(model: list, tp: int, t: int, ep: bool) -> list[DestPiece]:
    """TP rank ``t``'s pieces; fused experts TP-sliced, or (``ep``) whole experts of EP rank ``t``."""
    pieces: list[DestPiece] = []
    for n, s, kind, param in model:
        if kind in (W13, W2):
            experts, rows, cols = s
            local_of = _linear_experts(experts, tp, t) if ep else [(e, e) for e in range(experts)]
            mt = 1 if ep else tp  # vLLM's MoE TP size: 1 inside an expert-parallel layer
            pshape = (len(local_of), rows // mt, cols) if kind == W13 else (len(local_of), rows, cols // mt)
            pieces += fused_expert_pieces(n, s, kind, param, pshape, local_of=local_of,
                                          tp_rank=0 if ep else t, tp_size=mt)
        else:
            region, offsets = _piece(kind, s, tp, t)
            pieces.append(DestPiece(n, region, param, offsets))
    return pieces


def _bound_bytes(model: list, tp: int) -> float:
    """A worker's shard lower bound (bf16): replicated tensors whole, K/V over min(tp, KV heads)
    ranks, everything else (experts whole or sliced alike) / tp."""
    total = 0.0
    for _, s, kind, _ in model:
        nbytes = math.prod(s) * 2
        total += nbytes if kind.startswith("rep") else nbytes / (min(tp, KV_HEADS) if kind in ("k", "v") else tp)
    return total


def _rss_mib() -> tuple[float, float]:
    """(current RSS, peak RSS) of this process in MiB (peak: since the last ``_reset_peak``)."""
    try:
        with open("/proc/self/status") as f:
            kb = {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in f) if k in ("VmRSS", "VmHWM")}
        return kb["VmRSS"] / 1024, kb["VmHWM"] / 1024
    except (OSError, KeyError):  # no /proc: the lifetime peak only
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return peak, peak


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def measure(args: argparse.Namespace) -> dict:
    """Build the inputs and the plan of one scenario; time and size every step."""
    t0 = time.perf_counter()
    if args.model == "dsv3":
        model = _dsv3_model(args.layers, args.experts or 256)
    else:
        model = _model(args.layers, args.experts or 330)
    tp = args.tp or (8 if args.model == "dsv3" else 16)
    sources = [TensorSource(n, s, "bfloat16", _fsdp(s, args.trainer_ranks, args.hsdp)) for n, s, _, _ in model]
    per_tp = [_worker_pieces(model, tp, t, args.ep) for t in range(tp)]
    # The same TP rank in every replica wants the same pieces: share the list object.
    destinations = [per_tp[t] for _ in range(args.replicas) for t in range(tp)]
    t_inputs = time.perf_counter() - t0

    rss0, _ = _rss_mib()
    _reset_peak()
    t0 = time.perf_counter()
    plan = build_plan(sources, destinations)
    plan_times = [time.perf_counter() - t0]
    plan_rss, _ = _rss_mib()
    for _ in range(args.repeats - 1):  # the same plan again (the machine may be shared): the median counts
        del plan
        t0 = time.perf_counter()
        plan = build_plan(sources, destinations)
        plan_times.append(time.perf_counter() - t0)
    t_plan = median(plan_times)
    t0 = time.perf_counter()
    src0 = plan.pairs(0, sender=True)  # what the M2N executor keeps per rank: no object per item
    n_src0 = src0.count()
    t_src = time.perf_counter() - t0
    t0 = time.perf_counter()
    n_dst0 = plan.pairs(0, sender=False).count()
    t_dst = time.perf_counter() - t0
    _, peak = _rss_mib()
    cut = (_cut_pass(src0, {s.name: 2 for s in sources}, plan.num_src_ranks, plan.num_dst_ranks)
           if getattr(args, "cut", False) else {})
    t0 = time.perf_counter()
    cov = plan.coverage()
    t_cov = time.perf_counter() - t0
    return {
        "model": args.model, "layout": f"{'EP' if args.ep else 'TP'}{tp} x {args.replicas}",
        "hsdp": args.hsdp, "layers": args.layers,
        "params": sum(math.prod(s) for _, s, _, _ in model), "inputs_s": t_inputs,
        "tensors": plan.num_tensors, "trainer_ranks": plan.num_src_ranks, "workers": plan.num_dst_ranks,
        "signatures": plan.num_signatures, "items": plan.num_items, "plan_s": t_plan, "plan_s_all": plan_times,
        "items_src0": n_src0, "list_src0_s": t_src, "items_dst0": n_dst0, "list_dst0_s": t_dst,
        "coverage_ratio": cov.ratio, "coverage_s": t_cov,
        "send_max_over_mean": max(cov.send_bytes) / mean(cov.send_bytes),
        "recv_max_gb": max(cov.recv_bytes) / 1e9, "bound_gb": _bound_bytes(model, tp) / 1e9,
        "recv_max_over_bound": max(cov.recv_bytes) / _bound_bytes(model, tp), "rss_before_mib": rss0,
        "plan_extra_mib": plan_rss - rss0, "peak_extra_mib": peak - rss0, **cut,
    }


def _cut_pass(pairs: PairItems, itemsize: dict[str, int], num_src: int, num_dst: int) -> dict:
    """Trainer rank 0's rounds cut from the compact plan into arrays (64 MiB staging; a round stages
    at most half of it): what a rank does once at init (``reshard.handshake.Rounds``)."""
    cap = message_cap(64 << 20, num_src, num_dst, buffers=2)
    _reset_peak()
    rss0, _ = _rss_mib()
    t0 = time.perf_counter()
    cut = pair_rounds(pairs, cap=cap, itemsize_of=itemsize.__getitem__)
    n_rounds, n_msgs = len(cut), cut.num_messages
    _, peak = _rss_mib()
    return {"cut_s": time.perf_counter() - t0, "cut_rounds": n_rounds, "cut_messages": n_msgs,
            "cut_peak_mib": peak - rss0, "cut_cap": cap}


def table(rows: list[dict]) -> str:
    lines = ["| model | layout | params | tensors | trainer ranks | workers | unique signatures | plan s "
             "| plan MiB | items for src rank 0 | list s | items for worker 0 | list s | peak MiB "
             "| GB per worker | / shard bound | coverage ratio | coverage s | send max/mean |",
             "|---|---|" + "---:|" * 17]
    for r in rows:
        layout = r["layout"] + (f", HSDP {r['hsdp']}" if r["hsdp"] > 1 else "")
        lines.append(
            f"| {r['model']} | {layout} | {r['params'] / 1e9:.0f}B | {r['tensors']:,} | {r['trainer_ranks']} "
            f"| {r['workers']} | {r['signatures']} | {r['plan_s']:.2f} | {r['plan_extra_mib']:.0f} "
            f"| {r['items_src0']:,} | {r['list_src0_s']:.2f} | {r['items_dst0']:,} | {r['list_dst0_s']:.2f} "
            f"| {r['peak_extra_mib']:.0f} | {r['recv_max_gb']:.2f} | {r['recv_max_over_bound']:.4f} "
            f"| {r['coverage_ratio']:.2f} "
            f"| {r['coverage_s']:.2f} | {r['send_max_over_mean']:.3f} |")
    return "\n".join(lines)


def cut_line(r: dict) -> str:
    """The ``--cut`` pass of one row, in words (empty without it)."""
    if "cut_s" not in r:
        return ""
    return (f"{r['model']} {r['layout']}: trainer rank 0's rounds cut from the compact plan into arrays "
            f"in {r['cut_s']:.2f} s "
            f"({r['cut_rounds']:,} rounds, {r['cut_messages']:,} messages of <= {r['cut_cap'] >> 10} KiB), "
            f"peak +{r['cut_peak_mib']:.0f} MiB")


ALL = [[], ["--model", "dsv3"], ["--model", "dsv3", "--ep"]]
"""The scenarios ``--all`` runs (1T-class TP16 x 16; DeepSeek-V3 TP8 x 16 and EP8 x 16)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["k2", "dsv3"], default="k2")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--experts", type=int, default=None, help="routed experts (default: k2 330, dsv3 256)")
    ap.add_argument("--trainer-ranks", type=int, default=256)
    ap.add_argument("--tp", type=int, default=None, help="TP (or EP) size (default: k2 16, dsv3 8)")
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--hsdp", type=int, default=1, help="trainer replica groups (HSDP); 1 = plain FSDP")
    ap.add_argument("--ep", action="store_true", help="dsv3: expert-parallel routed experts (whole, linear)")
    ap.add_argument("--repeats", type=int, default=3, help="plan builds per scenario (median reported)")
    ap.add_argument("--cut", action="store_true",
                    help="also time one pass over trainer rank 0's rounds cut from the compact plan (k2: minutes)")
    ap.add_argument("--json", action="store_true", help="print the row as JSON (what --all reads)")
    ap.add_argument("--all", action="store_true", help="run the ALL scenarios, one process each")
    args = ap.parse_args()
    if args.ep and args.model != "dsv3":
        ap.error("--ep needs --model dsv3 (k2's experts are per-expert 2-D tensors)")
    if not args.all:
        row = measure(args)
        print(json.dumps(row) if args.json else f"{row['items']:,} items in all; inputs built in "
              f"{row['inputs_s']:.2f} s\n\n" + table([row]) + "\n" + cut_line(row))
        return
    rows = []
    for extra in ALL:
        cmd = [sys.executable, os.path.abspath(__file__), "--json", "--layers", str(args.layers),
               "--repeats", str(args.repeats), *(["--cut"] if args.cut else []), *extra]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{r['model']} {r['layout']}: plan {r['plan_s']:.2f} s (each: "
              f"{', '.join(f'{t:.2f}' for t in r['plan_s_all'])}), {r['items']:,} items, "
              f"inputs {r['inputs_s']:.2f} s", flush=True)
    print()
    print(table(rows))
    print("\n".join(filter(None, map(cut_line, rows))))
    res = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(res, exist_ok=True)
    with open(os.path.join(res, "plan_scale.json"), "w") as f:
        json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
