"""What a sync did, as one trainer rank saw it: :class:`SyncStats` and :class:`DeltaStats`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["SyncStats", "DeltaStats"]


@dataclass
class DeltaStats:
    """What a delta sync (``delta=True``) sent, as seen by one trainer rank."""

    base: int | None
    """The sync whose weights the deltas are against (None: no worker could take one, all dense)."""
    workers: list[int] = field(default_factory=list)
    """Workers that took deltas (they hold ``base``); every other worker got this sync dense."""
    changed: int = 0
    """Values (wire dtype) of this rank's messages to those workers that differ from ``base``."""
    compared: int = 0
    """Values compared (the items of this rank's messages to ``workers``)."""
    dense_bytes: int = 0
    """What this rank would have sent dense (``bytes_sent`` is what it sent)."""
    diff_seconds: float = 0.0
    """Comparing with the baseline and encoding, part of the ``transfer`` phase."""
    baseline_bytes: int = 0
    """Memory this rank keeps for the last version it sent (its shards in the wire dtype)."""

    @property
    def changed_fraction(self) -> float | None:
        """``changed / compared`` (None when nothing was compared)."""
        return self.changed / self.compared if self.compared else None


@dataclass
class SyncStats:
    """What one ``send_weights()`` did, as seen by this trainer rank."""

    backend: str
    """The transport: ``weightsync_m2n``, ``weightsync_nccl`` or ``weightsync_ipc``."""
    rank: int
    """The trainer rank these stats are from (rank 0 alone has the per-worker fields)."""
    bytes_sent: int = 0
    """Payload bytes this rank put on the wire (per destination: a broadcast counts once)."""
    bytes_received_per_worker: dict[int, int] = field(default_factory=dict)
    """Bytes each worker received, counted by the worker from the buffers its data plane filled
    (rank 0 only)."""
    lower_bound_per_worker: dict[int, int] = field(default_factory=dict)
    """Least payload bytes each worker needs, from the plan (its shard of every tensor for M2N, every
    tensor whole for the full-tensor transports); rank 0 only."""
    num_tensors: int = 0
    """Tensors in this sync (the source's metadata entries)."""
    num_steps: int = 0
    """Fills of the bounded staging memory: buckets (nccl, ipc) or point-to-point rounds (m2n)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per phase: ``preflight``, ``start``, ``transfer``, ``finish``, ..."""
    worker_phases: dict[int, dict[str, float]] = field(default_factory=dict)
    """Seconds per phase as each worker measured it (rank 0 only): ``start`` (rollback snapshot,
    staging), ``receive`` (wire waits and applying),
    ``finish`` (vLLM's processing of post-processed layers, layerwise finalize)."""
    drafter_bytes_per_worker: dict[int, int] = field(default_factory=dict)
    """Engines with a speculative-decoding drafter (docs/drafter.md): bytes of the drafter's own parameters
    each worker's sync wrote (its shard of them; part of ``bytes_received_per_worker``), rank 0 only;
    empty when no engine has a synced drafter."""
    weight_version: str | None = None
    """The version the engines report after this sync (``send_weights(weight_version=...)``)."""
    delta: DeltaStats | None = None
    """Set for an engine with ``delta=True``: what changed and what that saved."""
    verified: bool | None = None
    """True when the sync ran with ``verify=True`` and every worker's checksums matched."""
    replicas: list[int] = field(default_factory=list)
    """``on_engine_failure="drop"``: the replicas (ids, ``ElasticTrainerEngine.replicas``) this sync
    completed on; per-worker fields count worker ``replica * tp + tp rank`` (rank 0 only)."""
    dropped: dict[int, str] = field(default_factory=dict)
    """``on_engine_failure="drop"``: replica id -> why this sync dropped it (its failure)."""

    @property
    def seconds(self) -> float:
        """Wall seconds of the sync on this rank: the sum of ``phases``."""
        return sum(self.phases.values())

    @property
    def gbps(self) -> float:
        """Payload GB/s received per worker (max over workers / wall seconds)."""
        per = max(self.bytes_received_per_worker.values(), default=self.bytes_sent)
        return per / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def timed(self, phase: str) -> _Timer:
        return _Timer(self, phase)

    def __repr__(self) -> str:
        """The fields users read first (``seconds`` and ``gbps`` included, times rounded), then the rest."""
        head = {"backend": self.backend, "rank": self.rank, "weight_version": self.weight_version,
                "seconds": round(self.seconds, 4), "gbps": round(self.gbps, 3), "verified": self.verified,
                "bytes_sent": self.bytes_sent, "bytes_received_per_worker": self.bytes_received_per_worker,
                "lower_bound_per_worker": self.lower_bound_per_worker, "num_tensors": self.num_tensors,
                "num_steps": self.num_steps, "phases": _rounded(self.phases),
                "worker_phases": {w: _rounded(p) for w, p in self.worker_phases.items()}}
        if self.drafter_bytes_per_worker:
            head["drafter_bytes_per_worker"] = self.drafter_bytes_per_worker
        if self.delta is not None:
            head["delta"] = self.delta
        if self.replicas or self.dropped:
            head.update(replicas=self.replicas, dropped=self.dropped)
        return f"SyncStats({', '.join(f'{k}={v!r}' for k, v in head.items())})"


def _rounded(phases: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in phases.items()}


class _Timer:
    def __init__(self, stats: SyncStats, phase: str) -> None:
        self.stats, self.phase = stats, phase

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.stats.phases[self.phase] = self.stats.phases.get(self.phase, 0.0) + (
            time.perf_counter() - self.t0
        )
