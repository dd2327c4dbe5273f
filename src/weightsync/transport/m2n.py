"""``nccl_m2n`` transport (``weightsync_m2n``): FSDP2 shards straight into live vLLM parameters.

Every trainer rank sends only the pieces of its local shards that each worker needs (the
``TransferPlan``), point to point, in rounds bounded by a staging bucket; workers copy each piece
into the live parameter's memory (no ``load_weights``, no all-gather anywhere). Tensors a worker
cannot place directly arrive whole and go through ``load_weights`` inside layerwise reload.

Data group: trainer ranks 0..T-1, then workers T..T+W-1 (worker w = replica * tp + tp rank).
Init handshake on the store, before any data: trainer rank 0 publishes the sources, each worker its
destinations, every rank builds the plan and all ranks agree on its digest.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch

from ..comm import Communicator
from ..layout.schedule import message_cap
from ..protocol import (
    SyncStats,
    TrainerEngine,
    TrainerInitInfo,
    WeightSource,
    WorkerInitInfo,
    WorkerUpdateInfo,
    default_device,
)
from ..sources import tensor_sources
from ..worker import LayerwiseApplier, WorkerEngine
from .m2n_exec import (
    FALLBACK,
    agree,
    dests_to_wire,
    gather_plan,
    my_messages,
    run_rounds,
    sources_from_wire,
    sources_to_wire,
)

__all__ = ["M2NTrainerInitInfo", "M2NWorkerInitInfo", "M2NUpdateInfo", "M2NTrainerEngine", "M2NWorkerEngine"]

DEFAULT_STAGING_BYTES = 256 << 20
_P = "m2n"


@dataclass(kw_only=True)
class M2NTrainerInitInfo(TrainerInitInfo):
    """Trainer side of the M2N reshard. Give the same values on every trainer rank."""

    backend: ClassVar[str] = "weightsync_m2n"
    num_trainer_ranks: int
    """Ranks of the trainer mesh (every one calls ``trainer_init`` and ``send_weights``)."""
    world_size: int
    """num_trainer_ranks + number of vLLM workers over all replicas."""
    dst_mesh_dims: tuple[int, int]
    """(replicas, tp) of the vLLM side; replicas * tp workers."""
    master_address: str
    """Host of the rendezvous store (trainer rank 0 hosts it)."""
    master_port: int
    """Free port for the store on ``master_address``."""
    staging_bytes: int = DEFAULT_STAGING_BYTES
    """Extra memory each rank may use to stage messages (bounds trainer and worker peaks)."""
    timeout_s: float = 300.0
    """Limit for every blocking step."""
    rollback: bool = True
    """Workers keep a host copy of their parameters during a sync and restore it on failure."""
    device: str = field(default_factory=default_device)
    """``"cuda"`` (NCCL) or ``"cpu"`` (gloo)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        dims = tuple(self.dst_mesh_dims)
        if len(dims) != 2 or any(not isinstance(d, int) or d < 1 for d in dims):
            raise ValueError(f"dst_mesh_dims must be (replicas, tp) of positive ints, got {self.dst_mesh_dims!r}")
        self.dst_mesh_dims = dims  # type: ignore[assignment]
        if self.num_trainer_ranks < 1 or self.rank >= self.num_trainer_ranks:
            raise ValueError(f"rank must be in [0, num_trainer_ranks={self.num_trainer_ranks}), got {self.rank}")
        if self.world_size != self.num_trainer_ranks + math.prod(dims):
            raise ValueError(f"world_size must be num_trainer_ranks + replicas * tp = "
                             f"{self.num_trainer_ranks + math.prod(dims)}, got {self.world_size}")
        message_cap(self.staging_bytes, self.num_trainer_ranks, math.prod(dims))  # raises when too small


@dataclass(kw_only=True)
class M2NWorkerInitInfo(WorkerInitInfo):
    """What workers receive in ``init_weight_transfer_engine`` (built by trainer rank 0)."""

    master_address: str
    master_port: int
    num_trainer_ranks: int
    world_size: int
    dst_mesh_dims: list[int]
    staging_bytes: int = DEFAULT_STAGING_BYTES
    timeout_s: float = 300.0
    rollback: bool = True


@dataclass(kw_only=True)
class M2NUpdateInfo(WorkerUpdateInfo):
    sync_id: int
    digest: str
    verify: bool = False
    """Workers check what they applied against the trainers' checksums of what they sent, and fail
    (rolling back) on any difference, before the sync can be finished."""


class _Plan:
    """What both engines keep from the handshake."""

    def __init__(self, comm: Communicator, sources: list[Any], num_trainers: int, num_workers: int,
                 staging_bytes: int, *, rank: int, sender: bool) -> None:
        self.sources = sources
        self.dtypes = {s.name: s.dtype for s in sources}
        self.gathered = gather_plan(comm, sources, num_workers, _P)
        self.digest = self.gathered.plan.digest
        agree(comm, f"{_P}/digest", self.digest, "plan digest")
        cap = message_cap(staging_bytes, num_trainers, num_workers)
        self.rounds = my_messages(self.gathered.plan, sources, rank=rank, sender=sender, cap=cap)
        self.staging = torch.empty(staging_bytes, dtype=torch.uint8, device=comm.device)


class M2NTrainerEngine(TrainerEngine):
    """M2N trainer engine; ``trainer_init`` and ``send_weights`` run on every trainer rank."""

    init_info_cls = M2NTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: M2NTrainerInitInfo, *, client: Any, source: WeightSource | None = None) -> "M2NTrainerEngine":
        if source is None:
            raise ValueError("source is required for the m2n transport (use DTensorModuleSource)")
        self = cls(init_info, client=client, source=source)
        i = init_info
        sources = tensor_sources(source.metadata)  # raises on every rank alike for a source without layout
        self.sync_id, self.comm = 0, None
        pool = ThreadPoolExecutor(1)
        fut = None
        if self.is_sender:
            winfo = M2NWorkerInitInfo(master_address=i.master_address, master_port=i.master_port,
                                      num_trainer_ranks=i.num_trainer_ranks, world_size=i.world_size,
                                      dst_mesh_dims=list(i.dst_mesh_dims), staging_bytes=i.staging_bytes,
                                      timeout_s=i.timeout_s, rollback=i.rollback)
            fut = pool.submit(client.init_weight_transfer_engine, asdict(winfo))
        try:
            self.comm = Communicator.from_tcp_store(i.master_address, i.master_port, i.rank, i.world_size,
                                                    device=i.device, timeout_s=i.timeout_s)
            wire = sources_to_wire(sources)
            if self.is_sender:
                self.comm.publish(f"{_P}/sources", wire)
            theirs = self.comm.read(f"{_P}/sources")
            if theirs != wire:
                first = next((a[0] for a, b in zip(wire, theirs) if a != b), "(count)")
                raise ValueError(f"parameter {first!r}: trainer rank {i.rank}'s metadata differs from trainer rank 0's")
            self.plan = _Plan(self.comm, sources, i.num_trainer_ranks, math.prod(i.dst_mesh_dims), i.staging_bytes,
                              rank=i.rank, sender=True)
            if fut is not None:  # every worker finished its init: tell the other trainer ranks
                fut.result(timeout=i.timeout_s)
                self.comm.publish(f"{_P}/init_done", True)
            else:
                self.comm.read(f"{_P}/init_done")  # raises a failure any rank or worker reported
        except BaseException as e:
            _report(self.comm, i.master_address, i.master_port, e)
            raise
        finally:
            pool.shutdown(wait=False)
        self._names = [s.name for s in sources]
        self._local_shapes = {s.name: s.regions[i.rank].sizes for s in sources}
        return self

    def _local_shards(self) -> dict[str, torch.Tensor]:
        """This rank's shards, checked against the plan's metadata (no collectives)."""
        metas = {m.name: m for m in self.source.metadata}
        shards: dict[str, torch.Tensor] = {}
        for name, t in self.source.iter_local():
            m = metas.get(name)
            if m is None or name in shards:
                raise ValueError(f"parameter {name!r}: the source yielded it but "
                                 f"{'already did' if m is not None else 'its metadata does not list it'}")
            want = self._local_shapes.get(name)
            if t.dtype != m.dtype or want is None or tuple(t.shape) != tuple(want):
                raise ValueError(f"parameter {name!r}: expected a local shard {m.dtype} {want}, "
                                 f"source yielded {t.dtype} {tuple(t.shape)}")
            shards[name] = t
        missing = [n for n in self._names if n not in shards]
        if missing:
            raise ValueError(f"parameter {missing[0]!r}: the source yielded no local shard for it")
        return shards

    def send_weights(self, *, weight_version: str | None = None, verify: bool = False) -> SyncStats:
        """Collective on every trainer rank; returns after every worker applied the weights. With
        ``verify``, every worker compares checksums of what it applied with what each trainer rank
        sent before the sync is finished (the weight version only advances when all match)."""
        comm = self.comm
        stats = SyncStats(backend="weightsync_m2n", rank=self.rank, weight_version=weight_version)
        self.sync_id += 1
        key = f"{_P}/sync{self.sync_id}"
        with stats.timed("preflight"):
            try:
                shards, error = self._local_shards(), ""
            except ValueError as e:
                shards, error = {}, str(e)
            comm.publish(f"{key}/ready/{self.rank}", error)
            errors = [comm.read(f"{key}/ready/{r}") for r in range(self.init_info.num_trainer_ranks)]
            if any(errors):  # nobody sends; workers are never asked to update
                raise ValueError(error or next(e for e in errors if e))
        pool, fut = ThreadPoolExecutor(1), None
        try:
            if self.is_sender:
                with stats.timed("start"):
                    self.client.start_weight_update()
                fut = pool.submit(self.client.update_weights, asdict(
                    M2NUpdateInfo(sync_id=self.sync_id, digest=self.plan.digest, verify=verify)))
            with stats.timed("transfer"):
                sums: dict[int, int] | None = {} if verify else None
                stats.bytes_sent = run_rounds(comm, self.plan.rounds, self.plan.staging, sender=True,
                                              peer_rank=lambda w: self.init_info.num_trainer_ranks + w,
                                              dtypes=self.plan.dtypes,
                                              tensor_of=lambda m, i: shards[m.items[i].name], sums=sums)
                if sums is not None:
                    comm.publish(f"{key}/sums/{self.rank}", {str(w): v for w, v in sums.items()})
                if fut is not None:
                    fut.result(timeout=self.init_info.timeout_s)
            if self.is_sender:
                with stats.timed("finish"):
                    self.client.finish_weight_update(weight_version)
                nw = self.plan.gathered.plan.num_dst_ranks
                stats.bytes_received_per_worker = {w: int(comm.read(f"{key}/recv/{w}")) for w in range(nw)}
                comm.publish(f"{key}/done", "ok")
        except BaseException as e:
            if self.is_sender:
                comm.publish(f"{key}/done", f"{type(e).__name__}: {e}")
            _report(comm, "", 0, e)
            raise
        finally:
            pool.shutdown(wait=False)
        if not self.is_sender and (verdict := comm.read(f"{key}/done")) != "ok":
            raise RuntimeError(f"weight sync {self.sync_id} failed on trainer rank 0: {verdict}")
        stats.verified = True if verify else None
        stats.num_tensors = len(self._names)
        stats.num_chunks = len(self.plan.rounds)
        stats.lower_bound_per_worker = dict(enumerate(self.plan.gathered.plan.coverage().lower_bound))
        return stats

    def shutdown(self) -> None:
        if self.comm is not None:
            self.comm.shutdown()
        self.comm = None


def _report(comm: Communicator | None, host: str, port: int, error: BaseException) -> None:
    """Wake every peer with this rank's failure (a failure that came from a peer cascades the
    connection close, so ranks blocked on this one wake too; the first report wins)."""
    message = f"{type(error).__name__}: {error}"
    try:
        if comm is not None and comm.store is not None:
            comm.fail(message)
        elif host:
            Communicator.report(host, port, message, timeout_s=10)
    except Exception:  # noqa: BLE001 - the store may be gone with its host; the timeout still applies
        pass


@torch.no_grad()
def _zero_uncovered(model: torch.nn.Module, pieces: Any) -> None:
    """Zero what no piece ever writes in a directly-written parameter (vocab padding rows), as
    vLLM's own loader does, so the live parameters equal what ``load_weights`` would give."""
    params = dict(model.named_parameters())
    covered: dict[str, int] = {}
    for p in pieces:
        covered[p.param] = covered.get(p.param, 0) + p.region.numel
    for name, n in covered.items():
        param = params[name]
        if n < param.numel():
            mask = torch.ones(param.shape, dtype=torch.bool, device=param.device)
            for p in pieces:
                if p.param == name:
                    mask[tuple(slice(o, o + s) for o, s in zip(p.param_offsets, p.region.sizes))] = False
            param.data.masked_fill_(mask, 0)


class M2NWorkerEngine(WorkerEngine):
    """M2N worker engine: receives its pieces into live parameters (fallbacks via ``load_weights``)."""

    init_info_cls = M2NWorkerInitInfo
    update_info_cls = M2NUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.comm: Communicator | None = None
        self.plan: _Plan | None = None
        self._applier: LayerwiseApplier | None = None

    def init_transfer_engine(self, init_info: M2NWorkerInitInfo) -> None:

        self.shutdown()
        self.info, self.poisoned = init_info, None
        try:
            self._init(init_info)
        except BaseException as e:
            _report(self.comm, init_info.master_address, init_info.master_port, e)
            raise

    def _init(self, init_info: M2NWorkerInitInfo) -> None:
        from ..destinations import resolve_destinations

        replicas, tp = init_info.dst_mesh_dims
        w = self.worker_rank
        if w >= replicas * tp:
            raise ValueError(f"worker rank {w} is outside dst_mesh_dims={tuple(init_info.dst_mesh_dims)} "
                             f"(replicas x tp = {replicas * tp} workers)")
        self.comm = Communicator.from_tcp_store(init_info.master_address, init_info.master_port,
                                                init_info.num_trainer_ranks + w, init_info.world_size,
                                                device=self.device, timeout_s=init_info.timeout_s)
        sources = sources_from_wire(self.comm.read(f"{_P}/sources"))
        try:
            dests = resolve_destinations(self.model, [(s.name, s.dtype, list(s.shape)) for s in sources])
            self.comm.publish(f"{_P}/dest/{w}", dests_to_wire(dests))
        except Exception as e:
            self.comm.publish(f"{_P}/dest/{w}", {"error": f"{type(e).__name__}: {e}"})
            raise
        self.plan = _Plan(self.comm, sources, init_info.num_trainer_ranks, replicas * tp, init_info.staging_bytes,
                          rank=w, sender=False)
        self.fallbacks = self.plan.gathered.fallbacks[w]
        self._pieces, self._zeroed = dests.pieces, False

    def start_weight_update(self) -> None:
        self._check_not_poisoned()
        if self.plan is None:
            raise RuntimeError("init_transfer_engine must run before start_weight_update")
        self._applier = LayerwiseApplier(self.model, self.model_config, rollback=self.info.rollback)
        self._applier.start(layerwise=False)  # direct writes first; layerwise reload only for fallbacks

    def receive_weights(self, update_info: M2NUpdateInfo) -> None:
        self._check_not_poisoned()
        if self._applier is None or self.plan is None:
            raise RuntimeError("start_weight_update must run before update_weights")
        try:
            if update_info.digest != self.plan.digest:
                raise ValueError(f"update_info.digest {update_info.digest!r} is not this worker's plan digest "
                                 f"{self.plan.digest!r}; re-run init_weight_transfer_engine")
            params = {n: p.data for n, p in self.model.named_parameters()}
            by_name = {s.name: s for s in self.plan.sources}
            for name, _ in self.fallbacks:
                s = by_name[name]
                params[FALLBACK + name] = torch.empty(s.shape, dtype=getattr(torch, s.dtype), device=self.device)
            sums: dict[int, int] | None = {} if update_info.verify else None
            moved = run_rounds(self.comm, self.plan.rounds, self.plan.staging, sender=False,
                               peer_rank=lambda r: r, dtypes=self.plan.dtypes,
                               tensor_of=lambda m, i: params[m.items[i].param], sums=sums)
            if sums is not None:
                self._verify(update_info.sync_id, sums)
            if not self._zeroed:  # first sync since init: padding as load_weights leaves it
                _zero_uncovered(self.model, self._pieces)
                self._zeroed = True
            self.comm.publish(f"{_P}/sync{update_info.sync_id}/recv/{self.worker_rank}", moved)
            if self.fallbacks:
                self._applier.begin_layerwise()
                self._applier.load([(n, params.pop(FALLBACK + n)) for n, _ in self.fallbacks])
        except BaseException as e:
            self.poisoned = f"{type(e).__name__}: {e}"
            _report(self.comm, "", 0, e)
            self._applier.abort()
            self._applier = None
            raise

    def _verify(self, sync_id: int, applied: dict[int, int]) -> None:
        """Compare what this worker applied from each trainer rank with what that rank sent."""
        w = str(self.worker_rank)
        for src in range(self.info.num_trainer_ranks):
            sent = self.comm.read(f"{_P}/sync{sync_id}/sums/{src}").get(w)
            if sent != applied.get(src):
                raise ValueError(f"verify: worker {w} applied data from trainer rank {src} with checksum "
                                 f"{applied.get(src)}, the trainer sent {sent}")

    def finish_weight_update(self) -> None:
        self._check_not_poisoned()
        if self._applier is None:
            raise RuntimeError("finish_weight_update without start_weight_update")
        self._applier.finish()
        self._applier = None

    def shutdown(self) -> None:
        if self._applier is not None:
            self._applier.abort()
        self._applier = None
        if self.comm is not None:
            self.comm.shutdown()
        self.comm, self.plan = None, None
