"""Block-FP8 engines (issue 38): bytes on the wire and seconds per M2N sync, FP8 on the wire vs bf16 on the wire.

    .venv/bin/python benchmarks/fp8_wire.py [--syncs 5] [--trainers 2] [--out benchmarks/results]

``--trainers`` FSDP2 trainer processes (bf16) -> vLLM's ``Qwen3ForCausalLM`` at TP 2 over gloo (the
harness of ``weightsync.testing.cluster``), three times in one run: into ``tiny_qwen3_fp8`` (block FP8,
e4m3, 128 x 128, ``weight_scale_inv``) with the workers quantizing (mode (a): bf16 on the wire), into
it with the trainer ranks quantizing the blocks inside their shards (mode (b), ``fp8_wire=True``: fp8
+ float32 scales on the wire, cut blocks in bf16), and into the same shapes unquantized (a copy of
its config without ``quantization_config``). Per target: bytes each worker received (from the stats;
the workers count what their data plane delivered), the FP8 blocks quantized by the trainer and by
the workers (``SyncStats.fp8_blocks_per_worker``) and the median seconds of ``--syncs`` syncs after
one warm-up. Every FP8 sync is checked bit-exact against vLLM's load of a reference-quantized
checkpoint first (``tests/test_fp8.py``'s oracle); the run exits 1 otherwise. Writes
``--out``/fp8_wire.json (``fp8_wire_t<trainers>.json`` for other than 2 trainers).
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


def _unquantized_twin(tmp: str) -> str:
    from weightsync.testing.cluster import model_config_dir

    with open(os.path.join(model_config_dir(FP8_MODEL), "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config")
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f)
    return tmp


def run(cluster: Any, model: str, syncs: int, check: bool, trainers: int, **fields: Any) -> dict[str, Any]:
    from weightsync.testing.cluster import Layout, init_info

    layout = Layout(trainers=trainers, tp=2, dtype="bfloat16", model=model, backend="weightsync_m2n")
    cluster.setup(layout, fresh=True)
    cluster.make_engines(init_info(layout, buffer_bytes=64 << 20, timeout_s=120, **fields))
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
            "seconds": seconds, "fp8_blocks_per_worker": stats.get("fp8_blocks_per_worker", {}),
            "unquantized_bytes_per_worker": stats.get("unquantized_bytes_per_worker", {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    from weightsync.testing.cluster import LocalCluster

    sys.path.insert(0, TESTS)  # spawned actor processes inherit sys.path
    cluster = LocalCluster()
    t = args.trainers
    try:
        with tempfile.TemporaryDirectory() as tmp:
            mode_a = run(cluster, FP8_MODEL, args.syncs, True, t)
            mode_b = run(cluster, FP8_MODEL, args.syncs, True, t, fp8_wire=True)
            bf16 = run(cluster, _unquantized_twin(tmp), args.syncs, False, t)
    finally:
        cluster.close()
    result = {"layout": f"{t} FSDP2 ranks (bf16) -> TP 2, gloo, 2-core CPU", "model": FP8_MODEL,
              "bf16_target": bf16, "fp8_mode_a": mode_a, "fp8_mode_b": mode_b}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fp8_wire.json" if t == 2 else f"fp8_wire_t{t}.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("| target | bytes / worker 0 | FP8 blocks / worker 0 (trainer, worker) | median s / sync |\n"
          "|---|---|---|---|")
    for label, r in (("bf16 model", bf16), ("block FP8, mode (a) (bf16 wire, workers quantize)", mode_a),
                     ("block FP8, mode (b) (fp8_wire=True: FP8 + scales, cut blocks bf16)", mode_b)):
        blocks = r["fp8_blocks_per_worker"].get(0) or r["fp8_blocks_per_worker"].get("0") or {}
        share = f"{blocks.get('trainer', 0)}, {blocks.get('worker', 0)}" if blocks else "-"
        print(f"| {label} | {r['bytes_per_worker'][0]} | {share} | {r['median_s']:.4f} |")


if __name__ == "__main__":
    main()
