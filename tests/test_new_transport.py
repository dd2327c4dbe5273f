"""A new transport is one file plus one registry line, and a new data plane one file: both are here.

:class:`StorePlane` is a data plane that moves each message's bytes through the sync group's store (a
send sets a key, its receive reads and deletes it): nothing weightsync ships, written against the
:class:`~weightsync.dataplane.DataPlane` seam alone. ``test_store_m2n`` is the reshard core over it:
the M2N engines with ``data_plane = StorePlane``, declared as ``TRANSPORT`` and registered with
:func:`~weightsync.registry.register_transport` in every process (the receivers serve it through the
``weightsync`` worker backend, which builds whatever transport an init info names). The shared
transport checks then run on it: bit-exact against vLLM's own loader (shard-exact bytes), bad input
refused on every rank before data moves, and a killed peer failing every trainer rank in time.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist

from weightsync import registry
from weightsync.dataplane import Op, Work
from weightsync.errors import DataPlaneError
from weightsync.registry import Capabilities, Transport, register_transport, transport
from weightsync.testing.actors import RemoteError
from weightsync.testing.cluster import Layout
from weightsync.transports.m2n import M2NTrainerEngine, M2NTrainerInitInfo, M2NWorkerEngine

NAME = "test_store_m2n"
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


class StorePlane:
    """Bytes through the group's store, under keys only this plane's parties use; bounded waits that
    raise at once when a party reported a failure."""

    ordered = False

    def __init__(self, store: dist.Store, rank: int, world_size: int, *, device: torch.device, name: str,
                 timeout_s: float, peer_error: Callable[[], str | None], group_name: str) -> None:
        self.store = dist.PrefixStore(f"{group_name}/store-plane/", store)
        self.rank, self.world_size, self.device = rank, world_size, device
        self.name, self.timeout_s, self.peer_error = name, timeout_s, peer_error
        self.sent: Counter[tuple[int, int]] = Counter()
        self.received: Counter[tuple[int, int]] = Counter()
        self.live = True

    def _next(self, counter: Counter[tuple[int, int]], peer: int, tag: int) -> int:
        counter[peer, tag] += 1
        return counter[peer, tag]

    def post(self, sends: Sequence[Op], recvs: Sequence[Op]) -> list[Work]:
        if not self.live:
            raise DataPlaneError(f"{self.name}: the data plane was dropped")
        for t, peer, tag in sends:
            key = f"{self.rank}>{peer}/{tag}/{self._next(self.sent, peer, tag)}"
            self.store.set(key, t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return [(t, f"{peer}>{self.rank}/{tag}/{self._next(self.received, peer, tag)}") for t, peer, tag in recvs]

    def _take(self, key: str, what: str) -> bytes:
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check([key]):
            if (err := self.peer_error()) is not None:
                raise DataPlaneError(f"{what} failed on {self.name}: a party failed: {err}")
            if not self.live or time.monotonic() > deadline:
                raise DataPlaneError(f"{what} timed out after {self.timeout_s}s on {self.name}")
            time.sleep(0.001)
        raw = self.store.get(key)
        self.store.delete_key(key)
        return raw

    def wait_all(self, works: Sequence[Work], what: str = "point-to-point round") -> None:
        for t, key in works:  # type: ignore[misc]  # this plane's works are (tensor, key)
            raw = self._take(key, what)
            t.reshape(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))

    def exchange(self, sends: Sequence[Op], recvs: Sequence[Op], what: str = "point-to-point round") -> None:
        self.wait_all(self.post(sends, recvs), what)

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        sends = [(tensor, p, -1) for p in range(self.world_size) if p != self.rank] if self.rank == src else []
        return self.post(sends, [] if self.rank == src else [(tensor, src, -1)])

    def barrier(self) -> None:
        self.store.add("barrier", 1)
        deadline = time.monotonic() + self.timeout_s
        while self.store.add("barrier", 0) < self.world_size:
            if time.monotonic() > deadline:
                raise DataPlaneError(f"barrier timed out after {self.timeout_s}s on {self.name}")
            time.sleep(0.001)

    def abort(self) -> None:
        self.live = False


@dataclasses.dataclass(kw_only=True, frozen=True)
class StoreTrainerInitInfo(M2NTrainerInitInfo):
    backend: ClassVar[str] = NAME


class StoreTrainerEngine(M2NTrainerEngine):
    init_info_cls = StoreTrainerInitInfo
    data_plane = StorePlane


class StoreWorkerEngine(M2NWorkerEngine):
    data_plane = StorePlane


TRANSPORT = Transport(name=NAME, trainer_engine=StoreTrainerEngine, worker_engine=StoreWorkerEngine,
                      init_info=StoreTrainerInitInfo, source="local", colocated=False,
                      summary="the reshard core over a data plane that moves bytes through the store",
                      capabilities=Capabilities(shard_exact=True))
SERVING = Layout(trainers=2, tp=2, backend="weightsync")  # the worker backend that serves any transport


def forget() -> None:
    """Inside a process: this transport is registered no more (the other tests list every transport)."""
    registry.TRANSPORTS.pop(NAME, None)


@pytest.fixture(autouse=True)
def registered():
    """Registered in this process for the test, and in every cluster process it registers in (``_on_store_plane``)."""
    register_transport(NAME, __name__)
    yield
    forget()


@pytest.fixture
def store_cluster(cluster):
    """The shared cluster; afterwards no process of it knows this transport any more."""
    yield cluster
    for a in [*cluster.trainers, *cluster.receivers]:
        if a.alive():
            a.call(f"{__name__}:forget")


def _on_store_plane(cluster, layout: Layout = SERVING, *, fresh: bool = False) -> None:
    cluster.setup(layout, fresh=fresh)
    for a in [*cluster.active_trainers, *cluster.active_receivers]:
        a.call("weightsync.registry:register_transport", NAME, __name__)


def _info(**kw):
    from helpers import init_info  # (not at import: helpers lists every registered transport, this one too)

    return init_info(NAME, SERVING, buffer_bytes=1 << 14, **kw)


def mismatches(cluster) -> dict:
    from helpers import mismatches

    return mismatches(cluster)


def test_registered_by_name_with_what_it_declares():
    declared = transport(NAME)
    assert declared is TRANSPORT and declared.capabilities.shard_exact and not declared.capabilities.delta
    assert isinstance(_info(), StoreTrainerInitInfo)
    with pytest.raises(ValueError, match=rf"transport '{NAME}' is registered by module '{__name__}', not 'elsewhere'"):
        register_transport(NAME, "elsewhere")


def test_syncs_bit_exact_and_shard_exact(store_cluster):
    cluster = store_cluster
    _on_store_plane(cluster)
    cluster.make_engines(_info())
    cluster.train_step(3)
    stats = cluster.sync(weight_version="v1", verify=True)
    assert mismatches(cluster) == {}
    assert stats["bytes_received_per_worker"] == stats["lower_bound_per_worker"]
    assert cluster.client().weight_versions() == ["v1"] * SERVING.num_workers


def test_bad_input_refused_on_every_rank_before_data_moves(store_cluster):
    cluster = store_cluster
    _on_store_plane(cluster)
    cluster.make_engines(_info())
    cluster.sync(weight_version="good")
    before = cluster.on_receivers("checksum")
    cluster.train_step(1)
    cluster.make_engines(_info(), fault="shape")
    futs = [a.submit("weightsync.testing.trainer:send_weights", "bad") for a in cluster.active_trainers]
    for f in futs:
        with pytest.raises(RemoteError, match=r"parameter '[\w.]+': expected a local shard"):
            f.result(timeout=120)
    assert cluster.on_receivers("checksum") == before
    assert cluster.client().weight_versions() == ["good"] * SERVING.num_workers


def test_a_killed_worker_fails_every_trainer_rank_within_the_timeout(store_cluster):
    cluster = store_cluster
    timeout = 10.0
    _on_store_plane(cluster, fresh=True)
    cluster.make_engines(_info(timeout_s=timeout))
    cluster.sync(weight_version="good")
    cluster.train_step(1)
    counts = [os.path.join(tempfile.mkdtemp(), a.name) for a in cluster.active_trainers]
    for a, path in zip(cluster.active_trainers, counts):
        a.call("weightsync.testing.faults:slow_data_plane", 0.3, path, f"{__name__}:StorePlane")
    futs = [a.submit("weightsync.testing.trainer:send_weights", "bad") for a in cluster.active_trainers]
    deadline = time.monotonic() + 60
    while not any(os.path.exists(p) and os.path.getsize(p) >= 3 for p in counts):
        assert time.monotonic() < deadline, "the sync did not get under way"
        time.sleep(0.05)
    t0 = time.perf_counter()
    cluster.receivers[1].kill()
    for f in futs:
        with pytest.raises(RemoteError) as e:
            f.result(timeout=4 * timeout)
        assert re.search(r"SyncFailed|DataPlaneError|failed", str(e.value)), str(e.value)[:500]
    elapsed = time.perf_counter() - t0
    for a in cluster.active_trainers:
        a.call("weightsync.testing.faults:slow_data_plane", 0, None, f"{__name__}:StorePlane")
    assert elapsed < 2 * timeout, elapsed
    assert cluster.receivers[0].call("weightsync.testing.receiver:weight_version") == "good"
    assert cluster.replace_dead()
    _on_store_plane(cluster, fresh=True)
    cluster.make_engines(_info())
    cluster.sync(weight_version="recovered", verify=True)
    assert mismatches(cluster) == {}
