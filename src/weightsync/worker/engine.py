"""The transport core, worker side: the lifecycle every transport's worker engine shares.

As vLLM's worker calls it: ``init_transfer_engine`` connects to the trainer's store, checks the
deployment and runs ``_init`` (which checks the trainer's metadata against the model and for
coverage, ``_check_model``, before any data moves); ``start_weight_update`` opens a :class:`LayerwiseApplier`;
``receive_weights`` runs ``_receive`` (it returns the bytes its data plane delivered, which the worker
publishes) or, for an abort, rolls back; any failure poisons the engine (it refuses updates until
re-initialized) and is reported to every party of the group through the store.

During a sync, failures are reported on the store, not raised into vLLM: vLLM's multiprocess executor
stops reading the other workers' replies at the first worker error, and those replies then answer its
next calls (at TP >= 2 every later ``collective_rpc`` is off by one). So ``init_transfer_engine`` (once
connected to the store) and ``update_weights`` return after a failure or an abort (the trainer ranks
read it from the store), and ``finish_weight_update`` of a failed or aborted update only leaves it
(vLLM's worker then clears its active-update flag).

Trainer sessions are fenced. At init (:meth:`WorkerEngine.fence`): a worker bound to a live session refuses
another session's init, and an init repeating the bound session, unless it asks ``take_over``. Then every
call (:meth:`WorkerEngine.fence_call`): an update or abort must carry the bound session; a start, a finish
and an abort must match what the bound session's trainer rank 0 announced on its store
(:func:`weightsync.control.announced`), since vLLM's start and finish carry nothing. A start or finish that
does not is refused (``ValueError`` naming the sessions: vLLM keeps its update state as it was); an update
or abort that does not is ignored with a warning naming them (raising would make vLLM's worker leave the
live update). With a shared secret the announcements are sealed, so only a party holding the secret can
make a worker start or finish; without one the fence guards against accidents (docs/security.md).

Hooks: ``_expected_workers`` (for the deployment check), ``_init``, ``_start`` (optional), ``_receive``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Generic, Protocol, TypeVar

import torch

from ..comm import Communicator, describe
from ..control import SyncKeys, announced, model_metas
from ..dataplane import PlaneFactory
from ..dataplane.torch_group import TorchGroupPlane
from ..errors import PoisonedError
from ..infos import TAKEN_OVER, WorkerInitInfo, WorkerUpdateInfo, parse_info
from ..registry import TRANSPORTS, Transport, transport, transports_with
from .agreement import Fingerprint, fingerprint, weights_changed
from .applier import LayerwiseApplier
from .drafter import NOT_FOUND, WithDrafter, drafter_bytes, find_drafter, require_drafter
from .fp8 import refuse_full_tensors

if TYPE_CHECKING:
    from ..plan.buckets import WireMeta
    from ..protocol import ParamMeta
    from .destinations import WorkerDestinations

__all__ = ["ParallelLayout", "WorkerEngine"]

_log = logging.getLogger(__name__)
FENCED = "a call its trainer session did not announce"
"""In every refusal of ``fence_call``: the HTTP front answers 409 for it (``vllm_http.OUT_OF_ORDER``)."""

Json = dict[str, object]
TInit = TypeVar("TInit", bound=WorkerInitInfo)
TUpdate = TypeVar("TUpdate", bound=WorkerUpdateInfo)


class ParallelLayout(Protocol):
    """What the engine reads of vLLM's ``ParallelConfig`` (and ``data_parallel_size`` / ``data_parallel_index``
    where it has them: read with defaults, as a test's stand-in may lack them)."""

    @property
    def world_size(self) -> int: ...
    @property
    def rank(self) -> int: ...


def _wire(metas: Sequence[ParamMeta | WireMeta]) -> list[WireMeta]:
    """The JSON-safe metadata of ``metas``."""
    return [m if isinstance(m, dict) else m.wire() for m in metas]


class WorkerEngine(Generic[TInit, TUpdate]):
    """Base of weightsync's worker engines: the lifecycle every transport shares; a transport
    implements the hooks listed in the module docstring, typed by its init info ``TInit`` and update info
    ``TUpdate``. Constructor and methods match vLLM's ``WeightTransferEngine[TInitInfo, TUpdateInfo]`` (the
    plugin mixes vLLM's ABC in: ``weightsync.integrations.vllm_plugin``)."""

    # (set on the class; not ClassVar, which cannot hold a type variable)
    init_info_cls: type[TInit]
    update_info_cls: type[TUpdate]
    spec: ClassVar[Transport]
    """The transport's declaration, set when it is declared (``weightsync.registry``)."""
    data_plane: ClassVar[PlaneFactory] = TorchGroupPlane
    """The data plane this worker joins (its trainer engine names the same)."""
    supports_draft_weight_update: ClassVar[bool] = False
    defers_processing: ClassVar[bool] = False
    # one sync's state, set by ``start_weight_update`` (read only while its applier is open)
    phases: dict[str, float]
    _sync_id: int | None

    def __init__(self, config: object, vllm_config: object, device: torch.device, model: torch.nn.Module) -> None:
        """``config``: vLLM's ``WeightTransferConfig``; ``vllm_config``: its ``VllmConfig``, whose ``parallel_config``
        (:class:`ParallelLayout`) and ``model_config`` (handed on to vLLM's layerwise reload) are read if present."""
        self.config = config
        self.vllm_config = vllm_config
        self.parallel_config: ParallelLayout | None = getattr(vllm_config, "parallel_config", None)
        self.model_config: object = getattr(vllm_config, "model_config", None)
        self.device = torch.device(device)
        self.model = model
        self._default_model, self._default_model_config = model, self.model_config
        self._target = model
        # vLLM's speculative-decoding drafter, if any (``NOT_FOUND``: one this cannot reach)
        self._drafter: torch.nn.Module | str | None = find_drafter(model, vllm_config)
        self.drafter_bytes: int | None = None
        """Bytes of the drafter's own parameters a sync writes on this worker (None: no drafter synced)."""
        self.poisoned: str | None = None
        self.comm: Communicator | None = None
        self.info: TInit | None = None
        self._applier: LayerwiseApplier | None = None
        self._received = 0
        self._failed_sync: int | None = None
        self._aborted = False
        self.held: int | None = None
        """The sync whose weights this worker holds, complete (None: none under this init, or a sync
        failed or was aborted since). A delta sync is sent only to workers that hold its base."""
        self._fingerprint: Fingerprint | None = None  # the model's parameters at the last finish (``fingerprint``)
        self._lost = ""  # why the base was dropped, for the delta's refusal
        self._started_sync: int | None = None  # the sync of the update started here (``fence_call``)
        self._last_started = 0  # the last sync started under this init: a start must announce a later one
        self._started_before = 0  # the one before it (an abort before any data lets the same sync start again)
        # the metadata digest ``_check_full_tensor_metadata`` last checked under this init, and its destinations
        self._checked: tuple[str, WorkerDestinations] | None = None

    # ---- vLLM worker plumbing -------------------------------------------------------------
    def set_weight_update_target(self, model: torch.nn.Module, model_config: object) -> None:
        self.model, self.model_config = model, model_config

    def reset_weight_update_target(self) -> None:
        self.model, self.model_config = self._default_model, self._default_model_config

    def drain_pending(self) -> None:
        """Nothing is deferred: ``update_weights`` returns after the weights are applied."""

    def parse_update_info(self, update_dict: Json) -> TUpdate:
        return parse_info(self.update_info_cls, update_dict, "update_info")

    def _check_not_poisoned(self) -> None:
        if self.poisoned is not None:
            raise PoisonedError(f"{type(self).__name__} refuses updates after a failed sync "
                                f"({self.poisoned}); re-initialize from the trainer: TrainerEngine.trainer_init on "
                                "every trainer rank, which calls init_weight_transfer_engine on every engine")

    @property
    def _info(self) -> TInit:
        """The init info (hooks and syncs run only after ``init_transfer_engine`` set it)."""
        if self.info is None:
            raise RuntimeError("init_transfer_engine must run first")
        return self.info

    @property
    def _comm(self) -> Communicator:
        """The store channel (connected by ``init_transfer_engine`` before any hook runs)."""
        if self.comm is None:
            raise RuntimeError("init_transfer_engine must run first")
        return self.comm

    # ---- hooks ------------------------------------------------------------------------
    def _expected_workers(self, info: TInit) -> tuple[int, str]:
        """Workers over all engines that ``info`` describes, and the field that says so."""
        raise NotImplementedError

    def _init(self, info: TInit) -> None:
        """Join the data plane, resolve destinations, ... (after the deployment checks)."""

    def _start(self, applier: LayerwiseApplier) -> None:
        """Prepare a sync (default: enter layerwise reload at once)."""
        applier.start()

    def _receive(self, update: TUpdate) -> int:
        """Receive and apply; returns the bytes the data plane delivered."""
        raise NotImplementedError

    # ---- shared by the transports -------------------------------------------------------
    def _check_model(self, metas: Sequence[ParamMeta | WireMeta]) -> WorkerDestinations:
        """The model agreement and coverage check (:func:`weightsync.worker.agreement.check_model`) of the
        trainer's metadata (``ParamMeta`` or ``{name, dtype, shape}``) against this worker's model;
        returns the destinations. Before any data of the sync moves."""
        from .agreement import check_model

        triples = [(m["name"], m["dtype"], m["shape"]) for m in _wire(metas)]
        require_drafter(self.model, triples)
        info = self._info
        dests = check_model(self.model, triples, cast_dtypes=info.cast_dtypes, partial=tuple(info.partial),
                            source=type(self).spec.source)
        self.drafter_bytes = drafter_bytes(self.model, dests, triples) if isinstance(self.model, WithDrafter) else None
        return dests

    def _use_drafter(self, info: WorkerInitInfo) -> None:
        """Sync the drafter beside the target (the model every hook works on becomes :class:`WithDrafter`),
        or keep it as it is when the trainer declared it frozen; refused when vLLM has one this cannot reach."""
        drafter, self.drafter_bytes = self._drafter, None
        if drafter == NOT_FOUND and info.drafter != "frozen":
            raise ValueError("vLLM's engine runs speculative decoding with a draft model that weightsync cannot reach "
                             "(no vLLM worker on the call stack answered get_draft_model()): call "
                             "weightsync.worker.drafter.attach_drafter(target, drafter) where the models are built, "
                             "or declare drafter='frozen' in the trainer's init info")
        if not isinstance(drafter, torch.nn.Module) or info.drafter == "frozen":
            model: torch.nn.Module = self._target
        elif isinstance(self._default_model, WithDrafter) and self._default_model.drafter is drafter:
            model = self._default_model
        else:
            model = WithDrafter(self._target, drafter)
        self.model = self._default_model = model

    def _check_full_tensor_metadata(self, metas: list[ParamMeta] | None = None) -> WorkerDestinations:
        """Full-tensor transports: check the metadata trainer rank 0 published at init (``None``) or
        an update's, unless it is the one already checked; returns its destinations."""
        from ..plan.buckets import metadata_digest

        wire: list[WireMeta] = self._comm.read(model_metas(0)) if metas is None else _wire(metas)
        digest = metadata_digest(wire)
        if self._checked is None or digest != self._checked[0]:
            dests = self._check_model(wire)
            spec = type(self).spec
            if not spec.capabilities.fp8_targets:  # block-FP8 targets need workers that quantize
                refuse_full_tensors(dests, spec.name, transports_with("fp8_targets"))
            self._checked = digest, dests
        return self._checked[1]

    # ---- vLLM's worker calls ------------------------------------------------------------
    def parse_init_info(self, init_dict: Json) -> TInit:
        """The typed init info; an info for another transport is refused naming both. A refused info
        connects nowhere (the host and port it names are not trusted): the client's init call raises,
        and trainer rank 0 reports it to the other ranks."""
        return self._parse_init_info(init_dict)

    def _parse_init_info(self, init_dict: Json) -> TInit:
        named = init_dict.get("transport") if isinstance(init_dict, dict) else None
        if named:
            own = type(self).spec.name
            if named != own:
                if isinstance(named, str) and named not in TRANSPORTS:
                    transport(named)  # ValueError listing the transports
                raise ValueError(f"init_info.transport is {named!r}, but this vLLM engine's weight-transfer backend "
                                 f"is {own!r}: start vLLM with WeightTransferConfig(backend={named!r}), or "
                                 "backend='weightsync' to serve any weightsync transport")
        return parse_info(self.init_info_cls, init_dict, "init_info")

    @property
    def worker_rank(self) -> int:
        """This worker's rank over every engine: (engine, DP replica) index * (TP x PP) + rank."""
        pc = self.parallel_config
        if pc is None:
            return 0
        engine = self.info.engine_index if self.info is not None else 0
        dp_size = int(getattr(pc, "data_parallel_size", 1) or 1)
        replica = engine * dp_size + int(getattr(pc, "data_parallel_index", 0) or 0)
        return replica * int(pc.world_size) + int(pc.rank)

    def update_weights(self, update_info: Json) -> None:
        """vLLM's entry point: a malformed update info fails the sync like any receive error (reported,
        not raised: see the module docstring)."""
        try:
            parsed = self.parse_update_info(update_info)
        except ValueError as e:
            self._fail(e)
            return
        self.receive_weights(parsed)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def init_transfer_engine(self, init_info: TInit) -> None:
        try:
            self.fence(init_info)
        except ValueError as e:  # the refused trainer learns it on its own store; the bound one is left alone
            if self.info is None or init_info.session != self.info.session:  # (a repeated one names the bound store)
                self._report(init_info, e)
            raise
        self.shutdown()
        self.info, self.poisoned, self._checked, self.held, self._lost = init_info, None, None, None, ""
        self._started_sync, self._last_started = None, 0
        i = init_info
        try:
            self.comm = Communicator.connect(i.master_address, i.master_port, name=f"worker {self.worker_rank}",
                                             timeout_s=i.timeout_s, group=i.store_group, hosted=True)
            self._check_deployment(i)
            self._use_drafter(i)
            self._init(i)
        except BaseException as e:
            if self.comm is not None:  # reported: every trainer rank raises it (see the module docstring)
                self.poisoned = describe(e)
                self.comm.fail(self.poisoned, e)
                return
            self._report(i, e)
            raise

    def _report(self, info: WorkerInitInfo, error: BaseException) -> None:
        try:
            Communicator.report(info.master_address, info.master_port, f"worker {self.worker_rank}: {describe(error)}")
        except Exception:  # noqa: BLE001 - the trainer side still has its timeout
            pass

    def fence(self, info: WorkerInitInfo) -> None:
        """Trainer sessions are fenced: bound to a live session (its store reachable, no failure reported),
        this worker refuses another session's init and an init repeating the bound session (a trainer draws a
        new session at every init) (``ValueError`` naming both) unless it asks ``take_over``; then an update
        of the bound session still active here is waited for (up to half the new init's ``timeout_s``) and,
        if still active, aborted as that session's failure, reported on its store.
        (vLLM runs one worker call at a time, so only the bound session's failure ends the wait early.)"""
        comm = self.comm
        bound = self.info.session if self.info is not None else ""
        if not bound or comm is None or comm.peer_error() is not None:
            return
        if not info.take_over and info.session == bound:
            raise ValueError(f"worker {self.worker_rank} is bound to trainer session {bound!r}, live: an init "
                             f"repeating session {bound!r} is refused (every trainer_init draws a new session; a "
                             "replayed or copied init info repeats one) unless it asks take_over=True in its "
                             "TrainerInitInfo")
        if not info.take_over:
            raise ValueError(f"worker {self.worker_rank} is bound to trainer session {bound!r}: the init of trainer "
                             f"session {info.session!r} is refused until {bound!r} shuts down its engines (or the "
                             "new init asks take_over=True in its TrainerInitInfo)")
        deadline = time.monotonic() + info.timeout_s / 2  # the other half is the new init's own
        while self._applier is not None and comm.peer_error() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._applier is not None and comm.peer_error() is None:
            self._failed_sync = self._sync_id
            self._fail(RuntimeError(f"trainer session {info.session!r} {TAKEN_OVER} (its init asked take_over=True) "
                                    f"while an update of trainer session {bound!r} was active; "
                                    f"waited {info.timeout_s / 2:g} s (half its timeout_s), then aborted it"))

    def fence_call(self, call: str, sync_id: int | None = None) -> int:
        """Check a ``start``, ``finish`` or ``abort`` against what the bound session's trainer rank 0 announced on
        its store (``control.announced(call)``): that session, and for a start a sync after the last one started
        under this init, for a finish or an abort sync ``sync_id`` (the one started here; the abort's own).
        Returns the announced sync; ``ValueError`` naming the bound session and the announcement otherwise."""
        w, comm = self.worker_rank, self.comm
        bound = self.info.session if self.info is not None else ""
        if not bound or comm is None:
            raise ValueError(f"worker {w} refuses this {call}: {FENCED}; it is bound to no trainer session "
                             "(init_weight_transfer_engine from a weightsync trainer first)")
        try:
            said, why = comm.peek(announced(call)), ""
        except Exception as e:  # noqa: BLE001 - forged (DataPlaneError), or the store is gone (torch's own errors)
            said, why = None, f" ({describe(e)})"
        fields: Json = said if isinstance(said, dict) else {}
        session, sync = fields.get("session"), fields.get("sync_id")
        if session == bound and type(sync) is int:
            if sync > self._last_started if call == "start" else sync == sync_id:
                return sync
        what = "no such call" if said is None else f"{call} of sync {sync} by trainer session {session!r}"
        expected = f"a sync after {self._last_started}" if call == "start" else f"sync {sync_id}"
        raise ValueError(f"worker {w} refuses this {call}: {FENCED}; it is bound to trainer session {bound!r}, whose "
                         f"store announces {what}{why}, not {expected}: a {call} from a party without the session, or "
                         "with another one")

    def _fenced_unless_failed(self, call: str, sync_id: int | None = None) -> int | None:
        """``fence_call``, except that a late call of a sync that failed (a failure recorded on the bound
        session's store, or that store gone) returns None instead of raising: such a call rolls back and
        poisons, it never commits nor leaves vLLM's update active. A live store that announced no such call
        still refuses it (a party without the session cannot roll a live update back)."""
        try:
            return self.fence_call(call, sync_id)
        except ValueError:
            if self.comm is not None and self.comm.peer_error() is not None:
                return None
            raise

    def _check_deployment(self, info: TInit) -> None:
        (expected, field), w = self._expected_workers(info), self.worker_rank
        pc = self.parallel_config
        if info.num_engines is not None and pc is not None:
            per_engine = int(getattr(pc, "data_parallel_size", 1) or 1) * int(pc.world_size)
            if info.num_engines * per_engine != expected:
                raise ValueError(f"the trainer's {field} describes {expected} worker(s), but the client drives "
                                 f"{info.num_engines} engine(s) of {per_engine} worker(s) each (tensor x pipeline "
                                 "x data parallel size: for_deployment(tp=..., pp=...) counts them)")
        if w >= expected:
            raise ValueError(f"worker rank {w} is outside the {expected} worker(s) the trainer's {field} describes")

    def start_weight_update(self) -> None:
        self._check_not_poisoned()
        if self.comm is None:
            raise RuntimeError("init_transfer_engine must run before start_weight_update")
        sync, t0 = self._fenced_unless_failed("start"), time.perf_counter()
        why = self.comm.peer_error()
        if sync is None or why is not None:  # a start that arrives after its sync failed (this worker was stuck)
            self.poisoned = f"start_weight_update after the sync failed: {why}"  # opens nothing
            return
        self._check_base()
        self._applier = LayerwiseApplier(self.model, self.model_config, rollback=self._info.rollback)
        self._received, self._aborted, self._sync_id = 0, False, None
        self.phases: dict[str, float] = {}
        self._start(self._applier)
        self._started_before, self._started_sync = self._last_started, sync
        self._last_started = sync
        self.phases["start"] = time.perf_counter() - t0

    def receive_weights(self, update_info: TUpdate) -> None:
        """Receive and apply one update; failures are reported on the store and poison the engine."""
        bound = self.info.session if self.info is not None and self.comm is not None else ""
        if not bound or update_info.session != bound:  # (not reported: the bound session's store is not the sender's)
            _log.warning("worker %d refuses an update of trainer session %r (%s): it is bound to trainer session %r",
                         self.worker_rank, update_info.session, FENCED, bound)
            return
        if update_info.abort is not None:  # restore the weights; an engine that was in the update needs re-init
            try:
                self.fence_call("abort", update_info.sync_id)
            except ValueError as e:
                _log.warning("%s", e)
                return
            if self._applier is not None and self._sync_id is None and self._before_data():
                self._applier.abort()  # nothing of the sync reached this worker: weights, base and plane intact
                self._applier, self._last_started = None, self._started_before  # (it may start this sync again)
            else:
                if self._applier is not None:
                    self.poisoned = self.poisoned or f"trainer aborted weight sync {update_info.sync_id}"
                self._rollback()
            self._aborted = True  # the finish that follows leaves vLLM's update (a dead trainer's, too)
            return
        if self.poisoned is not None and self._failed_sync == update_info.sync_id:
            return  # this sync already failed here (reported): later chunks are ignored
        try:
            self._check_not_poisoned()
            if self._applier is None or self.comm is None:
                raise RuntimeError("start_weight_update must run before update_weights")
            t0, self._sync_id = time.perf_counter(), update_info.sync_id
            self._received += self._receive(update_info)
            self.phases["receive"] = self.phases.get("receive", 0.0) + time.perf_counter() - t0
            self.comm.publish(SyncKeys(update_info.sync_id).recv(self.worker_rank), self._received)
        except BaseException as e:
            if self.comm is None:
                raise
            self._failed_sync = update_info.sync_id
            self._fail(e)

    def _before_data(self) -> bool:
        """Whether trainer rank 0 announced its abort as one before any rank posted data of the sync."""
        try:
            said = self._comm.peek(announced("abort"))
        except Exception:  # noqa: BLE001 - no store, or gone: not known, so not before data
            return False
        return isinstance(said, dict) and said.get("before_data") is True

    def _fail(self, error: BaseException) -> None:
        """Poison this engine, report ``error`` to every party (dropping the data plane), roll back."""
        self.poisoned = describe(error)
        if self.comm is not None:
            self.comm.fail(self.poisoned, error)
        self._rollback()

    def finish_weight_update(self) -> None:
        if self._applier is None and (self.poisoned is not None or self._aborted):
            self._aborted = False
            return  # leaves a failed or aborted update (weights restored); a poisoned engine stays poisoned
        self._check_not_poisoned()
        if self._applier is None:
            raise RuntimeError("finish_weight_update without start_weight_update")
        # (raised: vLLM's worker keeps the live update active; a failed sync's late finish rolls back below)
        self._fenced_unless_failed("finish", self._started_sync)
        t0 = time.perf_counter()
        if (why := self._engine_not_finishing()) is not None:  # roll back, never commit a failed sync
            self._failed_sync = self._sync_id
            self._fail(RuntimeError(f"finish_weight_update of weight sync {self._sync_id} rolled back: {why}"))
            return
        try:
            self._applier.finish()
        except BaseException as e:  # reported, not raised (see the module docstring): the trainer raises it
            if self.comm is None:
                raise
            try:
                self._fail(RuntimeError(f"finish_weight_update of weight sync {self._sync_id} failed: {describe(e)}"))
            except Exception:  # noqa: BLE001 - reported first; the engine stays poisoned
                self._applier = None
            return
        self._applier = None
        self.phases["finish"] = time.perf_counter() - t0
        self._fingerprint, self._lost = fingerprint(self.model), ""  # what ``_check_base`` compares at the next start
        if self.comm is not None and self._sync_id is not None:  # the trainer's stats: SyncStats.worker_phases
            self.held = self._sync_id
            keys = SyncKeys(self._sync_id)
            self.comm.publish(keys.phases(self.worker_rank), self.phases)
            if self.drafter_bytes is not None:
                self.comm.publish(keys.drafter(self.worker_rank), self.drafter_bytes)
            self.comm.publish(keys.held(self.worker_rank), self.held)

    def _engine_not_finishing(self) -> str | None:
        """Before committing: every worker of this engine (its TP x PP workers, which vLLM calls together)
        reached its finish and the sync has not failed, waited for at most ``timeout_s``; else why not.
        So a worker stuck before its finish (or a trainer that gave up on the sync: its failure is on the
        store, or the store is gone) makes the others roll back, and itself once it gets here: the engine
        commits whole or not at all, and an abort never has to undo a finished worker."""
        pc = self.parallel_config
        if self.comm is None or self._sync_id is None or pc is None:
            return None
        keys, per_engine = SyncKeys(self._sync_id), int(pc.world_size)
        first = self.worker_rank // per_engine * per_engine
        try:
            self.comm.publish(keys.finishing(self.worker_rank), True)
            self.comm.read_all([keys.finishing(w) for w in range(first, first + per_engine)], self._info.timeout_s)
        except Exception as e:  # noqa: BLE001 - a peer failed, the time ran out, or the store is gone
            return describe(e)
        return self.comm.peer_error()

    def _check_holds(self, base: int | None) -> None:
        """A delta against sync ``base`` patches weights this worker must hold; refuse otherwise."""
        if self.held != base:
            lost = f" ({self._lost})" if self._lost and self.held is None else ""
            raise ValueError(f"update_info.delta_base is sync {base}, but worker {self.worker_rank} holds "
                             f"{'no complete sync' if self.held is None else f'sync {self.held}'}{lost}")

    def _check_base(self) -> None:
        """At a start: vLLM changed the weights since the last sync this worker holds (its ``load_weights``,
        ``reload_weights``, a level-2 sleep's restore), so a delta against that sync would patch another
        base: drop it (the next delta against it is refused; after re-init every sync starts dense)."""
        if self.held is not None and weights_changed(self._fingerprint, self.model):
            self._lost = (f"vLLM changed its weights since weight sync {self.held} (load_weights, reload_weights "
                          "or a level-2 sleep): that base is dropped")
            self.drop_held()

    def drop_held(self) -> None:
        """Say this worker no longer holds its last sync's weights (a failed or aborted sync, or
        weights lost otherwise): the next sync sends it everything dense."""
        held, self.held = self.held, None
        if held is not None and self.comm is not None:
            try:
                self.comm.publish(SyncKeys(held).held(self.worker_rank), None)
            except Exception:  # noqa: BLE001 - the store is gone: no sync can follow under this init
                pass

    def _rollback(self) -> None:
        self.drop_held()  # restored or not, the next delta would be against weights it may not hold
        if self._applier is not None:
            self._applier.abort()
        self._applier = None

    def shutdown(self) -> None:
        self.held = None  # (nothing to report: no sync follows under this init)
        self._rollback()
        if self.comm is not None:
            self.comm.shutdown()
        self.comm = None
