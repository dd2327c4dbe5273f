"""The transport core, trainer side (:class:`TrainerEngine`), on every trainer rank::

    trainer_init: trainer rank 0 hosts the group's store; rank 0 calls the client's
        init_weight_transfer_engine in a thread while every rank connects (and joins the data plane,
        for a transport that has one: ``_data_rank``), runs ``_handshake`` and agrees that init is done.
        There the ranks agree on their metadata and every worker checks it against its model and
        for coverage (:mod:`weightsync.worker.agreement`): a mismatch fails init, naming the parameter.
    send_weights: preflight (``_preflight`` on every rank; any rank's error is every rank's, before
        anything moves: a ``ValueError`` on every rank, or the rank's own exception there and a
        ``RuntimeError`` naming it on the others; the engines stay ready for the next sync) ->
        rank 0 starts the update on the engines, sends the update (``_update_info``) from the same
        client thread at once, and tells the others -> ``_transfer`` on every rank (or rank 0 calls
        ``update_weights`` inside it: ``_update_info`` None), which may do local work first (M2N
        packs its first staged rounds) but moves no data before ``started()`` (the wait for the
        start) returned -> every rank reports -> once every worker applied the update (its "recv"
        key; the update call's return, for a client that cannot be called from two threads) rank 0
        finishes the update (the version advances) and publishes the verdict.

One outcome per sync: after a failure anywhere, every trainer rank raises ``SyncFailed`` with the
first failure's message, rank 0 aborts the update on every worker (restoring its parameters when ``rollback=True``),
and every engine refuses further syncs until re-initialized (``PoisonedError``, on every rank).

The worker side is :class:`~weightsync.worker.engine.WorkerEngine`; the store keys and agreement,
:mod:`weightsync.control`. A transport file is its info fields, ``TRANSPORT`` and the hooks:
``_worker_init_info``, ``_data_rank``, ``_handshake``, ``_preflight``, ``_update_info``, ``_transfer``,
``_lower_bound`` on the trainer; ``_init``, ``_receive``, ``_expected_workers``, ``_start`` on the worker."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import asdict
from typing import TYPE_CHECKING, ClassVar, Generic, Protocol, Self, TypedDict, TypeVar

from ..comm import Communicator, describe
from ..control import INIT_DONE, SyncKeys, announced, gather, init_ack
from ..dataplane import PlaneFactory
from ..dataplane.torch_group import TorchGroupPlane
from ..errors import PoisonedError, Refused, RemoteCallError, SyncFailed, client_failure, refusal
from ..infos import TrainerInitInfo, WorkerInitInfo, WorkerUpdateInfo
from ..pausing import REFUSED, check_paused, preflight_error
from ..protocol import WeightSource
from ..stats import SyncStats
from .session import check_finished, check_source, connect_fresh, leave, new_session, taken_over
from .waits import MARGIN_S, ClientCalls, client_result, in_thread, left, settle

if TYPE_CHECKING:
    from .elastic import ElasticTrainerEngine

__all__ = ["EngineClient", "TrainerEngine", "client_result"]

_OK = "ok"
Json = dict[str, object]

TInit = TypeVar("TInit", bound=TrainerInitInfo)
TUpdate = TypeVar("TUpdate", bound=WorkerUpdateInfo)
TPrepared = TypeVar("TPrepared")


def _known_failure(failure: str | None) -> Exception | None:
    """What every trainer rank raises for a failed init whose first failure (on the store) says why:
    ``Refused`` for a worker's refusal, the client's own ``Unauthorized`` / ``EngineDead`` for trainer
    rank 0's failed init call (a token the server refused, an engine that died or never started)."""
    return refusal(failure) or client_failure(failure)


class SharedWorkerFields(TypedDict):
    """The worker init info's fields every transport shares (``TrainerEngine._shared_worker_fields``)."""

    master_address: str
    master_port: int
    timeout_s: float
    rollback: bool
    cast_dtypes: bool
    partial: list[str]
    session: str
    take_over: bool
    store_group: str
    drafter: str


class Declared(Protocol):
    """What the engine reads of its transport's declaration (``weightsync.registry.Transport``)."""

    @property
    def name(self) -> str: ...
    @property
    def source(self) -> str: ...


class EngineClient(Protocol):
    """What trainer rank 0 calls on the engines (``weightsync.clients``: Ray, HTTP, in-process), as
    vLLM's weight-transfer API names it; the other ranks never call it."""

    def init_weight_transfer_engine(self, init_info: Json, /) -> object: ...
    def start_weight_update(self) -> object: ...
    def update_weights(self, update_info: Json, /) -> object: ...
    def finish_weight_update(self, weight_version: str | None, /) -> object: ...


class TrainerEngine(Generic[TInit, TUpdate, TPrepared]):
    """Trainer-side engine, built by ``WeightTransferTrainerFactory.trainer_init`` on every trainer
    rank: the lifecycle every transport shares; a transport implements the hooks listed in the
    module docstring, typed by its init info ``TInit``, its workers' update info ``TUpdate`` and what its
    ``_preflight`` prepares for ``_transfer`` (``TPrepared``). Rank 0 drives the client; every rank runs
    every collective."""

    init_info_cls: ClassVar[type[TrainerInitInfo]]
    spec: ClassVar[Declared]
    """The transport's declaration, set when it is declared (``weightsync.registry``)."""
    update_info_cls: ClassVar[type[WorkerUpdateInfo]] = WorkerUpdateInfo
    """The workers' update info (an abort is sent as one)."""
    data_plane: ClassVar[PlaneFactory] = TorchGroupPlane
    """The data plane this transport's parties join (``_data_rank``); its workers' engine names the same."""
    _chunks = 0  # chunks the last sync handed over on the store (ipc), whose keys ``_forget`` deletes
    comm: Communicator  # the group's control channel (connected before any hook runs; ``shutdown`` drops it)
    _calls: Communicator | None  # rank 0: the client calls' channel (``_watched``)
    session: str
    sync_id: int
    failed: str | None  # why the last failed sync failed: the engines refuse syncs until re-initialized
    _pool: ClientCalls
    _outcome_ack: Callable[[int], str] | None  # rank 0: the last outcome's acknowledgements
    _held_syncs: list[int]  # rank 0: syncs whose workers' "held" keys are on the store (``_forget``)
    _forgetting: Future[None] | None  # rank 0: the last ``_forget``'s deletes, running aside
    # one sync's progress, for its failure path (``_failed_sync``)
    _t0: float
    _started: bool
    _start_sent: bool
    _finished: bool
    _update_call: Future[None] | None
    _closed: bool  # ``shutdown`` ran

    def __init__(self, init_info: TInit, *, client: EngineClient, source: WeightSource | None) -> None:
        self.init_info = init_info
        self.rank = init_info.rank
        self.is_sender = init_info.rank == 0
        self.client = client
        self.source = source

    # ---- hooks ------------------------------------------------------------------------
    def _worker_init_info(self, port: int) -> WorkerInitInfo:
        """What every worker's ``init_transfer_engine`` gets (``port``: the store's actual port)."""
        raise NotImplementedError

    def _shared_worker_fields(self, port: int) -> SharedWorkerFields:
        """The worker init info's fields every transport shares (``port``: the store's actual port)."""
        i = self.init_info
        return {"master_address": i.master_address, "master_port": port, "timeout_s": i.timeout_s,
                "rollback": i.rollback, "cast_dtypes": i.cast_dtypes, "partial": list(i.partial),
                "session": self.session, "take_over": i.take_over, "store_group": self.comm.group,
                "drafter": i.drafter}

    def _data_rank(self) -> tuple[int, int] | None:
        """``(rank, world size)`` of this trainer rank in the data plane, or None (control only)."""
        return None

    def _handshake(self) -> None:
        """After connecting, before init is agreed (e.g. plan agreement). Every trainer rank."""

    def _preflight(self, verify: bool) -> TPrepared:
        """Checks that need no peer and move no data (``ValueError`` naming the parameter); what ``_transfer`` needs."""
        raise NotImplementedError

    def _update_info(self, prepared: TPrepared, verify: bool) -> TUpdate | None:
        """Rank 0: this sync's update info, sent from the client's thread right after the start call, so
        the workers enter their receive while the trainer ranks wake; None: ``_transfer`` sends it."""
        return None

    def _transfer(self, prepared: TPrepared, stats: SyncStats, verify: bool, started: Callable[[], None]) -> None:
        """Move the weights; call ``started()`` (it waits until the engines accepted the update) before
        any data moves or the source's collectives run; local work may come first. On rank 0,
        ``self._update_call`` is the update call in flight (None when ``_update_info`` returned None:
        then this hook calls ``update_weights`` itself)."""
        raise NotImplementedError

    def _lower_bound(self) -> dict[int, int]:  # least payload bytes each worker needs per sync (rank 0)
        return {}

    # ---- init ---------------------------------------------------------------------------
    @classmethod
    def trainer_init(cls, init_info: TInit, *, client: EngineClient,
                     source: WeightSource | None = None) -> Self | ElasticTrainerEngine:
        """Rendezvous with every worker (collective on every trainer rank)."""
        if not isinstance(init_info, cls.init_info_cls):
            raise TypeError(f"{cls.__name__} needs a {cls.init_info_cls.__name__}, got {type(init_info).__name__}")
        check_source(init_info.backend, cls.spec.source, source)
        if init_info.on_engine_failure == "drop":  # one group per replica (docs/elastic.md)
            from .elastic import ElasticTrainerEngine

            return ElasticTrainerEngine.trainer_init(cls, init_info, client=client, source=source)
        self = cls(init_info, client=client, source=source)
        self.sync_id, self.failed, self._calls, self._closed = 0, None, None, False
        self.session = new_session()  # rank 0's is the one the workers get
        self._outcome_ack, self._held_syncs, self._forgetting = None, [], None
        self._pool = ClientCalls(client)  # rank 0's client calls run there, waited for within timeout_s
        i, t0 = init_info, time.monotonic()
        fut: Future[None] | None = None
        comm: Communicator | None = None
        try:
            def connect() -> Communicator:
                return Communicator.connect(i.master_address, i.master_port or 0, name=f"trainer rank {i.rank}",
                                            timeout_s=i.timeout_s, host_store=self.is_sender)

            comm = self.comm = connect() if self.is_sender else connect_fresh(connect, i.rank, i.timeout_s)
            if self.is_sender:
                self._calls = self.comm.second_channel()  # the client calls' threads report on it (``_watched``)
                payload = {**asdict(self._worker_init_info(self.comm.port)), "transport": self.init_info.backend}
                fut = self._watched(lambda: self.client.init_weight_transfer_engine(payload),
                                    "init_weight_transfer_engine")
            if (data := self._data_rank()) is not None:
                self.comm.join(*data, device=i.device, plane=self.data_plane)
            self._handshake()
            if fut is not None:
                client_result(fut, i.timeout_s, "init_weight_transfer_engine")
                failure = self.comm.peer_error()  # workers report a refused init here instead of raising
                if failure is not None:  # a worker's ValueError (bad input) is a ValueError here too
                    raise refusal(failure) or RuntimeError(failure)
                self.comm.publish(INIT_DONE, _OK)
            else:
                self.comm.read(INIT_DONE)  # raises a failure any rank or worker reported
        except BaseException as e:
            known: Exception | None = None
            if comm is not None:
                comm.fail(describe(e), e)
                if fut is not None:  # the workers learn it from the store too: they are not left connecting
                    settle(fut, left(t0, i.timeout_s, MARGIN_S))  # (a stuck worker is not waited for)
                if isinstance(e, Exception) and not isinstance(e, (ValueError, RemoteCallError)):
                    known = _known_failure(comm.peer_error())  # (read before rank 0 may close the store)
                self._acknowledge(init_ack)  # rank 0 (the store's host) lingers until every rank saw it
            if self._calls is not None:
                self._calls.shutdown()
            if comm is not None:  # rank 0: its store stops listening (the port is free for a retry)
                comm.shutdown()
            self._pool.shutdown(wait=False)
            if known is not None:  # a worker refused, or the client's init call failed: every rank says so
                raise known from e
            raise
        return self

    def _acknowledge(self, ack: Callable[[int], str]) -> None:
        """Ranks > 0 say they read an outcome (under ``ack(rank)``); rank 0, which hosts the store, waits
        for them (at most ``timeout_s``) so that no rank reads "store unreachable" instead of the outcome."""
        keys = [ack(r) for r in range(1, self.init_info.num_trainer_ranks)]
        if not self.is_sender:
            try:
                self.comm.publish(keys[self.rank - 1], True)
            except Exception:  # noqa: BLE001 - the store is gone: rank 0 gave up waiting
                pass
        elif keys:
            self.comm.wait_for(keys, self.init_info.timeout_s)

    def _start_update(self, update: TUpdate | None) -> Callable[[], object]:
        """Rank 0: start the update on every engine and tell the other ranks, then send ``update`` from
        the same client thread at once (that call is ``self._update_call``); returns what waits until
        the start returned (without ``update``: it has)."""
        if update is None:
            client_result(self._pool.submit(self._start_on_engines), self.init_info.timeout_s, "start_weight_update")
            self.comm.publish(self.keys.started, _OK)
            return lambda: None
        payload = {**asdict(update), "session": self.session}  # (fenced: see ``session``)
        started: Future[None] = Future()
        calls = self._calls_channel

        def start_then_update() -> None:
            try:
                self._start_on_engines()
                calls.publish(self.keys.started, _OK)
            except BaseException as e:  # noqa: BLE001 - raised in the caller; no update is sent
                started.set_exception(e)
                return
            started.set_result(None)
            self.client.update_weights(payload)

        self._update_call = self._watched(start_then_update, "update_weights", wake=self._recv_keys())
        return lambda: client_result(started, self.init_info.timeout_s, "start_weight_update")

    def _announce(self, call: str, **extra: bool) -> None:
        """Rank 0, before it sends ``call`` (``start``, ``finish``, ``abort``) to the engines: say so on the store,
        where the workers check it (``WorkerEngine.fence_call``). From the client calls' channel: the main one
        may be blocked in a wait."""
        (self._calls or self.comm).publish(announced(call), {"session": self.session, "sync_id": self.sync_id,
                                                             **extra})

    def _start_on_engines(self) -> None:
        """vLLM's worker refuses to start while an update is active, which a trainer that died
        mid-sync leaves behind; that one is aborted, then started again. No rank posted data yet (the
        ranks post once the start returned): the workers the first start reached leave it unpoisoned."""
        self._announce("start")
        self._start_sent = True  # from here some worker may be in the update: a failure aborts it
        try:
            self.client.start_weight_update()
        except Exception:  # noqa: BLE001 - a second refusal is raised as it is
            self._abort_workers("a previous trainer left this update active", before_data=True)
            self.client.start_weight_update()
        self._started = True

    def _holding(self, base: int | None, num_workers: int) -> list[int]:
        """Rank 0, delta sync: the workers that reported holding sync ``base`` complete."""
        if base is None:
            return []
        return [w for w in range(num_workers) if self.comm.peek(SyncKeys(base).held(w)) == base]

    def _abort_workers(self, reason: str, before_data: bool = False) -> None:
        """Rank 0: every worker of the update restores its parameters (the abort update), then leaves
        the update (``finish_weight_update`` without a version: vLLM's worker clears its active flag,
        the version stays). Workers answer both without raising (:mod:`weightsync.worker.engine`).
        ``before_data``: no rank posted any data of this sync (announced with the abort): a worker that
        received nothing keeps its weights, its base and its data plane, and may start this sync again."""
        update = self.update_info_cls(abort=reason, sync_id=self.sync_id, session=self.session)
        try:
            self._announce("abort", before_data=before_data)
        except Exception:  # noqa: BLE001 - the store is gone: the workers' own failure paths restore them
            return
        calls: tuple[Callable[[], object], ...] = (lambda: self.client.update_weights(asdict(update)),
                                                   lambda: self.client.finish_weight_update(None))
        for call in calls:
            try:
                call()
            except Exception:  # noqa: BLE001 - best effort: an engine that is gone answers with an error
                pass

    def _recv_keys(self) -> list[str]:
        """Where each worker publishes the bytes it received once it applied this sync's update."""
        return [self.keys.recv(w) for w in sorted(self._lower_bound())]

    def _watched(self, call: Callable[[], object], what: str, wake: Sequence[str] = ()) -> Future[None]:
        """A client call in the client thread, its failure recorded on the store (``ClientCalls.watched``)."""
        return self._pool.watched(call, what, self._calls_channel, wake)

    @property
    def _calls_channel(self) -> Communicator:
        """Rank 0's channel for its client calls' threads (opened at init)."""
        if self._calls is None:
            raise RuntimeError("only trainer rank 0 calls the engines")
        return self._calls

    def _applied(self) -> list[int] | None:
        """Rank 0: wait until every worker applied the update (the bytes each received, when read). With a
        ``concurrent_calls`` client the workers' "recv" keys say it, sooner than the update call returns."""
        if self._update_call is not None and getattr(self.client, "concurrent_calls", False):
            return self.comm.await_keys(self._recv_keys())
        if self._update_call is not None:
            client_result(self._update_call, self.init_info.timeout_s, "update_weights")
        return None

    # ---- one sync ---------------------------------------------------------------------
    keys = property(lambda self: SyncKeys(self.sync_id), doc="This sync's store keys.")

    def _forget(self, sync_id: int) -> None:
        """Rank 0, once every rank read sync ``sync_id``'s outcome (then published this sync's preflight):
        delete its keys and the workers' "held" keys but the last complete sync's (the next delta reads them)."""
        workers = len(self._lower_bound())
        keys = SyncKeys(sync_id).outcome_keys(self.init_info.num_trainer_ranks, workers, self._chunks)
        stale, self._held_syncs = self._held_syncs[:-1], self._held_syncs[-1:]
        keys += [SyncKeys(s).held(w) for s in stale for w in range(workers)]
        self._settle_forget()
        # aside: one store request per key (~0.3 ms each) is not this sync's to wait for; shutdown waits
        delete = self.comm.delete
        self._forgetting = in_thread(lambda: delete(keys), "weightsync-forget")

    def _settle_forget(self) -> None:
        """Wait (at most ``timeout_s``) for the last ``_forget``'s deletes."""
        if self._forgetting is not None:
            settle(self._forgetting, self.init_info.timeout_s)
            self._forgetting = None

    def _check_paused(self, asked: Future[None] | None) -> None:
        """Rank 0: every engine's generation is paused, or ``Refused`` (:mod:`weightsync.pausing`), asked
        (``asked``: ``check_paused`` submitted to the client thread) within half of ``timeout_s`` (an
        engine that does not answer is refused before the ranks' wait ends)."""
        if asked is not None:
            try:
                client_result(asked, self.init_info.timeout_s / 2, "generation_paused")
            except TimeoutError as e:
                raise Refused(f"{REFUSED}could not ask whether every engine's generation is paused: {e}") from None

    def _agreed_preflight(self, verify: bool) -> TPrepared:
        """``_preflight`` on every rank (rank 0 asks whether generation is paused meanwhile); any rank's
        error is every rank's (see the module docstring)."""
        asked = self._pool.submit(lambda: check_paused(self)) if self.is_sender else None
        try:
            prepared = [self._preflight(verify)]
            self._check_paused(asked)
            error = ""
        except ValueError as e:
            prepared, error = [], str(e)
        except BaseException as e:  # the source's own failure: the other ranks raise it now, not at a timeout
            try:
                self.comm.publish(self.keys.preflight(self.rank), {"rank": self.rank, "error": describe(e)})
            except Exception:  # noqa: BLE001 - the store is gone: this rank's own error is what matters
                pass
            raise
        errors = gather(self.comm, self.keys.preflight, error, rank=self.rank, ranks=self.init_info.num_trainer_ranks)
        if self.is_sender and self.sync_id > 1:
            self._forget(self.sync_id - 1)
        if failed := next((e for e in errors if isinstance(e, dict)), None):
            raise RuntimeError(f"weight sync {self.sync_id}: trainer rank {failed['rank']}: {failed['error']} "
                               "(in its preflight: nothing moved, the engines were not asked to update)")
        if any(errors):  # nothing moved; the engines were not asked to update
            raise preflight_error(next(e for e in errors if e))
        return prepared[0]

    def send_weights(self, *, weight_version: str | None = None, verify: bool = False) -> SyncStats:
        """Push the source's weights to every worker; returns once every worker applied them (``verify``:
        checked against checksums of what was sent). Collective on every trainer rank; failures: see above."""
        if self.failed is not None:
            raise PoisonedError(f"a previous sync failed ({self.failed}); the engines refuse updates until "
                                f"re-initialized: call {type(self).__name__}.trainer_init(init_info, client=..., "
                                "source=...) again on every trainer rank (the same master_port works)")
        if self._closed:
            raise RuntimeError("the engine was shut down; call trainer_init again")
        self.sync_id, self._t0 = self.sync_id + 1, time.monotonic()
        stats = SyncStats(backend=self.init_info.backend, rank=self.rank, weight_version=weight_version)
        with stats.timed("preflight"):
            prepared = self._agreed_preflight(verify)
        self._started, self._start_sent, self._update_call, self._finished = False, False, None, False
        try:
            with stats.timed("start"):
                wait = self._start_update(self._update_info(prepared, verify)) if self.is_sender else None
            waited: list[float] = []

            def started() -> None:  # no rank moves data before the engines accepted the update
                if waited:
                    return
                t0 = time.perf_counter()
                if wait is not None:
                    wait()
                else:
                    self.comm.await_key(self.keys.started)
                self._started = True
                waited.append(time.perf_counter() - t0)
            with stats.timed("transfer"):
                self._transfer(prepared, stats, verify, started)
                started()
                if not self.is_sender:  # (rank 0 reads the others')
                    self.comm.publish(self.keys.sent(self.rank), _OK)
                else:
                    received = self._applied()
                    if self.init_info.num_trainer_ranks > 1:  # one wait for every rank's
                        self.comm.read_all([self.keys.sent(r) for r in range(1, self.init_info.num_trainer_ranks)])
            stats.phases["start"] += waited[0]  # what was left to wait for is the start's, not the transfer's
            stats.phases["transfer"] -= waited[0]
            if self.is_sender:
                failure = self.comm.peer_error()  # every worker applied it or reported its failure
                if failure is not None:
                    raise SyncFailed(failure)
                with stats.timed("finish"):
                    self._announce("finish")
                    finish = self._pool.submit(lambda: self.client.finish_weight_update(weight_version), aside=True)
                    client_result(finish, self.init_info.timeout_s, "finish_weight_update")
                    self._finished = True  # (a worker whose finish failed reported it: raised here)
                    check_finished(self.comm)
                    if self._update_call is not None:  # returned by now, unless the client failed after applying
                        client_result(self._update_call, self.init_info.timeout_s, "update_weights")
                stats.lower_bound_per_worker = self._lower_bound()
                workers = sorted(stats.lower_bound_per_worker)
                if received is None:
                    received = self.comm.read_all([self.keys.recv(w) for w in workers]) if workers else []
                stats.bytes_received_per_worker = dict(zip(workers, map(int, received)))
                stats.worker_phases = {w: p for w in workers
                                       if (p := self.comm.peek(self.keys.phases(w))) is not None}
                stats.drafter_bytes_per_worker = {w: int(b) for w in workers
                                                  if (b := self.comm.peek(self.keys.drafter(w))) is not None}
                self.comm.publish(self.keys.verdict, _OK)
                self._outcome_ack = self.keys.ack
                self._held_syncs.append(self.sync_id)
                self._settle_forget()  # (done long ago, while the data moved): no key outlives its sync's return
            else:
                self.comm.await_key(self.keys.verdict)
                self._acknowledge(self.keys.ack)
        except BaseException as e:
            raise self._failed_sync(e) from e
        stats.verified = True if verify else None
        return stats

    def _failed_sync(self, error: BaseException) -> SyncFailed:
        """Every rank: record the first failure and wake every party; rank 0 also waits for its
        update call and aborts the update on every worker. Returns what every rank raises."""
        self.comm.fail(describe(error), error)
        self.comm.fail_keys([self.keys.started, self.keys.verdict])  # the ranks > 0 block on them
        reason = self.comm.peer_error() or f"trainer rank {self.rank}: {describe(error)}"
        if self.is_sender:
            if self._update_call is not None:  # (its failure is the workers' to report)
                settle(self._update_call, left(self._t0, self.init_info.timeout_s))
            if (self._started or self._start_sent) and not taken_over(reason):  # (a start sent but stuck on one
                # worker: the others are in the update; an update vLLM never started, or one another
                # session took over, is not aborted: those engines are not ours)
                margin = 0.0 if self._pool.busy() else MARGIN_S  # a call still running: a stuck worker holds it
                abort = self._pool.submit(lambda: self._abort_workers(reason), aside=True)  # (not behind a stuck call)
                settle(abort, left(self._t0, self.init_info.timeout_s, margin))
        self.failed = reason
        if not self.is_sender:
            self._acknowledge(self.keys.ack)
        else:
            self._outcome_ack = self.keys.ack
        restored = (self.init_info.rollback and not self._finished) or not self._started
        torn = "" if restored else ("; the engines' weights may be partly updated (rollback=False): "
                                    "re-initialize and sync again before serving")
        return SyncFailed(f"weight sync {self.sync_id} failed: {reason}{torn}", restored=restored,
                          stuck=self.is_sender and self._pool.busy())

    def shutdown(self, *, drain: bool = True) -> None:
        """Release the group (and the store, on rank 0, once every rank read the last outcome).
        Call on every trainer rank. ``drain=False``: a client call still stuck is not waited for.
        With ``drain``, rank 0 first has the workers leave the group (the client's
        ``shutdown_weight_transfer_engine``, where it has one; waited for at most ``timeout_s``) while
        the store still runs: a worker's store client left behind would find the store gone at its
        next init, and torch logs that as a C++ stack trace in the engine's log."""
        if self._closed:
            return
        self._settle_forget()
        if self.is_sender and self._outcome_ack:
            self._acknowledge(self._outcome_ack)
        else:
            leave(self.comm, self.rank)
        release = getattr(self.client, "shutdown_weight_transfer_engine", None)
        if self.is_sender and drain and release is not None:
            settle(self._pool.submit(release, aside=True), self.init_info.timeout_s)
        self._pool.drain(self.init_info.timeout_s if drain else 0.0)  # the client calls a failure left running
        for comm in (self.comm, self._calls):
            if comm is not None:
                comm.shutdown()
        self._closed = True

