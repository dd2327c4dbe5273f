"""Block-FP8 engines (issue 38): bytes on the wire and seconds per M2N sync, FP8 target vs bf16 target.

    .venv/bin/python benchmarks/fp8_wire.py [--syncs 5] [--out benchmarks/results]

Two FSDP2 trainer processes (bf16) -> vLLM's ``Qwen3ForCausalLM`` at TP 2 over gloo (the harness of
``weightsync.testing.cluster``), twice: into ``tiny_qwen3_fp8`` (block FP8, e4m3, 128 x 128,
``weight_scale_inv``; the workers quantize: mode (a)) and into the same shapes unquantized (a copy of
its config without ``quantization_config``). Per target: bytes each worker received (from the
stats; the workers count what their data plane delivered) and the median seconds of ``--syncs``
syncs after one warm-up. Beside them, what FP8 on the wire (mode (b), not built) would move per
worker: the same shard elements of the FP8 weights at 1 byte plus their float32 block scales, the
rest at 2 bytes. Every FP8 sync is checked bit-exact against vLLM's load of a reference-quantized
checkpoint first (``tests/test_fp8.py``'s oracle); the run exits 1 otherwise. Writes
``--out``/fp8_wire.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")  # the receivers import test_fp8's oracle from there

FP8_MODEL = "tiny_qwen3_fp8"
BLOCK = 128


def _unquantized_twin(tmp: str) -> str:
    from weightsync.testing.cluster import model_config_dir

    with open(os.path.join(model_config_dir(FP8_MODEL), "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config")
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f)
    return tmp


def _mode_b_bytes(sd: dict[str, Any], tp: int) -> int:
    """Per worker (TP rank 0): FP8 weights at 1 byte + float32 scales per 128 x 128 block, others bf16."""
    total = 0
    for name, t in sd.items():
        if ".layers." in name and name.endswith("_proj.weight"):
            rows, cols = t.shape
            total += rows * cols // tp + 4 * (-(-rows // BLOCK)) * (-(-cols // BLOCK)) // tp
        elif "norm" in name:
            total += 2 * t.numel()
        else:
            total += 2 * t.numel() // tp  # the vocabulary's rows, about evenly split
    return total


def run(cluster: Any, model: str, syncs: int, check: bool) -> dict[str, Any]:
    from weightsync.testing.cluster import Layout, init_info

    layout = Layout(trainers=2, tp=2, dtype="bfloat16", model=model, backend="weightsync_m2n")
    cluster.setup(layout, fresh=True)
    cluster.make_engines(init_info(layout, buffer_bytes=64 << 20, timeout_s=120))
    stats = cluster.sync("warm-up")
    if check:
        full = cluster.on_trainers("full_state_dict")[0]
        bad = cluster.on_receivers("test_fp8:fp8_differences", full)
        if any(b["bad"] for b in bad):
            print(f"FP8 sync differs from the reference: {bad}", file=sys.stderr)
            sys.exit(1)
    seconds = []
    for i in range(syncs):
        t0 = time.perf_counter()
        cluster.sync(f"v{i}")
        seconds.append(time.perf_counter() - t0)
    return {"bytes_per_worker": stats["bytes_received_per_worker"], "median_s": statistics.median(seconds),
            "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    from weightsync.testing.cluster import LocalCluster

    sys.path.insert(0, TESTS)  # spawned actor processes inherit sys.path
    cluster = LocalCluster()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            fp8 = run(cluster, FP8_MODEL, args.syncs, check=True)
            full = cluster.on_trainers("full_state_dict")[0]
            bf16 = run(cluster, _unquantized_twin(tmp), args.syncs, check=False)
    finally:
        cluster.close()
    result = {"layout": "2 FSDP2 ranks (bf16) -> TP 2, gloo, 2-core CPU", "model": FP8_MODEL,
              "fp8_mode_a": fp8, "bf16_target": bf16, "fp8_mode_b_bytes_worker0": _mode_b_bytes(full, 2)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fp8_wire.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("| target | bytes / worker 0 | median s / sync |\n|---|---|---|")
    print(f"| bf16 model | {bf16['bytes_per_worker'][0]} | {bf16['median_s']:.4f} |")
    print(f"| block FP8, mode (a) (bf16 wire, workers quantize) | {fp8['bytes_per_worker'][0]} | {fp8['median_s']:.4f} |")
    print(f"| block FP8, mode (b) (FP8 wire + scales; computed, not built) | {result['fp8_mode_b_bytes_worker0']} | - |")


if __name__ == "__main__":
    main()
