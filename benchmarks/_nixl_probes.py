"""NIXL's own raw transfer of a plan's bytes, run inside the local cluster's processes (``transfer_throughput.py``).

Called by name (``"_nixl_probes:<function>"``) through ``weightsync.testing.actors``, on the very trainer
and receiver processes a ``weightsync_nixl`` engine runs in. Each process gets a second NIXL agent (``new_agent``,
as ``NixlPlane``'s), one registered buffer per peer holding exactly the bytes the live plan moves between
the two per sync (pages touched), agents' metadata and the trainers' buffer addresses exchanged once
through a store of their own. A step is what a pull-based sync needs at the least: every worker READs
each trainer's bytes for it, one request per trainer, all posted at once, polls them to DONE, and tells each
trainer so in one notification; no plan, packing, applying or control message. Trainers only drive their
agent's progress until every worker's notification came: the agents have no progress thread (``new_agent``),
and UCX serves a READ of host memory with the target's progress.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from weightsync.dataplane.nixl import new_agent
from weightsync.testing.actors import STATE

__all__ = ["nixl_raw_plan", "nixl_raw_setup", "nixl_raw_teardown"]

_KEY = "nixl_raw"


def nixl_raw_setup(host: str, port: int, rank: int, world: int, trainers: int, pair_bytes: dict[int, int]) -> None:
    """Join the raw agents' store (rank 0 hosts it), register one buffer per peer of ``pair_bytes[peer]``
    bytes (a trainer: data rank of the worker -> bytes; a worker: trainer rank -> bytes), publish and load
    the metadata, and (workers) the trainers' buffer addresses."""
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timedelta(seconds=300),
                          wait_for_workers=False)
    agent = new_agent(f"raw-{rank}")
    bufs = {p: torch.ones(n, dtype=torch.uint8) for p, n in pair_bytes.items() if n}
    regs = [agent.register_memory(agent.get_reg_descs([(b.data_ptr(), b.nbytes, 0, "")], "DRAM"))
            for b in bufs.values()]
    store.set(f"md/{rank}", agent.get_agent_metadata())
    if rank < trainers:
        store.set(f"addr/{rank}", json.dumps({str(p): [b.data_ptr(), b.nbytes] for p, b in bufs.items()}))
    peers, remote = {}, {}
    for p in bufs:
        store.wait([f"md/{p}"])
        name = agent.add_remote_agent(store.get(f"md/{p}"))
        peers[p] = name.decode() if isinstance(name, bytes) else name
        if rank >= trainers:
            store.wait([f"addr/{p}"])
            remote[p] = json.loads(store.get(f"addr/{p}"))[str(rank)]
    store.add("ready", 1)
    while store.add("ready", 0) < world:  # every agent loaded its peers before anyone's first READ
        time.sleep(0.01)
    STATE[_KEY] = {"store": store, "agent": agent, "bufs": bufs, "regs": regs, "peers": peers, "remote": remote}


def _step(st: dict[str, Any]) -> None:
    agent = st["agent"]
    handles = []
    for p, buf in st["bufs"].items():
        addr, n = st["remote"][p]
        h = agent.initialize_xfer("READ", agent.get_xfer_descs([(buf.data_ptr(), n, 0)], "DRAM"),
                                  agent.get_xfer_descs([(addr, n, 0)], "DRAM"), st["peers"][p], b"")
        if agent.transfer(h) == "ERR":
            raise RuntimeError(f"raw NIXL READ from rank {p} could not be posted")
        handles.append(h)
    for h in handles:
        while (state := agent.check_xfer_state(h)) == "PROC":
            pass
        if state != "DONE":
            raise RuntimeError(f"raw NIXL READ ended {state}")
        h.release()
    for p in st["bufs"]:
        agent.send_notif(st["peers"][p], b"read")


def _serve(st: dict[str, Any], steps: int) -> None:
    """A trainer: progress until each worker reading from it notified ``steps`` steps, pausing between
    looks as ``NixlPlane.wait_all`` does (20 us doubling to 1 ms; from 20 us again after a notification),
    so that on a small machine the raw side's trainers take no more CPU from the READs than the plane's."""
    want, got, pause = steps * len(st["bufs"]), 0, 2e-5
    while got < want:
        n = sum(len(m) for m in st["agent"].get_new_notifs().values())
        got, pause = got + n, 2e-5 if n else min(2 * pause, 1e-3)
        if got < want:
            time.sleep(pause)


def nixl_raw_plan(iters: int) -> dict[str, float]:
    """A worker: seconds and CPU seconds per step (mean of ``iters`` after one untimed warm-up) and the
    bytes it READs per step. A trainer: serves the steps' READs; zeros."""
    st = STATE[_KEY]
    if not st["remote"]:
        _serve(st, iters + 1)
        return {"seconds": 0.0, "cpu_s": 0.0, "recv_bytes": 0.0}
    _step(st)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(iters):
        _step(st)
    return {"seconds": (time.perf_counter() - t0) / iters, "cpu_s": (time.process_time() - c0) / iters,
            "recv_bytes": float(sum(b.nbytes for b in st["bufs"].values()))}


def nixl_raw_teardown() -> None:
    """Deregister the buffers, unload the peers, drop the agent and the store."""
    st = STATE.pop(_KEY, None)
    if st is None:
        return
    agent = st["agent"]
    for reg in st["regs"]:
        agent.deregister_memory(reg)
    for name in st["peers"].values():
        agent.remove_remote_agent(name)
