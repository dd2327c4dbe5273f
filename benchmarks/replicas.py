"""Seconds per sync and trainer extra memory against the replica count, replica fan-out off and on,
on the CPU harness (M2N, ``on_engine_failure="fail"``: every replica in one group).

    PYTHONPATH=src .venv/bin/python benchmarks/replicas.py                 # small_qwen3, ~10 min on 2 cores
    PYTHONPATH=src .venv/bin/python benchmarks/replicas.py --model-config tiny_qwen3 --repeats 1

Two FSDP2 trainer ranks (gloo) and R = 1, 2, 4 vLLM replicas of TP 1 (``weightsync.testing.cluster``),
bf16, in one run: for each R and ``fan_out`` ("off": every replica from the trainers; "auto": the
trainers send replica 0's pieces, the workers forward them, docs/design.md "Replica fan-out"):

* ``sync_s``: median wall seconds of ``--repeats`` dense syncs (after a warm-up sync), unpaused;
* ``trainer_sent``: bytes trainer rank 0 sent in the last sync (``SyncStats.bytes_sent``);
* ``trainer_extra_bytes``: trainer rank 0's memory the engine holds beside the model (its staging
  buffer, plus a delta baseline when ``delta``) and ``kept_bytes`` (its rounds' arrays, host);
* ``received_per_worker``: bytes each worker received (each must equal its shard: ``lower_bound``).

Every replica is checked against vLLM's ``load_weights`` of the trainer's weights after the last sync;
a mismatch stops the run with exit status 1. Writes ``--out`` (default docs/results/replicas.json).
On 2 shared CPU cores the worker processes compete with the trainers for the cores, so seconds grow
with R either way; the bytes and memory columns are exact.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from weightsync.testing.cluster import Layout, LocalCluster, init_info

_R = "weightsync.testing.receiver:"


def trainer_memory() -> dict[str, int]:
    """Inside a trainer process: what its M2N engine holds beside the model."""
    from weightsync.testing.trainer import STATE

    engine = STATE["engine"]
    baseline = engine._baseline.nbytes if engine._baseline is not None else 0
    return {"staging": engine.plan.staging.nbytes, "baseline": baseline, "kept": engine.plan.rounds.kept_bytes()}


def measure(cluster: LocalCluster, model: str, replicas: int, fan_out: str, repeats: int) -> dict:
    layout = Layout(trainers=2, tp=1, replicas=replicas, dtype="bfloat16", model=model, backend="weightsync_m2n")
    cluster.setup(layout)
    cluster.make_engines(init_info(layout, timeout_s=120.0, require_paused=False, fan_out=fan_out))
    cluster.on_trainers("send_weights", "warm-up", pause=False)
    times = []
    stats: dict = {}
    for i in range(repeats):
        t0 = time.perf_counter()
        stats = cluster.on_trainers("send_weights", f"{fan_out}-{i}", pause=False)[0]
        times.append(time.perf_counter() - t0)
    sd = cluster.on_trainers("full_state_dict")[0]
    bad = {a.name: d for a in cluster.active_receivers if (d := a.call(_R + "compare_with_oracle", sd))}
    if bad:
        print(f"MISMATCH at R={replicas} fan_out={fan_out}: {bad}", file=sys.stderr)
        sys.exit(1)
    mem = cluster.active_trainers[0].call("replicas:trainer_memory")
    cluster.on_trainers("shutdown_engine")
    return {"model": model, "replicas": replicas, "tp": 1, "trainers": 2, "fan_out": fan_out,
            "sync_s": round(statistics.median(times), 4), "trainer_sent": stats["bytes_sent"],
            "trainer_extra_bytes": mem["staging"] + mem["baseline"], "kept_bytes": mem["kept"],
            "received_per_worker": stats["bytes_received_per_worker"],
            "lower_bound_per_worker": stats["lower_bound_per_worker"]}


def table(rows: list[dict]) -> str:
    lines = ["| replicas | fan_out | s / sync | trainer rank 0 sent | trainer extra MiB | each worker received |",
             "|---:|---|---:|---:|---:|---|"]
    for r in rows:
        got = set(r["received_per_worker"].values())
        lines.append(f"| {r['replicas']} | {r['fan_out']} | {r['sync_s']:.3f} | {r['trainer_sent']:,} "
                     f"| {r['trainer_extra_bytes'] / 2**20:.1f} | {', '.join(f'{g:,}' for g in sorted(got))} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-config", default="small_qwen3")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--out", default="docs/results/replicas.json")
    args = p.parse_args()
    cluster = LocalCluster()
    rows = []
    try:
        for r in args.replicas:
            for fan_out in ("off", "auto") if r > 1 else ("off",):
                rows.append(measure(cluster, args.model_config, r, fan_out, args.repeats))
                print(json.dumps({k: v for k, v in rows[-1].items() if "per_worker" not in k}), flush=True)
    finally:
        cluster.close()
    print(table(rows))
    with open(args.out, "w") as f:
        json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
