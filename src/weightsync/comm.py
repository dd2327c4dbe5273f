"""The data-plane seam: a stateless process group between trainer ranks and vLLM workers.

Built from its own TCPStore rendezvous, independent of the trainer's default group and of
vLLM's groups: gloo on CPU, NCCL on CUDA. The store doubles as the small control channel
(``publish`` / ``wait_for``) used for agreement and abort messages; it never carries weights.

On an unregistered group ``torch.distributed.send`` and ``batch_isend_irecv`` refuse to work, so
this module calls the backend's raw ``send``/``recv``/``broadcast`` and waits on their works.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pybase64
import torch
import torch.distributed as dist

__all__ = ["Communicator", "DataPlaneError", "decode_unique_id"]

NCCL_UNIQUE_ID_BYTES = 128


class DataPlaneError(RuntimeError):
    """A peer aborted or a data-plane operation failed or timed out."""


def decode_unique_id(b64: str) -> bytes:
    """Decode a standard-base64 NCCL unique id, checking its length."""
    try:
        raw = pybase64.b64decode(b64, validate=True)
    except (ValueError, TypeError) as e:
        raise ValueError("nccl_unique_id_b64 is not valid standard base64") from e
    if len(raw) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"nccl_unique_id_b64 must decode to {NCCL_UNIQUE_ID_BYTES} bytes, got {len(raw)}")
    return raw


class Communicator:
    """Point-to-point and broadcast among ``world_size`` ranks of one weight-sync group.

    Every method that moves data must be called by the matching peers (collective rule).
    """

    def __init__(self, pg: Any, store: Any, rank: int, world_size: int, device: torch.device,
                 timeout_s: float) -> None:
        self._pg = pg
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout_s = timeout_s

    @classmethod
    def from_tcp_store(cls, host: str, port: int, rank: int, world_size: int, *,
                       device: torch.device | str = "cpu", timeout_s: float = 300.0,
                       group_name: str = "weightsync") -> "Communicator":
        """Join (rank 0 hosts) a TCPStore rendezvous and build gloo (CPU) or NCCL (CUDA) on it."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        device = torch.device(device)
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout,
                              wait_for_workers=False, use_libuv=True)
        prefixed = dist.PrefixStore(f"{group_name}/", store)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        else:
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        comm = cls(pg, store, rank, world_size, device, timeout_s)
        comm.barrier()  # everyone joined before any data moves
        return comm

    # ---- control channel (store) -------------------------------------------------------
    def publish(self, key: str, value: Any) -> None:
        """Put a JSON-safe value under ``key`` for every peer to read."""
        self.store.set(key, json.dumps(value))

    def read(self, key: str, timeout_s: float | None = None) -> Any:
        """Wait (up to the timeout) for ``key`` and return its JSON value."""
        try:
            self.store.wait([key], timedelta(seconds=timeout_s or self.timeout_s))
        except Exception as e:  # torch raises DistStoreError / RuntimeError
            raise DataPlaneError(f"timed out after {timeout_s or self.timeout_s}s waiting for {key!r}") from e
        return json.loads(self.store.get(key))

    def peek(self, key: str) -> Any | None:
        """The JSON value under ``key`` if set, else None (never blocks)."""
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    # ---- data plane -------------------------------------------------------------------
    def _wait(self, work: Any, what: str) -> None:
        try:
            ok = work.wait(timedelta(seconds=self.timeout_s))
        except Exception as e:
            raise DataPlaneError(f"{what} failed on rank {self.rank}: {e}") from e
        if ok is False:
            raise DataPlaneError(f"{what} timed out after {self.timeout_s}s on rank {self.rank}")

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Any:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        work = self._pg.broadcast([tensor], opts)
        if async_op:
            return work
        self._wait(work, "broadcast")
        return None

    def wait(self, work: Any, what: str = "operation") -> None:
        """Wait for a work returned by an ``async_op=True`` call."""
        self._wait(work, what)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Any:
        return self._pg.send([tensor], dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Any:
        return self._pg.recv([tensor], src, tag)

    def exchange(self, sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[torch.Tensor, int, int]],
                 what: str = "point-to-point round") -> None:
        """Post every ``(tensor, peer, tag)`` send and receive together, then wait for all of them
        (NCCL: one coalesced group). The peers must post the matching ops in their own call."""
        cuda = self.device.type == "cuda"
        if cuda:
            self._pg._start_coalescing(self.device)
        works = [self._pg.send([t], peer, tag) for t, peer, tag in sends]
        works += [self._pg.recv([t], peer, tag) for t, peer, tag in recvs]
        if cuda:
            works = [self._pg._end_coalescing(self.device)]
        for w in works:
            self._wait(w, what)

    def barrier(self) -> None:
        flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._wait(self._pg.allreduce([flag]), "barrier")

    def shutdown(self) -> None:
        """Drop the group and the store. Safe to call twice."""
        pg, self._pg = self._pg, None
        if pg is not None and hasattr(pg, "abort") and self.device.type == "cuda":
            pg.abort()
        self.store = None
