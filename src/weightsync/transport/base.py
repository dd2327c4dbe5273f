"""The transport core: the lifecycle every transport shares, around small per-transport hooks.

Trainer side (:class:`BaseTrainerEngine`), on every trainer rank::

    trainer_init: trainer rank 0 hosts the group's store; rank 0 calls the client's
        init_weight_transfer_engine in a thread while every rank connects (and joins the data plane,
        for a transport that has one: ``_data_rank``), runs ``_handshake`` and agrees that init is done.
    send_weights: preflight (``_preflight`` on every rank; any rank's error is every rank's, before
        anything moves) -> rank 0 starts the update on the engines and tells the others ->
        ``_transfer`` on every rank (rank 0 calls ``update_weights`` inside it) -> every rank reports ->
        rank 0 finishes the update (the version advances) and publishes the verdict.

One outcome per sync: after a failure anywhere, every trainer rank raises ``SyncFailed`` with the
first failure's message, rank 0 aborts the update on every worker (each restores its parameters and
leaves the update, so vLLM's worker is ready again), and every engine refuses further syncs until
re-initialized (``PoisonedError``, on every rank).

Worker side (:class:`BaseWorkerEngine`), as vLLM's worker calls it: ``init_transfer_engine``
connects to the store, checks the deployment and runs ``_init``; ``start_weight_update`` opens a
:class:`LayerwiseApplier`; ``receive_weights`` runs ``_receive`` (it returns the bytes its data
plane delivered, which the worker publishes) or, for an abort, rolls back; a failure poisons the
engine and is reported to every party.

A transport file is then its info fields, ``TRANSPORT`` and these hooks: ``_worker_init_info``,
``_data_rank`` (optional), ``_handshake`` (optional), ``_preflight``, ``_transfer``, ``_lower_bound``
on the trainer; ``_init``, ``_receive``, ``_expected_workers`` (and ``_start``, optional) on the worker.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict
from typing import Any, ClassVar

from ..comm import Communicator, DataPlaneError, SyncAborted
from ..protocol import SyncStats, TrainerEngine, TrainerInitInfo, WeightSource, WorkerInitInfo, WorkerUpdateInfo
from ..worker import LayerwiseApplier, PoisonedError, WorkerEngine

__all__ = ["BaseTrainerEngine", "BaseWorkerEngine", "SyncFailed", "PoisonedError", "client_result"]

_OK = "ok"


class SyncFailed(RuntimeError):
    """A sync failed. Every trainer rank raises it with the same (first) failure; the workers
    restored their parameters; every engine refuses syncs until ``trainer_init`` runs again."""


def client_result(fut: Future, timeout_s: float, what: str) -> Any:
    """The result of a client call running in a thread, within the timeout."""
    try:
        return fut.result(timeout=timeout_s)
    except FutureTimeout:
        raise TimeoutError(f"the client's {what} did not return within timeout_s={timeout_s}") from None


def _message(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class BaseTrainerEngine(TrainerEngine):
    """The trainer-side lifecycle; subclasses implement the hooks listed in the module docstring."""

    source_kind: ClassVar[str] = "full"
    """``"local"``: the transport reads ``iter_local`` shards; ``"full"``: ``iter_full`` tensors."""
    update_info_cls: ClassVar[type[WorkerUpdateInfo]] = WorkerUpdateInfo
    """The workers' update info (an abort is sent as one)."""

    # ---- hooks ------------------------------------------------------------------------
    def _worker_init_info(self, port: int) -> WorkerInitInfo:
        """What every worker's ``init_transfer_engine`` gets (``port``: the store's actual port)."""
        raise NotImplementedError

    def _data_rank(self) -> tuple[int, int] | None:
        """``(rank, world size)`` of this trainer rank in the data plane, or None (control only)."""
        return None

    def _handshake(self) -> None:
        """After connecting, before init is agreed (e.g. plan agreement). Every trainer rank."""

    def _preflight(self, verify: bool) -> Any:
        """Checks that need no peer and move no data; ``ValueError`` naming the parameter. Returns
        what ``_transfer`` needs."""
        raise NotImplementedError

    def _transfer(self, prepared: Any, stats: SyncStats, verify: bool) -> Future | None:
        """Move the weights. Rank 0 calls the client's ``update_weights`` here (``self._update_async``
        or directly); returns the future of an update still running, if any."""
        raise NotImplementedError

    def _lower_bound(self) -> dict[int, int]:
        """Least payload bytes each worker needs per sync (rank 0)."""
        return {}

    # ---- init ---------------------------------------------------------------------------
    @classmethod
    def trainer_init(cls, init_info: TrainerInitInfo, *, client: Any,
                     source: WeightSource | None = None) -> "BaseTrainerEngine":
        """Rendezvous with every worker (collective on every trainer rank)."""
        if not isinstance(init_info, cls.init_info_cls):
            raise TypeError(f"{cls.__name__} needs a {cls.init_info_cls.__name__}, got {type(init_info).__name__}")
        _check_source(init_info.backend, cls.source_kind, source)
        self = cls(init_info, client=client, source=source)
        self.sync_id, self.failed, self.comm = 0, None, None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weightsync-client")
        i = init_info
        try:
            self.comm = Communicator.connect(i.master_address, i.master_port or 0, name=f"trainer rank {i.rank}",
                                             timeout_s=i.timeout_s, host_store=self.is_sender)
            fut = None
            if self.is_sender:
                payload = asdict(self._worker_init_info(self.comm.port))
                fut = self._pool.submit(self._client_init, payload)
            if (data := self._data_rank()) is not None:
                self.comm.join(*data, device=i.device)
            self._handshake()
            if fut is not None:
                client_result(fut, i.timeout_s, "init_weight_transfer_engine")
                self.comm.publish("init/done", _OK)
            else:
                self.comm.read("init/done")  # raises a failure any rank or worker reported
        except BaseException as e:
            if self.comm is not None:
                self.comm.fail(_message(e), e)
            self._pool.shutdown(wait=False)
            raise
        return self

    def _client_init(self, payload: dict[str, Any]) -> None:
        # An update a previous trainer left active (it died mid-sync) is aborted first: vLLM's worker
        # leaves an update when the engine raises, and refuses to start a new one while one is active.
        self._abort_workers("re-initializing")
        self.client.init_weight_transfer_engine(payload)

    def _abort_workers(self, reason: str) -> None:
        """Rank 0: every worker in an update restores its parameters and leaves it (best effort: a
        worker without an update in progress refuses, which is fine)."""
        update = self.update_info_cls(abort=reason, sync_id=self.sync_id)
        try:
            self.client.update_weights(asdict(update))
        except Exception:  # noqa: BLE001 - the abort itself answers with an error by design
            pass

    def _update_async(self, update: WorkerUpdateInfo | dict[str, Any]) -> Future:
        """Rank 0: the client's ``update_weights`` in a thread (workers receive while we send)."""
        payload = update if isinstance(update, dict) else asdict(update)
        return self._pool.submit(self.client.update_weights, payload)

    # ---- one sync ---------------------------------------------------------------------
    def _key(self, *parts: Any) -> str:
        return "/".join([f"sync{self.sync_id}", *map(str, parts)])

    def _from_every_trainer(self, step: str, value: Any) -> list[Any]:
        """Publish this rank's ``value`` for ``step`` and read every trainer rank's."""
        self.comm.publish(self._key(step, self.rank), value)
        return [self.comm.read(self._key(step, r)) for r in range(self.init_info.num_trainer_ranks)]

    def send_weights(self, *, weight_version: str | None = None, verify: bool = False) -> SyncStats:
        """Push the source's weights to every worker; returns once every worker applied them.
        Collective on every trainer rank. See the module docstring for what a failure does."""
        if self.failed is not None:
            raise PoisonedError(f"a previous sync failed ({self.failed}); the engines refuse updates until "
                                "re-initialized: call trainer_init again on every trainer rank")
        if self.comm is None:
            raise RuntimeError("the engine was shut down; call trainer_init again")
        self.sync_id += 1
        stats = SyncStats(backend=self.init_info.backend, rank=self.rank, weight_version=weight_version)
        with stats.timed("preflight"):
            try:
                prepared, error = self._preflight(verify), ""
            except ValueError as e:
                prepared, error = None, str(e)
            errors = self._from_every_trainer("preflight", error)
            if any(errors):  # nothing moved; the engines were not asked to update
                raise ValueError(next(e for e in errors if e))
        fut = None
        try:
            with stats.timed("start"):
                if self.is_sender:
                    self.client.start_weight_update()
                    self.comm.publish(self._key("started"), _OK)
                else:  # no rank enters the source's collectives before the engines accepted the update
                    self.comm.read(self._key("started"))
            with stats.timed("transfer"):
                fut = self._transfer(prepared, stats, verify)
                self.comm.publish(self._key("sent", self.rank), _OK)
                if self.is_sender:
                    if fut is not None:
                        client_result(fut, self.init_info.timeout_s, "update_weights")
                    for r in range(1, self.init_info.num_trainer_ranks):
                        self.comm.read(self._key("sent", r))
            if self.is_sender:
                with stats.timed("finish"):
                    self.client.finish_weight_update(weight_version)
                stats.bytes_received_per_worker = {w: int(self.comm.read(self._key("recv", w)))
                                                   for w in sorted(self._lower_bound())}
                stats.lower_bound_per_worker = self._lower_bound()
                self.comm.publish(self._key("verdict"), _OK)
            else:
                self.comm.read(self._key("verdict"))
        except BaseException as e:
            raise self._failed_sync(e, fut) from e
        stats.verified = True if verify else None
        return stats

    def _failed_sync(self, error: BaseException, fut: Future | None) -> SyncFailed:
        """Every rank: record the first failure and wake every party; rank 0 also waits for its
        update call and aborts the update on every worker. Returns what every rank raises."""
        self.comm.fail(_message(error), error)
        reason = self.comm.peer_error() or f"trainer rank {self.rank}: {_message(error)}"
        if self.is_sender:
            if fut is not None:
                try:
                    client_result(fut, self.init_info.timeout_s, "update_weights")
                except BaseException:  # noqa: BLE001 - it failed too: the workers report their own
                    pass
            self._abort_workers(reason)
        self.failed = reason
        return SyncFailed(f"weight sync {self.sync_id} failed: {reason}")

    def shutdown(self) -> None:
        """Release the group (and the store, on rank 0). Call on every trainer rank."""
        if self.comm is not None:
            self.comm.shutdown()
        self.comm = None
        self._pool.shutdown(wait=False)


def _check_source(backend: str, kind: str, source: WeightSource | None) -> None:
    if source is None:
        raise ValueError(f"source is required for the {backend} transport")
    method = "iter_local" if kind == "local" else "iter_full"
    if getattr(type(source), method) is getattr(WeightSource, method):
        want = "DTensorModuleSource" if kind == "local" else "FullTensorSource"
        raise ValueError(f"the {backend} transport reads {method}(); source {type(source).__name__} does not "
                         f"implement it (use {want})")


class BaseWorkerEngine(WorkerEngine):
    """The worker-side lifecycle; subclasses implement the hooks listed in the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.comm: Communicator | None = None
        self.info: Any = None
        self._applier: LayerwiseApplier | None = None
        self._received = 0

    # ---- hooks ------------------------------------------------------------------------
    def _expected_workers(self, info: Any) -> tuple[int, str]:
        """Workers over all engines that ``info`` describes, and the field that says so."""
        raise NotImplementedError

    def _init(self, info: Any) -> None:
        """Join the data plane, resolve destinations, ... (after the deployment checks)."""

    def _start(self, applier: LayerwiseApplier) -> None:
        """Prepare a sync (default: enter layerwise reload at once)."""
        applier.start()

    def _receive(self, update: Any) -> int:
        """Receive and apply; returns the bytes the data plane delivered."""
        raise NotImplementedError

    # ---- vLLM's worker calls ------------------------------------------------------------
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

    def init_transfer_engine(self, init_info: Any) -> None:
        self.shutdown()
        self.info, self.poisoned = init_info, None
        i = init_info
        try:
            self.comm = Communicator.connect(i.master_address, i.master_port, name=f"worker {self.worker_rank}",
                                             timeout_s=i.timeout_s)
            self._check_deployment(i)
            self._init(i)
        except BaseException as e:
            if self.comm is not None:
                self.comm.fail(_message(e), e)
            else:
                try:
                    Communicator.report(i.master_address, i.master_port, f"worker {self.worker_rank}: {_message(e)}")
                except Exception:  # noqa: BLE001 - the trainer side still has its timeout
                    pass
            raise

    def _check_deployment(self, info: Any) -> None:
        (expected, field), w = self._expected_workers(info), self.worker_rank
        pc = self.parallel_config
        if info.num_engines is not None and pc is not None:
            per_engine = int(getattr(pc, "data_parallel_size", 1) or 1) * int(pc.world_size)
            if info.num_engines * per_engine != expected:
                raise ValueError(f"the trainer's {field} describes {expected} worker(s), but the client drives "
                                 f"{info.num_engines} engine(s) of {per_engine} worker(s) each")
        if w >= expected:
            raise ValueError(f"worker rank {w} is outside the {expected} worker(s) the trainer's {field} describes")

    def start_weight_update(self) -> None:
        self._check_not_poisoned()
        if self.comm is None:
            raise RuntimeError("init_transfer_engine must run before start_weight_update")
        self._applier = LayerwiseApplier(self.model, self.model_config, rollback=self.info.rollback)
        self._received = 0
        self._start(self._applier)

    def receive_weights(self, update_info: Any) -> None:
        if update_info.abort is not None:
            self._rollback()
            self.poisoned = self.poisoned or f"trainer aborted weight sync {update_info.sync_id}"
            raise SyncAborted(f"trainer aborted weight sync {update_info.sync_id}: {update_info.abort}")
        self._check_not_poisoned()
        if self._applier is None or self.comm is None:
            raise RuntimeError("start_weight_update must run before update_weights")
        try:
            self._received += self._receive(update_info)
            self.comm.publish(f"sync{update_info.sync_id}/recv/{self.worker_rank}", self._received)
        except BaseException as e:
            self.poisoned = _message(e)
            if self.comm is not None:
                self.comm.fail(self.poisoned, e)
            self._rollback()
            raise

    def finish_weight_update(self) -> None:
        self._check_not_poisoned()
        if self._applier is None:
            raise RuntimeError("finish_weight_update without start_weight_update")
        self._applier.finish()
        self._applier = None

    def _rollback(self) -> None:
        if self._applier is not None:
            self._applier.abort()
        self._applier = None

    def shutdown(self) -> None:
        self._rollback()
        if self.comm is not None:
            self.comm.shutdown()
        self.comm = None
