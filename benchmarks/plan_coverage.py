"""Bytes each vLLM worker receives per sync: weightsync's M2N plan vs vLLM 0.33's ``nccl_m2n`` vs broadcast.

For real model shapes (built on the meta device: no weights) at TP 1, 2, 4, every worker resolves
its destinations twice from the same live vLLM model: with weightsync's resolver, and with vLLM's own
``resolve_parameter_destinations`` (vLLM's code, run on the CPU model; direct parameters receive
their shard, everything else the full tensor). Broadcast sends every tensor whole to every worker.

    python benchmarks/plan_coverage.py [--tp 1 2 4] [--models qwen3_0_6b llama3_8b]

Prints a markdown table and writes benchmarks/results/plan_coverage.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile

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
    total = direct = 0
    for d, (_, dtype, shape) in zip(dests, metas):
        full = math.prod(shape) * getattr(torch, dtype).itemsize
        got = d.tensor.numel() * d.tensor.element_size() if d.direct else full
        total += got
        direct += got if d.direct else 0
    return {"bytes": total, "direct_bytes": direct}


def main() -> None:
    from weightsync.testing.cluster import Layout, LocalCluster

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--models", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="weightsync-cfg-")
    rows = []
    cluster = LocalCluster()
    try:
        for name in args.models:
            model_dir = os.path.join(tmp, name)
            os.makedirs(model_dir)
            with open(os.path.join(model_dir, "config.json"), "w") as f:
                json.dump({**_COMMON, **CONFIGS[name]}, f)
            metas = hf_metas(model_dir)
            broadcast = sum(math.prod(s) * 2 for _, _, s in metas)
            for tp in args.tp:
                cluster.setup(Layout(trainers=0, tp=tp, model=model_dir, dtype="bfloat16", device="meta"))
                ours = cluster.on_receivers("destinations", metas)
                theirs = [a.call("plan_coverage:vllm_rules_bytes", metas, tp, tp) for a in cluster.active_receivers]
                our_bytes = [sum(p.region.numel * 2 for p in d.pieces) + sum(f.nbytes for f in d.fallbacks)
                             for d in ours]
                rows.append({
                    "model": name, "tp": tp, "params_gb": broadcast / 1e9,
                    "weightsync_gb": max(our_bytes) / 1e9,
                    "weightsync_fallback_tensors": max(len(d.fallbacks) for d in ours),
                    "vllm_nccl_m2n_gb": max(t["bytes"] for t in theirs) / 1e9,
                    "vllm_direct_pct": 100 * min(t["direct_bytes"] / t["bytes"] for t in theirs),
                    "broadcast_gb": broadcast / 1e9,
                })
                r = rows[-1]
                print(f"{name} TP{tp}: weightsync {r['weightsync_gb']:.3f} GB, vLLM nccl_m2n "
                      f"{r['vllm_nccl_m2n_gb']:.3f} GB, broadcast {r['broadcast_gb']:.3f} GB", flush=True)
    finally:
        cluster.close()
    print("\nBytes each worker receives per sync (max over workers; bf16):\n")
    print("| model | TP | weightsync M2N (GB) | vLLM 0.33 nccl_m2n (GB) | vLLM direct bytes | broadcast (GB) "
          "| vLLM / weightsync | weightsync fallback tensors |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['tp']} | {r['weightsync_gb']:.3f} | {r['vllm_nccl_m2n_gb']:.3f} | "
              f"{r['vllm_direct_pct']:.0f} % | {r['broadcast_gb']:.3f} | "
              f"{r['vllm_nccl_m2n_gb'] / r['weightsync_gb']:.2f}x | {r['weightsync_fallback_tensors']} |")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "plan_coverage.json"), "w") as f:
        json.dump({"source": "vLLM 0.33.0 resolve_parameter_destinations run on the CPU (meta) model",
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
