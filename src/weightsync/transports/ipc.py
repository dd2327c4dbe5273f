"""``weightsync_ipc``: colocated trainer ranks hand their vLLM workers a packed buffer on the same device.

Every trainer rank takes part in each bucket's gather (``source.iter_full()``); a rank serving workers
packs the bucket into its ONE reusable buffer (``bucket_bytes``; exported once per worker: CUDA IPC on
GPU, a shared-memory file on CPU, see :mod:`.ipc_handles`). Per chunk, every rank reports its handles
(or fails the sync) on rank 0's store; rank 0 calls ``client.update_weights`` with one dict that maps
each global worker rank to its serving rank's handle; it returns once every worker applied the chunk
(cloned out of the buffer), after which the ranks refill their buffers. Worker ``w`` is served by
trainer rank ``worker_to_trainer[w]`` (default ``w % ranks``). With ``verify`` every worker compares a
checksum of the chunk it applied with the one its serving rank computed after packing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch

from ..control import SyncKeys
from ..errors import SyncFailed
from ..infos import MetadataUpdateInfo, TrainerInitInfo, WorkerInitInfo
from ..plan.buckets import Bucket, check_bucket_bytes, metadata_digest, plan_buckets
from ..protocol import ParamMeta, check_metadata, checked
from ..registry import Capabilities, Transport, transports_with
from ..reshard.packing import fold_checksum, pack, unpack
from ..stats import SyncStats
from ..trainer.engine import TrainerEngine
from ..trainer.waits import client_result
from ..worker.agreement import agree_on_metadata
from ..worker.applier import LayerwiseApplier
from ..worker.engine import WorkerEngine
from .ipc_handles import BufferImporter, ExportedBuffer, memory_saver_paused

__all__ = ["IPCTrainerInitInfo", "IPCWorkerInitInfo", "IPCUpdateInfo", "IPCTrainerEngine", "IPCWorkerEngine",
           "TRANSPORT"]

DEFAULT_BUCKET_BYTES = 512 << 20


def _check_mapping(mapping: Any, num_workers: int, num_trainer_ranks: int) -> None:
    if (not isinstance(mapping, (list, tuple)) or len(mapping) != num_workers
            or any(not isinstance(t, int) or not 0 <= t < num_trainer_ranks for t in mapping)):
        raise ValueError(f"worker_to_trainer must list, for each of the num_workers={num_workers} workers, a trainer "
                         f"rank in [0, num_trainer_ranks={num_trainer_ranks}), got {mapping!r}")


@dataclass(kw_only=True, frozen=True)
class IPCTrainerInitInfo(TrainerInitInfo):
    """Trainer side of the colocated transport. Give the same values on every trainer rank."""

    backend: ClassVar[str] = "weightsync_ipc"
    num_workers: int
    """vLLM workers over all replicas (global worker rank = replica * TP x PP + rank in replica)."""
    worker_to_trainer: tuple[int, ...] | None = None
    """Trainer rank serving each worker; it must share the worker's device. None: ``w % num_trainer_ranks``."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Size of each rank's packed buffer (kept between syncs); every tensor must fit in one."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.delta:
            raise ValueError(f"delta=True is for transports with a wire ({', '.join(transports_with('delta'))}): "
                             "weightsync_ipc's workers read the trainer's memory in place")
        if not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {self.num_workers!r}")
        mapping = self.worker_to_trainer
        if mapping is None:
            mapping = [w % self.num_trainer_ranks for w in range(self.num_workers)]
        _check_mapping(mapping, self.num_workers, self.num_trainer_ranks)
        self._set(worker_to_trainer=tuple(mapping))
        check_bucket_bytes("bucket_bytes", self.bucket_bytes)

    @classmethod
    def for_deployment(cls, *, num_trainer_ranks: int, replicas: int, tp: int, pp: int = 1, rank: int = 0,
                       buffer_bytes: int | None = None, **fields: Any) -> IPCTrainerInitInfo:
        if buffer_bytes is not None:
            fields["bucket_bytes"] = buffer_bytes
        return cls(num_trainer_ranks=num_trainer_ranks, num_workers=replicas * tp * pp, rank=rank, **fields)


@dataclass(kw_only=True)
class IPCWorkerInitInfo(WorkerInitInfo):
    """What workers receive in ``init_weight_transfer_engine`` (built by trainer rank 0)."""

    num_workers: int
    worker_to_trainer: list[int]
    num_trainer_ranks: int
    bucket_bytes: int

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bucket_bytes("init_info.bucket_bytes", self.bucket_bytes)
        _check_mapping(self.worker_to_trainer, self.num_workers, self.num_trainer_ranks)


@dataclass(kw_only=True)
class IPCUpdateInfo(MetadataUpdateInfo):
    """One chunk for every worker. Metadata lists come with chunk 0 when they changed (else empty)."""

    chunk: int = 0
    """Index of this chunk among ``num_chunks`` (chunks arrive in order, each once)."""
    num_chunks: int = 0
    handles: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Global worker rank -> ``{"trainer_rank": t, "handle": {device key: handle fields}}`` (JSON-safe)."""
    checksums: dict[str, int] = field(default_factory=dict)
    """Trainer rank -> checksum of the chunk it packed (with ``verify``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.abort is None and not 0 <= self.chunk < self.num_chunks:
            raise ValueError(f"chunk must be in [0, num_chunks={self.num_chunks}), got {self.chunk}")


class IPCTrainerEngine(TrainerEngine[IPCTrainerInitInfo, IPCUpdateInfo, tuple[list[ParamMeta], list[Bucket], str]]):
    """Colocated trainer engine. ``trainer_init`` and ``send_weights`` run on every trainer rank."""

    init_info_cls = IPCTrainerInitInfo
    update_info_cls = IPCUpdateInfo

    def _worker_init_info(self, port: int) -> IPCWorkerInitInfo:
        i = self.init_info
        return IPCWorkerInitInfo(**self._shared_worker_fields(port), num_workers=i.num_workers,
                                 worker_to_trainer=list(i.worker_to_trainer), num_trainer_ranks=i.num_trainer_ranks,
                                 bucket_bytes=i.bucket_bytes)

    def _handshake(self) -> None:
        i = self.init_info
        self.device = torch.device(i.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        # the workers check the agreed metadata against their model at init
        agree_on_metadata(self.comm, self.source.metadata, rank=i.rank, num_ranks=i.num_trainer_ranks)
        self.served = [w for w, t in enumerate(i.worker_to_trainer) if t == i.rank]
        self._buffer: ExportedBuffer | None = None
        self._sent_digest: str | None = None
        self._total = 0

    def _preflight(self, verify: bool) -> tuple[list[ParamMeta], list[Bucket], str]:
        metas = self.source.metadata
        if not metas:
            raise ValueError("source.metadata is empty: there is nothing to send")
        check_metadata(metas)
        buckets = plan_buckets(metas, self.init_info.bucket_bytes)  # raises on every rank alike
        self._total = sum(b.nbytes for b in buckets)
        return metas, buckets, metadata_digest(m.wire() for m in metas)

    def _lower_bound(self) -> dict[int, int]:
        return dict.fromkeys(range(self.init_info.num_workers), self._total)

    def _transfer(self, prepared: tuple[list[ParamMeta], list[Bucket], str], stats: SyncStats, verify: bool,
                  started: Callable[[], None]) -> None:
        started()
        metas, buckets, digest = prepared
        stats.num_tensors, stats.num_steps = len(metas), len(buckets)
        source_it, keys, self._chunks = self.source.iter_full(), SyncKeys(self.sync_id), len(buckets)
        it = checked(source_it, metas)
        try:
            with memory_saver_paused():
                for b, bucket in enumerate(buckets):
                    mine = self._pack(it, bucket, b == len(buckets) - 1, verify, stats)
                    self.comm.publish(keys.chunk(b, self.rank), mine)
                    if self.is_sender:
                        packed = [mine] + [self.comm.read(keys.chunk(b, r))
                                           for r in range(1, self.init_info.num_trainer_ranks)]
                        payload = self._update(packed, b, len(buckets), digest, metas, verify)
                        client_result(self._pool.submit(lambda payload=payload: self.client.update_weights(payload)),
                                      self.init_info.timeout_s, "update_weights")  # (not the client's own timeout)
                        failure = self.comm.peer_error()  # a worker reports its failure instead of raising
                        if failure is not None:
                            raise SyncFailed(failure)
                        self.comm.publish(keys.applied(b), True)
                    else:  # the buffer is refilled only once every worker cloned this chunk
                        self.comm.read(keys.applied(b))
                    if self._buffer is not None:
                        self._buffer.unlink()  # every worker mapped it: nothing is left if a process dies
        finally:  # now, not at garbage collection: a source may hold a grad mode or a gather open
            it.close()
            if hasattr(source_it, "close"):
                source_it.close()
            if self.device.type == "cuda":
                torch.cuda.ipc_collect()
        self._sent_digest = digest

    def _pack(self, it: Any, bucket: Bucket, last: bool, verify: bool, stats: SyncStats) -> dict[str, Any]:
        """This rank's part of a chunk: take it from the source and pack it if serving."""
        buf = self._packing_buffer()
        for entry in bucket.entries:
            _, tensor = next(it)
            if buf is not None:
                pack(buf, entry, tensor)
        if last:
            next(it, None)  # lets `checked` report a source that yields too much
        if buf is None:
            return {"handles": {}}
        if buf.device.type == "cuda":
            torch.cuda.current_stream(buf.device).synchronize()
        stats.bytes_sent += bucket.nbytes
        return {"handles": {str(w): self._buffer.export(w) for w in self.served},
                "sum": fold_checksum(0, buf[: bucket.nbytes]) if verify else None}

    def _packing_buffer(self) -> torch.Tensor | None:
        if not self.served:
            return None  # this rank serves no worker: it only takes part in the gathers
        if self._buffer is None:
            self._buffer = ExportedBuffer(self.init_info.bucket_bytes, self.device, tag=f"r{self.rank}-")
        return self._buffer.tensor

    def _update(self, packed: list[dict[str, Any]], b: int, num_chunks: int, digest: str, metas: list[ParamMeta],
                verify: bool) -> dict[str, Any]:
        i = self.init_info
        handles = {w: h for p in packed for w, h in p["handles"].items()}
        wire = IPCUpdateInfo.wire(metas) if b == 0 and digest != self._sent_digest else {}
        sums = {str(r): p["sum"] for r, p in enumerate(packed) if p.get("sum") is not None} if verify else {}
        return asdict(IPCUpdateInfo(
            sync_id=self.sync_id, chunk=b, num_chunks=num_chunks, digest=digest, verify=verify, checksums=sums,
            session=self.session,
            handles={str(w): {"trainer_rank": t, "handle": handles[str(w)]} for w, t in enumerate(i.worker_to_trainer)},
            **wire))

    def shutdown(self, *, drain: bool = True) -> None:
        super().shutdown(drain=drain)
        if getattr(self, "_buffer", None) is not None:
            self._buffer.close()  # a CPU file is already gone; CUDA memory goes once the workers let go
        self._buffer = None


class IPCWorkerEngine(WorkerEngine[IPCWorkerInitInfo, IPCUpdateInfo]):
    """Colocated worker engine: imports its trainer rank's buffer once and applies each chunk."""

    init_info_cls = IPCWorkerInitInfo
    update_info_cls = IPCUpdateInfo

    def _expected_workers(self, info: IPCWorkerInitInfo) -> tuple[int, str]:
        return info.num_workers, f"num_workers={info.num_workers}"

    def _init(self, info: IPCWorkerInitInfo) -> None:
        self._check_full_tensor_metadata()  # model agreement and coverage, before any chunk
        self.importer = BufferImporter(self.device)
        self._plans: dict[str, list[Bucket]] = {}  # metadata digest -> chunks

    def _start(self, applier: LayerwiseApplier) -> None:
        applier.start()
        self._sync: int | None = None
        self._next_chunk = self._num_chunks = 0

    def _receive(self, u: IPCUpdateInfo) -> int:
        w = self.worker_rank
        mine = u.handles.get(str(w))
        expected = self.info.worker_to_trainer[w]
        if not isinstance(mine, dict) or mine.get("trainer_rank") != expected:
            raise ValueError(f"update_info.handles has no handle from trainer rank {expected} for worker {w}, "
                             f"which that rank serves: {mine!r:.200}")
        if u.chunk != self._next_chunk or (u.chunk and u.sync_id != self._sync):
            raise ValueError(f"update_info (sync {u.sync_id}, chunk {u.chunk}) out of order: expected sync "
                             f"{self._sync}, chunk {self._next_chunk}")
        if u.names:
            metas = u.metas()
            self._check_full_tensor_metadata(metas)
            self._plans = {metadata_digest(m.wire() for m in metas): plan_buckets(metas, self.info.bucket_bytes)}
        if u.digest not in self._plans:
            raise ValueError(f"update_info.digest {u.digest!r} does not match this worker's metadata "
                             f"digest(s) {sorted(self._plans)}")
        buckets = self._plans[u.digest]
        if u.num_chunks != len(buckets):
            raise ValueError(f"update_info.num_chunks is {u.num_chunks}, the metadata makes {len(buckets)} chunks")
        buf = self.importer.get(mine.get("handle"))
        bucket = buckets[u.chunk]
        if buf.numel() < bucket.nbytes:
            raise ValueError(f"the shared buffer has {buf.numel()} bytes, chunk {u.chunk} needs {bucket.nbytes}")
        # Clone: the trainer refills the buffer once we return; layerwise reload may keep tensors a while.
        tensors = [(n, t.clone()) for n, t in unpack(buf, bucket)]
        if u.verify:
            got, sent = fold_checksum(0, buf[: bucket.nbytes]), u.checksums.get(str(expected))
            if got != sent:
                raise ValueError(f"verify: worker {w} read chunk {u.chunk} with checksum {got}, trainer rank "
                                 f"{expected} packed {sent}")
        self._applier.load(tensors)
        self._sync, self._next_chunk, self._num_chunks = u.sync_id, u.chunk + 1, u.num_chunks
        return bucket.nbytes

    def finish_weight_update(self) -> None:
        if self._applier is not None and (self._next_chunk != self._num_chunks or self._sync is None):
            self._rollback()
            raise RuntimeError(f"finish_weight_update after {self._next_chunk} of {self._num_chunks} chunks of sync "
                               f"{self._sync}; parameters restored")
        super().finish_weight_update()

    def shutdown(self) -> None:
        super().shutdown()
        if getattr(self, "importer", None) is not None:
            self.importer.close()
        self.importer = None


TRANSPORT = Transport(
    name="weightsync_ipc", trainer_engine=IPCTrainerEngine, worker_engine=IPCWorkerEngine,
    init_info=IPCTrainerInitInfo, source="full", colocated=True,
    summary="each trainer rank hands its colocated workers one packed, reusable CUDA IPC (CPU: shared-memory) buffer",
    capabilities=Capabilities())
