"""``weightsync demo``: FSDP2 trainer ranks -> vLLM model TP ranks on CPU, per transport, verified.

For each transport: build the layout, sync, take an optimizer step, sync again, and check every
vLLM parameter is ``torch.equal`` to vLLM's own ``load_weights`` of the trainer's full state dict.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from .cluster import Layout, LocalCluster, free_port

__all__ = ["TRANSPORTS", "run_demo", "format_table"]

TRANSPORTS = ("nccl", "ipc", "nccl_m2n")
"""Transports the demo runs (``all`` = every one of them)."""
BACKENDS = {"nccl": "weightsync_nccl", "ipc": "weightsync_ipc", "nccl_m2n": "weightsync_m2n"}
"""Demo transport name -> the backend name registered in vLLM."""
SOURCES = {"nccl_m2n": "local"}
"""Transports that read local FSDP2 shards (``DTensorModuleSource``) rather than full tensors."""


def _init_info(transport: str, layout: Layout, bucket_bytes: int) -> Any:
    if transport == "nccl":
        from ..transport.nccl import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(),
                                   world_size=1 + layout.num_workers, bucket_bytes=bucket_bytes,
                                   device="cpu", rank=0)
    if transport == "ipc":  # colocated: worker w is served by trainer rank w % trainers (shared memory)
        from ..transport.ipc import IPCTrainerInitInfo

        return IPCTrainerInitInfo(num_trainer_ranks=layout.trainers, num_workers=layout.num_workers,
                                  master_port=free_port(), bucket_bytes=bucket_bytes, device="cpu", rank=0)
    if transport == "nccl_m2n":  # every trainer rank sends its shards' pieces straight into vLLM params
        from ..transport.m2n import M2NTrainerInitInfo

        return M2NTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(),
                                  num_trainer_ranks=layout.trainers, world_size=layout.trainers + layout.num_workers,
                                  dst_mesh_dims=(layout.replicas, layout.tp), staging_bytes=bucket_bytes,
                                  device="cpu", rank=0)
    raise ValueError(f"unknown transport {transport!r}; choose from {TRANSPORTS} or 'all'")


def run_transport(cluster: LocalCluster, transport: str, layout: Layout, bucket_bytes: int) -> dict[str, Any]:
    """One row: setup, two verified syncs (the second after an optimizer step)."""
    if transport not in BACKENDS:
        raise ValueError(f"unknown transport {transport!r}; choose from {TRANSPORTS} or 'all'")
    layout = replace(layout, backend=BACKENDS[transport])
    cluster.setup(layout)
    cluster.make_engines(_init_info(transport, layout, bucket_bytes), source=SOURCES.get(transport, "full"))
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
    return {"transport": transport, "trainers": layout.trainers, "tp": layout.tp, "replicas": layout.replicas,
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


def run_demo(transports: list[str], layout: Layout, bucket_bytes: int) -> list[dict[str, Any]]:
    cluster = LocalCluster()
    try:
        return [run_transport(cluster, t, layout, bucket_bytes) for t in transports]
    finally:
        cluster.close()
