"""Per-sync host cost of the M2N executor at 235B-1T scale (issue 36, item 4).

Launch (CPU, one core; no GPU needed)::

    PYTHONPATH=src python benchmarks/scale.py --quick   # ~1 minute: 1/8 of the layers, extrapolated
    PYTHONPATH=src python benchmarks/scale.py           # every layer (a few minutes)
    PYTHONPATH=src python benchmarks/scale.py --shape qwen3-tp   # one shape (see SHAPES)

Each shape is the real structure (true tensor names, shapes' row structure, FSDP ranks, TP / EP
layout), so the plan has its true item count; the bytes are scaled down by ``S``: every tensor of
2 or more dims has its last dim divided by ``S`` (row-parallel TP slices run along it: their rows
are S times shorter than at full size), and the staging buffer (so the message cap) and ``ALONE``
too, so the messages are cut as at full size. k2's per-expert tensors are fused at the source
(``DTensorModuleSource(fuse_experts=True)``: one [E, ...] tensor per layer and projection, into
vLLM's fused ``w13_weight`` / ``w2_weight``); its trainer's timed sync includes the stacking.
One process per shape builds the plan, then runs trainer rank 0's and worker 0's executor
(:func:`~weightsync.transport.m2n_rounds.run_rounds`) against a data plane that completes at once
(``ordered``, as NCCL): every byte the executor copies is still copied (staged packs and applies),
nothing else moves. Tensors are ``torch.empty`` (pages a sync never writes stay unbacked).

Per shape and rank: items, messages, rounds, median and smallest message (true bytes), host CPU s
per sync (``process_time`` of one sync after a warm-up, one torch thread), the same without copies
(``torch._foreach_copy_`` skipped: the executor's own work; on a GPU the copies are device kernels),
init s and MiB (plan + this rank's listing, peak RSS above the RSS before), kept MiB (its rounds'
arrays and spans, ``Rounds.kept_bytes``). Rounds hold at most ``PEERS`` peers each. Beside them the
wire lower bound from the plan's true bytes (the busiest rank's) at NVLink 450 GB/s and IB 50 GB/s,
and the anchors' published seconds. ``--quick`` multiplies counts, seconds, MiB and bytes by the
layer ratio (marked ``~``). The last line: ``scale targets: K/N met`` (host CPU per rank <= the
NVLink bound; median message >= 1 MiB; k2 init < 5 s and < 1 GiB per rank).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from functools import cache
from statistics import median

import torch

from plan_scale import (_dsv3_model, _fsdp, _linear_experts, _model, _region, _reset_peak, _rss_mib)
from weightsync.layout import DestPiece, Shard, TensorSource, build_plan
from weightsync.layout.regions import mesh_coordinates, source_regions
from weightsync.layout.schedule import ALONE, message_cap
from weightsync.protocol import ParamMeta
from weightsync.trainer.sources import fuse_expert_metas
from weightsync.transport.m2n_exec import my_messages
from weightsync.transport.m2n_rounds import run_rounds
from weightsync.worker.experts import W1, W2, W3, W13, fused_expert_pieces

S = 64
"""Byte scale: the last dim of every tensor of >= 2 dims is divided by it (divides every shape here)."""
STAGING = 256 << 20  # M2N's DEFAULT_STAGING_BYTES
NVLINK, IB = 450e9, 50e9
ANCHORS = {"nccl-extensions reshard (64 + 64 GB200)": 0.99, "vLLM sharded RDT": 3.5, "checkpoint-engine": 6.2}

Model = list[tuple[str, tuple[int, ...], str, str]]


def _dense(layers: int, hidden: int, heads: tuple[int, int, int], inter: int, vocab: int,
           moe: tuple[int, int] | None = None) -> Model:
    """(name, shape, kind, param) of a Llama-style model (``moe``: (experts, moe inter), fused 3-D
    experts and a router on every layer, no shared expert: Qwen3-MoE)."""
    q, kv, hd = heads
    out: Model = [("model.embed_tokens.weight", (vocab, hidden), "vocab", "model.embed_tokens.weight")]
    for i in range(layers):
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        out += [(f"{p}.input_layernorm.weight", (hidden,), "rep", f"{p}.input_layernorm.weight"),
                (f"{p}.post_attention_layernorm.weight", (hidden,), "rep", f"{p}.post_attention_layernorm.weight"),
                (f"{a}.q_proj.weight", (q * hd, hidden), "q", f"{a}.qkv_proj.weight"),
                (f"{a}.k_proj.weight", (kv * hd, hidden), "k", f"{a}.qkv_proj.weight"),
                (f"{a}.v_proj.weight", (kv * hd, hidden), "v", f"{a}.qkv_proj.weight"),
                (f"{a}.o_proj.weight", (hidden, q * hd), "row", f"{a}.o_proj.weight")]
        if moe is None:
            m = f"{p}.mlp"
            out += [(f"{m}.gate_proj.weight", (inter, hidden), "gate", f"{m}.gate_up_proj.weight"),
                    (f"{m}.up_proj.weight", (inter, hidden), "up", f"{m}.gate_up_proj.weight"),
                    (f"{m}.down_proj.weight", (hidden, inter), "row", f"{m}.down_proj.weight")]
            continue
        experts, mi = moe
        e, r = f"{p}.mlp.experts", f"{p}.mlp.experts.routed_experts"
        out += [(f"{a}.q_norm.weight", (hd,), "rep", f"{a}.q_norm.weight"),
                (f"{a}.k_norm.weight", (hd,), "rep", f"{a}.k_norm.weight"),
                (f"{p}.mlp.gate.weight", (experts, hidden), "rep", f"{p}.mlp.gate.weight"),
                (f"{e}.gate_up_proj", (experts, 2 * mi, hidden), W13, f"{r}.w13_weight"),
                (f"{e}.down_proj", (experts, hidden, mi), W2, f"{r}.w2_weight")]
    out += [("model.norm.weight", (hidden,), "rep", "model.norm.weight"),
            ("lm_head.weight", (vocab, hidden), "vocab", "lm_head.weight")]
    return out


# name -> (model(layers), full layers, heads (q, kv, head dim), trainer ranks, tp, replicas, ep, anchors)
SHAPES = {
    "qwen3-tp": (lambda n: _dense(n, 4096, (64, 4, 128), 0, 151936, (128, 1536)), 94, (64, 4, 128), 64, 8, 8,
                 False, True),
    "qwen3-ep": (lambda n: _dense(n, 4096, (64, 4, 128), 0, 151936, (128, 1536)), 94, (64, 4, 128), 64, 8, 8,
                 True, True),
    "dsv3-tp": (lambda n: _dsv3_model(n, 256), 61, (128, 128, 128), 256, 8, 16, False, False),
    "dsv3-ep": (lambda n: _dsv3_model(n, 256), 61, (128, 128, 128), 256, 8, 16, True, False),
    "k2-tp": (lambda n: _model(n, 330), 61, (64, 8, 128), 256, 16, 16, False, False),
    "dense70b-tp": (lambda n: _dense(n, 8192, (64, 8, 128), 28672, 128256), 80, (64, 8, 128), 64, 8, 8,
                    False, False),
}
LABELS = {"qwen3-tp": "Qwen3-235B-A22B FSDP 64 -> TP 8 x 8", "qwen3-ep": "Qwen3-235B-A22B FSDP 64 -> EP 8 x 8",
          "dsv3-tp": "DeepSeek-V3 FSDP 256 -> TP 8 x 16", "dsv3-ep": "DeepSeek-V3 FSDP 256 -> EP 8 x 16",
          "k2-tp": "k2 (per-expert, fused) FSDP 256 -> TP 16 x 16", "dense70b-tp": "dense 70B FSDP 64 -> TP 8 x 8"}


def _scaled(model: Model) -> Model:
    out = []
    for n, s, kind, param in model:
        if len(s) > 1:
            if s[-1] % S:
                raise ValueError(f"{n}: last dim {s[-1]} is not divisible by S={S}")
            s = (*s[:-1], s[-1] // S)
        out.append((n, s, kind, param))
    return out


_FUSED = {"gate": (W1, "w13_weight"), "up": (W3, "w13_weight"), "row": (W2, "w2_weight")}


def _fused(model: Model) -> tuple[Model, dict[str, list[str]]]:
    """``model`` as ``DTensorModuleSource(fuse_experts=True)`` sends it (k2's per-expert weights one
    [E, ...] tensor per layer and projection, into vLLM's fused experts), and the fused ones' members."""
    fused, members = fuse_expert_metas([ParamMeta(n, torch.bfloat16, s, mesh_shape=(1,), placements=(Shard(0),),
                                                  rank_coordinates=((0,),)) for n, s, _, _ in model])
    params = {n: (k, p) for n, _, k, p in model}
    kinds = {f: _FUSED[params[ms[0]][0]] for f, ms in members.items()}
    return [(m.name, m.shape, *params[m.name]) if m.name not in kinds else
            (m.name, m.shape, kinds[m.name][0], f"{m.name.rpartition('.')[0]}.{kinds[m.name][1]}") for m in fused], members


@cache
def _fsdp_rows(shape: tuple[int, ...], ranks: int) -> tuple:
    """A fused tensor's regions: its members' FSDP rows (``Shard(0)`` of each: dim 1 of the fused)."""
    return source_regions(shape, (ranks,), [Shard(1)], mesh_coordinates((ranks,)))


def _piece(kind: str, shape: tuple[int, ...], tp: int, t: int, heads: tuple[int, int, int]):
    """Region and param offsets TP rank t takes of a tensor of this kind (plan_scale's, any head counts)."""
    q, kv, hd = heads
    if kind == "rep":
        return _region((0,) * len(shape), shape), (0,) * len(shape)
    if kind.startswith("rep@"):
        return _region((0,) * len(shape), shape), (int(kind[4:]),) + (0,) * (len(shape) - 1)
    if kind == "row":
        per = shape[1] // tp
        return _region((0, per * t), (shape[0], per)), (0, 0)
    if kind == "vocab":
        per = -(-(-(-shape[0] // 64) * 64) // tp)
        lo = min(per * t, shape[0])
        return _region((lo, 0), (min(shape[0], lo + per) - lo, shape[1])), (0, 0)
    if kind in ("k", "v"):
        kv_per, reps = max(1, kv // tp), max(1, tp // kv)
        first = (t // reps) * kv_per
        at = q * hd // tp + (0 if kind == "k" else kv_per * hd)
        return _region((first * hd, 0), (kv_per * hd, shape[1])), (at, 0)
    per = shape[0] // tp  # q, gate, up, col: column-parallel row ranges
    return _region((per * t, 0), (per, shape[1])), (per if kind == "up" else 0, 0)


def _worker_pieces(model: Model, tp: int, t: int, ep: bool, heads: tuple[int, int, int]) -> list[DestPiece]:
    pieces: list[DestPiece] = []
    for n, s, kind, param in model:
        if kind in (W13, W2, W1, W3):
            experts, rows, cols = s
            local_of = _linear_experts(experts, tp, t) if ep else [(e, e) for e in range(experts)]
            mt = 1 if ep else tp
            rows *= 2 if kind in (W1, W3) else 1  # a gate or an up alone: half of w13
            pshape = (len(local_of), rows, cols // mt) if kind == W2 else (len(local_of), rows // mt, cols)
            pieces += fused_expert_pieces(n, s, kind, param, pshape, local_of=local_of,
                                          tp_rank=0 if ep else t, tp_size=mt)
        else:
            region, offsets = _piece(kind, s, tp, t, heads)
            pieces.append(DestPiece(n, region, param, offsets))
    return pieces


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


def _side(plan, sources: list[TensorSource], pieces: list[DestPiece], *, sender: bool, cap: int,
          members: dict[str, list[str]]) -> dict:
    """One rank's listing, stats pass, warm-up sync and timed sync (a sender's includes stacking
    its fused tensors' ``members``, as ``DTensorModuleSource(fuse_experts=True)`` does per sync)."""
    size = {s.name: 2 for s in sources}
    rss0, _ = _rss_mib()
    _reset_peak()
    t0 = time.perf_counter()
    rounds = my_messages(plan, sources, rank=0, sender=sender, cap=cap, alone=ALONE // S)
    list_s = time.perf_counter() - t0
    _, peak = _rss_mib()
    dt = {s.name: getattr(torch, s.dtype) for s in sources}
    if sender:
        tensors = {s.name: torch.empty(s.regions[0].sizes, dtype=dt[s.name]) for s in sources if s.name not in members}
        local = {s.name: [torch.empty(s.regions[0].sizes[1:], dtype=dt[s.name]) for _ in members[s.name]]
                 for s in sources if s.name in members}
        tensor_of = lambda m, i: tensors[m.items[i].name]  # noqa: E731
    else:
        ends: dict[str, list[int]] = {}
        for p in pieces:
            e = [o + n for o, n in zip(p.param_offsets, p.region.sizes)]
            ends[p.param] = [max(a, b) for a, b in zip(ends.get(p.param, e), e)]
        kind = {p.param: dt[p.name] for p in pieces}
        tensors = {p: torch.empty(e, dtype=kind[p]) for p, e in ends.items()}
        tensor_of = lambda m, i: tensors[m.items[i].param]  # noqa: E731
    n_rounds, nbytes = 0, []
    for rnd in rounds:  # stats pass
        n_rounds += 1
        nbytes += [_true_nbytes(m, size) for m in rnd]
    staging = torch.empty(STAGING // S, dtype=torch.uint8)
    log: list = []
    kw = dict(sender=sender, peer_rank=int, dtypes={s.name: s.dtype for s in sources}, tensor_of=tensor_of)

    def stack() -> None:
        if sender:
            tensors.update((n, torch.stack(ts)) for n, ts in local.items())

    stack()
    run_rounds(Instant(log), rounds, staging, **kw)  # warm-up
    lo, hi = staging.data_ptr(), staging.data_ptr() + staging.numel()
    staged = sum(1 for b in log if lo <= b.data_ptr() < hi)
    del log
    c0, w0 = time.process_time(), time.perf_counter()
    stack()
    run_rounds(Instant(), rounds, staging, **kw)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    copy, torch._foreach_copy_ = torch._foreach_copy_, lambda *a: None  # (device kernels on a GPU)
    c0 = time.process_time()
    run_rounds(Instant(), rounds, staging, **kw)
    work, torch._foreach_copy_ = time.process_time() - c0, copy
    return {"items": rounds.items, "messages": len(nbytes), "staged_messages": staged, "rounds": n_rounds,
            "kept_mib": rounds.kept_bytes() / 2**20,
            "median_msg": median(nbytes) if nbytes else 0, "min_msg": min(nbytes, default=0),
            "host_cpu_s": cpu, "host_wall_s": wall, "host_work_s": work, "list_s": list_s, "list_peak_mib": peak - rss0}


def measure(shape: str, quick: bool) -> dict:
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
    trainer = _side(plan, sources, dests[0], sender=True, cap=cap, members=members)
    worker = _side(plan, sources, dests[0], sender=False, cap=cap, members=members)
    return {"shape": shape, "label": LABELS[shape], "layers": layers, "full_layers": full,
            "extrapolate": full / layers, "S": S, "tensors": len(per_expert), "fused_tensors": len(members), "cap_true": cap * S, "items_plan": plan.num_items,
            "plan_s": plan_s, "plan_mib": plan_peak - rss0, "busiest_bytes": busiest,
            "src0_bytes": cov.send_bytes[0], "dst0_bytes": cov.recv_bytes[0],
            "wire_nvlink_s": busiest / NVLINK, "wire_ib_s": busiest / IB,
            "anchors": ANCHORS if anchored else {}, "trainer": trainer, "worker": worker}


def _x(r: dict, v: float) -> float:
    return v * r["extrapolate"]


def targets(rows: list[dict]) -> list[tuple[str, bool]]:
    out = []
    for r in rows:
        host = _x(r, max(r["trainer"]["host_cpu_s"], r["worker"]["host_cpu_s"]))
        out.append((f"{r['shape']}: host CPU {host:.3f} s <= NVLink {_x(r, r['wire_nvlink_s']):.3f} s",
                    host <= _x(r, r["wire_nvlink_s"])))
        med = min(r["trainer"]["median_msg"], r["worker"]["median_msg"])
        out.append((f"{r['shape']}: median message {med / 2**20:.2f} MiB >= 1 MiB", med >= 1 << 20))
        if r["shape"] == "k2-tp":
            init = _x(r, max(r["plan_s"] + r[s]["list_s"] for s in ("trainer", "worker")))
            mib = _x(r, max(r["plan_mib"] + r[s]["list_peak_mib"] + r[s].get("kept_mib", 0) for s in ("trainer", "worker")))
            out.append((f"k2-tp: init {init:.2f} s < 5 s and {mib:.0f} MiB < 1024 MiB", init < 5 and mib < 1024))
    return out


def table(rows: list[dict]) -> str:
    lines = ["| shape | rank | items | messages | staged msgs | rounds | median msg KiB | min msg B "
             "| host CPU s/sync | without copies | init s | init MiB | kept MiB | wire s NVLink 450 | wire s IB 50 | anchors s |",
             "|---|---|" + "---:|" * 13 + "---|"]
    for r in rows:
        q = "~" if r["extrapolate"] != 1 else ""
        for side in ("trainer", "worker"):
            s = r[side]
            anchors = ", ".join(f"{k} {v}" for k, v in r["anchors"].items()) if side == "trainer" else ""
            lines.append(
                f"| {r['label']} | {side} 0 | {q}{_x(r, s['items']):,.0f} | {q}{_x(r, s['messages']):,.0f} "
                f"| {q}{_x(r, s['staged_messages']):,.0f} | {q}{_x(r, s['rounds']):,.0f} | {s['median_msg'] / 1024:,.0f} "
                f"| {s['min_msg']:,} | {q}{_x(r, s['host_cpu_s']):.3f} | {q}{_x(r, s.get('host_work_s', 0)):.3f} "
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
    ap.add_argument("--json", action="store_true", help="one shape in this process: print its row as JSON")
    ap.add_argument("--out", default=None, help="JSON path (default results/scale.json, --quick: scale_quick.json)")
    ap.add_argument("--png", default=None, help="also plot the table to this PNG path")
    ap.add_argument("--from-json", default=None, help="print and plot a saved JSON instead of measuring")
    args = ap.parse_args()
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
        print(json.dumps(measure(args.shape[0], args.quick)))
        return
    rows = []
    for shape in args.shape or list(SHAPES):
        cmd = [sys.executable, os.path.abspath(__file__), "--json", "--shape", shape, *(["--quick"] * args.quick)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{r['label']}: {r['layers']} of {r['full_layers']} layers, plan {r['plan_s']:.2f} s, host CPU "
              f"trainer {r['trainer']['host_cpu_s']:.3f} s, worker {r['worker']['host_cpu_s']:.3f} s", flush=True)
    print()
    print(table(rows))
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
