"""``weightsync layouts``: FSDP2 trainer ranks -> vLLM's model classes at any TP x replicas on CPU (the
harness, vLLM 0.33's classes in plain processes), per transport, verified.

For each transport: build the layout, sync, take an optimizer step, sync again, and check every
vLLM parameter is ``torch.equal`` to vLLM's own ``load_weights`` of the trainer's full state dict.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from ..registry import transport, transport_names
from .cluster import Layout, LocalCluster

__all__ = ["run_layouts", "run_transport", "format_table"]


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
