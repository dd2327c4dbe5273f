"""Bytes each vLLM worker receives per sync: weightsync's M2N plan vs vLLM 0.33's ``nccl_m2n`` vs broadcast.

For real model shapes (built on the meta device: no weights) at TP 1, 2, 4 (and, for the MoE
models, with vLLM's ``enable_expert_parallel`` at TP 2, 4: rows "TP4 EP"), every worker resolves
its destinations twice from the same live vLLM model: with weightsync's resolver, and with vLLM's own
``resolve_parameter_destinations`` (vLLM's code, run on the CPU model; direct parameters receive
their shard, everything else the full tensor). Broadcast sends every tensor whole to every worker.
The shard lower bound of a worker is every tensor's bytes / TP, except norms and MoE routers
(replicated: whole) and K/V projections at TP above the KV head count (bytes / KV heads).

    python benchmarks/plan_coverage.py [--tp 1 2 4] [--ep-tp 2 4] [--models qwen3_0_6b qwen3_30b_a3b]
    python benchmarks/plan_coverage.py --models qwen3_235b_a22b --layers 24   # fewer layers, scaled

Prints a markdown table and writes benchmarks/results/plan_coverage.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import tempfile
import time

import torch

CONFIGS = {  # public shapes of each family; full layer counts (built on meta, so size is free)
    "qwen3_0_6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3_8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    "llama3_8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    "qwen2_5_7b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584,
                       intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen3_30b_a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                          vocab_size=151936, tie_word_embeddings=False),
    "qwen3_235b_a22b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=4096,
                            intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=94,
                            num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128,
                            num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                            vocab_size=151936, tie_word_embeddings=False),
}
_COMMON = dict(max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu",
               torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1)


def hf_metas(model_dir: str) -> list[tuple[str, str, list[int]]]:
    """HF tensor names/dtypes/shapes from transformers' own class, on meta (what a trainer exports)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.bfloat16)
    return [(n, "bfloat16", list(p.shape)) for n, p in model.named_parameters()]


def vllm_rules_bytes(metas: list[tuple[str, str, list[int]]], num_workers: int, tp: int) -> dict:
    """Inside a receiver: bytes this worker gets under vLLM 0.33's own nccl_m2n resolver."""
    from vllm.distributed.weight_transfer.m2n_layout import resolve_parameter_destinations

    from weightsync.testing.actors import STATE

    dests = resolve_parameter_destinations(
        STATE["model"], [m[0] for m in metas], [getattr(torch, m[1]) for m in metas], [m[2] for m in metas],
        num_workers=num_workers, shard_axis_size=tp, allow_direct=True)
    total = direct = fallbacks = 0
    kinds: dict[str, int] = {}  # fallback tensors by name without the layer index
    for d, (name, dtype, shape) in zip(dests, metas):
        fallbacks += not d.direct
        if not d.direct:
            kind = re.sub(r"\.layers\.\d+\.", ".layers.*.", name)
            kinds[kind] = kinds.get(kind, 0) + 1
        full = math.prod(shape) * getattr(torch, dtype).itemsize
        got = d.tensor.numel() * d.tensor.element_size() if d.direct else full
        total += got
        direct += got if d.direct else 0
    return {"bytes": total, "direct_bytes": direct, "fallback_tensors": fallbacks, "fallback_kinds": kinds}


def shard_bound(metas: list[tuple[str, str, list[int]]], cfg: dict, tp: int) -> dict:
    """The shard lower bound (see the module doc): per worker, and summed over the ``tp`` workers."""
    kv = cfg["num_key_value_heads"]
    sharded = replicated = kv_part = 0
    for name, dtype, shape in metas:
        nbytes = math.prod(shape) * getattr(torch, dtype).itemsize
        if name.endswith("norm.weight") or name.endswith("mlp.gate.weight"):
            replicated += nbytes
        elif tp > kv and (".k_proj." in name or ".v_proj." in name):
            kv_part += nbytes // kv  # each worker holds one KV head, replicated over tp // kv ranks
        else:
            sharded += nbytes
    return {"per_worker": sharded / tp + replicated + kv_part, "sum": sharded + tp * (replicated + kv_part)}


def main() -> None:
    from weightsync.testing.cluster import Layout, LocalCluster

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--ep-tp", type=int, nargs="*", default=[2, 4],
                    help="TP sizes with enable_expert_parallel (MoE models only)")
    ap.add_argument("--models", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--layers", type=int, default=None,
                    help="build this many layers (default: the model's own); rows then say so")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="weightsync-cfg-")
    rows = []
    cluster = LocalCluster()
    try:
        for name in args.models:
            cfg = {**_COMMON, **CONFIGS[name]}
            full_layers = cfg["num_hidden_layers"]
            if args.layers:
                cfg["num_hidden_layers"] = min(args.layers, full_layers)
            model_dir = os.path.join(tmp, name)
            os.makedirs(model_dir)
            with open(os.path.join(model_dir, "config.json"), "w") as f:
                json.dump(cfg, f)
            metas = hf_metas(model_dir)
            broadcast = sum(math.prod(s) * 2 for _, _, s in metas)
            moe = "num_experts" in cfg
            layouts = [(tp, False) for tp in args.tp] + [(tp, True) for tp in args.ep_tp if moe]
            for tp, ep in layouts:
                t0 = time.perf_counter()
                cluster.setup(Layout(trainers=0, tp=tp, model=model_dir, dtype="bfloat16", device="meta", ep=ep))
                ours = cluster.on_receivers("destinations", metas)
                theirs = [a.call("plan_coverage:vllm_rules_bytes", metas, tp, tp) for a in cluster.active_receivers]
                our_bytes = [sum(p.region.numel * 2 for p in d.pieces) + sum(f.nbytes for f in d.fallbacks)
                             for d in ours]
                bound = shard_bound(metas, cfg, tp)
                rows.append({
                    "model": name, "tp": tp, "ep": ep, "layers": cfg["num_hidden_layers"],
                    "model_layers": full_layers, "params_gb": broadcast / 1e9,
                    "weightsync_gb": max(our_bytes) / 1e9,
                    "weightsync_fallback_tensors": max(len(d.fallbacks) for d in ours),
                    "shard_bound_gb": bound["per_worker"] / 1e9,
                    "weightsync_over_bound": max(our_bytes) / bound["per_worker"],
                    "weightsync_sum_over_bound_sum": sum(our_bytes) / bound["sum"],
                    "vllm_nccl_m2n_gb": max(t["bytes"] for t in theirs) / 1e9,
                    "vllm_direct_pct": 100 * min(t["direct_bytes"] / t["bytes"] for t in theirs),
                    "vllm_fallback_tensors": max(t["fallback_tensors"] for t in theirs),
                    "vllm_fallback_kinds": theirs[0]["fallback_kinds"],
                    "broadcast_gb": broadcast / 1e9,
                    "seconds": time.perf_counter() - t0,
                })
                r = rows[-1]
                print(f"{name} {_label(r)}: weightsync {r['weightsync_gb']:.3f} GB (bound {r['shard_bound_gb']:.3f}), "
                      f"vLLM nccl_m2n {r['vllm_nccl_m2n_gb']:.3f} GB, broadcast {r['broadcast_gb']:.3f} GB "
                      f"({r['seconds']:.0f} s)", flush=True)
    finally:
        cluster.close()
    print()
    print(table(rows))
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "plan_coverage.json"), "w") as f:
        json.dump({"source": "vLLM 0.33.0 resolve_parameter_destinations run on the CPU (meta) model",
                   "rows": rows}, f, indent=1)


def _label(r: dict) -> str:
    return f"TP{r['tp']}" + (" EP" if r["ep"] else "")


def table(rows: list[dict]) -> str:
    """The markdown table of ``rows`` (layers column only where a model was built with fewer layers)."""
    cut = any(r["layers"] != r["model_layers"] for r in rows)
    lines = ["Bytes each worker receives per sync (max over workers; bf16"
             + ("; layers = built of the model's, bytes for the layers built" if cut else "") + "):", "",
             "| model |" + (" layers |" if cut else "") + " layout | weightsync M2N (GB) | shard bound (GB) "
             "| weightsync / bound | vLLM 0.33 nccl_m2n (GB) | vLLM direct bytes | vLLM fallback tensors "
             "| broadcast (GB) | vLLM / weightsync | weightsync fallback tensors |",
             "|---|" + ("---|" if cut else "") + "---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} |" + (f" {r['layers']}/{r['model_layers']} |" if cut else "")
                     + f" {_label(r)} | {r['weightsync_gb']:.3f} | {r['shard_bound_gb']:.3f} | "
                     f"{r['weightsync_over_bound']:.4f} | {r['vllm_nccl_m2n_gb']:.3f} | {r['vllm_direct_pct']:.0f} % | "
                     f"{r['vllm_fallback_tensors']} | {r['broadcast_gb']:.3f} | "
                     f"{r['vllm_nccl_m2n_gb'] / r['weightsync_gb']:.2f}x | {r['weightsync_fallback_tensors']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
