"""The NIXL data plane on its own, in separate processes over a real sync group store (sealed or not):
bytes arrive equal (views of shared storages, several dtypes, an empty message, a broadcast), a later
sync reuses every registration, a wrong size is refused naming the message, a reported failure or the
deadline ends a wait in time, and ``abort`` leaves no registration, agent or thread behind."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

from weightsync.comm import Communicator
from weightsync.dataplane import DataPlane
from weightsync.dataplane.nixl import NixlPlane, nixl_module
from weightsync.errors import DataPlaneError

try:
    nixl_module()
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)

pytestmark = pytest.mark.timeout(300)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _party(fn: Callable[..., Any], rank: int, world: int, port: int, timeout_s: float, secret: str | None,
           out: Any, done: Any, device: str = "cpu") -> None:
    comm: Communicator | None = None
    try:
        comm = Communicator.connect("127.0.0.1", port, name=f"party {rank}", timeout_s=timeout_s,
                                    host_store=rank == 0, secret=secret)
        comm.join(rank, world, plane=NixlPlane, device=device)
        out.put((rank, fn(comm, rank)))
    except Exception as e:  # noqa: BLE001 - reported to the test, and to the peers (they raise at once)
        out.put((rank, traceback.format_exc()))
        if comm is not None:
            comm.fail(f"party {rank}: {type(e).__name__}: {e}", e)
    done.wait(120)  # the store's host stays up until every party reported


def _run(fn: Callable[..., Any], world: int = 3, timeout_s: float = 60.0, secret: str | None = None,
         device: str = "cpu") -> dict[int, Any]:
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    port = _port()
    procs = [ctx.Process(target=_party, args=(fn, r, world, port, timeout_s, secret, out, done, device))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        return dict(out.get(timeout=600) for _ in range(world))  # (spawned parties start slowly on a loaded machine)
    finally:
        done.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def _data(rank: int, sync: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + sync)
    return [torch.randn(1000, generator=g), torch.randint(0, 255, (77,), generator=g, dtype=torch.uint8),
            torch.randn(33, 5, generator=g).to(torch.bfloat16), torch.empty(0)]


def _sync(plane: DataPlane, rank: int, stage: torch.Tensor, sync: int) -> list[bool]:
    """Ranks 0 and 1 send their tensors (copied into views of one storage) to rank 2, which receives into
    views of one storage: True per message that arrived equal."""
    if rank < 2:
        sends = []
        off = 0
        for i, t in enumerate(_data(rank, sync)):
            view = stage[off:off + t.nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            sends.append((view.reshape(-1), 2, i))
            off += -(-(t.nbytes + 8) // 16) * 16
        plane.exchange(sends, [])
        return []
    recvs, want = [], []
    off = 0
    for src in (0, 1):
        for i, t in enumerate(_data(src, sync)):
            recvs.append((stage[off:off + t.nbytes].view(t.dtype), src, i))
            want.append(t.reshape(-1))
            off += -(-(t.nbytes + 8) // 16) * 16
    plane.exchange([], recvs)
    return [torch.equal(r[0], w) for r, w in zip(recvs, want)]


def _bytes_equal(comm: Communicator, rank: int) -> dict[str, Any]:
    plane = comm.data
    assert isinstance(plane, NixlPlane) and plane.ordered is False
    stage = torch.zeros(1 << 16, dtype=torch.uint8)
    first = _sync(plane, rank, stage, 1)
    made = plane.registrations_made
    second = _sync(plane, rank, stage, 2)
    b = torch.arange(4096, dtype=torch.float32) * (rank == 1)
    plane.wait_all([plane.broadcast(b, 1)], "broadcast")
    return {"equal": first + second, "made": made, "again": plane.registrations_made - made,
            "broadcast": torch.equal(b, torch.arange(4096, dtype=torch.float32))}


@pytest.mark.parametrize("secret", [None, "s3cret-" + "0" * 32], ids=["open", "sealed"])
def test_bytes_arrive_equal_and_a_later_sync_reuses_every_registration(secret):
    results = _run(_bytes_equal, secret=secret)
    for rank, got in results.items():
        assert isinstance(got, dict), got
        assert got["broadcast"], rank
        assert got["again"] == 1, got  # the second sync registered nothing new: only the broadcast's tensor
    assert results[2]["equal"] == [True] * 16
    assert results[0]["made"] == 1 and results[2]["made"] == 1  # one storage each: registered once


def _wrong_size(comm: Communicator, rank: int) -> str:
    t = torch.zeros(100 if rank == 0 else 99)
    try:
        comm.data.exchange([(t, 1, 7)] if rank == 0 else [], [(t, 0, 7)] if rank == 1 else [], "sized round")
    except DataPlaneError as e:
        comm.fail(str(e), e)
        return str(e)
    return "completed"


def test_a_wrong_size_is_refused_naming_the_message():
    results = _run(_wrong_size, world=2, timeout_s=20.0)
    assert "tag 7" in results[1] and "400 bytes" in results[1] and "396" in results[1], results[1]
    assert "failed" in results[0], results[0]  # the sender hears of it through the control plane


def _reused_memory(comm: Communicator, rank: int) -> list[bool]:
    """Rank 0 sends from a storage, frees it, then from a larger one over the same memory (its address
    range starting before the freed one's, the message past the freed one's end): rank 1 still holds
    the freed one's descriptor. Each storage is a view of one bytearray, so the addresses are fixed."""
    got = []
    memory = bytearray(1 << 20)
    for sync, (offset, count, at) in enumerate([(4096, 65536, 0), (0, 524288, 200000), (0, 524288, 8192)]):
        if rank == 0:
            storage = torch.frombuffer(memory, dtype=torch.uint8, offset=offset, count=count)
            assert storage.untyped_storage().data_ptr() == storage.data_ptr()  # (its own storage)
            msg = storage[at:at + 100]
            msg.copy_(torch.arange(100, dtype=torch.uint8) + sync)
            comm.data.exchange([(msg, 1, 0)], [], f"sync {sync}")
            del storage, msg  # freed: the next sync's storage overlaps it
        else:
            into = torch.zeros(100, dtype=torch.uint8)
            comm.data.exchange([], [(into, 0, 0)], f"sync {sync}")
            got.append(torch.equal(into, torch.arange(100, dtype=torch.uint8) + sync))
    return got


def test_a_freed_storage_a_peer_still_knows_does_not_shadow_the_memory_registered_over_it():
    """NIXL keeps every descriptor a peer was told and resolves a READ against them assuming they do
    not overlap: without the sender's bounce buffer the second READ fails with NIXL_ERR_NOT_FOUND."""
    results = _run(_reused_memory, world=2)
    assert results[0] == [], results[0]
    assert results[1] == [True, True, True], results[1]


def _failing(comm: Communicator, rank: int) -> tuple[str, float]:
    t = torch.zeros(1 << 16)
    if rank == 0:
        time.sleep(1.0)
        comm.fail("ValueError: the source yielded a wrong shape")
        return "failed", 0.0
    t0 = time.monotonic()
    try:
        comm.data.exchange([], [(t, 0, 0)], "the round")
        return "completed", 0.0
    except DataPlaneError as e:
        return str(e), time.monotonic() - t0


def test_a_reported_failure_wakes_every_waiting_peer_at_once():
    results = _run(_failing, timeout_s=60.0)
    for rank in (1, 2):
        what, seconds = results[rank]
        assert "the round failed" in what and "wrong shape" in what, what
        assert seconds < 15, seconds


def _deadline(comm: Communicator, rank: int) -> tuple[str, float]:
    """Joined with a long timeout (a loaded machine starts processes slowly), waits with a 3 s one."""
    t = torch.zeros(16)
    comm.data.timeout_s = 3.0
    if rank == 0:
        time.sleep(8)  # never sends
        return "idle", 0.0
    t0 = time.monotonic()
    try:
        comm.data.exchange([], [(t, 0, 0)], "the round")
        return "completed", 0.0
    except DataPlaneError as e:
        return str(e), time.monotonic() - t0


def test_a_wait_ends_at_the_deadline_naming_the_round():
    results = _run(_deadline, world=2, timeout_s=60.0)
    what, seconds = results[1]
    assert "the round timed out after 3.0s" in what, what
    assert 3.0 <= seconds < 6.0, seconds


def _abort(comm: Communicator, rank: int) -> dict[str, Any]:
    plane = comm.data
    assert isinstance(plane, NixlPlane)
    stage = torch.zeros(1 << 16, dtype=torch.uint8)
    _sync(plane, rank, stage, 1) if comm.world_size == 3 else None
    held = len(plane._regs)
    comm.abort()
    comm.abort()  # twice: a no-op
    after = {"regs": len(plane._regs), "agent": plane._agent is None, "held": held}
    try:
        plane.post([], [(stage, (rank + 1) % 3, 0)])
    except DataPlaneError as e:
        after["post"] = str(e)
    return after


def test_abort_releases_every_registration_and_the_agent():
    results = _run(_abort)
    for got in results.values():
        assert isinstance(got, dict), got
        assert got["held"] == 1 and got["regs"] == 0 and got["agent"], got
        assert "dropped" in got["post"], got


def _threads_left(comm: Communicator, rank: int) -> tuple[int, int]:
    before = _threads()
    store = comm.store
    planes = []
    for i in range(3):  # three planes made and dropped: their threads must not pile up
        planes.append(NixlPlane(store, rank, 2, device=torch.device("cpu"), name=f"p{i}", timeout_s=30,
                                peer_error=comm.peer_error, group_name=f"g{i}"))
        planes[-1].barrier()
        planes[-1].abort()
    del planes
    import gc

    gc.collect()
    time.sleep(0.5)
    return before, _threads()


def test_dropped_planes_leave_no_thread_behind():
    results = _run(_threads_left, world=2)
    for before, after in results.values():
        assert after <= before, (before, after)


def _device_memory(comm: Communicator, rank: int) -> bool:
    """Rank 0 sends a CUDA tensor's bytes to rank 1, which READs them into its own CUDA tensor."""
    n = 1 << 20
    t = torch.arange(n, dtype=torch.float32, device="cuda") if rank == 0 else torch.zeros(n, device="cuda")
    comm.data.exchange([(t, 1, 0)] if rank == 0 else [], [(t, 0, 0)] if rank == 1 else [], "device round")
    return rank == 0 or torch.equal(t.cpu(), torch.arange(n, dtype=torch.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_memory_is_registered_and_read_on_a_gpu():
    results = _run(_device_memory, world=2, device="cuda")
    assert results == {0: True, 1: True}, results
