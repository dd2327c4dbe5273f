"""Delta sync (``weightsync_m2n``, ``delta=True``) between real GRPO steps of the FSDP2 reference trainer.

    .venv/bin/python benchmarks/delta_sync.py                     # 3 learning rates x 15 steps: ~2 min on 2 cores
    .venv/bin/python benchmarks/delta_sync.py --lrs 1e-5 --steps 5
    .venv/bin/python benchmarks/delta_sync.py --from-json docs/results/delta_sync.json

Two ``FSDP2Trainer`` rank processes (``weightsync.testing.fsdp2.FSDP2Ranks``, gloo, fp32 master weights
and AdamW state) train a seeded random ``small_qwen3`` checkpoint (Qwen3, hidden 512, 4 layers, 16k
vocabulary, tied embeddings: 20.8 M parameters) and sync into vLLM's own ``Qwen3ForCausalLM`` in bf16
with TP 2 over gloo (``weightsync.testing.cluster``). The wire is bf16:
``FSDP2Trainer.connect(..., dtype=torch.bfloat16)`` gives the engines
``DTensorModuleSource(trainer.model, world, dtype=torch.bfloat16)``, so each rank casts its fp32 shard as
it sends, and the delta baseline holds the bf16 values last sent.

Per learning rate, from the same checkpoint and the same rollouts (scripted: random prompts and
responses, reward = the fraction of even token ids, groups of ``--group-size``): ``--dense`` syncs with
``delta=False`` (same-run seconds of a dense M2N sync; the first is a warm-up), then an engine with
``delta=True``: one dense first sync, then ``--steps`` GRPO steps (``FSDP2Trainer.train_step``: GRPO
loss, grad clip 1.0, AdamW at a constant lr), each followed by a delta sync. Per step: the fraction of
the bf16 values that changed, bytes on the wire (delta, summed over trainer ranks), what the same sync
sends dense (``DeltaStats.dense_bytes``), what ``full_tensor()`` + broadcast to every worker moves
(naive: the model's bf16 bytes x workers, from the source's metadata), sync seconds, diff + encode
seconds and the trainer's extra memory (``DeltaStats.baseline_bytes``). After the first delta step and
after the last, every worker must equal vLLM's ``load_weights`` of the trainer's weights
(``compare_with_oracle``); otherwise the run stops with exit status 1.

Writes ``--out``/delta_sync.json, ``--img``/delta_sync.png and benchmarks/results/delta_sync.md (the tables it
prints).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

from _report import _f, _legend_below, portable

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.join(os.path.dirname(HERE), "docs")
MODEL = "small_qwen3"
LRS = (1e-6, 1e-5, 1e-4)
_M = "delta_sync:"


# --- inside an FSDP2 rank process (``FSDP2Ranks.run("delta_sync:...")``) -----------------------------------
def rank_connect(init_info: Any, client: Any, wire_dtype: str) -> None:
    """This rank's M2N engine on the trainer's model, casting to ``wire_dtype`` on the sender (collective)."""
    import torch

    from weightsync.testing.actors import STATE

    t = STATE["trainer"]
    STATE["engine"] = t.connect(dataclasses.replace(init_info, rank=t.rank), client, dtype=getattr(torch, wire_dtype))


def rank_sync(weight_version: str) -> dict[str, Any]:
    """``trainer.sync_weights(engine)``; this rank's ``SyncStats`` as a dict, plus ``seconds``."""
    from weightsync.testing.actors import STATE

    stats = STATE["trainer"].sync_weights(STATE["engine"], weight_version=weight_version)
    return {**dataclasses.asdict(stats), "seconds": stats.seconds}


def rank_wire_bytes() -> int:
    """Bytes of the whole model in the wire dtype, from the engine's source metadata."""
    import math

    from weightsync.testing.actors import STATE

    return sum(math.prod(m.shape) * m.dtype.itemsize for m in STATE["engine"].source.metadata)


# --- driver ---------------------------------------------------------------------------------
def rollouts(step: int, vocab: int, groups: int, group_size: int) -> list[Any]:
    """Scripted GRPO batch ``step`` (the same for every lr): random prompts (4-12 tokens) and responses
    (4-16 tokens); reward = the fraction of even token ids in the response (a signal that persists
    from step to step, as a real reward does)."""
    from weightsync.integrations.fsdp2 import Sample

    rng = random.Random(step)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(4, 12))]
        for _ in range(group_size):
            resp = [rng.randrange(vocab) for _ in range(rng.randint(4, 16))]
            out.append(Sample(prompt, resp, sum(t % 2 == 0 for t in resp) / len(resp), g))
    return out


def summarize(per_rank: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """One sync as the report needs it, from every trainer rank's stats."""
    deltas = [s["delta"] for s in per_rank if s.get("delta")]
    row = {"bytes_sent": sum(s["bytes_sent"] for s in per_rank), "seconds": max(s["seconds"] for s in per_rank),
           "seconds_rank0": per_rank[0]["seconds"], "wall_s": wall_s, "phases": per_rank[0]["phases"],
           "received_per_worker": per_rank[0]["bytes_received_per_worker"],
           "lower_bound_per_worker": per_rank[0]["lower_bound_per_worker"]}
    if deltas:
        changed, compared = sum(d["changed"] for d in deltas), sum(d["compared"] for d in deltas)
        row.update(base=deltas[0]["base"], workers=deltas[0]["workers"], changed=changed, compared=compared,
                   changed_fraction=changed / compared if compared else None,
                   dense_bytes=sum(d["dense_bytes"] for d in deltas),
                   diff_s=max(d["diff_seconds"] for d in deltas),
                   baseline_bytes=[d["baseline_bytes"] for d in deltas])
    return row


def timed_sync(procs: Any, version: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    per_rank = procs.run(_M + "rank_sync", version)
    return summarize(per_rank, time.perf_counter() - t0)


def check_oracle(procs: Any, cluster: Any, what: str) -> None:
    """Every worker equals vLLM's load of the trainer's weights, or the benchmark stops."""
    weights = procs.run("call", "full_state_dict")[0]
    bad = {a.name: b for a, b in zip(cluster.active_receivers, cluster.on_receivers("compare_with_oracle", weights))
           if b}
    if bad:
        raise AssertionError(f"{what}: workers differ from vLLM's load of the trainer's weights: "
                             f"{ {k: v[:5] for k, v in bad.items()} }")
    print(f"    {what}: every worker equals vLLM's load of the trainer's weights", flush=True)


def run_lr(procs: Any, cluster: Any, ckpt: str, lr: float, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    from weightsync.integrations.fsdp2 import ModelConfig, OptimConfig, TrainerConfig
    from weightsync.testing.cluster import Layout, init_info

    workers = cluster.layout.num_workers
    trainer_layout = Layout(trainers=procs.world, tp=cluster.layout.tp, replicas=cluster.layout.replicas,
                            backend="weightsync_m2n")

    def connect(delta: bool) -> None:
        info = init_info(trainer_layout, buffer_bytes=args.staging_mib << 20, timeout_s=120.0, delta=delta)
        procs.run(_M + "rank_connect", info, cluster.client(timeout_s=120), args.wire_dtype)

    procs.build(TrainerConfig(model=ModelConfig(path=ckpt), optim=OptimConfig(lr=lr), device="cpu",
                              max_tokens_per_micro_batch=args.max_tokens))
    connect(delta=False)
    dense = [timed_sync(procs, f"dense{i}") for i in range(args.dense)]
    wire = procs.run(_M + "rank_wire_bytes")[0]
    procs.run("shutdown_engine")
    connect(delta=True)
    out: dict[str, Any] = {"lr": lr, "dense": dense, "model_wire_bytes": wire, "naive_bytes": wire * workers,
                           "steps": [], "metrics": []}
    try:
        first = timed_sync(procs, "v0")
        if first["base"] is not None or first["bytes_sent"] != first["dense_bytes"]:
            raise AssertionError(f"the first delta sync should go dense: {first}")
        out["first"] = first
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            m = procs.run("call", "train_step", rollouts(step, vocab, args.groups, args.group_size))[0]
            out["metrics"].append({**{k: m[k] for k in ("loss", "grad_norm", "reward_mean")},
                                   "train_s": time.perf_counter() - t0})
            row = timed_sync(procs, f"v{step}")
            if row["workers"] != list(range(workers)) or row["bytes_sent"] > row["dense_bytes"]:
                raise AssertionError(f"step {step}: expected deltas to every worker, never above dense: {row}")
            out["steps"].append(row)
            print(f"    lr {lr:g} step {step:2d}: {100 * row['changed_fraction']:6.2f} % changed, "
                  f"{row['bytes_sent'] / 1e6:6.2f} MB sent (dense {row['dense_bytes'] / 1e6:.2f}, naive "
                  f"{out['naive_bytes'] / 1e6:.2f}), {row['seconds']:.3f} s (diff {row['diff_s']:.3f}), "
                  f"train {out['metrics'][-1]['train_s']:.1f} s, reward {m['reward_mean']:.3f}", flush=True)
            if step == 1:
                check_oracle(procs, cluster, f"lr {lr:g} after step 1")
        check_oracle(procs, cluster, f"lr {lr:g} after step {args.steps}")
        out["verified"] = True
    finally:
        procs.run("shutdown_engine")
    return out


def finish(lr_run: dict[str, Any]) -> dict[str, Any]:
    """Per-lr summary numbers (the table's row)."""
    steps = lr_run["steps"]
    med = statistics.median
    fr = [s["changed_fraction"] for s in steps]
    ratio = [s["bytes_sent"] / s["dense_bytes"] for s in steps]
    dense_timed = lr_run["dense"][1:] or lr_run["dense"]
    return {"lr": lr_run["lr"], "steps": len(steps), "changed_mean": statistics.fmean(fr), "changed_first": fr[0],
            "changed_last": fr[-1], "delta_mb_mean": statistics.fmean(s["bytes_sent"] for s in steps) / 1e6,
            "dense_mb": steps[0]["dense_bytes"] / 1e6, "naive_mb": lr_run["naive_bytes"] / 1e6,
            "ratio_mean": statistics.fmean(ratio), "ratio_max": max(ratio),
            "sparse_steps": sum(r < 1 for r in ratio),
            "delta_s": med(s["seconds"] for s in steps), "dense_s": med(s["seconds"] for s in dense_timed),
            "first_s": lr_run["first"]["seconds"], "diff_s": med(s["diff_s"] for s in steps),
            "baseline_mib": max(steps[0]["baseline_bytes"]) / 2**20,
            "train_s": med(m["train_s"] for m in lr_run["metrics"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lrs", type=float, nargs="+", default=list(LRS))
    ap.add_argument("--steps", type=int, default=15, help="GRPO steps (each followed by a delta sync) per lr")
    ap.add_argument("--dense", type=int, default=4, help="dense M2N syncs per lr (delta off; the first is a warm-up)")
    ap.add_argument("--model", default=MODEL, help="a shipped config (weightsync/configs) or a config directory")
    ap.add_argument("--wire-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--staging-mib", type=int, default=64)
    ap.add_argument("--groups", type=int, default=4, help="prompts per GRPO batch")
    ap.add_argument("--group-size", type=int, default=8, help="responses per prompt")
    ap.add_argument("--max-tokens", type=int, default=512, help="TrainerConfig.max_tokens_per_micro_batch")
    ap.add_argument("--out", default=os.path.join(DOCS, "results"), help="directory of delta_sync.json")
    ap.add_argument("--img", default=os.path.join(DOCS, "img"), help="directory of delta_sync.png")
    ap.add_argument("--from-json", metavar="PATH", help="only re-render the tables and the plot of a saved run")
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            write_report(json.load(f), args)
        return 0
    from transfer_throughput import machine

    from weightsync.testing.cluster import Layout, LocalCluster, model_config_dir
    from weightsync.testing.fsdp2 import FSDP2Ranks, write_checkpoint

    started = time.perf_counter()
    result: dict[str, Any] = {"machine": machine(), "args": portable(args), "lrs": [], "error": None}
    with open(os.path.join(model_config_dir(args.model), "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    ckpt = write_checkpoint(os.path.join(tempfile.mkdtemp(prefix="delta-bench-"), "actor"), seed=0, config=args.model)
    procs, cluster = FSDP2Ranks(2), LocalCluster()
    try:
        cluster.setup(Layout(trainers=0, tp=2, dtype="bfloat16", model=args.model, backend="weightsync_m2n"))
        procs.init(2)
        for lr in args.lrs:
            print(f"--- lr {lr:g} ({time.perf_counter() - started:.0f} s)", flush=True)
            result["lrs"].append(run_lr(procs, cluster, ckpt, lr, args, vocab))
    except Exception as e:  # noqa: BLE001 - recorded, then the run fails loudly
        result["error"] = f"{type(e).__name__}: {e}"[:4000]
        raise
    finally:
        procs.close()
        cluster.close()
        result["machine"]["loadavg_end"] = os.getloadavg()
        result["seconds_total"] = time.perf_counter() - started
        result["finished"] = time.strftime("%Y-%m-%d %H:%M")
        result["summary"] = [finish(r) for r in result["lrs"] if r.get("verified")]
        os.makedirs(args.out, exist_ok=True)
        name = "delta_sync.json" if result["error"] is None else "delta_sync.failed.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(result, f, indent=1, default=str)
    write_report(result, args)
    return 0


def write_report(result: dict[str, Any], args: argparse.Namespace) -> None:
    text = delta_markdown(result)
    print("\n" + text)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "delta_sync.md"), "w") as f:
        f.write(text)
    os.makedirs(args.img, exist_ok=True)
    print(f"wrote {delta_plot(result, os.path.join(args.img, 'delta_sync.png'))}")



# --- report: tables and the plot ---------------------------------------------------------------------
def _machine_line(result: dict[str, Any]) -> str:
    m = result["machine"]
    return (f"Repository HEAD at start {m.get('commit', '?')}; weightsync imported from {m.get('weightsync', '?')}. "
            f"Machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB; {m['backend']}; torch {m['torch']}, "
            f"vLLM {m['vllm']}, Python {m['python']}. Load average at start {_f(m['loadavg_start'][0])}, "
            f"at end {_f(m.get('loadavg_end', [None])[0])} (the machine is shared). "
            f"Run finished {result.get('finished', '?')}, {result.get('seconds_total', 0) / 60:.1f} min.")


def delta_tables(result: dict[str, Any]) -> list[str]:
    """The per-lr summary and the per-step table of ``delta_sync.py``'s result."""
    rows = result["summary"]
    lines = [("| lr | steps | values changed per step: mean (step 1 -> last) | delta MB / sync (mean) | dense MB "
              "| naive MB | delta / dense: mean (max) | delta / naive | steps sent sparser than dense "
              "| delta sync s (median) | dense M2N s (median) | diff + encode s (median) "
              "| first sync of the delta engine s (dense, fills the baseline) | trainer extra MiB / rank "
              "| train step s (median) |"),
             "|---:|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['lr']:g} | {r['steps']} | {100 * r['changed_mean']:.2f} % ({100 * r['changed_first']:.2f} -> "
            f"{100 * r['changed_last']:.2f} %) | {r['delta_mb_mean']:.2f} | {r['dense_mb']:.2f} | {r['naive_mb']:.2f} "
            f"| {r['ratio_mean']:.3f} ({r['ratio_max']:.3f}) | {r['delta_mb_mean'] / r['naive_mb']:.3f} "
            f"| {r['sparse_steps']} / {r['steps']} | {r['delta_s']:.3f} | {r['dense_s']:.3f} | {r['diff_s']:.3f} "
            f"| {r['first_s']:.3f} | {r['baseline_mib']:.1f} | {r['train_s']:.1f} |")
    runs = [x for x in result["lrs"] if x.get("verified")]
    n = max((len(x["steps"]) for x in runs), default=0)
    head = " | ".join(f"lr {x['lr']:g}: changed, delta / dense, s" for x in runs)
    lines += ["", f"| step | {head} |", "|---:|" + "---|" * len(runs)]
    for i in range(n):
        cells = []
        for x in runs:
            s = x["steps"][i] if i < len(x["steps"]) else None
            cells.append("" if s is None else f"{100 * s['changed_fraction']:.2f} %, "
                         f"{s['bytes_sent'] / s['dense_bytes']:.3f}, {s['seconds']:.3f}")
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return lines


def delta_markdown(result: dict[str, Any]) -> str:
    out = ["# Delta sync (weightsync_m2n, delta=True; CPU)", "", _machine_line(result), ""]
    return "\n".join(out + delta_tables(result) + [""])


def delta_plot(result: dict[str, Any], path: str) -> str:
    """Per step and lr: values changed, bytes on the wire against dense and naive, sync seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    runs = [x for x in result["lrs"] if x.get("verified")]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 5.2))
    for i, x in enumerate(runs):
        col, lab = f"C{i}", f"lr {x['lr']:g}"
        steps = list(range(1, len(x["steps"]) + 1))
        a.plot(steps, [100 * s["changed_fraction"] for s in x["steps"]], "o-", c=col, label=lab)
        b.plot(steps, [s["bytes_sent"] / 1e6 for s in x["steps"]], "o-", c=col, label=lab)
        dense_timed = x["dense"][1:] or x["dense"]
        c.plot(steps, [s["seconds"] for s in x["steps"]], "o-", c=col, label=lab)
        c.axhline(statistics.median(s["seconds"] for s in dense_timed), ls="--", c=col,
                  label=f"{lab}: dense M2N sync s (median)")
    if runs:
        dense, naive = runs[0]["steps"][0]["dense_bytes"] / 1e6, runs[0]["naive_bytes"] / 1e6
        b.axhline(dense, ls="--", c="gray", label=f"dense M2N ({dense:.1f} MB)")
        b.axhline(naive, ls=":", c="black", label=f"naive full_tensor + broadcast ({naive:.1f} MB)")
    a.axhline(100 * 15 / 16, ls="-.", c="C3",
              label="break-even for bf16 (~94 %: a 1-bit mask per value + 2-byte values)")
    for ax, y in ((a, "values changed since the last sync (%)"), (b, "MB on the wire per sync (all trainer ranks)"),
                  (c, "seconds per sync (slowest trainer rank)")):
        ax.set_xlabel("GRPO step (each followed by a sync)")
        ax.set_ylabel(y)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3, which="both")
    a.set_title("values changed", fontsize=9)
    b.set_title("bytes on the wire: delta (solid), dense and naive (gray)", fontsize=9)
    c.set_title("sync seconds: delta (solid), dense M2N (dashed)", fontsize=9)
    fig.suptitle("Delta sync after real GRPO steps: 2 FSDP2 ranks (fp32 master, bf16 wire) -> vLLM TP 2 bf16 "
                 "(CPU, gloo)")
    _legend_below(fig, (a, b, c))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
