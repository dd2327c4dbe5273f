"""Handles to a buffer shared between colocated processes: CUDA IPC on GPU, a shared-memory file on CPU.

A trainer rank owns one :class:`ExportedBuffer` (a flat ``uint8`` tensor) and exports it once per
consumer as a JSON-safe handle ``{device key: fields}``; the device key is the physical GPU's UUID
(``cuda:<uuid>``, independent of ``CUDA_VISIBLE_DEVICES``) or ``cpu@<hostname>``. A worker turns a
handle into a tensor with a :class:`BufferImporter`, which keeps one import per export (importing
the same handle again returns the cached tensor; a new handle releases the old import first).

CUDA IPC only exports plain ``cudaMalloc`` memory, so the buffer is allocated with
``torch_memory_saver``'s tracking paused and with ``expandable_segments`` switched off for that one
allocation (in a private memory pool); :func:`memory_saver_paused` is also used around the push.

A CPU buffer's file is removed on every exit path: ``unlink`` once every consumer mapped it, ``close``,
a finalizer when the buffer is collected, and, for a process that dies without running any of them
(SIGKILL, a crash), a reaper: a tiny ``sh`` in its own session holding a pipe from this process,
which removes the file when the pipe closes, i.e. when this process is gone.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

__all__ = ["SHM_DIR", "SHM_PREFIX", "device_key", "memory_saver_paused", "ExportedBuffer", "BufferImporter"]

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
"""Where CPU buffers live (tmpfs on Linux)."""
SHM_PREFIX = "weightsync-ipc-"
"""File-name prefix of every CPU buffer; importers refuse any other file."""


def device_key(device: torch.device) -> str:
    """Identity of the memory a handle points into: the GPU's UUID, or the host for CPU memory."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_properties(device).uuid}"
    if device.type == "cpu":
        return f"cpu@{socket.gethostname()}"
    raise ValueError(f"device must be cuda or cpu for the ipc transport, got {device}")


def memory_saver_paused() -> Any:
    """A context that pauses ``torch_memory_saver``'s tracking while it is active (its VMM
    allocations cannot be exported with CUDA IPC handles); a no-op when it is not in use."""
    tms = getattr(sys.modules.get("torch_memory_saver"), "torch_memory_saver", None)
    impl = getattr(tms, "_impl", None)
    try:
        active = impl is not None and bool(impl._binary_wrapper.cdll.tms_get_interesting_region())
    except AttributeError:  # a version without the query: its region() is the user's to manage
        active = False
    return tms.disable() if active else nullcontext()


# --- GPU-only: allocation outside expandable segments, CUDA IPC export/import ----------------
def _allocator_conf() -> str:
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)  # env + runtime changes
    if getter is not None:
        return str(getter())
    return ",".join(os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))


def _expandable_segments_on(conf: str | None = None) -> bool:
    on = False
    for item in (_allocator_conf() if conf is None else conf).replace(" ", "").lower().split(","):
        if item.startswith("expandable_segments:"):
            on = item.endswith(":true")
    return on


def _set_allocator_settings(value: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        raise RuntimeError("PYTORCH_CUDA_ALLOC_CONF sets expandable_segments:True, whose memory CUDA IPC handles "
                           "cannot export, and this torch cannot switch it off for the IPC buffer; unset "
                           "expandable_segments for the trainer process")
    setter(value)


@contextmanager
def _exportable_cuda_memory(device: torch.device) -> Iterator[Any]:
    """Allocations inside come from plain cudaMalloc segments of a private pool."""
    expandable = _expandable_segments_on()
    with memory_saver_paused(), torch.cuda.device(device):
        pool = torch.cuda.MemPool()
        if expandable:
            _set_allocator_settings("expandable_segments:False")
        try:
            with torch.cuda.use_mem_pool(pool):
                yield pool
        finally:
            if expandable:
                _set_allocator_settings("expandable_segments:True")


def _b64(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(raw).decode()


def _raw(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text, validate=True)


def _share_cuda(tensor: torch.Tensor) -> dict[str, Any]:
    try:
        (_, handle, size, offset, ref_counter, ref_counter_offset, event,
         event_sync_required) = tensor.untyped_storage()._share_cuda_()
    except RuntimeError as e:
        raise RuntimeError(f"cannot export the ipc buffer with a CUDA IPC handle ({e}); it must be plain cudaMalloc "
                           "memory: check PYTORCH_CUDA_ALLOC_CONF expandable_segments and torch_memory_saver regions "
                           "around the trainer engine") from e
    return {"kind": "cuda", "handle": _b64(handle), "size": int(size), "offset": int(offset),
            "ref_counter": _b64(ref_counter), "ref_counter_offset": int(ref_counter_offset),
            "event": _b64(event), "event_sync_required": bool(event_sync_required)}


def _open_cuda(fields: Mapping[str, Any], device: torch.device) -> torch.Tensor:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):  # the receiver's own index for the same physical GPU
        storage = torch.UntypedStorage._new_shared_cuda(
            index, _raw(fields["handle"]), int(fields["size"]), int(fields["offset"]), _raw(fields["ref_counter"]),
            int(fields["ref_counter_offset"]), _raw(fields["event"]), bool(fields["event_sync_required"]))
        return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index)).set_(storage)


# --- CPU files: removed on every exit path ------------------------------------------------------
_REAPER = 'read _; rm -f -- "$1"'
"""Waits for its stdin to close (the owner unlinked the file, or died), then removes the file."""


def _reaper(path: str) -> subprocess.Popen | None:
    """A process that removes ``path`` once this process closes its pipe or dies (None without sh)."""
    if not os.path.exists("/bin/sh"):
        return None
    return subprocess.Popen(["/bin/sh", "-c", _REAPER, "weightsync-shm-reaper", path], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _remove(path: str, reaper: subprocess.Popen | None) -> None:
    """Remove the file now and let its reaper go (idempotent: a ``weakref.finalize`` callback)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    if reaper is not None:
        try:
            reaper.stdin.close()
            reaper.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            pass


# --- both devices -----------------------------------------------------------------------------
class ExportedBuffer:
    """The producer side: a flat ``uint8`` buffer of ``nbytes`` on ``device``, exported once per consumer."""

    def __init__(self, nbytes: int, device: torch.device, *, tag: str = "") -> None:
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        self.nbytes, self.device, self.key = nbytes, device, device_key(device)
        self.path: str | None = None
        self._unlinked = False
        self._pool: Any = None
        self._exports: dict[int, dict[str, dict[str, Any]]] = {}
        self._remove: weakref.finalize | None = None
        if device.type == "cuda":
            with _exportable_cuda_memory(device) as self._pool:
                self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
            return
        path = os.path.join(SHM_DIR, f"{SHM_PREFIX}{os.getpid()}-{tag}{secrets.token_hex(4)}")
        self._remove = weakref.finalize(self, _remove, path, _reaper(path))  # from here on, every exit removes it
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # ENOSPC now, rather than SIGBUS while packing
        except OSError as e:
            os.close(fd)
            self._remove()
            raise RuntimeError(f"cannot reserve {nbytes} bytes in {SHM_DIR} for the ipc buffer ({e}); "
                               f"lower bucket_bytes or enlarge {SHM_DIR}") from e
        os.close(fd)
        self.path = path
        self.tensor = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)

    def export(self, consumer: int) -> dict[str, dict[str, Any]]:
        """JSON-safe handle for ``consumer`` (created on the first call, then the same one)."""
        if consumer not in self._exports:
            if self._unlinked:
                raise RuntimeError(f"the ipc buffer's file was removed after its consumers mapped it; a new "
                                   f"consumer ({consumer}) needs a new buffer")
            if self.device.type == "cuda":
                fields = _share_cuda(self.tensor)
            else:
                fields = {"kind": "shm", "path": self.path, "nbytes": self.nbytes}
            self._exports[consumer] = {self.key: fields}
        return self._exports[consumer]

    def unlink(self) -> None:
        """Remove a CPU buffer's file name once every consumer mapped it (the mappings stay valid and
        the memory goes when the last one does); later exports are refused. No-op on CUDA."""
        if self._remove is not None:
            self._remove()
        self._unlinked = self.device.type == "cpu"

    def close(self) -> None:
        """Free the buffer (a CUDA buffer still mapped by a consumer is freed by a later ``ipc_collect``)."""
        self.unlink()
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self._exports.clear()
        self._pool = None
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()


class BufferImporter:
    """The consumer side: one cached import of the latest handle, on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.key = device, device_key(device)
        self.imports = 0
        """How many imports this importer made (one per distinct handle)."""
        self._ident: str | None = None
        self._tensor: torch.Tensor | None = None

    def get(self, handle: Mapping[str, Any]) -> torch.Tensor:
        """The buffer ``handle`` points to; ``ValueError`` when it is for another device or malformed."""
        if not isinstance(handle, Mapping) or self.key not in handle:
            found = sorted(handle) if isinstance(handle, Mapping) else type(handle).__name__
            raise ValueError(f"update_info.handle is for {found}, but this worker's memory is {self.key}: the "
                             "trainer rank serving it must share its device (see worker_to_trainer)")
        fields = handle[self.key]
        ident = json.dumps(fields, sort_keys=True)
        if ident == self._ident and self._tensor is not None:
            return self._tensor
        kind = fields.get("kind") if isinstance(fields, Mapping) else None
        if kind == "cuda" and self.device.type == "cuda":
            tensor = _open_cuda(fields, self.device)
        elif kind == "shm" and self.device.type == "cpu":
            tensor = self._open_shm(fields)
        else:
            raise ValueError(f"update_info.handle: kind {kind!r} cannot be imported on {self.device}")
        self.close()  # the previous import (a new handle means the trainer replaced its buffer)
        self._ident, self._tensor = ident, tensor
        self.imports += 1
        return tensor

    @staticmethod
    def _open_shm(fields: Mapping[str, Any]) -> torch.Tensor:
        path, nbytes = fields.get("path"), fields.get("nbytes")
        if (not isinstance(path, str) or os.path.dirname(path) != SHM_DIR
                or not os.path.basename(path).startswith(SHM_PREFIX)):
            raise ValueError(f"update_info.handle path {path!r} is not a weightsync buffer in {SHM_DIR}")
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise ValueError(f"update_info.handle: {path} is gone (its trainer engine was shut down, or this "
                             "worker was re-initialized without it: run trainer_init again)") from None
        if not isinstance(nbytes, int) or nbytes != size:
            raise ValueError(f"update_info.handle nbytes {nbytes!r} differs from the size {size} of {path}")
        return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)

    def close(self) -> None:
        """Release the import (unmaps the file; drops the CUDA IPC reference)."""
        self._ident, self._tensor = None, None
