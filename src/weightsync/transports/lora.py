"""LoRA adapter sync, shard to shard: trainer ranks' ``lora_A`` / ``lora_B`` shards into vLLM's LoRA slots.

Trainer side :class:`~weightsync.trainer.lora.LoRASource` (local FSDP2 shards, never gathered); worker
side :class:`~weightsync.worker.lora.LoRASlots` (vLLM's stacked LoRA tensors, vLLM's own TP slicing).
:class:`LoRASync` drives it from the trainer, every rank constructing one (rank 0 with the engines):

* init: every worker resolves the adapter's tensors to the blocks its TP rank holds and checks them
  (:func:`worker_plan`), answering them as the reshard plan's destinations (``DestPiece`` s into its
  slot's matrices); any worker's refusal is a ``ValueError`` naming the field on every trainer rank,
  before anything moves. Rank 0 shares them over the trainer's own process group and every trainer
  rank plans: the adapter's shards (``LoRASource.sources``) are the plan's sources, and its rounds
  are cut once (:mod:`weightsync.reshard.handshake`).
  The workers also fingerprint their live base tensors that the trainer's base has too (its 1-D
  ones: norms), and every trainer rank compares them with the sum of the ranks' fingerprints of their
  shards: an engine that serves another base (another model, ``load_format="dummy"``) is ``Refused``
  naming the parameter (the adapter alone is sent, so the engine must already hold the trainer's base).
* a sync: rank 0 hosts a store; workers (:func:`worker_receive`, in the engine's ``collective_rpc``)
  and trainer ranks join a fresh data plane (gloo on CPU, NCCL on CUDA); rank 0 publishes the sources,
  each worker its destinations, every worker plans from them and all parties agree on the plan's
  digest before any data moves (a worker whose blocks changed since init fails the sync). Then the
  reshard executor (:func:`~weightsync.reshard.handshake.run_rounds`) moves the rounds, as for M2N:
  each element once, from the trainer rank the plan picks, read from its local shard, written
  into a free slot of each worker that holds it. A worker reports the bytes it received. Only when
  every worker staged does rank 0 commit (the adapter id switches to the new slot on every worker);
  otherwise every worker discards its staged slot and the previous version keeps serving. Rank 0
  publishes the outcome on the store and every rank returns or raises it: one outcome on every rank,
  as for every transport.
* the workers are called by method name (:class:`LoRAWorkerExtension`, mixed into vLLM's workers by
  ``worker_extension_cls=WORKER_EXTENSION``) with JSON-safe arguments: no function is sent, so vLLM
  needs no ``VLLM_ALLOW_INSECURE_SERIALIZATION``. Every wait is bounded by ``timeout_s`` (plus
  ``MARGIN_S`` for each clean-up step): a stuck worker makes every trainer rank raise.

Transports: this is M2N's reshard core with the adapter as one more kind of source and destination;
why not broadcast or IPC: docs/lora.md.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, wait
from typing import Any, cast

import torch

from ..comm import Communicator, describe
from ..control import SyncKeys, m2n_dest, m2n_sources
from ..errors import Refused
from ..plan.regions import Replicate, Shard
from ..plan.schedule import message_cap
from ..plan.transfer import DestPiece
from ..protocol import ParamMeta, dtype_from_name, dtype_name
from ..reshard.handshake import (
    DestsWire,
    Gathered,
    Rounds,
    agree_digest,
    gather_plan,
    my_messages,
    pieces_from_wire,
    pieces_to_wire,
    planned,
    run_rounds,
    sources_from_wire,
    sources_to_wire,
)
from ..stats import SyncStats
from ..trainer.lora import LoRASource
from ..trainer.session import share_json
from ..trainer.waits import MARGIN_S, in_thread
from ..worker.lora import base_fingerprints, lora_slots

__all__ = ["LoRASync", "LoRAWorkerExtension", "WORKER_EXTENSION", "STAGING_BYTES", "worker_plan", "worker_receive"]

STAGING_BYTES = 32 << 20
"""Each party's staging buffer for a sync's rounds (touched only as far as the rounds in flight need;
every party cuts the same messages from it)."""
_OUTCOME_MARGIN_S = 4 * MARGIN_S
"""How long past ``timeout_s`` ranks > 0 wait for rank 0's outcome: rank 0 waits for the workers' replies
until ``MARGIN_S`` past ``timeout_s``, then for the commit or discard at most ``MARGIN_S`` more."""


def meta_wire(m: ParamMeta) -> list[Any]:
    """``m`` as plain values (vLLM's ``collective_rpc`` serializes arguments with msgspec)."""
    places = [["S", p.dim] if isinstance(p, Shard) else ["R"] for p in m.placements]
    return [m.name, dtype_name(m.dtype), list(m.shape), list(m.mesh_shape), places,
            [list(c) for c in m.rank_coordinates]]


def meta_unwire(w: list[Any]) -> ParamMeta:
    name, dtype, shape, mesh, places, coords = w
    return ParamMeta(name, dtype_from_name(dtype), tuple(shape), mesh_shape=tuple(mesh),
                     placements=tuple(Shard(p[1]) if p[0] == "S" else Replicate() for p in places),
                     rank_coordinates=tuple(tuple(c) for c in coords))


# ---- worker side: methods of every vLLM worker, mixed in by ``worker_extension_cls`` -----------------
WORKER_EXTENSION = "weightsync.transports.lora.LoRAWorkerExtension"
"""What to pass as vLLM's ``worker_extension_cls`` (``LLM(..., worker_extension_cls=WORKER_EXTENSION)``,
``vllm serve --worker-extension-cls ...``) so that :class:`LoRASync` can call the workers by name."""


def worker_plan(worker: Any, adapter_id: int, config: dict[str, Any], wire: list[list[Any]],
                base: list[list[Any]] | None = None) -> dict[str, Any]:
    """Resolve and check; ``{"rank", "pieces", "base"}`` (its blocks as the plan's destinations, the wire form
    of ``DestsWire``; the fingerprints of ``base``, the trainer's base tensors ``[name, shape]``:
    ``base_fingerprints``) or ``{"error"}`` (never raises into vLLM)."""
    try:
        metas = [meta_unwire(w) for w in wire]
        slots = lora_slots(worker)
        slots.plan(adapter_id, config, [(m.name, m.shape) for m in metas])
        return {"rank": int(worker.rank), "pieces": pieces_to_wire(slots.dests(adapter_id))["pieces"],
                "base": base_fingerprints(slots.manager.model, base) if base else {}}
    except Exception as e:  # noqa: BLE001 - reported to the trainer, raised there
        return {"error": describe(e)}


def _cap(num_trainer_ranks: int, num_workers: int) -> int:
    """The largest message of a sync's rounds (the same on every party)."""
    return message_cap(STAGING_BYTES, num_trainer_ranks, num_workers, buffers=2)


def worker_receive(worker: Any, adapter_id: int, host: str, port: int, base: int, world: int,
                   num_trainer_ranks: int, timeout_s: float) -> dict[str, Any]:
    """Join the sync's data plane as ``base + worker.rank``, publish this worker's destinations, plan,
    agree on the digest, and receive its blocks into a staged slot; ``{"received": bytes}`` or ``{"error"}``."""
    comm = None
    slots = lora_slots(worker)
    try:
        comm = Communicator.connect(host, port, name=f"worker {worker.rank}", timeout_s=timeout_s, hosted=True)
        n, w = num_trainer_ranks, base - num_trainer_ranks + int(worker.rank)
        targets = slots.begin(adapter_id)
        comm.join(base + int(worker.rank), world, device=slots.device)
        sources = sources_from_wire(comm.read(m2n_sources(0)))
        comm.publish(m2n_dest(w), pieces_to_wire(slots.dests(adapter_id)))
        plan = gather_plan(comm, sources, world - n).plan
        agree_digest(comm, plan.digest)
        rounds = my_messages(plan, sources, rank=w, sender=False, cap=_cap(n, world - n))
        staging = torch.empty(STAGING_BYTES, dtype=torch.uint8, device=slots.device)
        received = run_rounds(comm.data, rounds, staging, sender=False, peer_rank=lambda r: r,
                              dtypes={s.name: s.dtype for s in sources},
                              tensor_of=lambda m, i: targets[m.items[i].param])
        return {"received": slots.end(adapter_id, received)}
    except Exception as e:  # noqa: BLE001 - reported to the trainer, raised there
        if comm is not None:
            comm.fail(describe(e), e)
        try:
            slots.discard(adapter_id)
        except Exception:  # noqa: BLE001 - an adapter never planned here: nothing staged
            pass
        return {"error": describe(e)}
    finally:
        if comm is not None:
            comm.shutdown()


def _reported(call: Any) -> dict[str, Any]:
    try:
        call()
        return {}
    except Exception as e:  # noqa: BLE001 - reported to the trainer, raised there
        return {"error": describe(e)}


class LoRAWorkerExtension:
    """Mixed into every vLLM worker by ``worker_extension_cls=WORKER_EXTENSION``: :class:`LoRASync` calls
    these by name through ``collective_rpc`` with JSON-safe arguments (no function is ever sent, so vLLM
    needs no ``VLLM_ALLOW_INSECURE_SERIALIZATION``). Each answers a dict, ``{"error"}`` on failure: a
    worker never raises into vLLM during a sync (see ``weightsync.worker.engine``)."""

    def weightsync_lora_plan(self, adapter_id: int, config: dict[str, Any], wire: list[list[Any]],
                             base: list[list[Any]] | None = None) -> dict[str, Any]:
        return worker_plan(self, adapter_id, config, wire, base)

    def weightsync_lora_receive(self, adapter_id: int, host: str, port: int, base: int, world: int,
                                num_trainer_ranks: int, timeout_s: float) -> dict[str, Any]:
        return worker_receive(self, adapter_id, host, port, base, world, num_trainer_ranks, timeout_s)

    def weightsync_lora_commit(self, adapter_id: int, version: int) -> dict[str, Any]:
        return _reported(lambda: lora_slots(self).commit(adapter_id, version))

    def weightsync_lora_discard(self, adapter_id: int) -> dict[str, Any]:
        return _reported(lambda: lora_slots(self).discard(adapter_id))

    def weightsync_lora_state(self) -> dict[int, dict[str, Any]]:
        """Per adapter id: its slot, version and the bytes its last sync received."""
        return lora_slots(self).state()


# ---- trainer side ------------------------------------------------------------------------------
def _rpc(engine: Any, method: str, args: tuple[Any, ...], timeout_s: float) -> Future:
    """``collective_rpc(method, args=args)`` on an ``LLM`` or a Ray actor handle of one, in a thread, bounded
    by ``timeout_s`` on its own too (vLLM's and Ray's timeouts); its future."""
    call = engine.collective_rpc
    if hasattr(call, "remote"):
        def remote() -> Any:
            import ray

            return ray.get(call.remote(method, timeout=timeout_s, args=args), timeout=timeout_s)

        return in_thread(remote, "weightsync-lora-rpc")
    return in_thread(lambda: call(method, timeout=timeout_s, args=args), "weightsync-lora-rpc")


def _replies(futures: list[Future], method: str, deadline: float) -> list[list[Any]]:
    """Each engine's replies, waited for until ``deadline`` (``time.monotonic()``): ``TimeoutError`` naming
    the call; an engine without the extension's methods is refused naming ``worker_extension_cls``."""
    wait(futures, timeout=max(0.0, deadline - time.monotonic()))
    out = []
    for i, f in enumerate(futures):
        if not f.done():
            raise TimeoutError(f"engines[{i}] did not answer {method} within timeout_s (a worker is stuck or gone)")
        try:
            out.append(list(f.result(timeout=0)))
        except Exception as e:  # noqa: BLE001 - re-raised, named
            if method in str(e) and ("attribute" in str(e) or "not found" in str(e)):
                raise ValueError(f"worker_extension_cls: engines[{i}]'s workers have no {method}: start the engine "
                                 f"with worker_extension_cls={WORKER_EXTENSION!r}") from None
            raise RuntimeError(f"engines[{i}]: {method} failed: {describe(e)}") from None
    return out


def _checked(replies: list[Any], what: str) -> list[Any]:
    errors = [r["error"] for r in replies if isinstance(r, dict) and "error" in r]
    if errors:
        more = f" (and {len(errors) - 1} more worker(s))" if len(errors) > 1 else ""
        raise ValueError(f"{what}: {errors[0]}{more}")
    return replies


def _shared_error(e: Exception) -> dict[str, str]:
    """An init or set-up failure of rank 0 as every rank raises it (bad input stays a ``ValueError``)."""
    if isinstance(e, ValueError):
        return {"error": str(e), "kind": type(e).__name__ if isinstance(e, Refused) else "ValueError"}
    return {"error": describe(e)}


def _raise_shared(error: dict[str, str]) -> None:
    kind = {"Refused": Refused, "ValueError": ValueError}.get(error.get("kind", ""), RuntimeError)
    raise kind(error["error"])


class LoRASync:
    """Sync one adapter of a PEFT model into engines' LoRA slots, as ``adapter_id`` (see the module docstring).

    Args:
        source: this rank's :class:`~weightsync.trainer.lora.LoRASource`.
        adapter_id: the ``LoRARequest.lora_int_id`` the engines serve the adapter under.
        engines: rank 0: the vLLM ``LLM`` objects or Ray handles of them, started with
            ``worker_extension_cls=WORKER_EXTENSION``; other ranks: ignored.
        host: where rank 0 hosts each sync's store (workers connect to it).
        timeout_s: bound of every wait of an init or a sync: a stuck worker makes every trainer rank
            raise within ``timeout_s`` plus a few seconds.
    """

    def __init__(self, source: LoRASource, adapter_id: int, engines: Sequence[Any] = (), *,
                 host: str = "127.0.0.1", timeout_s: float = 120.0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.source, self.adapter_id, self.engines = source, adapter_id, list(engines)
        self.host, self.timeout_s = host, timeout_s
        self.version = 0
        plans = self._share(self._plan_all() if source.rank == 0 else None)
        if isinstance(plans, dict):
            _raise_shared(plans)
        workers = [w for ws in plans for w in sorted(ws, key=lambda w: w["rank"])]
        self._check_base([w.get("base", {}) for w in workers])
        self.dests: list[list[DestPiece]] = [pieces_from_wire(cast(DestsWire, w)) for w in workers]
        self.engine_workers = [len(ws) for ws in plans]
        self._plan: Gathered = planned(source.sources, self.dests)
        self._dtypes = {s.name: s.dtype for s in source.sources}
        self._rounds: Rounds = my_messages(self._plan.plan, source.sources, rank=source.rank, sender=True,
                                           cap=_cap(source.num_trainer_ranks, self.workers))

    def _plan_all(self) -> Any:
        """Rank 0: every engine's workers' plans, or the error every rank raises."""
        try:
            if not self.engines:
                raise ValueError("engines: trainer rank 0 needs at least one engine")
            wire = [meta_wire(m) for m in self.source.metadata]
            args = (self.adapter_id, self.source.config, wire, [list(b) for b in self.source.base_metadata])
            futures = [_rpc(e, "weightsync_lora_plan", args, self.timeout_s) for e in self.engines]
            replies = _replies(futures, "weightsync_lora_plan", time.monotonic() + self.timeout_s)
            return [_checked(ws, "LoRA init") for ws in replies]
        except Exception as e:  # noqa: BLE001 - every rank raises it
            return _shared_error(e)

    def _check_base(self, reported: list[dict[str, list[Any]]]) -> None:
        """Every rank (the same outcome on each): ``Refused`` naming the first base tensor a worker holds
        with other values than the trainer's (``reported``: per worker, name -> ``[dtype, fingerprint]``).
        Collective over the trainer ranks (one all-reduce) when they are several."""
        wanted = sorted({(name, dtype) for rep in reported for name, (dtype, _) in rep.items()})
        if not wanted:
            return
        sums = torch.tensor(self.source.base_fingerprints([(n, dtype_from_name(d)) for n, d in wanted]),
                            dtype=torch.int64)
        if self.source.num_trainer_ranks > 1:  # int64 sums wrap as the fingerprints' do (modulo 2**64)
            import torch.distributed as dist

            on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
            sums = sums.to(on)
            dist.all_reduce(sums)
        trainer = dict(zip(wanted, sums.cpu().tolist()))
        for w, rep in enumerate(reported):
            for name, (dtype, fp) in rep.items():
                if fp != trainer[(name, dtype)]:
                    raise Refused(f"parameter {name!r}: worker {w} serves other base weights than the trainer's "
                                  f"(its {dtype} values' fingerprint {fp}, the trainer's {trainer[(name, dtype)]}): "
                                  "a LoRA sync sends the adapter only, so the engine must already hold the "
                                  "trainer's base model: start it from the trainer's base checkpoint (not "
                                  "load_format='dummy', not another model or revision)")

    def _share(self, value: Any) -> Any:
        return value if self.source.num_trainer_ranks == 1 else share_json(value)

    @property
    def workers(self) -> int:
        return len(self.dests)

    @property
    def digest(self) -> str:
        """The plan's digest (every party of a sync agrees on it before any data moves)."""
        return self._plan.plan.digest

    def worker_bytes(self) -> list[int]:
        """Each worker's shard of the adapter, in bytes (what it receives per sync)."""
        return list(self._plan.plan.coverage().lower_bound)

    def sync(self, *, _fail_at: int | None = None) -> SyncStats:
        """Send this rank's parts; rank 0 then commits (or discards) on every worker and publishes the
        outcome, which every rank returns or raises. Collective over the trainer ranks. Returns this
        rank's ``SyncStats`` (``weight_version``: the adapter's new version, ``str(self.version)``;
        ``bytes_sent``; ``phases["transfer"]``; rank 0 also ``bytes_received_per_worker`` and
        ``lower_bound_per_worker``: each worker's shard); raises ``RuntimeError`` on every rank on
        failure, the previous version still serving. ``_fail_at`` (tests): this rank fails as it would
        post worker ``_fail_at`` its bytes (rounds posted before went out)."""
        comm = port = None
        if self.source.rank == 0:
            try:
                comm = Communicator.connect(self.host, 0, name="trainer rank 0", timeout_s=self.timeout_s,
                                            host_store=True)
                port = comm.port
            except Exception as e:  # noqa: BLE001 - every rank raises it
                port = _shared_error(e)
        port = self._share(port)
        if isinstance(port, dict):
            raise RuntimeError(f"LoRA sync of adapter_id {self.adapter_id}: trainer rank 0 could not host the "
                               f"sync's store: {port['error']}")
        t0 = time.monotonic()  # (every rank got here: the trainer ranks' clocks start together)
        try:
            if self.source.rank == 0:
                return self._lead(comm, port, _fail_at, t0)
            comm = Communicator.connect(self.host, port, name=f"trainer rank {self.source.rank}",
                                        timeout_s=self.timeout_s, hosted=True)  # (rank 0 shared its port)
            return self._follow(comm, _fail_at, t0)
        finally:
            if comm is not None:
                comm.shutdown()

    def _lead(self, comm: Communicator, port: int, fail_at: int | None, t0: float) -> SyncStats:
        """Rank 0: start every worker's receive, send, then settle the outcome on every worker."""
        n = self.source.num_trainer_ranks
        futures, base = [], n
        for e, num in zip(self.engines, self.engine_workers):
            args = (self.adapter_id, self.host, port, base, n + self.workers, n, self.timeout_s)
            futures.append(_rpc(e, "weightsync_lora_receive", args, self.timeout_s))
            base += num
        error, sent = self._send(comm, fail_at)
        try:
            replies = [r for ws in _replies(futures, "weightsync_lora_receive", t0 + self.timeout_s + MARGIN_S)
                       for r in ws]
            failed = [r["error"] for r in replies if "error" in r]
        except Exception as e:  # noqa: BLE001 - a worker stuck or gone: the sync failed
            replies, failed = [], [describe(e)]
        if error is None and not failed:
            try:
                self._on_engines("weightsync_lora_commit", (self.adapter_id, self.version + 1), "LoRA commit")
                self.version += 1
                stats = self._stats(sent, t0)
                stats.bytes_received_per_worker = {w: int(r["received"]) for w, r in enumerate(replies)}
                stats.lower_bound_per_worker = dict(enumerate(self.worker_bytes()))
                return self._publish(comm, {"version": self.version}, stats)
            except Exception as e:  # noqa: BLE001 - the sync failed (reported on every rank)
                failed = [describe(e)]
        # the first failure any party reported (the others' errors follow from it), else what was seen here
        why = comm.peer_error() or (failed[0] if failed else describe(error))
        try:
            self._on_engines("weightsync_lora_discard", (self.adapter_id,), "LoRA discard")
        except Exception:  # noqa: BLE001 - a stuck worker: its staged slot stays staged, never served
            pass
        message = f"LoRA sync of adapter_id {self.adapter_id} failed, version {self.version} still serving: {why}"
        return self._publish(comm, {"error": message}, self._stats(sent, t0))

    def _on_engines(self, method: str, args: tuple[Any, ...], what: str) -> None:
        """``method`` on every engine's workers, waited for at most ``MARGIN_S`` beyond ``timeout_s`` of the
        sync (a worker stuck in it is not waited for longer); ``ValueError`` naming a worker's error."""
        futures = [_rpc(e, method, args, self.timeout_s) for e in self.engines]
        for ws in _replies(futures, method, time.monotonic() + MARGIN_S):
            _checked(ws, what)

    def _stats(self, sent: int, t0: float) -> SyncStats:
        """This rank's stats of the sync that began at ``t0`` (``time.monotonic()``), ``sent`` bytes sent."""
        return SyncStats(backend="lora", rank=self.source.rank, bytes_sent=sent, weight_version=str(self.version),
                         num_tensors=len(self.source.metadata), num_steps=1,
                         phases={"transfer": time.monotonic() - t0})

    def _publish(self, comm: Communicator, verdict: dict[str, Any], stats: SyncStats) -> SyncStats:
        """Rank 0: the outcome for every rank, whose reading is waited for (at most ``timeout_s``) before the
        store goes; then rank 0's own outcome (the same as every rank's)."""
        keys = SyncKeys(verdict.get("version", self.version + 1))  # (the sync's number: the version it makes)
        comm.publish(keys.verdict, verdict)
        ranks = range(1, self.source.num_trainer_ranks)
        if ranks:
            comm.wait_for([keys.ack(r) for r in ranks], self.timeout_s)
        if "error" in verdict:
            raise RuntimeError(verdict["error"])
        return stats

    def _follow(self, comm: Communicator, fail_at: int | None, t0: float) -> SyncStats:
        """Ranks > 0: send, then take rank 0's outcome (it settles within ``timeout_s`` plus margins)."""
        error, sent = self._send(comm, fail_at)
        keys = SyncKeys(self.version + 1)
        limit = max(0.0, t0 + self.timeout_s + _OUTCOME_MARGIN_S - time.monotonic())
        if not comm.wait_for([keys.verdict], limit):
            raise RuntimeError(f"LoRA sync of adapter_id {self.adapter_id}: trainer rank 0 published no outcome "
                               f"within timeout_s={self.timeout_s} (+{_OUTCOME_MARGIN_S:g} s)"
                               + (f"; this rank failed: {describe(error)}" if error is not None else "")) from error
        verdict = comm.peek(keys.verdict)
        try:
            comm.publish(keys.ack(self.source.rank), True)
        except Exception:  # noqa: BLE001 - rank 0 stopped waiting: the outcome is read anyway
            pass
        if "error" in verdict:
            raise RuntimeError(verdict["error"]) from error
        self.version = int(verdict["version"])
        return self._stats(sent, t0)

    def _send(self, comm: Communicator, fail_at: int | None) -> tuple[BaseException | None, int]:
        """Every rank: join the sync's data plane, agree on the plan's digest with every worker and send
        this rank's rounds from its local shards; the error, if any (recorded on the store first: every
        party waiting there wakes), and the bytes sent."""
        n, source = self.source.num_trainer_ranks, self.source
        try:
            shards = source.shards()
            for s in source.sources:
                if tuple(shards[s.name].shape) != s.regions[source.rank].sizes:
                    raise ValueError(f"parameter {s.name!r}: expected a local shard of {s.regions[source.rank].sizes}, "
                                     f"the model holds {tuple(shards[s.name].shape)}")
            device = next(iter(shards.values())).device
            if source.rank == 0:
                comm.publish(m2n_sources(0), sources_to_wire(source.sources))
            comm.join(source.rank, n + self.workers, device=device)
            agree_digest(comm, self.digest)
            def peer_rank(w: int) -> int:  # (asked as a message to worker w is posted)
                if w == fail_at:
                    raise RuntimeError(f"injected failure before worker {w}'s bytes")
                return n + w

            sent = run_rounds(comm.data, self._rounds, torch.empty(STAGING_BYTES, dtype=torch.uint8, device=device),
                              sender=True, peer_rank=peer_rank, dtypes=self._dtypes,
                              tensor_of=lambda m, i: shards[m.items[i].name])
            return None, sent
        except Exception as e:  # noqa: BLE001 - rank 0 settles it; every rank raises its outcome
            comm.fail(describe(e), e)
            return e, 0

