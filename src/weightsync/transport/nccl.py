"""``nccl`` transport: trainer rank 0 broadcasts packed buckets to every worker of every replica.

Data group: trainer rank 0 (data rank 0) + all workers (data ranks 1..W); NCCL on CUDA, gloo on
CPU. Other trainer ranks take part in the source's gathers and join the rendezvous store only.
Every bucket message is ``payload | status word``: an aborting sender still sends the bucket the
workers expect, flagged, so no peer is left waiting and the workers roll back what they applied.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch

from ..buckets import (
    ALIGN,
    Bucket,
    fold_checksum,
    metadata_digest,
    pack,
    plan_buckets,
    unpack,
)
from ..comm import Communicator, DataPlaneError, SyncAborted
from ..protocol import (
    ParamMeta,
    SyncStats,
    TrainerEngine,
    TrainerInitInfo,
    WeightSource,
    WorkerInitInfo,
    WorkerUpdateInfo,
    default_device,
    check_metadata,
    checked,
    dtype_from_name,
)
from ..worker import LayerwiseApplier, WorkerEngine

__all__ = ["NCCLTrainerInitInfo", "NCCLWorkerInitInfo", "NCCLUpdateInfo", "NCCLTrainerEngine", "NCCLWorkerEngine"]

DEFAULT_BUCKET_BYTES = 256 << 20
_OK, _ABORT = 1, 2


@dataclass(kw_only=True)
class NCCLTrainerInitInfo(TrainerInitInfo):
    """Trainer side of the broadcast transport. Give the same values on every trainer rank."""

    backend: ClassVar[str] = "weightsync_nccl"
    master_address: str
    """Host of the rendezvous store (trainer rank 0 hosts it)."""
    master_port: int
    """Free port on ``master_address`` for the store."""
    world_size: int
    """Data-group size: 1 (trainer rank 0) + the number of workers over all replicas."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Size of each packed buffer; every tensor must fit in one."""
    num_buffers: int = 2
    """Buckets in flight on the sender (pack one while the previous one is on the wire)."""
    timeout_s: float = 300.0
    """Limit for every blocking step."""
    rollback: bool = True
    """Workers keep a host copy of their parameters during a sync and restore it on failure."""
    device: str = field(default_factory=default_device)
    """``"cuda"`` (NCCL) or ``"cpu"`` (gloo)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.world_size < 2:
            raise ValueError(f"world_size must be >= 2 (sender + at least one worker), got {self.world_size}")
        if self.num_buffers < 1:
            raise ValueError(f"num_buffers must be >= 1, got {self.num_buffers}")
        if self.bucket_bytes < ALIGN or self.bucket_bytes % ALIGN:
            raise ValueError(f"bucket_bytes must be a positive multiple of {ALIGN}, got {self.bucket_bytes}")


@dataclass(kw_only=True)
class NCCLWorkerInitInfo(WorkerInitInfo):
    """What workers receive in ``init_weight_transfer_engine`` (built by trainer rank 0)."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 300.0
    rollback: bool = True


@dataclass(kw_only=True)
class NCCLUpdateInfo(WorkerUpdateInfo):
    """One sync. Empty lists reuse the previous sync's metadata (checked by ``digest``)."""

    sync_id: int
    digest: str
    verify: bool = False
    """Workers compare a checksum of every bucket they received with the sender's before finishing."""
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names, dtype_names and shapes must have equal lengths, got "
                             f"{len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)}")


def _message(bucket: Bucket) -> int:
    """Bytes of one bucket message: aligned payload plus the status word."""
    return (bucket.nbytes + ALIGN - 1) // ALIGN * ALIGN + 8


def _status(buf: torch.Tensor, nbytes: int) -> torch.Tensor:
    return buf[nbytes - 8 : nbytes].view(torch.int64)


class NCCLTrainerEngine(TrainerEngine):
    """Broadcast trainer engine. ``trainer_init`` and ``send_weights`` run on every trainer rank."""

    init_info_cls = NCCLTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: NCCLTrainerInitInfo, *, client: Any, source: WeightSource | None = None) -> "NCCLTrainerEngine":
        if source is None:
            raise ValueError("source is required for the nccl transport")
        self = cls(init_info, client=client, source=source)
        self.sync_id = 0
        self.comm: Communicator | None = None
        self._sent_digest: str | None = None
        i = init_info
        if self.is_sender:
            worker_info = NCCLWorkerInitInfo(master_address=i.master_address, master_port=i.master_port,
                                             world_size=i.world_size, bucket_bytes=i.bucket_bytes,
                                             timeout_s=i.timeout_s, rollback=i.rollback)
            pool = ThreadPoolExecutor(1)  # workers block in the rendezvous until we join it
            try:
                fut = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
                self.comm = Communicator.from_tcp_store(i.master_address, i.master_port, 0, i.world_size,
                                                        device=i.device, timeout_s=i.timeout_s)
                fut.result(timeout=i.timeout_s)
            except BaseException as e:
                if self.comm is not None:
                    self.comm.fail(f"{type(e).__name__}: {e}")
                raise
            finally:
                pool.shutdown(wait=False)  # never join a thread whose peer may be gone
            self.comm.publish("ws/init_done", True)  # every worker finished its init
            dev = torch.device(i.device)
            self._buffers = [torch.empty(i.bucket_bytes + ALIGN + 8, dtype=torch.uint8, device=dev)
                             for _ in range(i.num_buffers)]
        else:
            self.comm = Communicator.control_only(i.master_address, i.master_port, i.rank, timeout_s=i.timeout_s)
            self.comm.read("ws/init_done")  # raises a failure trainer rank 0 or a worker reported
        return self

    def send_weights(self, *, weight_version: str | None = None, verify: bool = False) -> SyncStats:
        """Collective on every trainer rank; returns after every worker applied the weights. With
        ``verify``, workers check what they received against the sender's checksums before the
        sync can finish."""
        info: NCCLTrainerInitInfo = self.init_info  # type: ignore[assignment]
        stats = SyncStats(backend="weightsync_nccl", rank=self.rank, weight_version=weight_version)
        self.sync_id += 1
        with stats.timed("preflight"):
            metas = self.source.metadata
            check_metadata(metas)
            buckets = plan_buckets(metas, info.bucket_bytes)  # raises on every rank alike
        stats.num_tensors, stats.num_chunks = len(metas), len(buckets)
        if not self.is_sender:
            error = None
            try:
                for _ in checked(self.source.iter_full(), metas):
                    pass
            except Exception as e:  # still wait for the sender's verdict below
                error = e
            try:
                verdict = self.comm.read(f"ws/done/{self.sync_id}")
            except DataPlaneError:
                if error is not None:
                    raise error from None
                raise
            if error is not None:
                raise error
            if verdict != "ok":
                raise RuntimeError(f"weight sync {self.sync_id} failed on trainer rank 0: {verdict}")
            return stats
        try:
            self._send(metas, buckets, stats, weight_version, verify)
        except BaseException as e:
            self.comm.publish(f"ws/done/{self.sync_id}", f"{type(e).__name__}: {e}")
            if not isinstance(e, ValueError):  # a source error was signalled in-band; the group is intact
                self.comm.fail(f"{type(e).__name__}: {e}")
            raise
        self.comm.publish(f"ws/done/{self.sync_id}", "ok")
        return stats

    def _send(self, metas: list[ParamMeta], buckets: list[Bucket], stats: SyncStats, version: str | None,
              verify: bool) -> None:
        info: NCCLTrainerInitInfo = self.init_info  # type: ignore[assignment]
        digest = metadata_digest(m.wire() for m in metas)
        wire = [m.wire() for m in metas] if digest != self._sent_digest else []
        update = NCCLUpdateInfo(sync_id=self.sync_id, digest=digest, verify=verify, names=[w["name"] for w in wire],
                                dtype_names=[w["dtype"] for w in wire], shapes=[w["shape"] for w in wire])
        with stats.timed("start"):
            self.client.start_weight_update()
        pool = ThreadPoolExecutor(1)
        try:
            fut = pool.submit(self.client.update_weights, asdict(update))
            with stats.timed("transfer"):
                self._broadcast(metas, buckets, stats, fut, verify)
                fut.result(timeout=info.timeout_s)
        finally:
            pool.shutdown(wait=False)  # never join a thread whose peer may be gone
        self._sent_digest = digest
        with stats.timed("finish"):
            self.client.finish_weight_update(version)
        per_worker = sum(b.nbytes for b in buckets)
        stats.bytes_received_per_worker = {w: per_worker for w in range(info.world_size - 1)}
        stats.verified = True if verify else None

    def _broadcast(self, metas: list[ParamMeta], buckets: list[Bucket], stats: SyncStats, fut: Any,
                   verify: bool) -> None:
        comm = self.comm
        assert comm is not None
        works: list[Any] = [None] * len(self._buffers)
        it = checked(self.source.iter_full(), metas)
        error: BaseException | None = None
        checksum = 0
        for b, bucket in enumerate(buckets):
            slot = b % len(self._buffers)
            if works[slot] is not None:
                comm.wait(works[slot], "bucket broadcast")
            buf = self._buffers[slot][: _message(bucket)]
            aborted_before = error is not None
            if error is None:
                try:
                    for entry in bucket.entries:
                        _, tensor = next(it)
                        pack(buf, entry, tensor)
                    if b == len(buckets) - 1:
                        next(it, None)  # lets `checked` report a source that yields too much
                except BaseException as e:
                    error = e
                    self.comm.publish(f"ws/abort/{self.sync_id}", f"{type(e).__name__}: {e}")
            _status(buf, buf.numel()).fill_(_OK if error is None else _ABORT)
            if buf.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            if fut.done() and fut.exception() is not None:
                raise fut.exception()  # a worker failed: stop before blocking on it
            works[slot] = comm.broadcast(buf, src=0, async_op=True)
            if verify and error is None:
                checksum = fold_checksum(checksum, buf[: bucket.nbytes])
            stats.bytes_sent += bucket.nbytes
            if aborted_before:
                break  # workers receive one message ahead: the flagged bucket and the next one
        for w in works:
            if w is not None:
                comm.wait(w, "bucket broadcast")
        if error is not None:
            raise error
        if verify:
            comm.publish(f"ws/sum/{self.sync_id}", checksum)

    def shutdown(self) -> None:
        if self.comm is not None:
            self.comm.shutdown()
        self.comm, self._buffers = None, []


class NCCLWorkerEngine(WorkerEngine):
    """Broadcast worker engine: receives buckets and applies them through layerwise reload."""

    init_info_cls = NCCLWorkerInitInfo
    update_info_cls = NCCLUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.comm: Communicator | None = None
        self.info: NCCLWorkerInitInfo | None = None
        self._metas: list[ParamMeta] = []
        self._digest: str | None = None
        self._applier: LayerwiseApplier | None = None

    def init_transfer_engine(self, init_info: NCCLWorkerInitInfo) -> None:
        self.shutdown()
        self.info, self.poisoned = init_info, None
        self.comm = Communicator.from_tcp_store(
            init_info.master_address, init_info.master_port, init_info.rank_offset + self.worker_rank,
            init_info.world_size, device=self.device, timeout_s=init_info.timeout_s)

    def start_weight_update(self) -> None:
        self._check_not_poisoned()
        if self.comm is None or self.info is None:
            raise RuntimeError("init_transfer_engine must run before start_weight_update")
        self._applier = LayerwiseApplier(self.model, self.model_config, rollback=self.info.rollback)
        self._applier.start()

    def receive_weights(self, update_info: NCCLUpdateInfo) -> None:
        self._check_not_poisoned()
        if self._applier is None or self.comm is None or self.info is None:
            raise RuntimeError("start_weight_update must run before update_weights")
        try:
            if update_info.names:
                metas = [ParamMeta(n, dtype_from_name(d), tuple(s))
                         for n, d, s in zip(update_info.names, update_info.dtype_names, update_info.shapes)]
                digest = metadata_digest(m.wire() for m in metas)
                self._metas, self._digest = metas, digest
            if update_info.digest != self._digest:
                raise ValueError(f"update_info.digest {update_info.digest!r} does not match this worker's "
                                 f"metadata digest {self._digest!r}")
            self._receive(plan_buckets(self._metas, self.info.bucket_bytes), update_info.sync_id,
                          update_info.verify)
        except BaseException as e:
            self.poisoned = f"{type(e).__name__}: {e}"
            if not isinstance(e, SyncAborted):  # an in-band abort leaves the group intact
                self.comm.fail(self.poisoned)
            self._applier.abort()
            self._applier = None
            raise

    def _receive(self, buckets: list[Bucket], sync_id: int, verify: bool) -> None:
        comm = self.comm
        assert comm is not None and self._applier is not None

        def post(b: int) -> tuple[torch.Tensor, Any]:
            # A fresh buffer per bucket: layerwise reload may keep views until a layer is complete.
            buf = torch.empty(_message(buckets[b]), dtype=torch.uint8, device=self.device)
            return buf, comm.broadcast(buf, src=0, async_op=True)

        inflight = post(0) if buckets else None
        checksum = 0
        for b, bucket in enumerate(buckets):
            buf, work = inflight
            inflight = post(b + 1) if b + 1 < len(buckets) else None  # receive b+1 while applying b
            comm.wait(work, f"bucket {b} broadcast")
            if int(_status(buf, buf.numel()).item()) != _OK:
                if inflight is not None:  # an aborting sender still sends the next message
                    comm.wait(inflight[1], f"bucket {b + 1} broadcast")
                raise SyncAborted(f"trainer aborted weight sync {sync_id}: {self._abort_reason(sync_id)}")
            if verify:
                checksum = fold_checksum(checksum, buf[: bucket.nbytes])
            self._applier.load(unpack(buf, bucket))
        if verify and (sent := self.comm.read(f"ws/sum/{sync_id}")) != checksum:
            raise ValueError(f"verify: worker {self.worker_rank} received buckets with checksum {checksum}, "
                             f"the sender sent {sent}")

    def _abort_reason(self, sync_id: int) -> str:
        return self.comm.peek(f"ws/abort/{sync_id}") or "no reason published"

    def finish_weight_update(self) -> None:
        self._check_not_poisoned()
        if self._applier is None:
            raise RuntimeError("finish_weight_update without start_weight_update")
        self._applier.finish()
        self._applier = None

    def shutdown(self) -> None:
        if self._applier is not None and self._applier.active:
            self._applier.abort()
        self._applier = None
        if self.comm is not None:
            self.comm.shutdown()
        self.comm = None
