"""Transfer rows of ``gpu_bench.py``: weightsync's data plane between a sender (trainer rank 0, data
rank 0) and one receiver (worker 0, data rank 1) on one device, each beside a raw op of the same bytes
on the same group in the same run (the ratio is the number that matters).

* ``M2N rounds``: a plan from :mod:`weightsync.plan` (Qwen3-8B-shaped tensors, one trainer rank
  holding FSDP dim-0 shards of the whole model -> worker 0 of TP 2: dim-0 halves of q/k/v/gate/up
  and the embedding, dim-1 halves of o/down_proj, norms whole) run by
  :func:`weightsync.reshard.handshake.run_rounds` over :class:`weightsync.comm.Communicator`, the
  receiver copying into its parameters; ``raw p2p``: one send/recv of the same bytes; ``raw p2p
  cap``: the same bytes in message-cap chunks, ``DEPTH`` in flight (the executor's messages without copies).
* ``bcast buckets``: the nccl transport's bucket path (``plan_buckets``, ``pack`` into two buffers,
  ``Communicator.broadcast``; the receiver takes a fresh buffer per bucket, receives the next while it
  copies its TP-rank-0 slices out of ``unpack``'s views); ``raw bcast``: one broadcast of a buffer of the
  payload's size.
* ``M2N copies, no wire``: ``run_rounds`` of both ends in this process with a data plane that moves
  nothing (the executor's pack and apply copies alone; runs even where NCCL refuses the pair).

Peers: ``procs`` (two processes, as trainer and vLLM worker are) or ``threads`` (one process, two
threads, each party on its own CUDA stream and NCCL communicator). NCCL refuses two ranks on one GPU
("Duplicate GPU detected", since NCCL 2.5) unless ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (experimental,
NCCL >= 2.30), which the parties set unless it is set already. Two processes without MPS time-slice
the GPU (their kernels do not overlap), so ``procs`` wire numbers may be a floor; ``threads`` share one
context, but NCCL's docs call issuing ops from several threads to communicators on one device unsafe
(it may hang): a row that hangs times out (``Communicator`` deadline, then the process is killed) and
is reported as skipped. Not yet run on a GPU. On CPU the same code runs over gloo (a plumbing check).
The first run of every row is a warm-up after which both ends fold checksums of what the receiver
should hold (``verified``); the runs after it are capped to ~5 s, and each mode to 120 s in all.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import queue
import statistics
import threading
import time
import traceback
from typing import Any

import torch

from weightsync.comm import Communicator, describe
from weightsync.plan import (
    DestPiece,
    Region,
    Shard,
    TensorSource,
    align_up,
    build_plan,
    mesh_coordinates,
    source_regions,
)
from weightsync.plan.buckets import plan_buckets
from weightsync.plan.schedule import message_cap
from weightsync.reshard.executor import DEPTH
from weightsync.reshard.handshake import my_messages, run_rounds
from weightsync.reshard.packing import fold_checksum, pack, unpack

MiB = 1 << 20
NCCL_ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"}
COLUMN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight",
          "embed_tokens.weight")
ROW = ("o_proj.weight", "down_proj.weight")


def tp_layout(metas: list[Any], tp: int = 2, rank: int = 0) -> tuple[list[TensorSource], list[DestPiece], dict]:
    """Sources (one trainer rank, dim-0 shards) and worker ``rank`` of TP ``tp``'s pieces and param shapes."""
    regions: dict[tuple[int, ...], Any] = {}  # one regions tuple per shape keeps planning fast
    sources, pieces, shapes = [], [], {}
    for m in metas:
        shape = tuple(m.shape)
        if shape not in regions:
            regions[shape] = source_regions(shape, (1,), [Shard(0)], mesh_coordinates((1,)))
        sources.append(TensorSource(m.name, shape, str(m.dtype).removeprefix("torch."), regions[shape]))
        dim = 0 if m.name.endswith(COLUMN) else 1 if m.name.endswith(ROW) else None
        sizes = tuple(s // tp if d == dim else s for d, s in enumerate(shape))
        offsets = tuple(rank * sizes[d] if d == dim else 0 for d in range(len(shape)))
        pieces.append(DestPiece(m.name, Region(offsets, sizes), m.name, (0,) * len(shape)))
        shapes[m.name] = sizes
    return sources, pieces, shapes


def _views(flat: torch.Tensor, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors of ``shapes`` laid out in ``flat`` (uint8) at 256-byte-aligned offsets (as a flat shard)."""
    out, off = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape) * dtype.itemsize
        out[name] = flat[off : off + n].view(dtype).view(shape)
        off = align_up(off + n, 256)
    return out


def _flat_bytes(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> int:
    return sum(align_up(math.prod(s) * dtype.itemsize, 256) for s in shapes.values())


def _stream_sync(device: torch.device) -> None:
    if device.type == "cuda":  # this party's stream only: a device-wide sync could wait on the peer's kernels
        torch.cuda.current_stream(device).synchronize()


class _NullComm:
    """A data plane that moves nothing (``M2N copies, no wire``)."""

    ordered = False

    def post(self, sends: list, recvs: list) -> list:
        return []

    def wait_all(self, works: list, what: str = "") -> None:
        pass


def executor_copies(metas: list[Any], device: torch.device, staging_bytes: int, repeats: int) -> dict[str, Any]:
    """Median seconds of the sender's and the receiver's ``run_rounds`` with no wire, one after the other."""
    dtype = metas[0].dtype
    sources, pieces, shapes = tp_layout(metas)
    plan = build_plan(sources, [pieces])
    cap = message_cap(staging_bytes, 1, 1, buffers=2)
    dtypes = {s.name: s.dtype for s in sources}
    src_flat = torch.empty(_flat_bytes({m.name: m.shape for m in metas}, dtype), dtype=torch.uint8, device=device)
    dst_flat = torch.zeros(_flat_bytes(shapes, dtype), dtype=torch.uint8, device=device)
    src = _views(src_flat.random_(0, 256), {m.name: tuple(m.shape) for m in metas}, dtype)
    params = _views(dst_flat, shapes, dtype)
    staging = torch.empty(staging_bytes, dtype=torch.uint8, device=device)
    ends = [(my_messages(plan, sources, rank=0, sender=s, cap=cap), s) for s in (True, False)]
    shard_of, param_of = (lambda m, i: src[m.items[i].name]), (lambda m, i: params[m.items[i].param])
    times = []
    for _ in range(repeats + 1):
        _stream_sync(device)
        t0 = time.perf_counter()
        for rounds, sender in ends:
            run_rounds(_NullComm(), rounds, staging, sender=sender, peer_rank=lambda p: p, dtypes=dtypes,
                       tensor_of=shard_of if sender else param_of)
        _stream_sync(device)
        times.append(time.perf_counter() - t0)
    lower = plan.coverage().lower_bound[0]
    return {"bytes": lower, "seconds": statistics.median(times[1:]),
            "note": f"pack + apply of {len(ends[0][0])} rounds in one process, nothing on the wire"}


def _measure(comm: Communicator, key: str, fn: Any, device: torch.device, spec: dict, check: Any = None) -> dict:
    """Median seconds of ``fn()``, both parties in step (a barrier before each run). The first run is
    a warm-up followed by ``check()``; rank 0 picks how many runs fit ``spec['budget_s']`` from it."""
    comm.data.barrier()
    t0 = time.perf_counter()
    fn()
    _stream_sync(device)
    warm = time.perf_counter() - t0
    ok = check() if check is not None else None
    if comm.rank == 0:
        comm.publish(f"rows/{key}/runs", max(1, min(spec["repeats"], int(spec["budget_s"] / max(warm, 1e-6)))))
    runs = comm.read(f"rows/{key}/runs")
    times = []
    for _ in range(runs):
        comm.data.barrier()
        t0 = time.perf_counter()
        fn()
        _stream_sync(device)
        times.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(times), "runs": runs, "warmup_s": warm, "verified": ok}


def _verify(comm: Communicator, key: str, tensors: list[torch.Tensor]) -> bool:
    """Both ends fold ``tensors`` (the sender: what each piece should hold; the receiver: the params)."""
    acc = 0
    for t in tensors:
        acc = fold_checksum(acc, t)
    if comm.rank == 0:
        comm.publish(f"rows/{key}/sum", acc)
    else:
        comm.publish(f"rows/{key}/ok", comm.read(f"rows/{key}/sum") == acc)
    return bool(comm.read(f"rows/{key}/ok"))


def _party_rows(comm: Communicator, device: torch.device, spec: dict) -> dict[str, dict]:
    metas, sender = spec["metas"], comm.rank == 0
    dtype = metas[0].dtype
    sources, pieces, shapes = tp_layout(metas)
    plan = build_plan(sources, [pieces])
    lower = plan.coverage().lower_bound[0]
    cap = message_cap(spec["staging_bytes"], 1, 1, buffers=2)
    rounds = my_messages(plan, sources, rank=0, sender=sender, cap=cap)
    dtypes = {s.name: s.dtype for s in sources}
    full_shapes = {m.name: tuple(m.shape) for m in metas}
    if sender:
        flat = torch.empty(_flat_bytes(full_shapes, dtype), dtype=torch.uint8, device=device).random_(0, 256)
        tensors = _views(flat, full_shapes, dtype)
        expected = [tensors[p.name][p.region.slices()] for p in pieces]
    else:
        flat = torch.zeros(_flat_bytes(shapes, dtype), dtype=torch.uint8, device=device)
        params = _views(flat, shapes, dtype)
        expected = [params[p.param] for p in pieces]
    staging = torch.empty(spec["staging_bytes"], dtype=torch.uint8, device=device)
    buckets = plan_buckets(metas, spec["bucket_bytes"])
    total = sum(b.nbytes for b in buckets)
    # Everything allocated before the first op (no cudaMalloc while a peer's kernel waits on this party).
    # The receiver's raw broadcast target is freed before the bucket row, whose fresh buffers reuse it.
    raw = flat[:total] if sender else torch.empty(total, dtype=torch.uint8, device=device)
    buffers = [torch.empty(spec["bucket_bytes"], dtype=torch.uint8, device=device) for _ in range(2)] if sender else []
    out: dict[str, dict] = {}

    def m2n() -> None:
        run_rounds(comm.data, rounds, staging, sender=sender, peer_rank=(lambda w: 1 + w) if sender else (lambda r: r),
                   dtypes=dtypes, tensor_of=(lambda m, i: tensors[m.items[i].name]) if sender
                   else (lambda m, i: params[m.items[i].param]))

    out["m2n"] = _measure(comm, "m2n", m2n, device, spec, lambda: _verify(comm, "m2n", expected))
    out["m2n"].update(bytes=lower, note=f"1 -> TP 2 worker 0, {len(rounds)} rounds of <= {cap // MiB} MiB")

    def raw_p2p(chunk: int) -> Any:
        def run() -> None:
            in_flight = []
            for off in range(0, lower, chunk):
                op = [(flat[off : min(off + chunk, lower)], 1 if sender else 0, off // chunk)]
                in_flight.append(comm.data.post(op, []) if sender else comm.data.post([], op))
                if len(in_flight) == DEPTH:
                    comm.data.wait_all(in_flight.pop(0))
            for works in in_flight:
                comm.data.wait_all(works)
        return run

    out["p2p"] = _measure(comm, "p2p", raw_p2p(lower), device, spec)
    out["p2p"].update(bytes=lower, note="one send/recv of the same bytes")
    out["p2p_cap"] = _measure(comm, "p2p_cap", raw_p2p(cap), device, spec)
    out["p2p_cap"].update(bytes=lower, note=f"same bytes in {cap // MiB} MiB messages, {DEPTH} in flight")

    def raw_bcast(buf: torch.Tensor) -> Any:  # takes `raw` as an argument: it is freed just below
        return lambda: comm.data.wait_all([comm.data.broadcast(buf, 0)], "broadcast")

    out["raw_bcast"] = _measure(comm, "raw_bcast", raw_bcast(raw), device, spec)
    out["raw_bcast"].update(bytes=total, note="one broadcast of a buffer of the payload's size")
    del raw
    by_name = {p.name: p for p in pieces}
    starts = [0]
    for b in buckets:
        starts.append(starts[-1] + len(b.entries))
    order = [tensors[m.name] for m in metas] if sender else []

    def send_buckets() -> None:  # NCCLTrainerEngine._broadcast's loop
        works: list[Any] = [None, None]
        for b, bucket in enumerate(buckets):
            slot = b % 2
            if works[slot] is not None:
                comm.data.wait_all([works[slot]], "bucket broadcast")
            buf = buffers[slot][: align_up(bucket.nbytes, 256)]
            for entry, t in zip(bucket.entries, order[starts[b] : starts[b + 1]]):
                pack(buf, entry, t)
            _stream_sync(device)
            works[slot] = comm.data.broadcast(buf, 0)
        for w in works:
            if w is not None:
                comm.data.wait_all([w], "bucket broadcast")

    def receive_buckets() -> None:  # NCCLWorkerEngine._receive_buckets, applying TP-rank-0 slices
        def post(b: int) -> tuple[torch.Tensor, Any]:
            buf = torch.empty(align_up(buckets[b].nbytes, 256), dtype=torch.uint8, device=device)
            return buf, comm.data.broadcast(buf, 0)

        inflight = post(0) if buckets else None
        for b, bucket in enumerate(buckets):
            buf, work = inflight
            inflight = post(b + 1) if b + 1 < len(buckets) else None
            comm.data.wait_all([work], f"bucket {b} broadcast")
            for name, t in unpack(buf, bucket):
                piece = by_name[name]
                params[piece.param].copy_(t[piece.region.slices()])

    if not sender:
        flat.zero_()  # the check below must see what the broadcast wrote, not the M2N row's values
    out["bcast"] = _measure(comm, "bcast", send_buckets if sender else receive_buckets, device, spec,
                            lambda: _verify(comm, "bcast", expected))
    out["bcast"].update(bytes=total, note=f"{len(buckets)} buckets of <= {spec['bucket_bytes'] // MiB} MiB, "
                                          "receiver copies its TP-rank-0 slices out")
    return out


def _party(rank: int, port: int, device_str: str, spec: dict, results: Any) -> None:
    """One end: join the data plane, run every row, put ``(rank, "ok", rows)`` or ``(rank, "error", why)``."""
    device, comm = torch.device(device_str), None
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # Each party on its own stream: in one process (threads) the two must not share one.
        stream = torch.cuda.stream(torch.cuda.Stream(device)) if device.type == "cuda" else contextlib.nullcontext()
        with stream:
            comm = Communicator.connect("127.0.0.1", port, name=("sender", "receiver")[rank],
                                        timeout_s=spec["timeout_s"])
            comm.join(rank, 2, device=device, group_name="bench")
            results.put((rank, "ok", _party_rows(comm, device, spec)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, and to the peer so it fails fast
        frame = traceback.extract_tb(e.__traceback__)[-1:]
        where = f" (at {os.path.basename(frame[0].filename)}:{frame[0].lineno})" if frame else ""
        if comm is not None:
            comm.fail(describe(e), e)
        results.put((rank, "error", describe(e).splitlines()[0][:400] + where))
    finally:
        if comm is not None:
            comm.shutdown()


def _process_main(ranks: tuple[int, ...], port: int, device_str: str, spec: dict, results: Any) -> None:
    """A spawned process: one party, or (``threads``) both, each in its own thread."""
    for k, v in NCCL_ENV.items():
        os.environ.setdefault(k, v)
    if torch.device(device_str).type == "cpu":
        torch.set_num_threads(1)  # two parties' intra-op pools on a few cores: spinning threads skew the rows
    threads = [threading.Thread(target=_party, args=(r, port, device_str, spec, results)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_pair(mode: str, device: torch.device, spec: dict, timeout_s: float) -> dict[int, Any]:
    """Both parties (``procs`` or ``threads``); ``{rank: rows}``, or ``{"error": why}``."""
    host = Communicator.connect("127.0.0.1", 0, name="bench store", timeout_s=timeout_s, host_store=True)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    groups = [(0,), (1,)] if mode == "procs" else [(0, 1)]
    procs = [ctx.Process(target=_process_main, args=(g, host.port, str(device), spec, results), daemon=True)
             for g in groups]
    for p in procs:
        p.start()
    got: dict[Any, Any] = {}
    errors = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) + len(errors) < 2 and time.monotonic() < deadline:
            try:
                rank, status, payload = results.get(timeout=1.0)
            except queue.Empty:
                if all(p.exitcode is not None for p in procs):
                    break
                continue
            if status == "ok":
                got[rank] = payload
            else:
                errors.append(f"{('sender', 'receiver')[rank]}: {payload}")
    finally:
        for p in procs:
            p.join(10 if len(got) == 2 else 1)
            if p.is_alive():
                p.kill()
                p.join(5)
        host.shutdown()
    if len(got) == 2:
        return got
    if not errors:
        exits = [p.exitcode for p in procs]
        errors.append(f"timed out after {timeout_s:.0f}s" if time.monotonic() >= deadline
                      else f"a party exited without a result (exit codes {exits})")
    return {"error": "; ".join(errors)}


ROWS = (("m2n", "M2N rounds", "p2p"), ("p2p", "raw p2p", None), ("p2p_cap", "raw p2p cap", None),
        ("bcast", "bcast buckets", "raw_bcast"), ("raw_bcast", "raw bcast", None))
"""(key, row name, the raw row it is compared with)."""
NAMES = {k: n for k, n, _ in ROWS}


def transfer_rows(metas: list[Any], device: torch.device, *, staging_bytes: int, bucket_bytes: int, repeats: int,
                  peers: list[str], budget_s: float = 5.0, timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """Every transfer row: the no-wire executor copies here, then each of ``peers``' pair rows."""
    rows = []
    r = executor_copies(metas, device, staging_bytes, repeats)
    rows.append({"row": "M2N copies, no wire", **r, "gbps": r["bytes"] / r["seconds"] / 1e9})
    if device.type == "cuda":
        torch.cuda.empty_cache()  # nothing else runs here meanwhile: the pairs get the memory
    wire = "NCCL" if device.type == "cuda" else "gloo"
    spec = {"metas": metas, "staging_bytes": staging_bytes, "bucket_bytes": bucket_bytes, "repeats": repeats,
            "budget_s": budget_s, "timeout_s": min(45.0, timeout_s)}
    for mode in peers:
        got = run_pair(mode, device, spec, timeout_s)
        if "error" in got:
            rows.append({"row": f"{wire} rows [{mode}]", "skipped": got["error"]})
            continue
        merged = {k: {**got[1][k], "seconds": max(got[0][k]["seconds"], got[1][k]["seconds"])} for k, _, _ in ROWS}
        for key, name, raw in ROWS:
            m = merged[key]
            note = f"{wire}, {m['note']}, {m['runs']} runs"
            if raw is not None:
                note += f"; {merged[raw]['seconds'] / m['seconds']:.2f}x {NAMES[raw]}"
            if m["verified"] is not None:
                note += ", verified" if m["verified"] else ", CHECKSUM MISMATCH"
            rows.append({"row": f"{name} [{mode}]", "bytes": m["bytes"], "seconds": m["seconds"],
                         "gbps": m["bytes"] / m["seconds"] / 1e9, "note": note})
    return rows
