"""Same-run baselines of ``transfer_throughput.py``, run on the very processes the transports use: raw
gloo point-to-point (one pair alone, one M2N-shaped round, the M2N plan's traffic moved raw), the naive
sync (``full_tensor()`` per parameter, trainer rank 0 broadcasts, each worker ``load_weights``), and the
paired runs that take each ratio between measurements made moments apart."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

from weightsync.testing.actors import Actor, gather
from weightsync.testing.cluster import Layout, LocalCluster, free_port, init_info

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Scenario:
    sweep: str  # "size", "layout" or "staging": which table and plot it belongs to
    trainers: int
    tp: int
    replicas: int
    size: str  # key of SIZES
    transports: tuple[str, ...]
    staging_mib: int  # M2N staging = broadcast/IPC bucket (raised to the largest tensor where needed)
    tp_aligned: bool = False  # trainers shard row-parallel weights on dim 1 (ModelConfig.tp_aligned_shards)


def on(actors: list[Actor], fn: str, *args: Any, **kwargs: Any) -> list[Any]:
    return gather([a.submit("_probes:" + fn, *args, **kwargs) for a in actors])


def median_dicts(ds: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for d in ds for k in d})
    return {k: statistics.median(d.get(k, 0.0) for d in ds) for k in keys}


def p2p_group(actors: list[Actor]) -> None:
    """A gloo group over ``actors`` (trainers first, then workers: the M2N data-group order)."""
    port = free_port()
    gather([a.submit("_probes:p2p_setup", "127.0.0.1", port, i, len(actors), timeout_s=300)
            for i, a in enumerate(actors)])


def p2p_pair(actors: list[Actor], T: int, nbytes: int) -> float:
    """GB/s from trainer 0 to worker 0 (data rank ``T``) alone, ~256 MiB in ``nbytes`` messages."""
    iters = max(3, min(32, (256 * MiB) // nbytes))
    res = gather([actors[0].submit("_probes:p2p_run", [T], [], nbytes, iters),
                  actors[T].submit("_probes:p2p_run", [], [0], nbytes, iters)])
    return res[1]["recv_bytes"] / res[1]["seconds"] / 1e9


def measure_p2p(cluster: LocalCluster, sc: Scenario, sizes_mib: list[int]) -> dict[str, Any]:
    """Raw gloo bandwidth between the same processes: trainer 0 -> worker 0 alone at several message
    sizes, and one M2N-shaped round (every trainer -> every worker at once, M2N's message size)."""
    ts, rs = cluster.active_trainers, cluster.active_receivers
    actors, T, W = ts + rs, len(ts), len(rs)
    p2p_group(actors)
    out: dict[str, Any] = {"pair_gbps": {}}
    try:
        for mib in sizes_mib:
            out["pair_gbps"][mib] = p2p_pair(actors, T, mib * MiB)
        cap = sc.staging_mib * MiB // max(T, W) // 64 * 64
        iters = max(3, min(16, (256 * MiB) // (cap * T)))
        res = gather([a.submit("_probes:p2p_run", list(range(T, T + W)), [], cap, iters) for a in ts]
                     + [a.submit("_probes:p2p_run", [], list(range(T)), cap, iters) for a in rs])
        out["round_msg_mib"] = cap / MiB
        out["round_gbps_per_receiver"] = min(r["recv_bytes"] / r["seconds"] for r in res[T:]) / 1e9
    finally:
        on(actors, "p2p_teardown")
    out["pair_best_gbps"] = max(out["pair_gbps"].values())
    return out


def merge_p2p(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    """Keep the best of two raw p2p measurements (the machine is shared; the ceiling is what counts)."""
    if a is None:
        return b
    pair = {k: max(a["pair_gbps"].get(k, 0.0), v) for k, v in b["pair_gbps"].items()}
    return {"pair_gbps": pair, "pair_best_gbps": max(pair.values()), "round_msg_mib": b["round_msg_mib"],
            "round_gbps_per_receiver": max(a["round_gbps_per_receiver"], b["round_gbps_per_receiver"]),
            "samples": a.get("samples", 1) + 1}


def naive_group(ts: list[Actor], rs: list[Actor]) -> None:
    port, world = free_port(), 1 + len(rs)
    gather([a.submit("_probes:naive_setup", "127.0.0.1", port, world, timeout_s=300) for a in ts]
           + [a.submit("_probes:naive_setup", "127.0.0.1", port, world, rank=1 + w, timeout_s=300)
              for w, a in enumerate(rs)])


def naive_sync(ts: list[Actor], rs: list[Actor]) -> float:
    """Seconds of one naive sync, as the driver sees it."""
    t0 = time.perf_counter()
    gather([a.submit("_probes:naive_send") for a in ts] + [a.submit("_probes:naive_recv") for a in rs])
    return time.perf_counter() - t0


def run_naive(cluster: LocalCluster, warmup: int, repeats: int, verify: bool) -> dict[str, Any]:
    """The baseline on the current layout (any receiver backend): no weightsync engine involved."""
    ts, rs = cluster.active_trainers, cluster.active_receivers
    cluster.on_trainers("shutdown_engine")
    cluster.on_receivers("shutdown_weight_transfer_engine")
    on(rs, "touch_params")
    rss_t, rss_r = on(ts, "mem_reset"), on(rs, "mem_reset")
    naive_group(ts, rs)
    walls, phases = [], []
    try:
        for i in range(warmup + repeats):
            on(ts + rs, "timers")
            wall = naive_sync(ts, rs)
            tts, rt = on(ts, "timers"), on(rs, "timers")
            if i >= warmup:
                walls.append(wall)
                phases.append({"cpu_trainers": sum(t["cpu"] for t in tts), "cpu_workers": sum(r["cpu"] for r in rt)})
    finally:
        on(ts + rs, "naive_teardown")
    peaks_t, peaks_r = on(ts, "mem_peak"), on(rs, "mem_peak")
    bad = cluster.verify() if verify else None
    full = on(ts[:1], "model_bytes")[0]
    return {
        "transport": "naive", "bucket_mib": 0.0, "init_s": 0.0, "walls": walls, "seconds": statistics.median(walls),
        "phases": median_dicts(phases), "received_per_worker": dict.fromkeys(range(len(rs)), full),
        "lower_bound_per_worker": {},
        "trainer_extra_mib": [(p["hwm"] - r) / MiB for p, r in zip(peaks_t, rss_t)],
        "worker_extra_mib": [(p["hwm"] - r) / MiB for p, r in zip(peaks_r, rss_r)],
        "verified": None if bad is None else not any(bad.values()),
    }


def raw_plan_traffic(ts: list[Actor], rs: list[Actor], pair_bytes: list[dict[int, int]]) -> tuple[float, float]:
    """Seconds for the M2N plan's traffic moved raw (``_probes.p2p_plan``: every pair's bytes of one
    sync as one message, all posted at once, no copies), mean of 3 steps, slowest rank; and the CPU
    seconds per step of all those processes together."""
    T = len(ts)
    sends = [{T + w: n for w, n in pb.items()} for pb in pair_bytes[:T]]
    recvs = [dict(pb) for pb in pair_bytes[T:]]
    res = gather([a.submit("_probes:p2p_plan", s, {}, 3) for a, s in zip(ts, sends)]
                 + [a.submit("_probes:p2p_plan", {}, r, 3) for a, r in zip(rs, recvs)])
    return max(r["seconds"] for r in res), sum(r["cpu_s"] for r in res)


STEPS = 3
"""Timed runs per side of a pair, after one untimed warm-up, back to back: how ``_probes.p2p_plan``
times the raw step, so that every side of a pair is measured alike."""


def steady(fn: Callable[[], Any], then: Callable[[], Any] | None = None) -> tuple[float, float, Any]:
    """``fn`` once (a warm-up, right after the other sides' work), ``then`` (untimed), then ``fn``
    ``STEPS`` times back to back: the warm-up's seconds, the timed runs' mean seconds, the last result."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    if then is not None:
        then()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        out = fn()
    return first, (time.perf_counter() - t0) / STEPS, out


def run_paired(cluster: LocalCluster, sc: Scenario, model_dir: str, itemsize: int, repeats: int,
               p2p_mib: int) -> dict[str, Any]:
    """weightsync_m2n, the naive sync (before or after it, alternately), raw p2p (one pair, ``p2p_mib``
    messages) and the plan's traffic moved raw back to back, ``repeats`` times after a warm-up, on the
    same processes: on a shared machine each ratio is taken between measurements made moments apart,
    and the medians of the ratios are reported. Each sync side is one warm-up sync and the mean of
    ``STEPS`` more, as the raw step is timed; the warm-up sync (the first after the other sides' work)
    is kept as ``*_first_s``. Against the raw step (timed inside the processes, slowest rank) M2N's
    sync is ``send_weights`` as the slowest trainer rank timed it (``m2n_trainer_s``: what a trainer
    waits for); ``m2n_s`` adds the harness's calls from this driver into the trainer processes."""
    layout = Layout(trainers=sc.trainers, tp=sc.tp, replicas=sc.replicas, model=model_dir, tp_aligned=sc.tp_aligned,
                    dtype="float32" if itemsize == 4 else "bfloat16", backend="weightsync_m2n")
    cluster.setup(layout)
    ts, rs = cluster.active_trainers, cluster.active_receivers
    cluster.make_engines(init_info(layout, buffer_bytes=sc.staging_mib * MiB), source="local")
    on(ts + rs, "instrument")  # send_weights' own seconds on every trainer rank
    naive_group(ts, rs)
    p2p_group(ts + rs)
    pair_bytes = on(ts + rs, "plan_pair_bytes")
    samples = []
    try:
        for i in range(1 + repeats):
            naive = steady(lambda: naive_sync(ts, rs)) if i % 2 else None  # alternate: no side always goes first
            m2n_first, m2n, st = steady(lambda version=f"p{i}": cluster.sync(weight_version=version),
                                        lambda: on(ts + rs, "timers"))  # from here: each process's CPU seconds
            tim = on(ts + rs, "timers")
            m2n_cpu = sum(t["cpu"] for t in tim) / STEPS
            m2n_trainer = max(t["send"] for t in tim[:len(ts)]) / STEPS  # what send_weights took, slowest rank
            naive_first, naive_s, _ = naive or steady(lambda: naive_sync(ts, rs))
            pair = p2p_pair(ts + rs, len(ts), p2p_mib * MiB)
            raw, raw_cpu = raw_plan_traffic(ts, rs, pair_bytes)
            if i:
                gbps = max(st["bytes_received_per_worker"].values()) / m2n / 1e9
                samples.append({"m2n_s": m2n, "naive_s": naive_s, "p2p_gbps": pair, "m2n_gbps": gbps,
                                "speedup": naive_s / m2n, "fraction_of_p2p": gbps / pair,
                                "raw_plan_s": raw, "fraction_of_raw_plan": raw / m2n_trainer,
                                "m2n_trainer_s": m2n_trainer, "fraction_of_raw_plan_driver": raw / m2n,
                                "m2n_cpu_s": m2n_cpu, "raw_plan_cpu_s": raw_cpu,
                                "m2n_first_s": m2n_first, "naive_first_s": naive_first,
                                "fraction_of_raw_plan_first": raw / m2n_first})
    finally:
        on(ts + rs, "naive_teardown")
        on(ts + rs, "p2p_teardown")
        cluster.on_trainers("shutdown_engine")
    out = median_dicts(samples)
    out.update(samples=samples, p2p_mib=p2p_mib)
    return out

