"""``NixlPlane`` (the data plane of ``weightsync_nixl``) against NIXL's own raw READ of the same bytes.

Two processes on this machine: rank 0 holds a source buffer of each size, rank 1 a destination. Each
repeat times, back to back (paired, same run, same buffers), (a) one message through ``NixlPlane``
(``exchange``: announce, READ, read-notification; the registrations made by an untimed first
transfer) and (b) a raw NIXL READ of the same bytes by a second agent in the same processes (made as the
plane makes its agents: ``new_agent``), buffers registered and descriptors exchanged beforehand
(``initialize_xfer``, ``transfer``, poll to DONE, one notification to the source, which progresses until then).
What it does not measure: the plan, packing and applying of a whole ``weightsync_nixl`` sync (that is
``transfer_throughput.py``). Prints a table and writes JSON (``--out``).

    python benchmarks/nixl_raw.py --sizes 268MB 1.07GB --repeats 5 --out docs/results/nixl_raw.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import time
from typing import Any

import torch


def _size(text: str) -> int:
    units = {"KB": 1e3, "MB": 1e6, "GB": 1e9}
    for u, f in units.items():
        if text.upper().endswith(u):
            return int(float(text[:-2]) * f)
    return int(text)


def _raw_pair(comm: Any, rank: int, buf: torch.Tensor) -> tuple[Any, Any]:
    """A second agent per process, the buffer registered, agents and descriptors exchanged (store, JSON)."""
    from weightsync.dataplane.nixl import new_agent

    agent = new_agent(f"raw-{rank}-{buf.nbytes}")
    agent.register_memory(agent.get_reg_descs([(buf.data_ptr(), buf.nbytes, 0, "")], "DRAM"))
    comm.store.set(f"raw/md/{rank}/{buf.nbytes}", agent.get_agent_metadata())
    comm.store.set(f"raw/desc/{rank}/{buf.nbytes}", json.dumps([buf.data_ptr(), buf.nbytes]))
    other = 1 - rank
    comm.store.wait([f"raw/md/{other}/{buf.nbytes}"])
    peer = agent.add_remote_agent(comm.store.get(f"raw/md/{other}/{buf.nbytes}"))
    return agent, peer.decode() if isinstance(peer, bytes) else peer


def _raw_read(agent: Any, peer: str, dst: torch.Tensor, comm: Any) -> float:
    addr, n = json.loads(comm.store.get(f"raw/desc/0/{dst.nbytes}"))
    t0 = time.perf_counter()
    h = agent.initialize_xfer("READ", agent.get_xfer_descs([(dst.data_ptr(), dst.nbytes, 0)], "DRAM"),
                              agent.get_xfer_descs([(addr, n, 0)], "DRAM"), peer, b"")
    state = agent.transfer(h)
    while state == "PROC":
        state = agent.check_xfer_state(h)
    dt = time.perf_counter() - t0
    assert state == "DONE", state
    h.release()
    agent.send_notif(peer, b"read")  # rank 0 drives its agent's progress until it comes (``_serve``)
    return dt


def _serve(agent: Any) -> float:
    """Rank 0: drive the raw agent's progress (no progress thread) until rank 1's READ-done notification."""
    pause = 2e-5  # as ``NixlPlane.wait_all`` pauses between looks
    while not agent.get_new_notifs():
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)
    return 0.0


def _party(rank: int, port: int, sizes: list[int], repeats: int, out: Any) -> None:
    from weightsync.comm import Communicator
    from weightsync.dataplane.nixl import NixlPlane

    comm = Communicator.connect("127.0.0.1", port, name=f"rank {rank}", timeout_s=300, host_store=rank == 0)
    comm.join(rank, 2, plane=NixlPlane)
    plane = comm.data
    rows = []
    for size in sizes:
        buf = torch.randint(0, 255, (size,), dtype=torch.uint8) if rank == 0 else torch.zeros(size, dtype=torch.uint8)
        agent, peer = _raw_pair(comm, rank, buf)
        plane.exchange([(buf, 1, 0)] if rank == 0 else [], [(buf, 0, 0)] if rank == 1 else [])  # registers
        pairs = []
        for _ in range(repeats):
            plane.barrier()
            t0 = time.perf_counter()
            plane.exchange([(buf, 1, 0)] if rank == 0 else [], [(buf, 0, 0)] if rank == 1 else [])
            ws = time.perf_counter() - t0
            plane.barrier()
            raw = _raw_read(agent, peer, buf, comm) if rank == 1 else _serve(agent)
            pairs.append((ws, raw))
        plane.barrier()
        if rank == 1:
            ws_s = statistics.median(p[0] for p in pairs)
            raw_s = statistics.median(p[1] for p in pairs)
            ratio = statistics.median(p[1] / p[0] for p in pairs)
            rows.append({"bytes": size, "weightsync_nixl_s": ws_s, "raw_nixl_s": raw_s,
                         "weightsync_nixl_GBps": size / ws_s / 1e9, "raw_nixl_GBps": size / raw_s / 1e9,
                         "ratio_of_raw": ratio, "pairs": pairs})
        del agent
    out.put(rows if rank == 1 else None)
    comm.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["268MB"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="")
    args = p.parse_args()
    sizes = [_size(s) for s in args.sizes]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_party, args=(r, port, sizes, args.repeats, q)) for r in range(2)]
    for pr in procs:
        pr.start()
    rows = [r for r in (q.get(timeout=1800), q.get(timeout=1800)) if r is not None][0]
    for pr in procs:
        pr.join(60)
    print(f"{'bytes':>12} {'weightsync_nixl GB/s':>21} {'raw NIXL GB/s':>14} {'ratio (paired median)':>22}")
    for r in rows:
        ws, raw = r["weightsync_nixl_GBps"], r["raw_nixl_GBps"]
        print(f"{r['bytes']:>12} {ws:>21.2f} {raw:>14.2f} {r['ratio_of_raw']:>22.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "cpus": torch.get_num_threads(), "when": time.strftime("%Y-%m-%d %H:%M")}, f,
                      indent=1)


if __name__ == "__main__":
    main()
