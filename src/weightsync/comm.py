"""The data-plane seam: a stateless process group between trainer ranks and vLLM workers.

Built from its own TCPStore rendezvous, independent of the trainer's default group and of
vLLM's groups: gloo on CPU, NCCL on CUDA. The store doubles as the small control channel
(``publish`` / ``wait_for``) used for agreement and abort messages; it never carries weights.

On an unregistered group ``torch.distributed.send`` and ``batch_isend_irecv`` refuse to work, so
this module calls the backend's raw ``send``/``recv``/``broadcast`` and waits on their works.
"""

from __future__ import annotations

import gc
import json
import time
from datetime import timedelta
from typing import Any

import pybase64
import torch
import torch.distributed as dist

__all__ = ["Communicator", "DataPlaneError", "SyncAborted", "decode_unique_id", "connect_store"]

NCCL_UNIQUE_ID_BYTES = 128
_ERROR = "error"


def connect_store(host: str, port: int, timeout_s: float, *, is_master: bool = False,
                  world_size: int | None = None) -> Any:
    """A TCPStore client (or the host, with ``is_master``) for the group's control channel."""
    return dist.TCPStore(host, port, world_size, is_master=is_master, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False, use_libuv=True)


def _fail(store: Any, message: str) -> None:
    store.compare_set(_ERROR, "", message)  # sets only if no failure was recorded yet


class DataPlaneError(RuntimeError):
    """A peer aborted or a data-plane operation failed or timed out."""


class SyncAborted(DataPlaneError):
    """The sender flagged the sync as aborted in-band; the group itself is intact."""


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
        """Join (rank 0 hosts) a TCPStore rendezvous and build gloo (CPU) or NCCL (CUDA) on it.

        Every rank first announces itself on the store; a peer that fails before joining reports
        it with ``Communicator.report`` and every waiting rank raises its message at once."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        device = torch.device(device)
        store = connect_store(host, port, timeout_s, is_master=rank == 0, world_size=world_size)
        comm = cls(None, store, rank, world_size, device, timeout_s)
        comm.publish(f"join/{rank}", True)
        for r in range(world_size):
            comm.read(f"join/{r}")  # raises a peer's reported failure instead of waiting it out
        prefixed = dist.PrefixStore(f"{group_name}/", store)
        timeout = timedelta(seconds=timeout_s)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            comm._pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        else:
            comm._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        comm.barrier()  # everyone joined before any data moves
        return comm

    @classmethod
    def control_only(cls, host: str, port: int, rank: int, *, timeout_s: float = 300.0) -> "Communicator":
        """The group's control channel only (store client, no data plane), e.g. for trainer ranks that
        take part in a sync without moving data themselves."""
        return cls(None, connect_store(host, port, timeout_s), rank, 0, torch.device("cpu"), timeout_s)

    @staticmethod
    def report(host: str, port: int, message: str, timeout_s: float = 30.0) -> None:
        """Tell every rank of the group at ``host:port`` that this peer failed (it never joins)."""
        _fail(connect_store(host, port, timeout_s), message)

    # ---- control channel (store) -------------------------------------------------------
    def publish(self, key: str, value: Any) -> None:
        """Put a JSON-safe value under ``key`` for every peer to read."""
        self.store.set(key, json.dumps(value))

    def fail(self, message: str) -> None:
        """Record this rank's failure for every peer (the first report wins) and drop the data plane:
        closing its connections wakes every peer blocked on this rank at once, and peers waiting on
        the store raise the reported message. Call on any failure during a transfer."""
        if self.store is not None:
            try:
                _fail(self.store, f"rank {self.rank}: {message}")
            except Exception:  # noqa: BLE001 - the store's host may be gone already
                pass
        self.abort()

    def abort(self) -> None:
        """Drop the data-plane group now (NCCL: abort the communicator)."""
        pg, self._pg = self._pg, None
        if pg is not None and self.device.type == "cuda":
            pg.abort()
        del pg
        gc.collect()  # gloo closes its connections when the group is freed

    def peer_error(self) -> str | None:
        """The failure a rank reported on this group, if any (never blocks)."""
        store = self.store
        return store.get(_ERROR).decode() if store is not None and store.check([_ERROR]) else None

    def read(self, key: str, timeout_s: float | None = None) -> Any:
        """Wait (up to the timeout) for ``key`` and return its JSON value; raises ``DataPlaneError``
        at once when a peer reported a failure."""
        limit = timeout_s or self.timeout_s
        deadline = time.monotonic() + limit
        while not self.store.check([key]):
            if (err := self.peer_error()) is not None:
                raise DataPlaneError(f"a peer failed: {err}")
            if time.monotonic() > deadline:
                raise DataPlaneError(f"timed out after {limit}s on rank {self.rank} waiting for {key!r}")
            time.sleep(0.005)
        return json.loads(self.store.get(key))

    def peek(self, key: str) -> Any | None:
        """The JSON value under ``key`` if set, else None (never blocks)."""
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    # ---- data plane -------------------------------------------------------------------
    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(timedelta(seconds=self.timeout_s))
        except Exception as e:  # timeout, or a peer closed its connections (it died or failed)
            err = self.peer_error()
            reason = f"; a peer reported: {err}" if err else ""
            raise DataPlaneError(f"{what} failed on rank {self.rank}: {str(e).splitlines()[0][:300]}{reason}") from e

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
        self.abort()
        self.store = None
