"""Init and update infos: typed, frozen, parsed from the JSON-safe dicts vLLM's API passes.

Names mirror vLLM 0.33's trainer API (``vllm.distributed.weight_transfer``) so that users switch by
import. :func:`parse_info` turns a wrongly typed or unknown field into a ``ValueError`` naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from .protocol import ParamMeta, default_device, dtype_from_name

TAKEN_OVER = "took this engine over"
"""What a worker's report says when another trainer session's init took it over mid-update."""

__all__ = ["TAKEN_OVER", "TrainerInitInfo", "WorkerInitInfo", "WorkerUpdateInfo", "MetadataUpdateInfo", "parse_info"]

T = TypeVar("T")


def _type_error(value: Any, hint: Any) -> str | None:
    """Why ``value`` does not fit the annotation ``hint`` (JSON-safe kinds only), or None."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return None
    if origin in (typing.Union, types.UnionType):
        reasons = [_type_error(value, a) for a in args]
        return None if any(r is None for r in reasons) else next(r for r in reasons if r)
    if hint is type(None):
        return None if value is None else "must be null"
    if hint is bool:
        return None if isinstance(value, bool) else "must be a bool"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "must be an int"
    if hint is float:
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "must be a number"
    if hint is str:
        return None if isinstance(value, str) else "must be a str"
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return "must be a list"
        inner = args[0] if args and (origin is list or (len(args) == 2 and args[1] is Ellipsis)) else None
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                return f"must have {len(args)} elements"
            return next((f"element {i} {r}" for i, (v, a) in enumerate(zip(value, args))
                         if (r := _type_error(v, a))), None)
        return None if inner is None else next(
            (f"element {i} {r}" for i, v in enumerate(value) if (r := _type_error(v, inner))), None)
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            return "must be a dict"
        if len(args) == 2:
            return next((f"entry {k!r} {r}" for k, v in value.items()
                         if (r := _type_error(k, args[0]) or _type_error(v, args[1]))), None)
    return None


def parse_info(cls: type[T], data: Mapping[str, Any] | T, what: str = "info") -> T:
    """Build dataclass ``cls`` from a JSON-safe dict: unknown, missing and wrongly typed fields
    raise ``ValueError`` naming the field (before any value reaches torch)."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ValueError(f"{what} for {cls.__name__} must be a dict, got {type(data).__name__}")
    fields_ = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields_))
    if unknown:
        raise ValueError(f"{what} for {cls.__name__}: unknown field(s) {unknown}; expected {sorted(fields_)}")
    hints = _hints(cls)
    for name, value in data.items():
        if (reason := _type_error(value, hints.get(name, Any))) is not None:
            raise ValueError(f"{what} for {cls.__name__}: field {name!r} {reason}, got {value!r:.80}")
    try:
        return cls(**data)
    except TypeError as e:
        raise ValueError(f"{what} for {cls.__name__}: {e}") from e


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # ~0.2 ms a call, once per class


def _check_port(name: str, port: Any, *, required: bool) -> None:
    if port is None and not required:
        return
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"{name} must be a port number in [0, 65535]{'' if required else ' or None'}, got {port!r}")


@dataclass(kw_only=True, frozen=True)
class TrainerInitInfo:
    """Base of every trainer-side init info: the fields every transport shares. ``backend``
    selects the engine. Give the same values on every trainer rank (``rank`` aside)."""

    backend: ClassVar[str] = ""
    rank: int
    """This trainer process's rank, 0 <= rank < num_trainer_ranks (rank 0 drives the client)."""
    num_trainer_ranks: int = 1
    """Trainer ranks taking part in every sync (each calls ``trainer_init`` and ``send_weights``)."""
    master_address: str = "127.0.0.1"
    """Host of the sync group's rendezvous store; trainer rank 0 hosts it, so it is rank 0's address."""
    master_port: int | None = None
    """Free port for the store on ``master_address``; None picks one (one trainer rank only)."""
    timeout_s: float = 300.0
    """Limit for every blocking step (rendezvous, each transfer wait, each client call)."""
    rollback: bool = False
    """Workers keep a host copy of their parameters during a sync and restore it on failure (a
    model-sized copy per sync). Off (the default): a sync that fails after data moved leaves the
    engines poisoned with weights possibly partly updated (``SyncFailed.restored`` is False): they
    refuse every sync until re-initialized, keep reporting the last complete version, and
    ``clients.paused`` keeps their generation paused, so no request is served from those weights."""
    device: str = field(default_factory=default_device)
    """``"cuda"`` (NCCL data plane, CUDA IPC) or ``"cpu"`` (gloo, shared memory)."""
    cast_dtypes: bool = False
    """Let a tensor's wire dtype differ from vLLM's parameter dtype (floating point only; the workers
    cast on receive, as vLLM's loader does). Off: a mismatch fails at init naming the parameter."""
    partial: tuple[str, ...] = ()
    """vLLM parameter names (or module prefixes, e.g. ``"lm_head"``) a sync may leave unwritten;
    any other parameter a sync does not fully write fails it at init (coverage)."""
    delta: bool = False
    """Delta sync (``weightsync_m2n``, ``weightsync_nccl``): the sender keeps the last version it
    sent (in the wire dtype, on ``delta_baseline``; M2N: each rank its shards, broadcast: rank 0 the
    full model) and sends what changed as positions and values where that is smaller, to workers
    that hold that version; the first sync after init, and any worker that does not hold it, get it
    dense (broadcast: every worker, if any does not). Destinations vLLM post-processes, and
    fallbacks, always get it dense. ``SyncStats.delta`` says what changed and what was sent."""
    delta_baseline: str = "cpu"
    """Where the delta baseline lives: ``"cpu"`` (host memory) or ``"device"`` (the trainer's device)."""
    take_over: bool = False
    """Take the engines over from the trainer session they are bound to (the last init of another
    trainer that has not shut down): an update of that session still active is waited for (up to half
    of ``timeout_s``), then aborted as its failure (its ranks raise ``SyncFailed`` saying so). Off: an
    init to engines bound to a live session is refused, naming both sessions."""
    require_paused: bool = True
    """A sync refuses to start (``Refused``, on every trainer rank, before anything moves) unless every
    engine reports its generation paused (``client.pause_generation()`` or ``clients.paused``);
    False allows syncs while the engines serve (requests may then run on half-written weights)."""
    drafter: str = "synced"
    """An engine with a speculative-decoding drafter (MTP layers, an EAGLE head; docs/drafter.md): ``"synced"``
    (the default) writes the drafter's parameters too, from the tensors the source sends under the drafter
    checkpoint's names (an init that sends none of them is refused, naming the drafter and its parameters);
    ``"frozen"`` says this trainer trains no drafter: the engine keeps it as it is, on purpose."""

    on_engine_failure: str = "fail"
    """``"fail"`` (all-or-nothing): a worker's failure fails the sync on every replica. ``"drop"``:
    one sync group per replica (one fanned-out group of them all where ``fans_out()``; docs/elastic.md);
    a replica whose worker fails or does not answer within ``timeout_s`` is dropped (its update aborted,
    it is poisoned, ``SyncStats.dropped`` says why), every other replica completes the sync, and
    replicas can be added and removed between syncs."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.on_engine_failure not in ("fail", "drop"):
            raise ValueError(f"{name}.on_engine_failure must be 'fail' or 'drop', got {self.on_engine_failure!r}")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ValueError(f"{name}.rank must be an int >= 0, got {self.rank!r}")
        if not isinstance(self.num_trainer_ranks, int) or self.num_trainer_ranks < 1:
            raise ValueError(f"{name}.num_trainer_ranks must be an int >= 1, got {self.num_trainer_ranks!r}")
        if self.rank >= self.num_trainer_ranks:
            raise ValueError(f"{name}.rank must be in [0, num_trainer_ranks={self.num_trainer_ranks}), got {self.rank}")
        if not isinstance(self.master_address, str) or not self.master_address:
            raise ValueError(f"{name}.master_address must be a host name or address, got {self.master_address!r}")
        _check_port(f"{name}.master_port", self.master_port, required=False)
        if self.master_port is None and self.num_trainer_ranks > 1:
            raise ValueError(f"{name}.master_port is required when num_trainer_ranks={self.num_trainer_ranks} > 1")
        if not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"{name}.timeout_s must be > 0, got {self.timeout_s!r}")
        if not isinstance(self.rollback, bool):
            raise ValueError(f"{name}.rollback must be a bool, got {self.rollback!r}")
        if not isinstance(self.device, str) or self.device.partition(":")[0] not in ("cuda", "cpu"):
            raise ValueError(f"{name}.device must be 'cuda' or 'cpu', got {self.device!r}")
        if not isinstance(self.cast_dtypes, bool):
            raise ValueError(f"{name}.cast_dtypes must be a bool, got {self.cast_dtypes!r}")
        if isinstance(self.partial, str) or not isinstance(self.partial, (list, tuple)) or not all(
                isinstance(p, str) and p for p in self.partial):
            raise ValueError(f"{name}.partial must be a tuple of vLLM parameter names, got {self.partial!r}")
        self._set(partial=tuple(self.partial))
        if not isinstance(self.delta, bool):
            raise ValueError(f"{name}.delta must be a bool, got {self.delta!r}")
        if not isinstance(self.require_paused, bool):
            raise ValueError(f"{name}.require_paused must be a bool, got {self.require_paused!r}")
        if self.delta_baseline not in ("cpu", "device"):
            raise ValueError(f"{name}.delta_baseline must be 'cpu' or 'device', got {self.delta_baseline!r}")
        if self.drafter not in ("synced", "frozen"):
            raise ValueError(f"{name}.drafter must be 'synced' or 'frozen', got {self.drafter!r}")
        if not isinstance(self.take_over, bool):
            raise ValueError(f"{name}.take_over must be a bool, got {self.take_over!r}")
        if self.delta and self.cast_dtypes:
            raise ValueError(f"{name}.delta needs the wire dtype to be the parameters' dtype, not cast_dtypes=True: "
                             "cast on the sender instead (the source's dtype=...)")

    def _set(self, **values: Any) -> None:
        """Normalize fields in ``__post_init__`` (the info is frozen)."""
        for k, v in values.items():
            object.__setattr__(self, k, v)

    @classmethod
    def for_deployment(cls, *, num_trainer_ranks: int, replicas: int, tp: int, pp: int = 1, rank: int = 0,
                       buffer_bytes: int | None = None, **fields: Any) -> TrainerInitInfo:
        """The init info for ``num_trainer_ranks`` trainer ranks and ``replicas`` engines of ``tp`` x ``pp``
        workers each (``pp``: the engines' ``pipeline_parallel_size``); ``buffer_bytes`` sets the
        transport's staging/bucket size, ``fields`` any other field."""
        raise NotImplementedError(f"{cls.__name__} does not implement for_deployment")

    def replica_workers(self, num_replicas: int) -> int:
        """Workers per replica when the client drives ``num_replicas`` engines (``on_engine_failure="drop"``)."""
        raise ValueError(f"{type(self).__name__}.on_engine_failure='drop' needs one sync group per replica, "
                         f"which {self.backend} does not have (weightsync.registry.transports_with('elastic') "
                         f"lists the transports that do)")

    def for_replica(self, tp: int, port: int) -> TrainerInitInfo:
        """This info for one replica of ``tp`` workers, its group's store on ``port``."""
        self.replica_workers(1)  # raises for a transport without per-replica groups
        raise NotImplementedError(f"{type(self).__name__} does not implement for_replica")

    def fans_out(self) -> bool:
        """Whether the trainers send one replica's worth and the workers forward it to the others (then
        ``on_engine_failure="drop"`` keeps one group over every replica: ``for_replicas``)."""
        return False

    def for_replicas(self, replicas: int, tp: int, port: int) -> TrainerInitInfo:
        """This info for one group of ``replicas`` replicas of ``tp`` workers (all-or-nothing), its store on
        ``port``: the fanned-out group of ``on_engine_failure="drop"`` (``fans_out``)."""
        raise NotImplementedError(f"{type(self).__name__} does not fan out to replicas")


@dataclass(kw_only=True)
class WorkerInitInfo:
    """Base of worker-side init infos (what ``init_weight_transfer_engine`` receives; built by
    trainer rank 0, JSON-safe)."""

    master_address: str
    """Host of the sync group's store (trainer rank 0)."""
    master_port: int
    """Port of the sync group's store."""
    timeout_s: float = 300.0
    """Limit for every blocking step."""
    rollback: bool = False
    """Keep a host copy of the parameters during a sync and restore it on failure."""
    transport: str = ""
    """The transport this info is for (weightsync's trainer engines fill it in): a worker engine refuses
    an info for another transport, and vLLM's ``weightsync`` backend builds the engine it names."""
    engine_index: int = 0
    """Which engine of the client's list this one is (weightsync's clients set it per engine):
    separate engines all have vLLM's ``data_parallel_index == 0``."""
    num_engines: int | None = None
    """How many engines the client drives (set by weightsync's clients), to check the deployment."""
    cast_dtypes: bool = False
    """Cast float tensors whose dtype differs from the parameter's (else the model check refuses them)."""
    partial: list[str] = field(default_factory=list)
    """vLLM parameter names (or module prefixes) a sync may leave unwritten (coverage check)."""
    session: str = ""
    """The trainer session (a random token trainer rank 0 draws at each init): the worker is bound to it
    until it shuts down; an init of another session is refused unless it asks ``take_over`` ("": none)."""
    take_over: bool = False
    """This init takes the worker over from the session it is bound to (``TrainerInitInfo.take_over``)."""
    drafter: str = "synced"
    """``"frozen"``: keep vLLM's speculative-decoding drafter as it is (``TrainerInitInfo.drafter``)."""
    store_group: str = ""
    """The id (hex) of the sealed store's group, which its host drew (``Communicator.group``): the worker
    refuses a store that says another ("": a store without a secret)."""

    def __post_init__(self) -> None:
        _check_port("init_info.master_port", self.master_port, required=True)
        if self.engine_index < 0 or (self.num_engines is not None and not 0 <= self.engine_index < self.num_engines):
            raise ValueError(f"init_info.engine_index must be in [0, num_engines={self.num_engines}), "
                             f"got {self.engine_index}")


@dataclass(kw_only=True)
class WorkerUpdateInfo:
    """Base of worker-side update infos (what ``update_weights`` receives)."""

    sync_id: int = 0
    """The trainer's sync counter (1, 2, ...)."""
    digest: str = ""
    """What both sides must agree on before data moves (plan or metadata digest)."""
    verify: bool = False
    """Compare checksums of what was applied with what the trainers sent before the sync finishes."""
    abort: str | None = None
    """Set when the trainer gave up on the sync: the worker restores its parameters and raises."""
    session: str = ""
    """The trainer session sending it (an abort always says): a worker bound to another session ignores it."""


@dataclass(kw_only=True)
class MetadataUpdateInfo(WorkerUpdateInfo):
    """An update that carries the tensors' metadata when it changed (empty lists: the previous one)."""

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names, dtype_names and shapes must have equal lengths, got "
                             f"{len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)}")

    def metas(self) -> list[ParamMeta]:
        return [ParamMeta(n, dtype_from_name(d), tuple(s))
                for n, d, s in zip(self.names, self.dtype_names, self.shapes)]

    @staticmethod
    def wire(metas: list[ParamMeta]) -> dict[str, list[Any]]:
        """The metadata fields for ``metas``."""
        recs = [m.wire() for m in metas]
        return {"names": [r["name"] for r in recs], "dtype_names": [r["dtype"] for r in recs],
                "shapes": [r["shape"] for r in recs]}
