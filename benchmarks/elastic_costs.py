"""What elastic replicas cost (``on_engine_failure="drop"``, docs/elastic.md), on the CPU harness.

    flock /tmp/ws-main.lock .venv/bin/python benchmarks/elastic_costs.py        # ~3 min on 2 cores
    .venv/bin/python benchmarks/elastic_costs.py --model-config tiny_qwen3 --repeats 1

Two FSDP2 trainer ranks (gloo) and three vLLM replicas of TP 1 (``weightsync.testing.cluster``), the
demo's model (``small_qwen3``: 20.8 M parameters) in bf16, per transport (M2N, broadcast):

* ``add_s``: ``add_engines`` of one replica while two run (its group's init: store, data plane, M2N's
  plan of its pairs), wall seconds seen by the caller; ``first_sync_s``: the sync that then brings it
  to the current version (dense);
* ``sync_3_s``: a sync of three healthy replicas (median of ``--repeats``);
* ``sync_dropped_s``: a sync of the same three where one replica's worker process is dead: it is dropped
  (its group's start call fails at once), the other two complete;
* ``sync_2_s``: the next sync, of the two that are left (median).

Syncs run unpaused (``require_paused=False``): the harness pauses through the client, which a dead
worker would fail before the engine sees it. Every replica that completed a sync is checked against
vLLM's ``load_weights`` of the trainer's weights; a mismatch stops the run with exit status 1.
Writes ``--out`` (default docs/results/elastic_costs.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

from weightsync.testing.client import LocalWeightSyncClient
from weightsync.testing.cluster import Layout, LocalCluster, init_info

_R = "weightsync.testing.receiver:"


def _sync(cluster: LocalCluster, version: str) -> tuple[float, dict]:
    t0 = time.perf_counter()
    stats = cluster.on_trainers("send_weights", version, pause=False)[0]
    return time.perf_counter() - t0, stats


def _exact(cluster: LocalCluster, receivers: list) -> None:
    sd = cluster.on_trainers("full_state_dict")[0]
    bad = {r.name: d for r in receivers if (d := r.call(_R + "compare_with_oracle", sd))}
    if bad:
        print(f"MISMATCH: {bad}", file=sys.stderr)
        sys.exit(1)


def measure(cluster: LocalCluster, backend: str, model: str, repeats: int) -> dict:
    layout = Layout(trainers=2, tp=1, replicas=3, dtype="bfloat16", model=model, backend=backend)
    cluster.setup(layout, fresh=True)
    rs = cluster.receivers[:3]
    info = init_info(dataclasses.replace(layout, replicas=2),
                     buffer_bytes=None if backend == "weightsync_m2n" else 64 << 20,
                     timeout_s=60.0, on_engine_failure="drop", require_paused=False)
    cluster.make_engines(info, client=LocalWeightSyncClient([[rs[0].address], [rs[1].address]]))
    _sync(cluster, "warm-up")
    t0 = time.perf_counter()
    cluster.on_trainers("add_engines", [[rs[2].address]])
    add_s = time.perf_counter() - t0
    first_s, _ = _sync(cluster, "joined")
    _exact(cluster, rs)
    three = [_sync(cluster, f"three-{i}")[0] for i in range(repeats)]
    rs[1].kill()
    dropped_s, stats = _sync(cluster, "dropped")
    assert list(stats["dropped"]) == [1] and stats["replicas"] == [0, 2], stats
    _exact(cluster, [rs[0], rs[2]])
    two = [_sync(cluster, f"two-{i}")[0] for i in range(repeats)]
    cluster.on_trainers("shutdown_engine")
    cluster.replace_dead()
    return {"transport": backend, "model": model, "dtype": "bfloat16", "trainers": 2, "tp": 1,
            "add_s": round(add_s, 3), "first_sync_s": round(first_s, 3),
            "sync_3_s": round(statistics.median(three), 3), "sync_dropped_s": round(dropped_s, 3),
            "sync_2_s": round(statistics.median(two), 3), "dropped_reason": stats["dropped"][1][:300]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-config", default="small_qwen3")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="docs/results/elastic_costs.json")
    args = p.parse_args()
    cluster = LocalCluster()
    try:
        rows = [measure(cluster, b, args.model_config, args.repeats) for b in ("weightsync_m2n", "weightsync_nccl")]
    finally:
        cluster.close()
    for r in rows:
        print(json.dumps(r))
    with open(args.out, "w") as f:
        json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
