"""Markdown tables and PNG plots for ``transfer_throughput.py`` (pure: results in, text and files out).

``delta_sync.py`` builds its own tables and plot, with ``_f`` and ``_legend_below`` from here."""

from __future__ import annotations

import os
import statistics
from typing import Any

__all__ = ["TARGETS", "acceptance", "markdown", "plots", "portable", "row_line"]

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TARGETS = {"wire_over_lower_bound": 1.00, "speedup_over_naive": 2.0, "fraction_of_p2p": 0.80,
           "trainer_extra_over_staging": 1.0}
"""Issue 8 / issue 4 targets for weightsync_m2n at 2 trainers -> TP 2."""


def portable(fields: Any) -> dict[str, Any]:
    """``fields`` (a dict, or an argparse namespace) as a saved result records it: every absolute path
    relative to this repository, or its last part outside it (no machine's paths in docs/results)."""
    out = dict(fields if isinstance(fields, dict) else vars(fields))
    for k, v in out.items():
        if isinstance(v, str) and os.path.isabs(v):
            inside = os.path.commonpath([_REPO, os.path.abspath(v)]) == _REPO
            out[k] = os.path.relpath(v, _REPO) if inside else os.path.basename(v.rstrip("/"))
    return out


def _layout(r: dict[str, Any]) -> str:
    return f"{r['trainers']} -> TP{r['tp']}" + (f" x {r['replicas']}" if r["replicas"] > 1 else "")


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def row_line(r: dict[str, Any]) -> str:
    return (f"{r['transport']:<22} {r['seconds']:.3f} s/sync  {r['gbps_per_receiver']:.3f} GB/s/receiver  "
            f"wire/lower {_f(r['wire_over_lower_bound'])}  trainer +{max(r['trainer_extra_mib']):.0f} MiB  "
            f"worker +{max(r['worker_extra_mib']):.0f} MiB  verified {r['verified']}")


def _p2p(result: dict[str, Any], r: dict[str, Any]) -> dict[str, Any] | None:
    return result["p2p"].get(f"{r['trainers']}x{r['tp']}x{r['replicas']}@{r['staging_mib']}")


def acceptance(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per model size at 2 trainers -> TP 2: the four numbers the issues ask for, against the targets.
    Speedup and fraction of raw p2p come from the paired runs when present (medians of ratios taken
    moments apart), else from the separate rows."""
    out = []
    rows = [r for r in result["rows"] if r["sweep"] == "size" and (r["trainers"], r["tp"], r["replicas"]) == (2, 2, 1)]
    for m2n in (r for r in rows if r["transport"] == "weightsync_m2n"):
        naive = next((r for r in rows if r["transport"] == "naive" and r["size"] == m2n["size"]), None)
        p2p = _p2p(result, m2n)
        paired = result.get("paired", {}).get(m2n["size"])
        a = {
            "size": m2n["size"], "model_mb": m2n["model_mb"], "seconds": m2n["seconds"],
            "wire_over_lower_bound": m2n["wire_over_lower_bound"],
            "naive_seconds": naive and naive["seconds"],
            "speedup_rows": naive and naive["seconds"] / m2n["seconds"],
            "gbps_per_receiver": m2n["gbps_per_receiver"],
            "p2p_pair_best_gbps": p2p and p2p["pair_best_gbps"],
            "p2p_round_gbps": p2p and p2p["round_gbps_per_receiver"],
            "fraction_of_p2p_rows": p2p and m2n["gbps_per_receiver"] / p2p["pair_best_gbps"],
            "fraction_of_p2p_round": p2p and m2n["gbps_per_receiver"] / p2p["round_gbps_per_receiver"],
            "transfer_phase_gbps": max(m2n["received_per_worker"].values()) / m2n["phases"]["transfer"] / 1e9,
            "trainer_extra_mib": max(m2n["trainer_extra_mib"]), "staging_mib": m2n["bucket_mib"],
            "phases": m2n["phases"], "cpu_s": _cpu_s(m2n), "naive_cpu_s": naive and _cpu_s(naive),
            "paired": paired,
        }
        a["speedup_over_naive"] = paired["speedup"] if paired else a["speedup_rows"]
        a["fraction_of_p2p"] = paired["fraction_of_p2p"] if paired else a["fraction_of_p2p_rows"]
        for variant, flag in (("no-rollback", False), ("rollback", True)):  # runs before / after the default flipped
            nr = next((r for r in rows if r["transport"] == f"weightsync_m2n/{variant}" and r["size"] == m2n["size"]),
                      None)
            if nr is not None:
                a.update(variant_rollback=flag, variant_seconds=nr["seconds"], variant_gbps=nr["gbps_per_receiver"])
        out.append(a)
    return out


def _range(paired: dict[str, Any], key: str, scale: float = 1.0) -> str:
    vals = [x[key] * scale for x in paired["samples"]]
    fmt = ".0f" if scale != 1.0 else ".2f"
    return f"{min(vals):{fmt}}-{max(vals):{fmt}}"


def _targets_table(acc: list[dict[str, Any]]) -> list[str]:
    lines = ["| model MB | criterion | target | measured | verdict | how it is measured |",
             "|---:|---|---|---|---|---|"]
    for a in acc:
        p = a["paired"]
        wl = a["wire_over_lower_bound"]
        how_speed = (f"median (range {_range(p, 'speedup')}) over {len(p['samples'])} back-to-back pairs of "
                     f"naive s / weightsync_m2n s (medians "
                     f"{p['naive_s']:.3f} / {p['m2n_s']:.3f} s); separate rows: {_f(a['speedup_rows'])}x"
                     if p else "naive row s / weightsync_m2n row s")
        how_p2p = (f"median (range {_range(p, 'fraction_of_p2p', 100)} %) over the same pairs of weightsync_m2n GB/s "
                   f"per receiver / raw gloo p2p one pair "
                   f"({p['p2p_mib']} MiB messages, median {p['p2p_gbps']:.2f} GB/s); separate rows: "
                   f"{100 * a['fraction_of_p2p_rows']:.0f} % of the best pair {a['p2p_pair_best_gbps']:.2f} GB/s, "
                   f"{100 * a['fraction_of_p2p_round']:.0f} % of a raw M2N-shaped round "
                   f"{a['p2p_round_gbps']:.2f} GB/s" if p else "weightsync_m2n row GB/s / best raw pair GB/s")
        mb = f"{a['model_mb']:.0f}"
        lines += [
            (f"| {mb} | bytes on the wire / lower bound | 1.00 | {_f(wl)} | "
            f"{_verdict(wl is not None and abs(wl - 1) < 5e-3)} | bytes each worker counted / its shard bytes |"),
            (f"| {mb} | speedup over naive | >= 2x | {_f(a['speedup_over_naive'])}x | "
            f"{_verdict(a['speedup_over_naive'] is not None and a['speedup_over_naive'] >= 2)} | {how_speed} |"),
            (f"| {mb} | fraction of raw p2p | >= 80 % | "
            f"{_f(a['fraction_of_p2p'] and 100 * a['fraction_of_p2p'], '.0f')} % | "
            f"{_verdict(a['fraction_of_p2p'] is not None and a['fraction_of_p2p'] >= 0.8)} | {how_p2p} |"),
            *([(f"| {mb} | fraction of the plan's traffic moved raw | >= 80 % | "
                 f"{100 * p['fraction_of_raw_plan']:.0f} % | {_verdict(p['fraction_of_raw_plan'] >= 0.8)} | "
                 f"median (range {_range(p, 'fraction_of_raw_plan', 100)} %) over the same pairs of raw s / "
                 f"weightsync_m2n s{_trainer_side(p)}, raw = every (trainer, worker) pair's bytes of one sync "
                 f"as one gloo message, "
                 f"all posted at once, no copies (median {p['raw_plan_s']:.3f} s); {_steps(p)}{_first(p)}; "
                 f"separate rows: "
                 f"{100 * a['fraction_of_p2p_round']:.0f} % of the balanced raw M2N-shaped round |")]
              if p and "fraction_of_raw_plan" in p else []),
            (f"| {mb} | trainer extra peak memory | <= 1 staging bucket ({a['staging_mib']:.0f} MiB) + 1 MiB | "
            f"{a['trainer_extra_mib']:.1f} MiB | {_verdict(a['trainer_extra_mib'] <= a['staging_mib'] + 1)} | "
            "peak RSS during the syncs minus RSS before the engine was built (max over trainer ranks); the "
            "staging buffer is allocated at init and its pages count once a sync has touched them, the 1 MiB "
            "is for the rest (plan, bookkeeping) |"),
        ]
    return lines


def _trainer_side(paired: dict[str, Any]) -> str:
    if "m2n_trainer_s" not in paired:
        return " (as the driver timed it)"
    return (f" (send_weights on the slowest trainer rank, median {paired['m2n_trainer_s']:.3f} s; as the driver "
            f"timed it, through the harness's calls into the trainer processes: "
            f"{100 * paired['fraction_of_raw_plan_driver']:.0f} %)")


def _steps(paired: dict[str, Any]) -> str:
    if "m2n_first_s" in paired:
        return "each side the mean of 3 runs after a warm-up run"
    return "weightsync_m2n one sync, raw the mean of 3 steps after a warm-up step"  # runs saved before 2026-12-02c


def _first(paired: dict[str, Any]) -> str:
    """The ratio for M2N's warm-up sync (the first after the naive sync and the raw probes), if recorded."""
    if "fraction_of_raw_plan_first" not in paired:
        return ""
    return (f" (M2N's warm-up sync as the driver timed it, the first after the other sides' work: "
            f"{100 * paired['fraction_of_raw_plan_first']:.0f} %, "
            f"range {_range(paired, 'fraction_of_raw_plan_first', 100)} %)")


def _cpu_s(r: dict[str, Any]) -> float | None:
    ph = r["phases"]
    return ph["cpu_trainers"] + ph["cpu_workers"] if "cpu_trainers" in ph else None


def _cpu_budget(a: dict[str, Any], cores: int) -> str:
    """One sentence: the paired runs' CPU seconds (every trainer and worker process, all threads) of one
    M2N sync and of one step of the plan's traffic moved raw, against what the machine's cores offer."""
    p = a["paired"]
    busy = [x["m2n_cpu_s"] / (cores * x["m2n_s"]) for x in p["samples"]]
    raw_busy = [x["raw_plan_cpu_s"] / (cores * x["raw_plan_s"]) for x in p["samples"]]
    return (f"- {a['model_mb']:.0f} MB, CPU (paired medians, the trainer and worker processes together): "
            f"an M2N sync used {p['m2n_cpu_s']:.3f} CPU s in {p['m2n_s']:.3f} s, "
            f"{100 * statistics.median(busy):.0f} % of the {cores} cores; a raw step of the same traffic "
            f"{p['raw_plan_cpu_s']:.3f} CPU s in {p['raw_plan_s']:.3f} s, {100 * statistics.median(raw_busy):.0f} %. "
            f"M2N's extra CPU per sync: {p['m2n_cpu_s'] - p['raw_plan_cpu_s']:.3f} s.")


def _where(a: dict[str, Any]) -> str:
    """One sentence: where the headline row's seconds go, and the like-for-like comparison."""
    ph = a["phases"]
    parts = [f"start {ph.get('start', 0):.3f} s (of which the workers' start {ph.get('worker_start', 0):.3f} s)",
             (f"transfer {ph.get('transfer', 0):.3f} s (trainer pack {ph.get('pack', 0):.3f}, wire wait "
             f"{ph.get('trainer_wire', 0):.3f}; worker apply {ph.get('worker_apply', 0):.3f})"),
             f"finish {ph.get('finish', 0):.3f} s", f"preflight {ph.get('preflight', 0):.3f} s",
             f"driver call {ph.get('driver_rpc', 0):.3f} s"]
    text = f"- {a['model_mb']:.0f} MB: {a['seconds']:.3f} s per sync = " + ", ".join(parts) + "."
    if a.get("cpu_s") is not None and a.get("naive_cpu_s"):
        text += (f" CPU time per sync (all processes): {a['cpu_s']:.2f} s vs naive {a['naive_cpu_s']:.2f} s "
                 f"({a['naive_cpu_s'] / a['cpu_s']:.1f}x less).")
    if a.get("variant_seconds"):
        what = ("With the opt-in `rollback=True` (a host snapshot per sync; separate rows)" if a["variant_rollback"]
                else "With `rollback=False` (separate rows; the naive baseline has no rollback either)")
        text += (f" {what}: {a['variant_seconds']:.3f} s"
                 + (f", {a['naive_seconds'] / a['variant_seconds']:.2f}x naive" if a["naive_seconds"] else "")
                 + (f", {100 * a['variant_gbps'] / a['p2p_pair_best_gbps']:.0f} % of raw p2p"
                    if a["p2p_pair_best_gbps"] else "") + ".")
    return text


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**missed**")


def _cpu(r: dict[str, Any]) -> str:
    ph = r["phases"]
    if "cpu_trainers" not in ph:
        return "n/a"
    return f"{ph['cpu_trainers'] + ph['cpu_workers']:.2f} ({ph['cpu_trainers']:.2f} + {ph['cpu_workers']:.2f})"


def _main_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [("| transport | layout | model MB | bucket MiB | s/sync (median) | GB/s per receiver | MB per worker "
             "| wire / lower bound | CPU s per sync (trainers + workers) | trainer extra peak MiB "
             "| worker extra peak MiB "
             "| verified |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        v = {True: "yes", False: "**MISMATCH**", None: "-"}[r["verified"]]
        lines.append(f"| {r['transport']} | {_layout(r)} | {r['model_mb']:.0f} | {r['bucket_mib']:.0f} | "
                     f"{r['seconds']:.3f} | {r['gbps_per_receiver']:.3f} | {r['mb_per_worker']:.1f} | "
                     f"{_f(r['wire_over_lower_bound'])} | {_cpu(r)} | {max(r['trainer_extra_mib']):.0f} | "
                     f"{max(r['worker_extra_mib']):.0f} | {v} |")
    return lines


_PHASES = [("init_s", "init (handshake + plan, once)"), ("preflight", "preflight"), ("start", "start"),
           ("pack", "pack (+gather)"), ("trainer_wire", "trainer wire wait"), ("finish", "finish"),
           ("worker_start", "worker start (snapshot)"), ("worker_wire", "worker wire wait"),
           ("worker_apply", "worker apply"), ("worker_finish", "worker finish"),
           ("send_other", "rest of send_weights"), ("driver_rpc", "driver call overhead")]


def _phase_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| transport | layout | model MB | " + " | ".join(h for _, h in _PHASES) + " |",
             "|---|---|---:|" + "---:|" * len(_PHASES)]
    for r in rows:
        if r["transport"] == "naive":
            continue
        vals = [r["init_s"] if k == "init_s" else r["phases"].get(k) for k, _ in _PHASES]
        lines.append(f"| {r['transport']} | {_layout(r)} | {r['model_mb']:.0f} | "
                     + " | ".join(_f(v, ".3f") for v in vals) + " |")
    return lines


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    rows = result["rows"]
    out = ["# Transfer throughput (weightsync, CPU)", "",
           (f"Repository HEAD at start {m.get('commit', '?')}; weightsync imported from {m.get('weightsync', '?')}. "
            f"Machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB; {m['backend']}; torch {m['torch']}, "
           f"vLLM {m['vllm']}, Python {m['python']}. Load average at start {_f(m['loadavg_start'][0])}, "
           f"at end {_f(m.get('loadavg_end', [None])[0])} (the machine is shared). "
           f"Run finished {result.get('finished', '?')}, {result.get('seconds_total', 0) / 60:.1f} min."), ""]
    acc = acceptance(result)
    if acc:
        out += ["## Targets: weightsync_m2n, 2 trainers -> TP 2", ""] + _targets_table(acc)
        out += ["", "Where weightsync_m2n's time goes (medians; trainer rank 0, slowest worker):", ""]
        out += [_where(a) for a in acc]
        out += [_cpu_budget(a, m["cores"]) for a in acc if a["paired"] and "m2n_cpu_s" in a["paired"]]
        out.append("")
    for sweep, title in (("size", "Model-size sweep"), ("layout", "Rank-layout sweep"), ("staging", "Staging sweep")):
        sel = [r for r in rows if r["sweep"] == sweep]
        if sweep == "layout" and sel:  # the size sweep's 2 -> TP 2 rows at the same size belong here too
            sel = [r for r in rows if r["sweep"] == "size" and r["size"] == sel[0]["size"]
                   and r["transport"] in {x["transport"] for x in sel}] + sel
        if sweep == "staging":  # the size sweep's weightsync_m2n row at the same size belongs here too
            sizes = {r["size"] for r in sel}
            sel = sorted(sel + [r for r in rows if r["sweep"] == "size" and r["transport"] == "weightsync_m2n"
                                and r["size"] in sizes and (r["trainers"], r["tp"]) == (2, 2)],
                         key=lambda r: r["bucket_mib"])
        if sel:
            out += [f"## {title}", ""] + _main_table(sel) + [""]
    timed = [r for r in rows if r["sweep"] != "staging"]
    if timed:
        out += (["## Time per phase (seconds, median; trainer rank 0 and slowest worker)", ""]
                + _phase_table(timed) + [""])
    if result["p2p"]:
        out += ["## Same-run baselines", "", ("| layout @ M2N staging | raw gloo p2p, one pair (GB/s by message MiB) "
                "| best | M2N-shaped round: message MiB, GB/s per receiver |"), "|---|---|---:|---|"]
        for k, p in result["p2p"].items():
            pairs = ", ".join(f"{mib} MiB: {g:.2f}" for mib, g in p["pair_gbps"].items())
            out.append(f"| {k} MiB | {pairs} | {p['pair_best_gbps']:.2f} | {p['round_msg_mib']:.0f} MiB: "
                       f"{p['round_gbps_per_receiver']:.2f} |")
        if result.get("memcpy"):
            mc = result["memcpy"]
            out += ["", (f"memcpy (64 MiB, one thread, in a trainer process): into an existing buffer "
                        f"{mc['existing_gbps']:.2f} GB/s, into a fresh allocation {mc['fresh_gbps']:.2f} GB/s.")]
        out.append("")
    if result.get("errors"):
        out += ["## Scenarios that failed (their processes were restarted)", ""]
        out += [f"- {e['scenario']['sweep']} {e['scenario']['trainers']} -> TP{e['scenario']['tp']} x "
                f"{e['scenario']['replicas']}, {e['scenario']['size']}: {e['error'][:300]}" for e in result["errors"]]
        out.append("")
    for key, title in (("plan_coverage", "plan_coverage.py"), ("plan_scale", "plan_scale.py")):
        text = (result.get(key) or "").strip()
        if key == "plan_coverage" and "Bytes each worker" in text:  # drop the per-row progress lines
            text = text[text.index("Bytes each worker"):]
        if text:
            out += [f"## {title}", "", text, ""]
    return "\n".join(out)


def _legend_below(fig: Any, axes: tuple[Any, ...]) -> None:
    """One legend for the figure, under the plots (keeps the data and reference lines clear)."""
    entries: dict[str, Any] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(lab, h)
    fig.legend(list(entries.values()), list(entries), loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 1))


def plots(result: dict[str, Any], out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    rows, paths = result["rows"], []
    transports = list(dict.fromkeys(r["transport"] for r in rows if r["sweep"] != "staging"))
    colors = {t: f"C{i}" for i, t in enumerate(dict.fromkeys(r["transport"] for r in rows))}
    plain = FuncFormatter(lambda x, _: f"{x:g}")
    size_rows = [r for r in rows if r["sweep"] == "size"]
    p2p_22 = [p for k, p in result["p2p"].items() if k.startswith("2x2x1@")]  # the size sweep's layout
    if size_rows:
        fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
        for t in transports:
            sel = sorted((r for r in size_rows if r["transport"] == t), key=lambda r: r["model_mb"])
            if sel:
                a.plot([r["model_mb"] for r in sel], [r["seconds"] for r in sel], "o-", c=colors[t], label=t)
                b.plot([r["model_mb"] for r in sel], [r["gbps_per_receiver"] for r in sel], "o-", c=colors[t], label=t)
        if p2p_22:
            b.axhline(max(p["pair_best_gbps"] for p in p2p_22), ls="--", c="gray",
                      label="raw gloo p2p, one pair (best)")
            b.axhline(max(p["round_gbps_per_receiver"] for p in p2p_22), ls=":", c="gray",
                      label="raw gloo p2p, M2N-shaped 2 -> 2 round (best)")
        for ax, y in ((a, "seconds per sync (median)"), (b, "GB/s per receiver (bytes it received / s)")):
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(plain)
            ax.set_xlabel("model size (MB, all parameters)")
            ax.set_ylabel(y)
            ax.grid(alpha=0.3)
        a.set_yscale("log")
        a.yaxis.set_major_formatter(plain)
        a.yaxis.set_minor_formatter(FuncFormatter(lambda x, _: f"{x:g}" if f"{x:.0e}"[0] in "25" else ""))
        fig.suptitle("2 FSDP2 trainer ranks -> vLLM TP 2 (CPU, gloo, 2 cores)")
        _legend_below(fig, (a, b))
        paths.append(os.path.join(out_dir, "transfer_size.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    lay = [r for r in rows if r["sweep"] == "layout"]
    if lay:
        lay = [r for r in size_rows
               if r["size"] == lay[0]["size"] and r["transport"] in {x["transport"] for x in lay}] + lay
        lay = sorted(lay, key=lambda r: (r["replicas"], r["trainers"], r["tp"]))
        labels = list(dict.fromkeys(_layout(r) for r in lay))
        fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
        for t in transports:
            by = {_layout(r): r for r in lay if r["transport"] == t}
            xs = [i for i, lab in enumerate(labels) if lab in by]
            if xs:
                a.plot(xs, [by[labels[i]]["seconds"] for i in xs], "o-", c=colors[t], label=t)
                b.plot(xs, [by[labels[i]]["gbps_per_receiver"] for i in xs], "o-", c=colors[t], label=t)
        for ax, y in ((a, "seconds per sync (median)"), (b, "GB/s per receiver")):
            ax.set_xticks(range(len(labels)), labels, rotation=30, fontsize=8)
            ax.set_xlabel("trainer ranks -> vLLM TP x replicas")
            ax.set_ylabel(y)
            ax.grid(alpha=0.3)
        fig.suptitle(f"Rank layouts at {lay[0]['model_mb']:.0f} MB (CPU, gloo, 2 cores)")
        _legend_below(fig, (a, b))
        paths.append(os.path.join(out_dir, "transfer_layouts.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    stag = [r for r in rows if r["transport"] == "weightsync_m2n" and r["sweep"] in ("staging", "size")
            and (r["trainers"], r["tp"], r["replicas"]) == (2, 2, 1)]
    if size_rows:
        fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
        for t in transports:
            sel = sorted((r for r in size_rows if r["transport"] == t), key=lambda r: r["model_mb"])
            if sel:
                a.plot([r["model_mb"] for r in sel], [max(r["trainer_extra_mib"]) for r in sel], "o-", c=colors[t],
                       label=t)
        a.axhline(size_rows[0]["staging_mib"], ls="--", c="gray",
                  label=f"staging bucket ({size_rows[0]['staging_mib']} MiB)")
        a.set_xscale("log")
        a.xaxis.set_major_formatter(plain)
        a.set_xlabel("model size (MB)")
        a.set_ylabel("trainer extra peak RSS (MiB, max over ranks)")
        a.set_title("trainer memory during a sync, 2 -> TP 2")
        size = max((r["size"] for r in stag if r["sweep"] == "staging"), default=None)
        sel = sorted((r for r in stag if r["size"] == size), key=lambda r: r["bucket_mib"])
        if sel:
            xs = [r["bucket_mib"] for r in sel]
            b.plot(xs, [max(r["trainer_extra_mib"]) for r in sel], "o-", label="weightsync_m2n trainer")
            b.plot(xs, [max(r["worker_extra_mib"]) for r in sel], "s-", label="weightsync_m2n worker")
            b.plot(xs, xs, ls="--", c="gray", label="one staging bucket")
            b.set_xscale("log", base=2)
            b.xaxis.set_major_formatter(plain)
            b.set_title(f"weightsync_m2n staging sweep at {sel[0]['model_mb']:.0f} MB")
        b.set_xlabel("staging bucket (MiB)")
        b.set_ylabel("extra peak RSS (MiB, max over ranks)")
        for ax in (a, b):
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:  # a run without a staging sweep leaves b empty
                ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, "transfer_memory.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
