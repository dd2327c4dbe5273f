"""Per-sync host cost of the M2N executor at 235B-1T scale (issue 36, item 4).

Launch (CPU, one core; no GPU needed)::

    PYTHONPATH=src python benchmarks/scale.py --quick   # ~1 minute: 1/8 of the layers, extrapolated
    PYTHONPATH=src python benchmarks/scale.py           # every layer (a few minutes)
    PYTHONPATH=src python benchmarks/scale.py --shape qwen3-tp   # one shape (see SHAPES)
    PYTHONPATH=src python benchmarks/scale.py --device cuda      # the same on one GPU (see below)
    PYTHONPATH=src python benchmarks/scale.py --fan-out          # plans only: replica fan-out vs direct

Each shape is the real structure (true tensor names, shapes' row structure, FSDP ranks, TP / EP
layout), so the plan has its true item count; the bytes are scaled down by ``S``: every tensor of
2 or more dims has its last dim divided by ``S`` (row-parallel TP slices run along it: their rows
are S times shorter than at full size), and the staging buffer (so the message cap) and ``ALONE``
too, so the messages are cut as at full size. k2's per-expert tensors are fused at the source
(``DTensorModuleSource(fuse_experts=True)``: one [E, ...] tensor per layer and projection, into
vLLM's fused ``w13_weight`` / ``w2_weight``); its trainer's timed sync includes the stacking.
One process per shape builds the plan, then runs trainer rank 0's and worker 0's executor
(:func:`~weightsync.reshard.executor.run_rounds`) against a data plane that completes at once
(``ordered``, as NCCL): every byte the executor copies is still copied (staged packs and applies),
nothing else moves. The trainer's tensors and the staging buffer hold bytes (their pages are backed, as
a received buffer's are); a worker's parameters are backed by the warm-up sync.

Per shape and rank: items, messages, rounds, median and smallest message (true bytes), host CPU s
per sync (``process_time`` of one sync after a warm-up, one torch thread), the same without copies
(``torch._foreach_copy_`` skipped: the executor's own work; on a GPU the copies are device kernels),
memcpy s (the bytes it copied, stacking included, at this machine's one-thread rate for one large
contiguous copy, measured in the same process: what those bytes cost when they are copied from and to
memory rather than cache, whatever the executor does), copy calls (``torch._foreach_copy_`` calls /
the tensors of those calls that hold a tensor not contiguous on both sides: on a GPU such a call
falls back to one copy kernel per tensor, the others are grouped launches),
init s and MiB (plan + this rank's listing, peak RSS above the RSS before), kept MiB (its rounds'
arrays and spans, ``Rounds.kept_bytes``). Rounds hold at most ``PEERS`` peers each. Beside them the
wire lower bound from the plan's true bytes (the busiest rank's) at NVLink 450 GB/s and IB 50 GB/s,
and the anchors' published seconds. ``--quick`` multiplies counts, seconds, MiB and bytes by the
layer ratio (marked ``~``). The last line: ``scale targets: K/N met`` (host CPU per rank <= the
NVLink bound; median message >= 1 MiB; k2 init < 5 s and < 1 GiB per rank; k2's host CPU < 2x
DeepSeek-V3 TP's, with ~60x the tensors at ~2/3 of the bytes: issue 36's "10x the items").

For the shapes with several replicas (``FAN_OUT_SHAPES``) worker 0 also runs one warm sync as a
fan-out relay forwarding every round to one child (``relay_host_cpu_s``).

``--fan-out`` (plans only, no executor run; ``docs/results/scale_fanout.json``): for the TP shapes with
several replicas, the direct plan (every replica from the trainers) against the fan-out one (replica 0
from the trainers, the rest forwarded worker to worker, :mod:`weightsync.plan.fanout`, ``auto``): the
busiest trainer rank's bytes per sync, and the wire bound at NVLink / IB: the busiest link's bytes
(trainer egress, worker ingress; with fan-out also a worker's egress, its children times its shard)
over the link rate, plus with fan-out the pipeline's fill (the cost model's time for the deepest
replica less its bytes term, chunks = the message cap).

``--device cuda`` puts every tensor and the staging buffer on the GPU: the copies are kernels, as in a
real sync, so host CPU s is the executor's work and its launches (until the last launch returns) and
"device s" the kernels' time (CUDA events); memcpy s prices the bytes at the GPU's copy rate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from functools import cache
from statistics import median

import torch
from _scale_shapes import LABELS, SHAPES, S, _fsdp_rows, _fused, _scaled, _worker_pieces
from plan_scale import _fsdp, _reset_peak, _rss_mib

from weightsync.plan import DestPiece, TensorSource, build_plan
from weightsync.plan.fanout import LinkCost, plan_fan_out
from weightsync.plan.schedule import ALONE, message_cap
from weightsync.reshard.executor import Relay, run_rounds
from weightsync.reshard.handshake import my_messages

STAGING = 256 << 20  # M2N's DEFAULT_STAGING_BYTES
NVLINK, IB = 450e9, 50e9
ANCHORS = {"nccl-extensions reshard (64 + 64 GB200)": 0.99, "vLLM sharded RDT": 3.5, "checkpoint-engine": 6.2}


class Instant:
    """A data plane whose ops complete at once (nothing moves); ``log``: every posted buffer."""

    ordered = True

    def __init__(self, log: list | None = None) -> None:
        self.log = log

    def post(self, sends: list, recvs: list) -> list:
        ops = sends or recvs
        if self.log is not None:
            self.log.extend(b for b, _, _ in ops)
        return ops

    def wait_all(self, works: list, what: str = "") -> None:
        pass


def _true_nbytes(m, size: dict[str, int]) -> int:
    return sum(it.region.numel * size[it.name] * (S if len(it.region.sizes) > 1 else 1) for it in m.items)


def _timed(sync, device: str) -> tuple[float, float, float]:
    """Host CPU, wall and device seconds of ``sync()``: on CUDA the host's are until the last launch
    returns (the executor's work and its launches), the device's until the last kernel ends."""
    cuda = device != "cpu"
    if cuda:
        torch.cuda.synchronize()
        ends = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ends[0].record()
    c0, w0 = time.process_time(), time.perf_counter()
    sync()
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    if not cuda:
        return cpu, wall, 0.0
    ends[1].record()
    ends[1].synchronize()
    return cpu, wall, ends[0].elapsed_time(ends[1]) / 1e3


def _side(plan, sources: list[TensorSource], pieces: list[DestPiece], *, sender: bool, cap: int,
          members: dict[str, list[str]], device: str, relay: bool = False) -> dict:
    """One rank's listing, stats pass, warm-up sync and timed sync (a sender's includes stacking
    its fused tensors' ``members``, as ``DTensorModuleSource(fuse_experts=True)`` does per sync), its
    tensors and staging on ``device``; with ``relay`` (a worker) also one warm sync as a fan-out relay."""
    size = {s.name: 2 for s in sources}
    rss0, _ = _rss_mib()
    _reset_peak()
    t0 = time.perf_counter()
    rounds = my_messages(plan, sources, rank=0, sender=sender, cap=cap, alone=ALONE // S)
    list_s = time.perf_counter() - t0
    _, peak = _rss_mib()
    dt = {s.name: getattr(torch, s.dtype) for s in sources}
    if sender:
        tensors = {s.name: torch.ones(s.regions[0].sizes, dtype=dt[s.name], device=device)
                   for s in sources if s.name not in members}
        local = {s.name: [torch.ones(s.regions[0].sizes[1:], dtype=dt[s.name], device=device) for _ in members[s.name]]
                 for s in sources if s.name in members}
        tensor_of = lambda m, i: tensors[m.items[i].name]  # noqa: E731
    else:
        ends: dict[str, list[int]] = {}
        for p in pieces:
            e = [o + n for o, n in zip(p.param_offsets, p.region.sizes)]
            ends[p.param] = [max(a, b) for a, b in zip(ends.get(p.param, e), e)]
        kind = {p.param: dt[p.name] for p in pieces}
        tensors = {p: torch.empty(e, dtype=kind[p], device=device) for p, e in ends.items()}
        tensor_of = lambda m, i: tensors[m.items[i].param]  # noqa: E731
    n_rounds, nbytes = 0, []
    for rnd in rounds:  # stats pass
        n_rounds += 1
        nbytes += [_true_nbytes(m, size) for m in rnd]
    staging = torch.ones(STAGING // S, dtype=torch.uint8, device=device)
    log: list = []
    kw = dict(sender=sender, peer_rank=int, dtypes={s.name: s.dtype for s in sources}, tensor_of=tensor_of)

    def stack() -> None:
        if sender:
            tensors.update((n, torch.stack(ts)) for n, ts in local.items())

    copy = torch._foreach_copy_
    copied = [sum(t.nbytes for ts in local.values() for t in ts) if sender else 0, 0, 0]  # bytes, calls, per tensor

    def counted(dsts: list, srcs: list) -> None:
        copied[0] += sum(d.nbytes for d in dsts)
        copied[1] += 1
        copied[2] += len(dsts) if any(not (d.is_contiguous() and s.is_contiguous()) for d, s in zip(dsts, srcs)) else 0
        copy(dsts, srcs)

    stack()
    run_rounds(Instant(log), rounds, staging, **kw)  # warm-up
    lo, hi = staging.data_ptr(), staging.data_ptr() + staging.numel()
    staged = sum(1 for b in log if lo <= b.data_ptr() < hi)
    del log
    cpu, wall, on_device = _timed(lambda: (stack(), run_rounds(Instant(), rounds, staging, **kw)), device)
    torch._foreach_copy_ = counted  # the same sync again, its copies counted
    run_rounds(Instant(), rounds, staging, **kw)
    torch._foreach_copy_ = lambda *a: None  # (device kernels on a GPU)
    c0 = time.process_time()
    run_rounds(Instant(), rounds, staging, **kw)
    work, torch._foreach_copy_ = time.process_time() - c0, copy
    relay_cpu = _relay_cpu(rounds, staging, kw, plan.num_src_ranks, device) if relay else None
    return {"items": rounds.items, "messages": len(nbytes), "staged_messages": staged, "rounds": n_rounds,
            "kept_mib": rounds.kept_bytes() / 2**20,
            "median_msg": median(nbytes) if nbytes else 0, "min_msg": min(nbytes, default=0),
            "host_cpu_s": cpu, "host_wall_s": wall, "device_s": on_device, "host_work_s": work,
            "copied_bytes": copied[0], "memcpy_s": copied[0] / _copy_rate(device), "copy_calls": copied[1],
            "per_tensor_copies": copied[2],
            "list_s": list_s, "list_peak_mib": peak - rss0, "relay_host_cpu_s": relay_cpu}


def _relay_cpu(rounds, staging: torch.Tensor, kw: dict, trainers: int, device: str) -> float:
    """Host CPU of one warm sync of this worker as a fan-out relay: every round it receives is also
    sent on to one child (compiled, as its rounds are after the warm-up)."""
    relay = Relay(children=(1 << 20,), from_parent=False, trainers=trainers)
    run_rounds(Instant(), rounds, staging, **kw, relay=relay)  # warm-up
    return _timed(lambda: run_rounds(Instant(), rounds, staging, **kw, relay=relay), device)[0]


@cache
def _copy_rate(device: str) -> float:
    """Bytes per second of one staging-sized contiguous copy (best of 5): CPU seconds of one thread, or
    a CUDA device's seconds."""
    a, b = torch.ones(STAGING, dtype=torch.uint8, device=device), torch.empty(STAGING, dtype=torch.uint8, device=device)
    return STAGING / min(_timed(lambda: b.copy_(a), device)[0 if device == "cpu" else 2] for _ in range(5))


def measure(shape: str, quick: bool, device: str = "cpu") -> dict:
    build, full, heads, ranks, tp, replicas, ep, anchored = SHAPES[shape]
    layers = -(-full // 8) if quick else full
    per_expert = _scaled(build(layers))
    model, members = _fused(per_expert)
    sources = [TensorSource(n, s, "bfloat16" if len(s) > 1 else "float16",
                            _fsdp_rows(s, ranks) if n in members else _fsdp(s, ranks, 1)) for n, s, _, _ in model]
    per_tp = [_worker_pieces(model, tp, t, ep, heads) for t in range(tp)]
    dests = [per_tp[t] for _ in range(replicas) for t in range(tp)]
    rss0, _ = _rss_mib()
    _reset_peak()
    t0 = time.perf_counter()
    plan = build_plan(sources, dests)
    plan_s = time.perf_counter() - t0
    _, plan_peak = _rss_mib()
    cov = plan.coverage(lambda d: 2 * S if d == "bfloat16" else 2)  # true bytes
    busiest = max(max(cov.recv_bytes), max(cov.send_bytes))
    cap = message_cap(STAGING // S, plan.num_src_ranks, plan.num_dst_ranks, buffers=2)
    torch.set_num_threads(1)
    trainer = _side(plan, sources, dests[0], sender=True, cap=cap, members=members, device=device)
    worker = _side(plan, sources, dests[0], sender=False, cap=cap, members=members, device=device,
                   relay=shape in FAN_OUT_SHAPES)
    return {"shape": shape, "label": LABELS[shape], "device": device, "layers": layers, "full_layers": full,
            "extrapolate": full / layers, "S": S, "tensors": len(per_expert), "fused_tensors": len(members),
            "cap_true": cap * S, "items_plan": plan.num_items,
            "plan_s": plan_s, "plan_mib": plan_peak - rss0, "busiest_bytes": busiest,
            "src0_bytes": cov.send_bytes[0], "dst0_bytes": cov.recv_bytes[0],
            "wire_nvlink_s": busiest / NVLINK, "wire_ib_s": busiest / IB,
            "anchors": ANCHORS if anchored else {}, "trainer": trainer, "worker": worker}


FAN_OUT_SHAPES = ("qwen3-tp", "dsv3-tp")


def _fan_bound(fan_cov, replicas: int, cap: int, bw: float) -> tuple[float, str]:
    """Fan-out wire bound at link rate ``bw`` (see the module docstring) and the trees chosen."""
    fan = plan_fan_out(replicas, fan_cov.recv_bytes, chunk_bytes=cap, cost=LinkCost(bandwidth=bw))
    assert fan is not None  # (several replicas)
    out = max(t.degree for t in fan.trees) * max(fan_cov.recv_bytes)
    links = max(max(fan_cov.send_bytes), max(fan_cov.recv_bytes), out) / bw
    fill = max(t.seconds - t.degree * b / bw for t, b in zip(fan.trees, fan_cov.recv_bytes))
    return links + max(fill, 0.0), ",".join(sorted({f"{t.shape} {t.degree}" for t in fan.trees}))


def measure_fan_out(shape: str) -> dict:
    """Plans only (every layer): the direct plan over every replica against replica 0's, true bytes."""
    build, full, heads, ranks, tp, replicas, ep, _ = SHAPES[shape]
    model, members = _fused(_scaled(build(full)))
    sources = [TensorSource(n, s, "bfloat16" if len(s) > 1 else "float16",
                            _fsdp_rows(s, ranks) if n in members else _fsdp(s, ranks, 1)) for n, s, _, _ in model]
    one = [_worker_pieces(model, tp, t, ep, heads) for t in range(tp)]
    true = lambda d: 2 * S if d == "bfloat16" else 2  # noqa: E731 - the true bytes of a scaled element
    direct = build_plan(sources, one * replicas).coverage(true)
    fanned = build_plan(sources, one).coverage(true)
    cap = message_cap(STAGING, ranks, tp, buffers=2)
    row = {"shape": shape, "label": LABELS[shape], "replicas": replicas, "tp": tp, "trainer_ranks": ranks,
           "trainer_bytes_direct": max(direct.send_bytes), "trainer_bytes_fanout": max(fanned.send_bytes),
           "worker_bytes": max(fanned.recv_bytes)}
    for name, bw in (("nvlink", NVLINK), ("ib", IB)):
        row[f"wire_{name}_direct_s"] = max(max(direct.send_bytes), max(direct.recv_bytes)) / bw
        row[f"wire_{name}_fanout_s"], row["trees"] = _fan_bound(fanned, replicas, cap, bw)
    return row


def fan_out_table(rows: list[dict]) -> str:
    lines = ["| shape | replicas | bytes / trainer rank, direct | with fan-out | trees (auto) "
             "| NVLink 450 s direct | fan-out | IB 50 s direct | fan-out |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['replicas']} | {r['trainer_bytes_direct'] / 1e9:.2f} GB "
                     f"| {r['trainer_bytes_fanout'] / 1e9:.2f} GB | {r['trees']} "
                     f"| {r['wire_nvlink_direct_s']:.3f} | {r['wire_nvlink_fanout_s']:.3f} "
                     f"| {r['wire_ib_direct_s']:.3f} | {r['wire_ib_fanout_s']:.3f} |")
    return "\n".join(lines)


def _x(r: dict, v: float) -> float:
    return v * r["extrapolate"]


PAIR = ("k2-tp", "dsv3-tp")
"""The items check: k2 lists ~60x the tensors of DeepSeek-V3 (per-expert vs fused 3-D) at ~2/3 of the bytes."""


def _pair(rows: list[dict]) -> list[tuple[str, bool]]:
    """Host CPU of the many-item shape over the few-item one's, the worse of trainer 0 and worker 0."""
    by = {r["shape"]: r for r in rows}
    if not all(s in by for s in PAIR):
        return []
    a, b = by[PAIR[0]], by[PAIR[1]]
    ratio = max(_x(a, a[s]["host_cpu_s"]) / _x(b, b[s]["host_cpu_s"]) for s in ("trainer", "worker"))
    return [(f"{PAIR[0]} vs {PAIR[1]}: {a['tensors'] / b['tensors']:.0f}x the tensors at "
             f"{a['busiest_bytes'] / b['busiest_bytes']:.2f}x the bytes: host CPU {ratio:.1f}x < 2x", ratio < 2)]


def targets(rows: list[dict]) -> list[tuple[str, bool]]:
    out = _pair(rows)
    for r in rows:
        host = _x(r, max(r["trainer"]["host_cpu_s"], r["worker"]["host_cpu_s"]))
        out.append((f"{r['shape']}: host CPU {host:.3f} s <= NVLink {_x(r, r['wire_nvlink_s']):.3f} s",
                    host <= _x(r, r["wire_nvlink_s"])))
        med = min(r["trainer"]["median_msg"], r["worker"]["median_msg"])
        out.append((f"{r['shape']}: median message {med / 2**20:.2f} MiB >= 1 MiB", med >= 1 << 20))
        if r["shape"] == "k2-tp":
            init = _x(r, max(r["plan_s"] + r[s]["list_s"] for s in ("trainer", "worker")))
            mib = _x(r, max(r["plan_mib"] + r[s]["list_peak_mib"] + r[s].get("kept_mib", 0)
                            for s in ("trainer", "worker")))
            out.append((f"k2-tp: init {init:.2f} s < 5 s and {mib:.0f} MiB < 1024 MiB", init < 5 and mib < 1024))
    return out


def _device(r: dict, s: dict) -> str:
    """A CUDA row's device seconds per sync (its copy kernels), else "-"."""
    return f"{'~' if r['extrapolate'] != 1 else ''}{_x(r, s['device_s']):.3f}" if s.get("device_s") else "-"


def table(rows: list[dict]) -> str:
    lines = ["| shape | rank | items | messages | staged msgs | rounds | median msg KiB | min msg B "
             "| host CPU s/sync | without copies | memcpy s | device s | copy calls / per tensor "
             "| init s | init MiB | kept MiB "
             "| wire s NVLink 450 | wire s IB 50 | anchors s |",
             "|---|---|" + "---:|" * 16 + "---|"]
    for r in rows:
        q = "~" if r["extrapolate"] != 1 else ""
        for side in ("trainer", "worker"):
            s = r[side]
            anchors = ", ".join(f"{k} {v}" for k, v in r["anchors"].items()) if side == "trainer" else ""
            lines.append(
                f"| {r['label']} | {side} 0 | {q}{_x(r, s['items']):,.0f} | {q}{_x(r, s['messages']):,.0f} "
                f"| {q}{_x(r, s['staged_messages']):,.0f} | {q}{_x(r, s['rounds']):,.0f} "
                f"| {s['median_msg'] / 1024:,.0f} "
                f"| {s['min_msg']:,} | {q}{_x(r, s['host_cpu_s']):.3f} | {q}{_x(r, s.get('host_work_s', 0)):.3f} "
                f"| {q}{_x(r, s.get('memcpy_s', 0)):.3f} | {_device(r, s)} "
                f"| {q}{_x(r, s.get('copy_calls', 0)):,.0f} / {_x(r, s.get('per_tensor_copies', 0)):,.0f} "
                f"| {q}{_x(r, r['plan_s'] + s['list_s']):.2f} "
                f"| {q}{_x(r, r['plan_mib'] + s['list_peak_mib']):.0f} | {q}{_x(r, s.get('kept_mib', 0)):.0f} "
                f"| {q}{_x(r, r['wire_nvlink_s']):.3f} "
                f"| {q}{_x(r, r['wire_ib_s']):.3f} | {anchors} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """Host CPU per sync (trainer 0, worker 0) beside the NVLink and IB wire bounds, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    xs = range(len(rows))
    for k, (label, f) in enumerate([("host CPU, trainer 0", lambda r: r["trainer"]["host_cpu_s"]),
                                    ("host CPU, worker 0", lambda r: r["worker"]["host_cpu_s"]),
                                    ("wire bound, NVLink 450 GB/s", lambda r: r["wire_nvlink_s"]),
                                    ("wire bound, IB 50 GB/s", lambda r: r["wire_ib_s"])]):
        ax.bar([x + (k - 1.5) * 0.2 for x in xs], [_x(r, f(r)) for r in rows], 0.2, label=label)
    ax.set_xticks(list(xs), [r["label"].replace(" FSDP", "\nFSDP") for r in rows], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("seconds per sync")
    ax.set_title("M2N host CPU per sync vs wire lower bound" + (" (--quick, extrapolated)" if any(
        r["extrapolate"] != 1 for r in rows) else ""))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1/8 of the layers, extrapolated (a few minutes)")
    ap.add_argument("--shape", action="append", choices=list(SHAPES), help="only these shapes (repeatable)")
    ap.add_argument("--device", default="cpu", help="where the tensors and staging live: cpu or cuda (on a GPU the "
                    "copies are kernels: host CPU is the executor's work and launches, 'device s' the kernels)")
    ap.add_argument("--json", action="store_true", help="one shape in this process: print its row as JSON")
    ap.add_argument("--out", default=None, help="JSON path (default results/scale.json, --quick: scale_quick.json)")
    ap.add_argument("--png", default=None, help="also plot the table to this PNG path")
    ap.add_argument("--from-json", default=None, help="print and plot a saved JSON instead of measuring")
    ap.add_argument("--fan-out", action="store_true", help="plans only: replica fan-out vs direct (module docstring)")
    args = ap.parse_args()
    if args.fan_out:
        fan_rows = [measure_fan_out(s) for s in args.shape or FAN_OUT_SHAPES]
        print(fan_out_table(fan_rows))
        res = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
        os.makedirs(res, exist_ok=True)
        with open(args.out or os.path.join(res, "scale_fanout.json"), "w") as f:
            json.dump({"rows": fan_rows}, f, indent=1)
        return
    if args.device != "cpu" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: CUDA is not available here")
    if args.from_json:
        with open(args.from_json) as f:
            rows = json.load(f)["rows"]
        print(table(rows))
        if args.png:
            plot(rows, args.png)
        return
    if args.json:
        if not args.shape or len(args.shape) != 1:
            ap.error("--json needs exactly one --shape")
        print(json.dumps(measure(args.shape[0], args.quick, args.device)))
        return
    rows = []
    for shape in args.shape or list(SHAPES):
        cmd = [sys.executable, os.path.abspath(__file__), "--json", "--shape", shape, "--device", args.device,
               *(["--quick"] * args.quick)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{r['label']}: {r['layers']} of {r['full_layers']} layers, plan {r['plan_s']:.2f} s, host CPU "
              f"trainer {r['trainer']['host_cpu_s']:.3f} s, worker {r['worker']['host_cpu_s']:.3f} s", flush=True)
    print()
    print(table(rows))
    for r in rows:
        if (relay := r["worker"].get("relay_host_cpu_s")) is not None:
            q = "~" if r["extrapolate"] != 1 else ""
            print(f"{r['label']}: worker 0 as a fan-out relay (forwarding to one child) {q}{_x(r, relay):.3f} s "
                  f"host CPU per sync, {q}{_x(r, r['worker']['host_cpu_s']):.3f} s without forwarding")
    met = targets(rows)
    for text, ok in met:
        print(f"  [{'x' if ok else ' '}] {text}")
    res = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(res, exist_ok=True)
    path = args.out or os.path.join(res, "scale_quick.json" if args.quick else "scale.json")
    with open(path, "w") as f:
        json.dump({"rows": rows, "targets": [{"target": t, "met": ok} for t, ok in met]}, f, indent=1)
    if args.png:
        plot(rows, args.png)
    print(f"scale targets: {sum(ok for _, ok in met)}/{len(met)} met")


if __name__ == "__main__":
    main()
