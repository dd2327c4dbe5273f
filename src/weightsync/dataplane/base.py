"""The data-plane seam: what the reshard executor and the broadcast need from whatever moves bytes.

A data plane connects the parties of one sync group (trainer ranks, then workers) by rank. It moves
the bytes of registered-or-not tensors two-sided (every send is matched by the peer's receive with
the same tag, in the same posting order per pair) and broadcasts from one rank. Waiting is bounded
(the group's ``timeout_s``); a peer's failure reported on the control plane, or the deadline, makes
a wait raise :class:`~weightsync.errors.DataPlaneError` naming the party. ``abort`` drops the plane so
that peers blocked on this party are released at once.

Rules an implementation keeps (the shared transport tests check them through a transport):

- ``post`` returns at once; the tensors must stay alive and untouched until ``wait_all`` of the
  returned works returns. A receive's bytes are written only into the tensor given.
- ``ordered``: whether the plane runs posted ops in issue order (NCCL: one stream), so a round's
  ops must be posted together; False where each op progresses on its own (gloo, in memory).
- Nothing is left behind after ``abort``: no connection, registration, thread or buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

__all__ = ["DataPlane", "Op", "PlaneFactory", "Work"]

Op = tuple[torch.Tensor, int, int]
"""One point-to-point operation: (contiguous tensor, peer rank, tag)."""


class Work(Protocol):
    """A posted operation, opaque to its caller: only passed back to the plane's ``wait_all``."""


@runtime_checkable
class DataPlane(Protocol):
    """One party's end of a sync group's data plane."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def ordered(self) -> bool:
        """Whether posted ops run in issue order (a round's ops must then be posted together)."""
        ...

    def post(self, sends: Sequence[Op], recvs: Sequence[Op]) -> list[Work]:
        """Post every send and receive together, without waiting; every pair of peers posts its
        groups in the same order (several may be in flight)."""
        ...

    def wait_all(self, works: Sequence[Work], what: str = "point-to-point round") -> None:
        """Wait for ``works`` (bounded; ``DataPlaneError`` naming ``what`` on a failure)."""
        ...

    def exchange(self, sends: Sequence[Op], recvs: Sequence[Op], what: str = "point-to-point round") -> None:
        """``post`` then ``wait_all``."""
        ...

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        """Post a broadcast of ``tensor`` from rank ``src`` to every rank (wait with ``wait_all``)."""
        ...

    def barrier(self) -> None:
        """Return once every rank called it."""
        ...

    def abort(self) -> None:
        """Drop the plane now, releasing peers blocked on this party. Safe to call twice."""
        ...


class PlaneFactory(Protocol):
    """How a party joins a data plane: ``store`` is the sync group's control store (for the plane's own
    rendezvous), ``peer_error`` reads the group's first reported failure (None while there is none)."""

    def __call__(self, store: dist.distributed_c10d.Store, rank: int, world_size: int, *, device: torch.device,
                 name: str, timeout_s: float, peer_error: Callable[[], str | None], group_name: str) -> DataPlane: ...
