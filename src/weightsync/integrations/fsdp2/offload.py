"""Host copies of this rank's shards: the reference model's weights, and sleep / wake.

* ``ReferenceWeights`` keeps the reference model as a host copy of each rank's local shards of the
  *same* sharded module. ``swapped_in`` exchanges them with the actor's shards for the reference
  log-probs and exchanges them back afterwards, so only one host copy exists at any time.
* ``HostOffload`` moves whole storages (parameter shards, gradients, optimizer state) to host memory
  and frees them on the device; ``restore`` brings the same bytes back into the same tensors.

Before any exchange the FSDP2 modules are resharded: the root module keeps its gathered weights after
a forward pass, and a later forward would otherwise compute on those stale copies.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["reshard", "local_tensor", "ReferenceWeights", "HostOffload"]


def reshard(model: torch.nn.Module) -> None:
    """Free every FSDP2 module's gathered parameters (no-op for modules already sharded)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (an alias, writes go into the parameter), or ``t`` itself."""
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def _host_empty(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=like.is_cuda)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ReferenceWeights:
    """The reference model as host copies of this rank's shards of ``model``'s parameters.

    Built from the module's current weights (load the reference checkpoint into the module first).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        reshard(model)
        self.names: list[str] = []
        self.host: list[torch.Tensor] = []
        device = torch.device("cpu")
        with torch.no_grad():
            for name, p in model.named_parameters():
                local = local_tensor(p)
                self.names.append(name)
                self.host.append(_host_empty(local).copy_(local, non_blocking=True))
                device = local.device
        _sync(device)
        self.swapped = False
        """True while the module holds the reference weights (and ``host`` the actor's)."""

    def _exchange(self, model: torch.nn.Module) -> None:
        reshard(model)
        names = [n for n, _ in model.named_parameters()]
        if names != self.names:
            raise RuntimeError("the module's parameters changed since the reference weights were captured")
        device = torch.device("cpu")
        with torch.no_grad():
            for (_, p), host in zip(model.named_parameters(), self.host):
                local = local_tensor(p)
                tmp = local.clone()
                local.copy_(host, non_blocking=True)
                host.copy_(tmp, non_blocking=True)
                device = local.device
        _sync(device)
        self.swapped = not self.swapped

    @contextmanager
    def swapped_in(self, model: torch.nn.Module) -> Iterator[None]:
        """Inside, ``model`` computes with the reference weights; on exit (also on error) it holds the
        actor's weights again. Same on every rank (no collectives)."""
        if self.swapped:
            raise RuntimeError("the reference weights are already swapped in")
        self._exchange(model)
        try:
            yield
        finally:
            self._exchange(model)


class HostOffload:
    """Storages moved to host memory, to be restored byte for byte into the same tensors."""

    def __init__(self) -> None:
        self._saved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    @property
    def active(self) -> bool:
        return bool(self._saved)

    @property
    def nbytes(self) -> int:
        return sum(h.numel() for _, h in self._saved)

    def offload(self, tensors: Iterable[torch.Tensor], device: torch.device) -> None:
        """Copy the storage of every tensor on ``device`` to host memory and free it on the device.
        Storages shared by several tensors (views) move once."""
        seen = {id(s) for s, _ in self._saved}
        todo = []
        for t in tensors:
            st = local_tensor(t).untyped_storage()
            if t.device != device or id(st) in seen or st.nbytes() == 0:
                continue
            if not st.resizable():
                raise RuntimeError(f"a storage of {st.nbytes()} bytes on {device} cannot be freed (not resizable)")
            seen.add(id(st))
            todo.append(st)
        for st in todo:
            host = torch.empty(st.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=device.type == "cuda")
            host.copy_(torch.empty(0, dtype=torch.uint8, device=st.device).set_(st), non_blocking=True)
            self._saved.append((st, host))
        _sync(device)
        for st, _ in self._saved:
            st.resize_(0)

    def restore(self) -> None:
        """Reallocate every offloaded storage and copy its bytes back."""
        device = torch.device("cpu")
        for st, host in self._saved:
            st.resize_(host.numel())
            torch.empty(0, dtype=torch.uint8, device=st.device).set_(st).copy_(host, non_blocking=True)
            device = st.device
        _sync(device)
        self._saved = []
