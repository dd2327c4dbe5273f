"""Trainer sessions and the checks ``TrainerEngine.trainer_init`` and a sync's end share.

Every ``trainer_init`` draws a session id on trainer rank 0 (:func:`new_session`), sent in every
worker's init info and in every abort: a worker bound to one session refuses another's init unless it
asks ``take_over`` (:meth:`weightsync.worker.engine.WorkerEngine.fence`), and ignores another session's
abort. A session whose update a take-over aborted does not abort the engines again (they are the new
session's): :func:`taken_over`. A rank > 0 re-initializing on a fixed ``master_port`` connects to the new
init's store, never to the previous one rank 0 is still closing: :func:`connect_fresh`. What one trainer
rank learned (a plan, a port, a verdict) reaches the others as JSON in tensors (:func:`share_json`), never
pickled: torch's object collectives would unpickle whatever a peer on the trainer's network sent.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ..control import trainer_left
from ..errors import DataPlaneError, SyncFailed
from ..infos import TAKEN_OVER
from ..protocol import WeightSource
from ..sealed import StoreClosed

__all__ = ["new_session", "taken_over", "check_finished", "check_source", "connect_fresh", "leave", "share_json"]


def new_session() -> str:
    """A fresh trainer session id (random: two trainers never draw the same)."""
    return secrets.token_hex(8)


def taken_over(reason: str | None) -> bool:
    """Whether a sync's failure is another trainer session taking the engines over."""
    return reason is not None and TAKEN_OVER in reason


def check_finished(comm: Any) -> None:
    """Rank 0, after the finish call returned: a worker whose finish failed reported it (workers never
    raise into vLLM); raise it as the sync's failure."""
    failure = comm.peer_error()
    if failure is not None:
        raise SyncFailed(failure)


def check_source(backend: str, kind: str, source: WeightSource | None) -> None:
    if source is None:
        raise ValueError(f"source is required for the {backend} transport")
    method = "iter_local" if kind == "local" else "iter_full"
    if getattr(type(source), method) is getattr(WeightSource, method):
        want = "DTensorModuleSource" if kind == "local" else "FullTensorSource"
        raise ValueError(f"the {backend} transport reads {method}(); source {type(source).__name__} does not "
                         f"implement it (use {want})")


def leave(comm: Any, rank: int) -> None:
    """Rank > 0, shutting its engine down: mark the store as one this rank left (see :func:`connect_fresh`)."""
    try:
        comm.publish(trainer_left(rank), True)
    except Exception:  # noqa: BLE001 - the store's host is gone already: nothing to mark
        pass


def connect_fresh(connect: Callable[[], Any], rank: int, timeout_s: float) -> Any:
    """Rank > 0: the store of this init. One this rank left (:func:`leave`) is the previous init's, which
    rank 0 is still closing on the same port: wait (at most ``timeout_s``) until it is gone, then connect again
    (also when it closed while this rank connected to it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            comm = connect()
            if comm.peek(trainer_left(rank)) is None:
                return comm
        except (StoreClosed, dist.DistNetworkError):  # the previous init's store closed while this rank
            if time.monotonic() > deadline:  # connected to it or looked into it: connect again
                raise
            continue
        comm.wait_for([trainer_left(0)], deadline - time.monotonic())  # never set: returns once it closed
        comm.shutdown()
        if time.monotonic() > deadline:
            raise DataPlaneError(f"trainer rank {rank}: the previous init's store on this master_port was not "
                                 f"closed within timeout_s={timeout_s}: shut the engine down on trainer rank 0 too")


def share_json(value: Any, *, src: int = 0, group: Any = None) -> Any:
    """Trainer rank ``src``'s ``value`` (JSON: dicts, lists, str, numbers, None; tuples come back as
    lists) on every rank of ``group`` (default: the default process group); the others' ``value`` is
    ignored. Collective. A value JSON cannot hold raises ``TypeError`` on every rank."""
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    data = b""
    if dist.get_rank() == src:
        try:
            data = json.dumps({"value": value}).encode()
        except (TypeError, ValueError) as e:
            data = json.dumps({"error": f"share_json: trainer rank {src}'s value is not JSON: {e}"}).encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data
           else torch.empty(int(size), dtype=torch.uint8, device=device))
    dist.broadcast(buf, src=src, group=group)
    shared = json.loads(buf.cpu().numpy().tobytes())
    if "error" in shared:
        raise TypeError(shared["error"])
    return shared["value"]
