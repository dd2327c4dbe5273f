"""The data plane over a torch process group: gloo on CPU, NCCL on CUDA.

Built on the sync group's store (through a ``PrefixStore``, so its rendezvous is sealed with the
store) as a stateless group independent of the trainer's and vLLM's own groups. On an unregistered
group ``torch.distributed.send`` and ``batch_isend_irecv`` refuse to work, so this module calls the
backend's raw ``send``/``recv``/``broadcast`` and waits on their works itself.

Waiting on NCCL: a blocked party polls its works and the control plane together, so a peer's failure
or the deadline aborts its own communicator and raises ``DataPlaneError`` (NCCL's async error handling
is off for this group: our deadline governs, not the watchdog). On gloo a failing party drops its
group, which wakes every peer blocked on it.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from ..errors import DataPlaneError
from .base import Op, Work

__all__ = ["TorchGroupPlane"]

_CHECK_S = 0.005  # the longest pause between two looks at the control plane while an NCCL work runs
_NCCL_ENV = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT")
_ENV_LOCK = threading.Lock()


class _Backend(Protocol):
    """What this plane calls on its backend (``ProcessGroupNCCL`` or ``ProcessGroupGloo``). torch's
    stubs declare these on ``ProcessGroup`` only; the backends' bindings have them too."""

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> dist.Work: ...

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...

    def allreduce(self, tensors: list[torch.Tensor]) -> dist.Work: ...

    def _start_coalescing(self, device: torch.device) -> None: ...

    def _end_coalescing(self, device: torch.device) -> dist.Work: ...

    def abort(self) -> None: ...


@contextmanager
def _nccl_env() -> Iterator[None]:
    """NCCL's error-handling variables off while one group is built (torch reads them only then, from
    the environment), set only where they differ and restored after; the lock keeps two threads of
    one process from seeing each other's settings."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in _NCCL_ENV if os.environ.get(k) != "0"}
        os.environ.update(dict.fromkeys(saved, "0"))
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _nccl_group(store: dist.distributed_c10d.Store, rank: int, world_size: int, timeout: timedelta) -> _Backend:
    """ProcessGroupNCCL whose errors and timeouts raise in the caller (no watchdog teardown)."""
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    with _nccl_env():
        # torch's stubs make ProcessGroupNCCL a Backend without send/recv/...; its binding has them
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)  # type: ignore[return-value]


class TorchGroupPlane:
    """One party's end of a torch process group (see the module docstring). ``peer_error`` reads
    the control plane's first reported failure (None while there is none)."""

    def __init__(self, store: dist.distributed_c10d.Store, rank: int, world_size: int, *, device: torch.device,
                 name: str, timeout_s: float, peer_error: Callable[[], str | None],
                 group_name: str = "weightsync") -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.rank, self.world_size, self.device = rank, world_size, device
        self.name, self.timeout_s, self._peer_error = name, timeout_s, peer_error
        prefixed = dist.distributed_c10d.PrefixStore(f"{group_name}/", store)
        timeout = timedelta(seconds=timeout_s)
        if device.type == "cuda":
            self._pg: _Backend | None = _nccl_group(prefixed, rank, world_size, timeout)
        else:
            # torch's stubs make ProcessGroupGloo a Backend without send/recv/...; its binding has them
            self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)  # type: ignore[assignment]

    @property
    def ordered(self) -> bool:
        """NCCL runs a party's point-to-point ops in issue order (one stream); gloo runs each on its own."""
        return self.device.type == "cuda"

    def _live(self) -> _Backend:
        if self._pg is None:
            raise DataPlaneError(f"{self.name}: the data plane was dropped after a failure (re-initialize)")
        return self._pg

    def wait(self, work: Work, what: str = "operation") -> None:
        """Wait for one work. NCCL: poll it and the control plane, so a reported failure or the deadline
        aborts this party's communicator and raises ``DataPlaneError``. gloo: a blocking wait (its
        send/recv works complete only inside ``wait``); a failing peer closes its connections, which
        raises here at once."""
        assert isinstance(work, dist.Work)
        try:
            if self.device.type == "cuda":
                self._poll(work, what)
            work.wait(timedelta(seconds=self.timeout_s))
        except DataPlaneError:
            raise
        except Exception as e:
            err = self._peer_error()
            reason = f"; a party reported: {err}" if err else ""
            raise DataPlaneError(f"{what} failed on {self.name}: {str(e).splitlines()[0][:300]}{reason}") from e

    def _poll(self, work: dist.Work, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        next_check, pause = 0.0, 2e-5
        while not work.is_completed():
            now = time.monotonic()
            if now >= next_check:
                if (err := self._peer_error()) is not None:
                    self.abort()
                    raise DataPlaneError(f"{what} failed on {self.name}: a party failed: {err}")
                if now > deadline:
                    self.abort()
                    raise DataPlaneError(f"{what} timed out after {self.timeout_s}s on {self.name}")
                next_check = now + _CHECK_S
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        return self._live().broadcast([tensor], opts)

    def post(self, sends: Sequence[Op], recvs: Sequence[Op]) -> list[Work]:
        pg = self._live()
        cuda = self.device.type == "cuda"
        if cuda:
            pg._start_coalescing(self.device)
        works = [pg.send([t], peer, tag) for t, peer, tag in sends]
        works += [pg.recv([t], peer, tag) for t, peer, tag in recvs]
        return [pg._end_coalescing(self.device)] if cuda else list(works)

    def wait_all(self, works: Sequence[Work], what: str = "point-to-point round") -> None:
        for w in works:
            self.wait(w, what)

    def exchange(self, sends: Sequence[Op], recvs: Sequence[Op], what: str = "point-to-point round") -> None:
        self.wait_all(self.post(sends, recvs), what)

    def barrier(self) -> None:
        flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.wait(self._live().allreduce([flag]), "barrier")

    def abort(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None and self.device.type == "cuda":
            pg.abort()
        del pg
        gc.collect()  # gloo closes its connections when the group is freed
