"""LoRA adapter sync, shard to shard: trainer ranks' ``lora_A`` / ``lora_B`` shards into vLLM's LoRA slots.

Trainer side :class:`~weightsync.trainer.lora.LoRASource` (local FSDP2 shards, never gathered); worker
side :class:`~weightsync.worker.lora.LoRASlots` (vLLM's stacked LoRA tensors, vLLM's own TP slicing).
:class:`LoRASync` drives it from the trainer, every rank constructing one (rank 0 with the engines):

* init: every worker resolves the adapter's tensors to the blocks its TP rank holds and checks them
  (:func:`worker_plan`); any worker's refusal is a ``ValueError`` naming the field on every trainer rank,
  before anything moves. Rank 0 shares the plans over the trainer's own process group.
* a sync: rank 0 hosts a store; workers (:func:`worker_receive`, in their own thread of the engine's
  ``collective_rpc``) and trainer ranks join a fresh data plane (gloo on CPU, NCCL on CUDA); each
  trainer rank sends every worker one message: the parts of that worker's blocks in its own shards,
  packed (M2N's pairing: each element once, from the lowest rank that holds it). A worker receives
  exactly its shard of the adapter, writes it into a free slot, and reports. Only when every worker
  staged does rank 0 commit (the adapter id switches to the new slot on every worker); otherwise every
  worker discards its staged slot and the previous version keeps serving.

Transports: this is M2N's shard-to-shard pairing on its data plane (an adapter is ~1 % of the model,
so one packed message per pair, no rounds). Broadcast (``weightsync_nccl``) would send every worker
the whole adapter, gathered: more bytes than any worker's shard at TP >= 2, so it is not offered.
IPC (``weightsync_ipc``, colocated) applies in principle (the slot could be filled from the trainer's
CUDA handles) but needs GPUs; it is not built here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..comm import Communicator, describe
from ..plan.regions import Region, Replicate, Shard
from ..protocol import ParamMeta, dtype_from_name, dtype_name
from ..trainer.lora import LoRASource, sender_regions
from ..trainer.session import share_json
from ..worker.lora import lora_slots

__all__ = ["LoRASync", "pair_cuts", "worker_plan", "worker_receive", "worker_commit", "worker_discard",
           "worker_state", "worker_slot"]

Blocks = list[tuple[str, Region]]


def pair_cuts(blocks: Sequence[tuple[str, Region]], metas: Sequence[ParamMeta], trainer_rank: int) -> Blocks:
    """The parts of a worker's ``blocks`` that ``trainer_rank`` sends it, in order (both ends compute it)."""
    senders = {m.name: sender_regions(m)[trainer_rank] for m in metas}
    out = []
    for name, block in blocks:
        mine = senders.get(name)
        part = block.intersect(mine) if mine is not None else None
        if part is not None and not part.is_empty:
            out.append((name, part))
    return out


def meta_wire(m: ParamMeta) -> list[Any]:
    """``m`` as plain values (vLLM's ``collective_rpc`` serializes arguments with msgspec)."""
    places = [["S", p.dim] if isinstance(p, Shard) else ["R"] for p in m.placements]
    return [m.name, dtype_name(m.dtype), list(m.shape), list(m.mesh_shape), places, [list(c) for c in m.rank_coordinates]]


def meta_unwire(w: list[Any]) -> ParamMeta:
    name, dtype, shape, mesh, places, coords = w
    return ParamMeta(name, dtype_from_name(dtype), tuple(shape), mesh_shape=tuple(mesh),
                     placements=tuple(Shard(p[1]) if p[0] == "S" else Replicate() for p in places),
                     rank_coordinates=tuple(tuple(c) for c in coords))


# ---- worker side: run in every vLLM worker by the engine's collective_rpc ------------------------
def worker_plan(worker: Any, adapter_id: int, config: dict[str, Any], wire: list[list[Any]]) -> dict[str, Any]:
    """Resolve and check; ``{"rank", "blocks"}`` or ``{"error"}`` (never raises into vLLM)."""
    try:
        metas = [meta_unwire(w) for w in wire]
        slots = lora_slots(worker)
        blocks = slots.plan(adapter_id, config, [(m.name, m.shape) for m in metas])
        slots.adapters[adapter_id].metas = list(metas)
        return {"rank": int(worker.rank), "blocks": [(b.name, b.region.offsets, b.region.sizes) for b in blocks]}
    except Exception as e:  # noqa: BLE001 - reported to the trainer, raised there
        return {"error": describe(e)}


def worker_receive(worker: Any, adapter_id: int, host: str, port: int, base: int, world: int,
                   num_trainer_ranks: int, timeout_s: float) -> dict[str, Any]:
    """Join the sync's data plane as ``base + worker.rank``, receive this worker's blocks from every
    trainer rank and stage them; ``{"received": bytes}`` or ``{"error"}``."""
    comm = None
    slots = lora_slots(worker)
    try:
        a = slots.adapters[adapter_id]
        comm = Communicator.connect(host, port, name=f"worker {worker.rank}", timeout_s=timeout_s)
        comm.join(base + int(worker.rank), world)
        blocks = [(b.name, b.region) for b in a.blocks]
        dtype = a.metas[0].dtype
        recvs, cuts = [], []
        for t in range(num_trainer_ranks):
            parts = pair_cuts(blocks, a.metas, t)
            if parts:
                buf = torch.empty(sum(r.numel for _, r in parts), dtype=dtype)
                recvs.append((buf, t, 0))
                cuts.append(parts)
        comm.data.exchange([], recvs, "LoRA adapter")
        pieces = []
        for (buf, _, _), parts in zip(recvs, cuts):
            for (name, region), flat in zip(parts, buf.split([r.numel for _, r in parts])):
                pieces.append((name, region, flat.view(region.sizes)))
        received = slots.stage(adapter_id, pieces)
        return {"received": received}
    except Exception as e:  # noqa: BLE001 - reported to the trainer, raised there
        if comm is not None:
            comm.fail(f"worker {getattr(worker, 'rank', '?')}: {describe(e)}", e)
        return {"error": describe(e)}
    finally:
        if comm is not None:
            comm.shutdown()


def worker_commit(worker: Any, adapter_id: int, version: int) -> dict[str, Any]:
    try:
        lora_slots(worker).commit(adapter_id, version)
        return {}
    except Exception as e:  # noqa: BLE001
        return {"error": describe(e)}


def worker_discard(worker: Any, adapter_id: int) -> dict[str, Any]:
    try:
        lora_slots(worker).discard(adapter_id)
        return {}
    except Exception as e:  # noqa: BLE001
        return {"error": describe(e)}


def worker_state(worker: Any) -> dict[int, dict[str, Any]]:
    return lora_slots(worker).state()


def worker_slot(worker: Any, lora_id: int) -> dict[str, torch.Tensor]:
    """The stacked LoRA tensors of the slot that serves ``lora_id`` (ours or one vLLM loaded)."""
    m = lora_slots(worker).manager
    return lora_slots(worker).slot_tensors(m.lora_index_to_id.index(lora_id))


# ---- trainer side ------------------------------------------------------------------------------
def _rpc(engine: Any, fn: Any, args: tuple[Any, ...]) -> list[Any]:
    """``collective_rpc`` on an ``LLM`` or a Ray actor handle of one."""
    call = engine.collective_rpc
    if hasattr(call, "remote"):
        import ray

        return ray.get(call.remote(fn, args=args))
    return call(fn, args=args)


def _checked(replies: list[Any], what: str) -> list[Any]:
    errors = [r["error"] for r in replies if isinstance(r, dict) and "error" in r]
    if errors:
        raise ValueError(f"{what}: {errors[0]}" + (f" (and {len(errors) - 1} more worker(s))" if len(errors) > 1 else ""))
    return replies


class LoRASync:
    """Sync one adapter of a PEFT model into engines' LoRA slots, as ``adapter_id`` (see the module docstring).

    Args:
        source: this rank's :class:`~weightsync.trainer.lora.LoRASource`.
        adapter_id: the ``LoRARequest.lora_int_id`` the engines serve the adapter under.
        engines: rank 0: the vLLM ``LLM`` objects or Ray handles of them; other ranks: ignored.
        host: where rank 0 hosts each sync's store (workers connect to it).
        timeout_s: bound of every wait of a sync.
    """

    def __init__(self, source: LoRASource, adapter_id: int, engines: Sequence[Any] = (), *,
                 host: str = "127.0.0.1", timeout_s: float = 120.0) -> None:
        self.source, self.adapter_id, self.engines = source, adapter_id, list(engines)
        self.host, self.timeout_s = host, timeout_s
        self.version = 0
        plans = None
        if source.rank == 0:
            if not self.engines:
                raise ValueError("engines: trainer rank 0 needs at least one engine")
            try:
                wire = [meta_wire(m) for m in source.metadata]
                plans = [_checked(_rpc(e, worker_plan, (adapter_id, source.config, wire)), "LoRA init")
                         for e in self.engines]
            except ValueError as e:
                plans = {"error": str(e)}
        plans = self._share(plans)
        if isinstance(plans, dict):
            raise ValueError(plans["error"])
        self.plans: list[list[Blocks]] = [[[(n, Region(o, s)) for n, o, s in w["blocks"]]
                                           for w in sorted(ws, key=lambda w: w["rank"])] for ws in plans]

    def _share(self, value: Any) -> Any:
        return value if self.source.num_trainer_ranks == 1 else share_json(value)

    @property
    def workers(self) -> int:
        return sum(len(ws) for ws in self.plans)

    def worker_bytes(self) -> list[int]:
        """Each worker's shard of the adapter, in bytes (what it receives per sync)."""
        itemsize = self.source.metadata[0].dtype.itemsize
        return [sum(r.numel for _, r in blocks) * itemsize for ws in self.plans for blocks in ws]

    def sync(self, *, _fail_at: int | None = None) -> dict[str, Any]:
        """Send this rank's parts; rank 0 then commits (or discards) on every worker. Collective over the
        trainer ranks. Returns (rank 0) ``{"version", "received", "seconds"}``; raises on failure, the
        previous version still serving. ``_fail_at`` (tests): this rank fails before sending worker
        ``_fail_at`` its bytes, after the workers before it got theirs."""
        t0 = time.perf_counter()
        n = self.source.num_trainer_ranks
        port = None
        comm = None
        if self.source.rank == 0:
            comm = Communicator.connect(self.host, 0, name="trainer rank 0", timeout_s=self.timeout_s,
                                        host_store=True)
            port = comm.port
        port = self._share(port)
        pool = ThreadPoolExecutor(max(1, len(self.engines)))
        try:
            futures = []
            if self.source.rank == 0:
                base = n
                for e, ws in zip(self.engines, self.plans):
                    args = (self.adapter_id, self.host, port, base, n + self.workers, n, self.timeout_s)
                    futures.append(pool.submit(_rpc, e, worker_receive, args))
                    base += len(ws)
            else:
                comm = Communicator.connect(self.host, port, name=f"trainer rank {self.source.rank}",
                                            timeout_s=self.timeout_s)
            error = self._send(comm, _fail_at)
            if self.source.rank != 0:
                return {}
            replies = [r for f in futures for r in f.result()]
            return self._finish(replies, error, t0)
        finally:
            if comm is not None:
                comm.shutdown()
            pool.shutdown(wait=True)

    def _send(self, comm: Communicator, fail_at: int | None) -> BaseException | None:
        n = self.source.num_trainer_ranks
        works: list[Any] = []
        keep: list[torch.Tensor] = []  # the packed buffers stay alive until their sends complete
        try:
            comm.join(self.source.rank, n + self.workers)
            blocks_per_worker = [blocks for ws in self.plans for blocks in ws]
            for w, blocks in enumerate(blocks_per_worker):
                if fail_at == w:
                    comm.data.wait_all(works, "LoRA adapter")
                    raise RuntimeError(f"injected failure before worker {w}'s bytes")
                pieces = self.source.pieces(pair_cuts(blocks, self.source.metadata, self.source.rank))
                if pieces:
                    wire = self.source.metadata[0].dtype
                    buf = torch.cat([p.reshape(-1).to(wire) for _, _, p in pieces])
                    keep.append(buf)
                    works += comm.data.post([(buf, n + w, 0)], [])
            comm.data.wait_all(works, "LoRA adapter")
            return None
        except Exception as e:  # noqa: BLE001 - rank 0 discards; other ranks raise
            works.clear()  # a pending work keeps gloo's connections open: peers would not wake
            comm.fail(f"trainer rank {self.source.rank}: {describe(e)}", e)
            if self.source.rank != 0:
                raise
            return e

    def _finish(self, replies: list[Any], error: BaseException | None, t0: float) -> dict[str, Any]:
        failed = [r["error"] for r in replies if "error" in r]
        if error is not None or failed:
            for e in self.engines:
                _rpc(e, worker_discard, (self.adapter_id,))
            why = failed[0] if failed else describe(error)
            raise RuntimeError(f"LoRA sync of adapter_id {self.adapter_id} failed, version {self.version} still "
                               f"serving: {why}")
        self.version += 1
        for e in self.engines:
            _checked(_rpc(e, worker_commit, (self.adapter_id, self.version)), "LoRA commit")
        return {"version": self.version, "received": [r["received"] for r in replies],
                "seconds": time.perf_counter() - t0}
