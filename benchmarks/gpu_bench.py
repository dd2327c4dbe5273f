"""CUDA-only transfer rows: colocated IPC between two processes on one GPU, weightsync's M2N rounds and
bucket broadcast over NCCL between two ranks on that GPU, and packing throughput against the GPU's
device-to-device copy bandwidth.

Launch (one CUDA GPU, no vLLM, no internet; well under 5 minutes, ~4x ``--mib`` of GPU memory)::

    python benchmarks/gpu_bench.py                  # 4 GiB payload, bf16
    python benchmarks/gpu_bench.py --mib 16384      # larger payload (needs ~64 GiB)

Without CUDA it prints why and exits 0 (``--device cpu`` runs the same code on shared memory and gloo,
to check the plumbing at 1/8 of the dimensions; those numbers are not GPU rows). Rows, all with
``torch.cuda.synchronize`` around the timed region and the median of ``--repeats`` runs after one warm-up:

* ``d2d copy``: one ``copy_`` of the whole payload (bytes copied per second);
* ``pack (bucket)``: weightsync's ``plan_buckets`` + ``pack`` of a Qwen3-8B-shaped tensor list
  (36 layers' shapes, cycled up to the payload) into one reusable bucket, bucket by bucket;
* ``unpack + clone``: weightsync's ``unpack`` views of each bucket, cloned (what an IPC worker does);
* ``strided slice pack``: column halves of row-parallel weights copied into a flat staging buffer
  (an M2N pack from a TP-sharded source);
* ``IPC clone``: a second process imports the bucket buffer once (weightsync's ``ExportedBuffer`` /
  ``BufferImporter``, CUDA IPC) and clones each chunk out of it; the producer packs the next chunk only
  after the consumer's acknowledgement over a pipe (the ipc transport's per-chunk handshake);
* ``IPC handle open``: first import of the handle in the consumer (milliseconds);
* transfer rows (``_gpu_transfer.py``; sender = trainer rank 0, receiver = worker 0 of TP 2, over
  ``weightsync.comm.Communicator``, NCCL, or gloo with ``--device cpu``), each run as two processes and
  as two threads of one process (``--peers``): ``M2N rounds`` (``run_rounds`` of a 1 -> TP 2 plan, the
  receiver's half of the payload) beside ``raw p2p`` (one send/recv of the same bytes) and ``raw p2p
  cap`` (the same bytes in message-cap chunks); ``bcast buckets`` (the nccl transport's pack /
  broadcast / unpack loop, receiver copying its TP slices out) beside ``raw bcast`` (one broadcast of
  the payload's size); ``M2N copies, no wire`` (the executor's copies alone, in this process). A pair
  row runs from a barrier to each party's own stream sync (not a device-wide one), the slower party's
  median. Each note gives the ratio to its raw row and whether the receiver's checksums matched.
  NCCL needs ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (NCCL >= 2.30) for two ranks on one GPU; the parties set
  it. Each row's runs are capped to ~5 s after its warm-up and each mode to 120 s, so a slow or hung
  pair cannot stall the run (it is reported as skipped).

Prints a markdown table; writes ``gpu_bench.json`` and ``gpu_bench.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import _gpu_transfer
from _report import portable

from weightsync.plan import align_up
from weightsync.plan.buckets import plan_buckets
from weightsync.protocol import ParamMeta
from weightsync.reshard.packing import pack, unpack
from weightsync.transports.ipc_handles import BufferImporter, ExportedBuffer

MiB = 1 << 20
_H, _I, _Q, _KV, HD, _V = 4096, 12288, 32, 8, 128, 151936  # Qwen3-8B


def qwen3_8b_metas(total_bytes: int, dtype: torch.dtype, shrink: int = 1) -> list[ParamMeta]:
    """Qwen3-8B tensor shapes (embedding first, then layers cycled) until ``total_bytes``; every
    dimension but head_dim divided by ``shrink`` (the CPU plumbing check)."""
    H, I, Q, KV, V = (d // shrink for d in (_H, _I, _Q, _KV, _V))
    layer = [("self_attn.q_proj.weight", (Q * HD, H)), ("self_attn.k_proj.weight", (KV * HD, H)),
             ("self_attn.v_proj.weight", (KV * HD, H)), ("self_attn.o_proj.weight", (H, Q * HD)),
             ("self_attn.q_norm.weight", (HD,)), ("self_attn.k_norm.weight", (HD,)),
             ("mlp.gate_proj.weight", (I, H)), ("mlp.up_proj.weight", (I, H)), ("mlp.down_proj.weight", (H, I)),
             ("input_layernorm.weight", (H,)), ("post_attention_layernorm.weight", (H,))]
    metas = [ParamMeta("model.embed_tokens.weight", dtype, (V, H))]
    used, i = metas[0].nbytes, 0
    while used < total_bytes:
        name, shape = layer[i % len(layer)]
        m = ParamMeta(f"model.layers.{i // len(layer)}.{name}", dtype, shape)
        metas.append(m)
        used += m.nbytes
        i += 1
    return metas


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Any, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` after one warm-up."""
    fn()
    _sync(device)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def bench_d2d(nbytes: int, device: torch.device, repeats: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src), device, repeats)


def bench_strided(row_parallel: list[torch.Tensor], staging_bytes: int, device: torch.device, repeats: int) -> float:
    """Column half ``[:, :n/2]`` of each row-parallel weight (a TP 2 source shard) into flat staging."""
    staging = torch.empty(staging_bytes, dtype=torch.uint8, device=device)

    def run() -> None:
        off = 0
        for t in row_parallel:
            half = t[:, : t.shape[1] // 2]
            n = half.numel() * half.element_size()
            if off + n > staging.numel():
                off = 0
            staging[off : off + n].view(t.dtype).view(half.shape).copy_(half)
            off += (n + 63) // 64 * 64

    return timed(run, device, repeats)


def _consumer(conn: Any, device_str: str) -> None:
    """The second process: import the handle once, clone each announced chunk, acknowledge it."""
    device = torch.device(device_str)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    importer = BufferImporter(device)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        kind, payload = msg
        if kind == "open":
            t0 = time.perf_counter()
            buf = importer.get(payload)
            _sync(device)
            conn.send(time.perf_counter() - t0)
        elif kind == "clone":  # (nbytes,) of the chunk at the start of the buffer
            out = buf[: payload].clone()
            _sync(device)
            del out
            conn.send(True)
    importer.close()
    conn.send("closed")


def bench_ipc(device: torch.device, bucket: torch.Tensor, exported: ExportedBuffer, chunks: list[int],
              fill: Any, repeats: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(child, str(device)), daemon=True)
    proc.start()
    try:
        parent.send(("open", exported.export(0)))
        open_s = parent.recv()

        def run() -> None:
            for b, n in enumerate(chunks):
                fill(b)  # pack chunk b into the shared buffer
                _sync(device)
                parent.send(("clone", n))
                parent.recv()

        seconds = timed(run, device, repeats)
        parent.send(None)
        parent.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return {"seconds": seconds, "open_ms": open_s * 1e3}


def local_rows(metas: list[ParamMeta], dtype: torch.dtype, nbytes: int, bucket_bytes: int, device: torch.device,
               repeats: int, row: Callable[..., None]) -> float:
    """The rows run in this process (copy, pack, unpack, strided pack, IPC), each passed to ``row``; returns
    the IPC handle's open milliseconds. Their tensors and buffer are freed on return, before the transfer
    rows' processes need the memory."""
    tensors = [torch.randn(m.shape, device=device).to(dtype) for m in metas]
    buckets = plan_buckets(metas, bucket_bytes)
    exported = ExportedBuffer(bucket_bytes, device, tag="bench")
    bucket = exported.tensor
    row("d2d copy", nbytes, bench_d2d(nbytes, device, repeats), "one copy_ of the payload")

    starts, k = [], 0
    for b in buckets:
        starts.append(k)
        k += len(b.entries)

    def fill(b: int) -> None:
        for e, t in zip(buckets[b].entries, tensors[starts[b]: starts[b] + len(buckets[b].entries)]):
            pack(bucket, e, t)

    def pack_all() -> None:
        for b in range(len(buckets)):
            fill(b)

    row("pack (bucket)", nbytes, timed(pack_all, device, repeats),
        f"{len(metas)} tensors, {len(buckets)} buckets of <= {bucket_bytes // MiB} MiB")

    def unpack_clone() -> None:
        for b in buckets:
            for _, t in unpack(bucket, b):
                t.clone()

    row("unpack + clone", nbytes, timed(unpack_clone, device, repeats), "views of one bucket, cloned")
    row_parallel = [t for m, t in zip(metas, tensors) if m.name.endswith(("o_proj.weight", "down_proj.weight"))]
    strided = sum(t.numel() * t.element_size() // 2 for t in row_parallel)
    row("strided slice pack", strided, bench_strided(row_parallel, bucket_bytes, device, repeats),
        "column halves of o/down_proj")
    ipc = bench_ipc(device, bucket, exported, [b.nbytes for b in buckets], fill, repeats)
    row("IPC pack + clone", nbytes, ipc["seconds"], "2 processes, 1 device, ack per chunk")
    exported.close()
    return ipc["open_ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=4096,
                    help="payload (MiB of bf16 tensors; the embedding alone is 1.2 GB)")
    ap.add_argument("--bucket-mib", type=int, default=512,
                    help="bucket size (the ipc transport's default; the broadcast rows use it too)")
    ap.add_argument("--staging-mib", type=int, default=256, help="M2N staging (the m2n transport's default)")
    ap.add_argument("--peers", default="both", choices=["procs", "threads", "both", "none"],
                    help="how the transfer rows' two ranks run: two processes, two threads of one, both, or not at all")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: plumbing check only")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_bench: CUDA is not available; nothing to measure (these rows need one GPU). Skipped.")
        return
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype, total = torch.bfloat16, args.mib * MiB
    metas = qwen3_8b_metas(total, dtype, 1 if device.type == "cuda" else 8)
    bucket_bytes = align_up(max(args.bucket_mib * MiB, max(m.nbytes for m in metas)), 256)
    nbytes = sum(m.nbytes for m in metas)
    rows: list[dict[str, Any]] = []

    def row(name: str, moved: int, seconds: float, note: str = "") -> None:
        rows.append({"row": name, "bytes": moved, "seconds": seconds, "gbps": moved / seconds / 1e9, "note": note})
        print(f"{name:<22} {moved / 1e9:.2f} GB in {seconds * 1e3:.1f} ms: {rows[-1]['gbps']:.1f} GB/s {note}",
              flush=True)

    open_ms = local_rows(metas, dtype, nbytes, bucket_bytes, device, args.repeats, row)
    rows.append({"row": "IPC handle open", "ms": open_ms})
    print(f"IPC handle open        {open_ms:.1f} ms (first import in the consumer)")
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the transfer rows' processes need the memory
    peers = {"both": ["procs", "threads"], "none": []}.get(args.peers, [args.peers])
    for r in _gpu_transfer.transfer_rows(metas, device, staging_bytes=args.staging_mib * MiB,
                                         bucket_bytes=bucket_bytes, repeats=args.repeats, peers=peers):
        if "skipped" in r:
            rows.append(r)
            print(f"{r['row']:<22} skipped: {r['skipped']}", flush=True)
        else:
            row(r["row"], r["bytes"], r["seconds"], r["note"])

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (plumbing check, not a GPU row)"
    title = (f"GPU rows on {name}, torch {torch.__version__}, payload {nbytes / 1e9:.2f} GB bf16, "
             f"median of {args.repeats}")
    lines = [title, "", "| row | GB | ms | GB/s | note |", "|---|---:|---:|---:|---|"]
    for r in rows:
        if "gbps" in r:
            lines.append(f"| {r['row']} | {r['bytes'] / 1e9:.2f} | {r['seconds'] * 1e3:.1f} | {r['gbps']:.1f} "
                         f"| {r['note']} |")
        elif "skipped" in r:
            lines.append(f"| {r['row']} | | | | skipped: {r['skipped']} |")
        else:
            lines.append(f"| {r['row']} | | {r['ms']:.1f} | | first import in the consumer |")
    print("\n" + "\n".join(lines))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_bench.json"), "w") as f:
        json.dump({"device": name, "torch": torch.__version__, "args": portable(args), "rows": rows}, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    bars = [r for r in rows if "gbps" in r]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh([r["row"] for r in bars], [r["gbps"] for r in bars])
    ax.set_xlabel("GB/s (payload bytes per second)")
    ax.set_title(f"{name}: packing, IPC and transfers vs device-to-device copy", fontsize=9)
    ax.invert_yaxis()
    fig.tight_layout()
    path = os.path.join(args.out, "gpu_bench.png")
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
