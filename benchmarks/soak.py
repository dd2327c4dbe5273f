"""Soak: many consecutive verified syncs; RSS, open fds and threads of every process must stay flat.

    python benchmarks/soak.py [--syncs 200] [--transport weightsync_m2n weightsync_nccl]

For each transport (2 FSDP2 trainer ranks -> vLLM Qwen3 TP=2 on CPU), runs ``--syncs`` syncs with
``verify=True`` (every worker checks what it applied against the trainers' checksums before the sync
may finish), an optimizer step every 10 syncs, and checks the final weights bit-exact against vLLM's
``load_weights``. Prints per process: RSS growth, fd and thread counts before/after; writes
benchmarks/results/soak.json. Exits 1 if any sync is not verified, RSS grows >= 1 %, or fds/threads grow.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import threading
import time


def resources() -> dict:
    """Inside a trainer/receiver process: RSS bytes, open fds, live threads (after a GC pass)."""
    gc.collect()
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"rss": rss, "fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count()}


def soak(cluster, transport: str, syncs: int) -> dict:
    from weightsync.testing.cluster import Layout

    cluster.setup(Layout(trainers=2, tp=2, backend=transport))
    cluster.make_engines(cluster.init_info(buffer_bytes=1 << 16))  # the source kind the transport reads
    procs = cluster.active_trainers + cluster.active_receivers
    for i in range(3):  # warm-up: buffers, plan, optimizer state, allocator
        cluster.train_step(-1 - i)
        cluster.sync(weight_version=f"warm{i}", verify=True)
    before = [a.call("soak:resources") for a in procs]
    t0, verified = time.perf_counter(), 0
    for i in range(syncs):
        if i % 10 == 0:
            cluster.train_step(i)
        verified += cluster.sync(weight_version=f"soak{i}", verify=True)["verified"] is True
    seconds = time.perf_counter() - t0
    after = [a.call("soak:resources") for a in procs]
    exact = not any(cluster.verify().values())
    rows = [{"process": a.name, "rss_growth": (y["rss"] - x["rss"]) / x["rss"], "fds": (x["fds"], y["fds"]),
             "threads": (x["threads"], y["threads"])} for a, x, y in zip(procs, before, after)]
    return {"transport": transport, "syncs": syncs, "verified": verified, "bit_exact_after": exact,
            "seconds_per_sync": seconds / syncs, "processes": rows}


def main() -> int:
    from weightsync.registry import transport_names
    from weightsync.testing.cluster import LocalCluster

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--syncs", type=int, default=200)
    ap.add_argument("--transport", nargs="+", default=["weightsync_m2n", "weightsync_nccl"], choices=transport_names())
    args = ap.parse_args()
    cluster = LocalCluster()
    try:
        results = [soak(cluster, t, args.syncs) for t in args.transport]
    finally:
        cluster.close()
    ok = True
    print("| transport | syncs | verified | bit-exact after | s/sync | process | RSS growth | fds | threads |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for p in r["processes"]:
            print(f"| {r['transport']} | {r['syncs']} | {r['verified']} | {r['bit_exact_after']} | "
                  f"{r['seconds_per_sync']:.3f} | {p['process']} | {p['rss_growth']:+.2%} | "
                  f"{p['fds'][0]} -> {p['fds'][1]} | {p['threads'][0]} -> {p['threads'][1]} |")
            ok &= p["rss_growth"] < 0.01 and p["fds"][1] <= p["fds"][0] and p["threads"][1] <= p["threads"][0]
        ok &= r["verified"] == r["syncs"] and r["bit_exact_after"]
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "soak.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("soak:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
