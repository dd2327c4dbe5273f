"""Faults the tests inject into harness processes: sources that disagree with their metadata,
clients that corrupt requests or answer late, a slowed data plane, wrong checksums.

Sources: ``make_engine(..., fault=NAME)`` (``weightsync.testing.trainer``) wraps the source it built
(``FullTensorSource`` or ``DTensorModuleSource``) in ``faulty(source, NAME)``; the fault hits
``BAD_NAME``, after earlier tensors moved:

* ``shape`` / ``dtype``: the tensor loses its last row / becomes float16;
* ``name``: it is yielded as ``BAD_NAME + ".typo"``;
* ``stops_early``: iteration ends before it; ``missing``: it alone is skipped;
* ``duplicate`` (the first tensor listed twice), ``rank1_differs`` (rank 1 omits ``BAD_NAME``),
  ``rank1_swapped`` (rank 1 lists ``BAD_NAME`` before the tensor preceding it),
  ``complex`` (``BAD_NAME`` declared complex64): the metadata is wrong;
* consistent on every rank (metadata and iteration agree) but not the engine's model: ``omitted``
  (``BAD_NAME``, one half of vLLM's fused ``gate_up_proj``, is left out), ``extra`` (``EXTRA_NAME``,
  a copy of ``BAD_NAME`` no vLLM parameter takes, follows it).

Workers: ``hang(call, port)`` inside a receiver process makes its next ``call`` block, alive, until
the test releases it (``HANG_CALLS``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from functools import cached_property
from typing import Any

import torch

from ..protocol import ParamMeta, WeightSource

__all__ = ["BAD_NAME", "EXTRA_NAME", "FAULTS", "HANG_CALLS", "faulty", "JsonRoundTripClient", "CorruptingClient",
           "LaggingClient", "slow_data_plane", "wrong_checksums", "hang"]

BAD_NAME = "model.layers.1.mlp.up_proj.weight"
EXTRA_NAME = "model.layers.1.mlp.extra_proj.weight"
FAULTS = ("shape", "dtype", "name", "stops_early", "missing", "duplicate", "rank1_differs", "rank1_swapped", "complex",
          "omitted", "extra", "rank1_raises")


class _Faulty(WeightSource):
    def __init__(self, inner: WeightSource, fault: str, rank: int) -> None:
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
        self.inner, self.fault, self.rank = inner, fault, rank

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        metas = list(self.inner.metadata)
        if self.fault == "duplicate":
            metas.append(metas[0])
        elif self.fault == "rank1_differs" and self.rank == 1:
            metas = [m for m in metas if m.name != BAD_NAME]
        elif self.fault == "rank1_swapped" and self.rank == 1:
            i = next(i for i, m in enumerate(metas) if m.name == BAD_NAME)
            metas[i - 1], metas[i] = metas[i], metas[i - 1]
        elif self.fault == "omitted":
            metas = [m for m in metas if m.name != BAD_NAME]
        elif self.fault == "extra":
            i = next(i for i, m in enumerate(metas) if m.name == BAD_NAME)
            metas.insert(i + 1, dataclasses.replace(metas[i], name=EXTRA_NAME))
        elif self.fault == "complex":
            metas = [dataclasses.replace(m, dtype=torch.complex64) if m.name == BAD_NAME else m for m in metas]
        return metas

    def _corrupt(self, it: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in it:
            if name == BAD_NAME:
                if self.fault == "shape":
                    t = t[:-1]
                elif self.fault == "dtype":
                    t = t.to(torch.float16)
                elif self.fault == "name":
                    name = name + ".typo"
                elif self.fault == "stops_early":
                    return
                elif self.fault == "rank1_raises" and self.rank == 1:
                    raise RuntimeError("the source's own collective failed")
                elif self.fault in ("missing", "omitted"):
                    continue
                elif self.fault == "extra":
                    yield name, t
                    name = EXTRA_NAME
            yield name, t


class _FaultyFull(_Faulty):
    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._corrupt(self.inner.iter_full())


class _FaultyLocal(_Faulty):
    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._corrupt(self.inner.iter_local())


def faulty(source: WeightSource, fault: str) -> WeightSource:
    """``source`` (full tensors or local shards) with ``fault`` (one of ``FAULTS``) at ``BAD_NAME``."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    full = type(source).iter_full is not WeightSource.iter_full
    return (_FaultyFull if full else _FaultyLocal)(source, fault, rank)


class JsonRoundTripClient:
    """Wraps a weight-sync client; every payload must survive ``json.dumps``/``loads`` (as over HTTP)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @staticmethod
    def _json(payload: Any) -> Any:
        import json

        return json.loads(json.dumps(payload, allow_nan=False))

    def init_weight_transfer_engine(self, init_info: Any) -> None:
        self.inner.init_weight_transfer_engine(self._json(init_info))

    def start_weight_update(self) -> None:
        self.inner.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.inner.update_weights(self._json(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.inner.finish_weight_update(weight_version)

    def pause_generation(self, *args: Any, **kwargs: Any) -> None:
        self.inner.pause_generation(*args, **kwargs)

    def resume_generation(self) -> None:
        self.inner.resume_generation()

    def generation_paused(self) -> dict[str, bool]:
        return self.inner.generation_paused()


class CorruptingClient(JsonRoundTripClient):
    """Sets ``update_info["handles"][worker][field] = value`` (what one worker gets) in the ``chunk``-th
    ``update_weights`` call of each sync."""

    def __init__(self, inner: Any, *, chunk: int, worker: int, field: str, value: Any) -> None:
        super().__init__(inner)
        self.chunk, self.worker, self.field, self.value = chunk, worker, field, value
        self._calls = 0

    def start_weight_update(self) -> None:
        self._calls = 0
        super().start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        update_info = self._json(update_info)
        if self._calls == self.chunk:
            update_info["handles"][str(self.worker)][self.field] = self.value
        self._calls += 1
        self.inner.update_weights(update_info)


class LaggingClient(JsonRoundTripClient):
    """Each ``update_weights`` returns ``lag_s`` after the engines answered (a slow reply), and ``log``
    (a file) gets a line per event: ``update``, ``returned`` (the update call returns), ``finish``.
    ``concurrent_calls`` is what the client says of itself."""

    def __init__(self, inner: Any, *, lag_s: float, log: str, concurrent_calls: bool) -> None:
        super().__init__(inner)
        self.lag_s, self.log, self.concurrent_calls = lag_s, log, concurrent_calls

    def _note(self, event: str) -> None:
        with open(self.log, "a") as f:
            f.write(event + "\n")

    def update_weights(self, update_info: Any) -> None:
        import time

        self._note("update")
        super().update_weights(update_info)
        time.sleep(self.lag_s)
        self._note("returned")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._note("finish")
        super().finish_weight_update(weight_version)


_ORIGINALS: dict[str, Any] = {}


def wrong_checksums(enabled: bool = True) -> None:
    """Inside a trainer process: the checksums a verified sync publishes for the workers (M2N's
    ``sync<N>/sums/<rank>``, the broadcast's ``sync<N>/sum``) are off by one, so every worker's check
    fails once every byte moved; False restores."""
    import re

    from ..comm import Communicator

    original = _ORIGINALS.setdefault("publish", Communicator.publish)
    if not enabled:
        Communicator.publish = original  # type: ignore[method-assign]
        return
    checksum = re.compile(r"sync\d+/sums?(/\d+)?$")

    def publish(self: Any, key: str, value: Any) -> None:
        if checksum.match(key):
            value = {k: v + 1 for k, v in value.items()} if isinstance(value, dict) else value + 1
        original(self, key, value)

    Communicator.publish = publish  # type: ignore[method-assign]


def slow_data_plane(seconds: float, count_to: str | None = None,
                    plane: str = "weightsync.dataplane.torch_group:TorchGroupPlane") -> None:
    """Inside a process: every post (an M2N round) and broadcast of the data plane class ``plane``
    (``module:Class``), and every control-channel publish (the colocated transport's chunk hand-off),
    first sleeps ``seconds`` (0 restores). With ``count_to``, each such call first appends a byte to
    that file: a test can see a sync get under way while the process is busy in it (an actor serves
    one call at a time)."""
    import importlib
    import time

    from ..comm import Communicator

    module, _, name = plane.partition(":")
    targets = [(getattr(importlib.import_module(module), name), n) for n in ("post", "broadcast")]
    targets.append((Communicator, "publish"))  # (exchange posts through post)
    originals = [_ORIGINALS.setdefault(f"{cls.__qualname__}.{n}", getattr(cls, n)) for cls, n in targets]
    if not seconds:
        for (cls, n), fn in zip(targets, originals):
            setattr(cls, n, fn)
        return

    def slow(fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            if count_to is not None:
                with open(count_to, "ab") as f:
                    f.write(b".")
            time.sleep(seconds)
            return fn(*a, **k)
        return wrapper

    for (cls, n), fn in zip(targets, originals):
        setattr(cls, n, slow(fn))


HANG_CALLS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")


def hang(call: str, port: int) -> None:
    """Inside a receiver process: its next ``call`` (one of ``HANG_CALLS``, the worker methods the
    client calls) hangs before it reaches the engine: the worker is alive, connected, and answers
    nothing else meanwhile (an actor serves one call at a time), like a worker stuck in a kernel or a
    lock. It blocks reading a connection to the test's listener on 127.0.0.1:``port`` (no timer): the
    test releases it by closing that listener (or the process exiting does), then the call goes on."""
    import socket

    from . import receiver

    if call not in HANG_CALLS:
        raise ValueError(f"call must be one of {HANG_CALLS}, got {call!r}")
    original = getattr(receiver, call)
    line = socket.create_connection(("127.0.0.1", port), timeout=30)
    line.settimeout(None)

    def hung(*args: Any, **kwargs: Any) -> Any:
        setattr(receiver, call, original)  # once
        try:
            line.recv(1)  # b"" or a reset once the test closes its listener
        except OSError:
            pass
        finally:
            line.close()
        return original(*args, **kwargs)

    setattr(receiver, call, hung)
