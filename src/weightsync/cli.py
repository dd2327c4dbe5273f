"""Command line: ``weightsync demo`` (the CPU end-to-end demo)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from .registry import transport_names
    from .testing.cluster import Layout
    from .testing.demo import format_table, run_demo

    transports = transport_names() if args.transport == "all" else [args.transport]
    layout = Layout(trainers=args.trainers, tp=args.tp, replicas=args.replicas, dtype=args.dtype,
                    model=args.model_config)
    print(f"weightsync demo: {args.trainers} FSDP2 trainer rank(s) -> vLLM {layout.model} "
          f"TP={args.tp} x {args.replicas} replica(s), {args.dtype}, CPU (gloo)", flush=True)
    rows = run_demo(transports, layout, args.bucket_mb << 20)
    print(format_table(rows))
    for r in rows:
        if not r["verified"]:
            print(f"{r['transport']}: parameters differ from vLLM's load_weights: {r['mismatches']}", file=sys.stderr)
    return 0 if all(r["verified"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    from .registry import transport_names

    parser = argparse.ArgumentParser(prog="weightsync")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="FSDP2 trainer ranks -> vLLM TP ranks on CPU, verified, with throughput")
    demo.add_argument("--transport", default="all", choices=[*transport_names(), "all"],
                      help="a registered transport (weightsync.registry), or all of them (default)")
    demo.add_argument("--trainers", type=int, default=2, help="FSDP2 trainer ranks (default 2)")
    demo.add_argument("--tp", type=int, default=2, help="vLLM tensor-parallel size (default 2)")
    demo.add_argument("--replicas", type=int, default=1, help="vLLM replicas (default 1)")
    demo.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    demo.add_argument("--model-config", default="small_qwen3",
                      help="a shipped config (tiny_qwen3, tiny_llama, small_qwen3, ...) or a directory with config.json")
    demo.add_argument("--bucket-mb", type=int, default=64, help="packed bucket size in MiB (default 64)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
