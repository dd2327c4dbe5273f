"""``weightsync_nccl``: trainer rank 0 broadcasts packed buckets to every worker of every replica.

Data plane: trainer rank 0 (data rank 0) + all workers (data ranks 1..W); NCCL on CUDA, gloo on
CPU. The other trainer ranks take part in the source's gathers (``iter_full``) and in the control
channel only. The bucket layout is a pure function of the metadata, so only the metadata (when it
changed) and its digest travel in the update info. Workers apply each bucket through vLLM's
layerwise reload while the next one arrives.

Delta sync (``delta=True``): rank 0 keeps the full model as last sent. When every worker holds that
version, rank 0 gathers every tensor first, and the tensors every worker writes in place (each one's
destinations, published at init) go first, each sparse where smaller (the list is announced on the
store, so every worker derives the same buckets); the workers patch or copy them into their live
parameters, then the rest follows dense through layerwise reload.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..control import SyncKeys, nccl_loader
from ..infos import MetadataUpdateInfo, TrainerInitInfo, WorkerInitInfo
from ..plan.buckets import ALIGN, Bucket, check_bucket_bytes, metadata_digest, plan_buckets
from ..plan.transfer import align_up
from ..protocol import ParamMeta, check_metadata, checked
from ..registry import Capabilities, Transport
from ..reshard.delta import Baseline, decode, diff, encode, patch_pieces, sparse_nbytes, write_pieces
from ..reshard.packing import fold_checksum, pack, unpack
from ..stats import DeltaStats, SyncStats
from ..trainer.engine import TrainerEngine
from ..worker.agreement import agree_on_metadata
from ..worker.applier import LayerwiseApplier
from ..worker.engine import WorkerEngine

__all__ = ["NCCLTrainerInitInfo", "NCCLWorkerInitInfo", "NCCLUpdateInfo", "NCCLTrainerEngine", "NCCLWorkerEngine",
           "TRANSPORT"]

DEFAULT_BUCKET_BYTES = 256 << 20


@dataclass(kw_only=True, frozen=True)
class NCCLTrainerInitInfo(TrainerInitInfo):
    """Trainer side of the broadcast transport. Give the same values on every trainer rank."""

    backend: ClassVar[str] = "weightsync_nccl"
    world_size: int
    """Data-plane size: 1 (trainer rank 0) + the number of workers over all replicas."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Size of each packed buffer; every tensor must fit in one."""
    num_buffers: int = 2
    """Buckets in flight on the sender (pack one while the previous one is on the wire)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.world_size, int) or self.world_size < 2:
            raise ValueError(f"world_size must be >= 2 (sender + at least one worker), got {self.world_size!r}")
        if not isinstance(self.num_buffers, int) or self.num_buffers < 1:
            raise ValueError(f"num_buffers must be an int >= 1, got {self.num_buffers!r}")
        check_bucket_bytes("bucket_bytes", self.bucket_bytes)

    @classmethod
    def for_deployment(cls, *, num_trainer_ranks: int, replicas: int, tp: int, pp: int = 1, rank: int = 0,
                       buffer_bytes: int | None = None, **fields: Any) -> NCCLTrainerInitInfo:
        if buffer_bytes is not None:
            fields["bucket_bytes"] = buffer_bytes
        return cls(num_trainer_ranks=num_trainer_ranks, world_size=1 + replicas * tp * pp, rank=rank, **fields)

    def replica_workers(self, num_replicas: int) -> int:
        if (self.world_size - 1) % num_replicas:
            raise ValueError(f"world_size={self.world_size} is not 1 + a multiple of the {num_replicas} engine(s) "
                             "the client drives")
        return (self.world_size - 1) // num_replicas

    def for_replica(self, tp: int, port: int) -> NCCLTrainerInitInfo:
        """One replica's group: trainer rank 0 and that replica's ``tp`` workers (a communicator of its own)."""
        return dataclasses.replace(self, master_port=port, world_size=1 + tp, on_engine_failure="fail")


@dataclass(kw_only=True)
class NCCLWorkerInitInfo(WorkerInitInfo):
    """What workers receive in ``init_weight_transfer_engine`` (built by trainer rank 0)."""

    world_size: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bucket_bytes("init_info.bucket_bytes", self.bucket_bytes)
        if self.world_size < 2:
            raise ValueError(f"init_info.world_size must be >= 2, got {self.world_size}")


@dataclass(kw_only=True)
class NCCLUpdateInfo(MetadataUpdateInfo):
    """One sync: the metadata when it changed (else empty lists) and its digest."""

    delta_base: int | None = None
    """A delta sync against this sync (every worker holds it): the entries are announced on the store."""


class NCCLTrainerEngine(TrainerEngine[NCCLTrainerInitInfo, NCCLUpdateInfo, tuple[list[ParamMeta], list[Bucket]]]):
    """Broadcast trainer engine. ``trainer_init`` and ``send_weights`` run on every trainer rank."""

    init_info_cls = NCCLTrainerInitInfo
    update_info_cls = NCCLUpdateInfo

    def _worker_init_info(self, port: int) -> NCCLWorkerInitInfo:
        i = self.init_info
        return NCCLWorkerInitInfo(**self._shared_worker_fields(port), world_size=i.world_size,
                                  bucket_bytes=i.bucket_bytes)

    def _data_rank(self) -> tuple[int, int] | None:
        return (0, self.init_info.world_size) if self.is_sender else None

    def _handshake(self) -> None:
        # the workers check the agreed metadata against their model before joining
        self._init_digest = agree_on_metadata(self.comm, self.source.metadata, rank=self.rank,
                                              num_ranks=self.init_info.num_trainer_ranks)
        self._sent_digest: str | None = None
        self._buffers: list[torch.Tensor] = []
        self._total = 0
        self._baseline = Baseline.for_engine(self.init_info) if self.is_sender else None  # rank 0 sends
        self._loader_only: set[str] | None = None  # tensors some worker takes only through vLLM's loader

    def _preflight(self, verify: bool) -> tuple[list[ParamMeta], list[Bucket]]:
        metas = self.source.metadata
        check_metadata(metas)
        buckets = plan_buckets(metas, self.init_info.bucket_bytes)  # raises on every rank alike
        self._total = sum(b.nbytes for b in buckets)
        return metas, buckets

    def _lower_bound(self) -> dict[int, int]:
        return dict.fromkeys(range(self.init_info.world_size - 1), self._total)

    def _update_info(self, prepared: tuple[list[ParamMeta], list[Bucket]], verify: bool) -> NCCLUpdateInfo:
        metas, _ = prepared
        digest = metadata_digest(m.wire() for m in metas)
        wire = NCCLUpdateInfo.wire(metas) if digest != self._sent_digest else {}
        self._sending = digest, self._delta_base(digest)
        return NCCLUpdateInfo(sync_id=self.sync_id, digest=digest, verify=verify, delta_base=self._sending[1], **wire)

    def _transfer(self, prepared: tuple[list[ParamMeta], list[Bucket]], stats: SyncStats, verify: bool,
                  started: Callable[[], None]) -> None:
        started()
        metas, buckets = prepared
        stats.num_tensors, stats.num_steps = len(metas), len(buckets)
        if not self.is_sender:
            for _ in checked(self.source.iter_full(), metas):  # the source's gathers are collective
                pass
            return
        digest, base = self._sending  # (from _update_info)
        if base is None:
            tensors = (self._keep(m, t) for m, t in checked(self.source.iter_full(), metas))
        else:
            buckets, tensors = self._encode(metas, base, stats)
        checksum = self._broadcast(buckets, tensors, stats, self._update_call, verify)
        if self._baseline is not None and base is None:
            stats.delta = DeltaStats(base=None, dense_bytes=self._total, baseline_bytes=self._baseline.nbytes)
        if verify:
            self.comm.publish(SyncKeys(self.sync_id).sum, checksum)
        self._sent_digest = digest

    def send_weights(self, *, weight_version: str | None = None, verify: bool = False) -> SyncStats:
        stats = super().send_weights(weight_version=weight_version, verify=verify)
        if self._baseline is not None:  # every worker holds this sync now
            self._baseline.version = self.sync_id
        return stats

    # ---- delta sync (rank 0) -------------------------------------------------------------
    def _delta_base(self, digest: str) -> int | None:
        """The sync this one is a delta against: the baseline's, when every worker holds it and the
        metadata is the one the workers resolved at init; else None (dense, to every worker)."""
        b = self._baseline
        if b is None or b.version is None or digest != self._init_digest:
            if b is not None:
                b.version = None  # overwritten by this dense sync
            return None
        workers = range(self.init_info.world_size - 1)
        if len(self._holding(b.version, len(workers))) < len(workers):  # a broadcast: all or none
            b.version = None
            return None
        if self._loader_only is None:
            self._loader_only = set().union(*(self.comm.read(nccl_loader(w)) for w in workers))
        return b.version

    def _keep(self, meta: ParamMeta, tensor: torch.Tensor) -> torch.Tensor:
        """A dense sync's tensor, kept as the next delta's baseline (delta mode)."""
        if self._baseline is not None:
            self._baseline.keep(meta.name, tensor)
        return tensor

    def _encode(self, metas: list[ParamMeta], base: int, stats: SyncStats) -> tuple[list[Bucket], Any]:
        """Gather every tensor, compare it with the baseline and make it the baseline. Tensors every
        worker writes in place come first, each sparse (changed positions and values) where that is
        smaller, announced on the store; the others follow dense, for vLLM's loader."""
        t0, b = time.perf_counter(), self._baseline
        b.version = None
        first: list[tuple[ParamMeta, torch.Tensor]] = []
        entries: list[list[Any]] = []
        later: list[ParamMeta] = []
        changed = compared = 0
        for m, t in checked(self.source.iter_full(), metas):
            if m.name in self._loader_only or t.dim() == 0:
                b.keep(m.name, t)
                later.append(m)
                continue
            mask, vals = diff(t, b.tensors[m.name].to(t.device))
            kept = b.keep(m.name, t)
            changed, compared, n = changed + vals.numel(), compared + t.numel(), vals.numel()
            nbytes = sparse_nbytes([t.numel()], n, t.element_size())
            if nbytes < t.numel() * t.element_size():
                first.append((ParamMeta(m.name, torch.uint8, (nbytes,)), encode([(mask, vals)], t.element_size())))
                entries.append([m.name, n])
            else:
                first.append((m, kept))
                entries.append([m.name, -1])
        self.comm.publish(SyncKeys(self.sync_id).delta, entries)
        order = [m for m, _ in first] + later
        stats.delta = DeltaStats(base=base, workers=list(range(self.init_info.world_size - 1)), changed=changed,
                                 compared=compared, dense_bytes=self._total, diff_seconds=time.perf_counter() - t0,
                                 baseline_bytes=b.nbytes)
        tensors = [t for _, t in first] + [b.tensors[m.name] for m in later]
        return plan_buckets(order, self.init_info.bucket_bytes), iter(tensors)

    def _broadcast(self, buckets: list[Bucket], tensors: Iterator[torch.Tensor], stats: SyncStats, fut: Future,
                   verify: bool) -> int:
        """Pack ``tensors`` (in the buckets' entry order) and broadcast each bucket while the next is packed."""
        i = self.init_info
        if not self._buffers:
            self._buffers = [torch.empty(i.bucket_bytes, dtype=torch.uint8, device=i.device)
                             for _ in range(i.num_buffers)]
        works: list[Any] = [None] * len(self._buffers)
        checksum = 0
        for b, bucket in enumerate(buckets):
            slot = b % len(works)
            if works[slot] is not None:
                self.comm.data.wait_all([works[slot]], "bucket broadcast")
            buf = self._buffers[slot][: align_up(bucket.nbytes, ALIGN)]
            for entry in bucket.entries:
                pack(buf, entry, next(tensors))
            if b == len(buckets) - 1:
                next(tensors, None)  # lets `checked` report a source that yields too much
            if buf.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            if fut.done() and fut.exception() is not None:
                raise fut.exception()  # a worker failed: stop before blocking on it
            works[slot] = self.comm.data.broadcast(buf, 0)
            if verify:
                checksum = fold_checksum(checksum, buf[: bucket.nbytes])
            stats.bytes_sent += bucket.nbytes
        for w in works:
            if w is not None:
                self.comm.data.wait_all([w], "bucket broadcast")
        return checksum

    def shutdown(self, *, drain: bool = True) -> None:
        super().shutdown(drain=drain)
        self._buffers = []


class NCCLWorkerEngine(WorkerEngine[NCCLWorkerInitInfo, NCCLUpdateInfo]):
    """Broadcast worker engine: receives buckets and applies them through layerwise reload."""

    init_info_cls = NCCLWorkerInitInfo
    update_info_cls = NCCLUpdateInfo

    def _expected_workers(self, info: NCCLWorkerInitInfo) -> tuple[int, str]:
        return info.world_size - 1, f"world_size={info.world_size} (1 sender + workers)"

    def _init(self, info: NCCLWorkerInitInfo) -> None:
        self._metas: list[ParamMeta] = []
        self._digest: str | None = None
        # (rank 0 joins before publishing)
        self.comm.join(1 + self.worker_rank, info.world_size, device=self.device, plane=self.data_plane)
        dests = self._check_full_tensor_metadata()  # model agreement and coverage, before any bucket
        via = set(dests.via_loader)
        self._pieces: dict[str, list[Any]] = {}
        for p in dests.pieces:
            self._pieces.setdefault(p.name, []).append(p)
        loader_only = {f.name for f in dests.fallbacks} | {p.name for p in dests.pieces if p.param in via}
        self.comm.publish(nccl_loader(self.worker_rank), sorted(loader_only))  # delta syncs send these dense

    def _start(self, applier: LayerwiseApplier) -> None:
        applier.start(layerwise=False)  # a delta sync writes in place first; layerwise reload begins in _receive

    def _receive(self, u: NCCLUpdateInfo) -> int:
        if u.names:
            self._check_full_tensor_metadata(u.metas())  # before this sync's first bucket arrives
            self._metas = u.metas()
            self._digest = metadata_digest(m.wire() for m in self._metas)
        if u.digest != self._digest:
            raise ValueError(f"update_info.digest {u.digest!r} does not match this worker's metadata "
                             f"digest {self._digest!r}")
        if u.delta_base is None:
            self._applier.begin_layerwise()
            return self._receive_buckets(plan_buckets(self._metas, self.info.bucket_bytes), u,
                                         lambda buf, bucket: self._applier.load(unpack(buf, bucket)))
        self._check_holds(u.delta_base)
        entries = dict(self.comm.read(SyncKeys(u.sync_id).delta))  # name -> changed values (-1: dense), in order
        by_name = {m.name: m for m in self._metas}
        order = [by_name[n] if k < 0 else ParamMeta(
                     n, torch.uint8, (sparse_nbytes([math.prod(by_name[n].shape)], k, by_name[n].dtype.itemsize, [n]),))
                 for n, k in entries.items()] + [m for m in self._metas if m.name not in entries]
        params = {n: p.data for n, p in self.model.named_parameters()}

        def apply(buf: torch.Tensor, bucket: Bucket) -> None:
            later = []
            for name, t in unpack(buf, bucket):
                k, pieces, meta = entries.get(name), self._pieces.get(name, ()), by_name[name]
                if k is None:  # for vLLM's loader, after every in-place write
                    later.append((name, t))
                elif k < 0:
                    write_pieces(t, pieces, params)
                else:
                    (positions, values), = decode(t, [math.prod(meta.shape)], k, meta.dtype.itemsize, [name])
                    patch_pieces(meta.shape, positions, values, pieces, params)
            if later:
                if not self._applier.active:
                    self._applier.begin_layerwise()
                self._applier.load(later)

        return self._receive_buckets(plan_buckets(order, self.info.bucket_bytes), u, apply)

    def _receive_buckets(self, buckets: list[Bucket], u: NCCLUpdateInfo, apply: Any) -> int:
        """Receive every bucket (the next one arriving while ``apply(buf, bucket)`` runs on this one)."""

        def post(b: int) -> tuple[torch.Tensor, Any]:
            # A fresh buffer per bucket: layerwise reload may keep views until a layer is complete.
            buf = torch.empty(align_up(buckets[b].nbytes, ALIGN), dtype=torch.uint8, device=self.device)
            return buf, self.comm.data.broadcast(buf, 0)

        inflight = post(0) if buckets else None
        checksum = received = 0
        for b, bucket in enumerate(buckets):
            buf, work = inflight
            inflight = post(b + 1) if b + 1 < len(buckets) else None  # receive b+1 while applying b
            self.comm.data.wait_all([work], f"bucket {b} broadcast")
            received += bucket.nbytes
            if u.verify:
                checksum = fold_checksum(checksum, buf[: bucket.nbytes])
            apply(buf, bucket)
        if u.verify and (sent := self.comm.read(SyncKeys(u.sync_id).sum)) != checksum:
            raise ValueError(f"verify: worker {self.worker_rank} received buckets with checksum {checksum}, "
                             f"the sender sent {sent}")
        return received


TRANSPORT = Transport(
    name="weightsync_nccl", trainer_engine=NCCLTrainerEngine, worker_engine=NCCLWorkerEngine,
    init_info=NCCLTrainerInitInfo, source="full", colocated=False,
    summary="trainer rank 0 broadcasts packed buckets of full tensors to every worker of every replica",
    capabilities=Capabilities(delta=True, elastic=True))
