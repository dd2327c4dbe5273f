"""Soak: many consecutive syncs; trainer rank 0's RSS, the store's key count, fds and threads must stay flat.

    python benchmarks/soak.py [--syncs 10000] [--mode m2n-delta broadcast] [--model tiny_qwen3]
                              [--layers 1] [--verify-every 100]

Modes (2 FSDP2 trainer ranks -> vLLM TP=2 on CPU, the ``weightsync.testing`` harness):
``m2n-delta`` (``weightsync_m2n`` with ``delta=True``: fp32 trainers, bf16 engine and wire), ``m2n``
(``weightsync_m2n``, fp32) and ``broadcast`` (``weightsync_nccl``, fp32). Each runs ``--warmup`` syncs (10;
verified and not), then ``--syncs`` syncs with the weights changed every 10 (``--change``: in place, or an FSDP2
optimizer step), every ``--verify-every``-th (and
each one sampled) with ``verify=True`` (every worker checks what it applied against the trainers' checksums
before the sync may finish), and checks the final weights bit-exact against vLLM's ``load_weights``.
``--model`` is a shipped config (``weightsync/configs``) or a directory; ``--layers N`` cuts it to N decoder
layers (a copy of its config).

Measures trainer rank 0's RSS (after a GC pass, MiB) after the warm-up and at ``--samples`` points of the
run, the store's key count (``store.num_keys()`` on trainer rank 0, which hosts it) at the same points,
and every process's RSS, fds (by kind: the new ones are named) and threads before/after. Writes
benchmarks/results/soak.json; exits 1
unless every sync succeeded, every verified sync verified, the weights are bit-exact, trainer rank 0's
RSS grew < 5 MiB, the key count stayed constant and no process gained fds (but the harness's own
pooled call connections, named as such) or threads.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import tempfile
import threading
import time

MIB = 1 << 20
RSS_LIMIT_MIB = 5.0


def resources() -> dict:
    """Inside a trainer/receiver process: RSS bytes, open fds, live threads (after a GC pass)."""
    gc.collect()
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    kinds: dict[str, int] = {}
    tcp = _tcp_ports()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")  # "socket:[inode]", "pipe:[inode]", "anon_inode:...", a path
        except OSError:  # the listing's own fd, closed by now
            continue
        kind = tcp.get(target, target.split("[")[0])
        kinds[kind] = kinds.get(kind, 0) + 1
    return {"rss": rss, "fds": sum(kinds.values()), "fd_kinds": kinds, "threads": threading.active_count()}


def _tcp_ports() -> dict[str, str]:
    """``socket:[inode]`` -> ``tcp <local port>-><remote port>`` for the TCP sockets of this network namespace."""
    ports = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                local, remote, inode = (c := row.split())[1], c[2], c[9]
                ports[f"socket:[{inode}]"] = f"tcp {int(local[-4:], 16)}->{int(remote[-4:], 16)}"
    return ports


def perturb(seed: int) -> None:
    """Inside a trainer rank: change a varying share (0.1-5 %) of every local shard in place, as an optimizer
    step changes the weights, without the step's own autograd and optimizer allocations (``--change step``
    runs the FSDP2 step instead: it alone grows a rank's RSS by a few MiB over its first few hundred steps,
    which is the trainer's, not weightsync's)."""
    import torch

    from weightsync.testing.trainer import STATE

    g = torch.Generator().manual_seed(seed * 100 + STATE["rank"])
    share = 0.001 + 0.049 * torch.rand((), generator=g).item()
    with torch.no_grad():
        for p in STATE["model"].parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            hit = torch.rand(local.shape, generator=g) < share
            local.add_(torch.randn(local.shape, generator=g).mul_(hit).to(local.dtype))


def store_keys() -> int:
    """Inside trainer rank 0: the keys on the group's store (it hosts it)."""
    from weightsync.testing.trainer import STATE

    return int(STATE["engine"].comm.store.num_keys())


def modes() -> dict:
    """Mode name -> (Layout, init info fields, make_engines keyword arguments)."""
    from weightsync.testing.cluster import Layout

    return {
        "m2n-delta": (Layout(trainers=2, tp=2, dtype="bfloat16", trainer_dtype="float32", backend="weightsync_m2n"),
                      {"delta": True}, {"wire_dtype": "bfloat16"}),
        "m2n": (Layout(trainers=2, tp=2, backend="weightsync_m2n"), {}, {}),
        "broadcast": (Layout(trainers=2, tp=2, backend="weightsync_nccl"), {}, {}),
    }


def cut_model(model: str, layers: int | None, into: str) -> str:
    """``model``'s config directory, or a copy of its config.json with ``layers`` decoder layers in ``into``."""
    from weightsync.testing.cluster import model_config_dir

    path = model_config_dir(model)
    if layers is None:
        return path
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    if not 1 <= layers <= config["num_hidden_layers"]:
        raise ValueError(f"--layers must be in [1, {config['num_hidden_layers']}] for {model}, got {layers}")
    config["num_hidden_layers"] = layers
    out = os.path.join(into, f"{os.path.basename(path.rstrip('/'))}_{layers}l")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def sample(cluster) -> dict:
    """Trainer rank 0's RSS (MiB), open fds and the store's key count, now."""
    rank0 = cluster.active_trainers[0]
    res = rank0.call("soak:resources")
    return {"rss_mib": res["rss"] / MIB, "fds": res["fds"], "store_keys": rank0.call("soak:store_keys")}


def soak(cluster, mode: str, model_dir: str, syncs: int, verify_every: int, samples: int, warmup: int,
         change: str = "perturb") -> dict:
    import dataclasses

    def step(seed: int) -> None:
        if change == "step":
            cluster.train_step(seed)
        else:
            cluster.on_trainers("soak:perturb", seed)

    layout, fields, engine_kwargs = modes()[mode]
    cluster.setup(dataclasses.replace(layout, model=model_dir))
    buffer = 1 << 15 if layout.backend == "weightsync_m2n" else 1 << 16
    cluster.make_engines(cluster.init_info(buffer_bytes=buffer, **fields), **engine_kwargs)
    procs = cluster.active_trainers + cluster.active_receivers
    for i in range(warmup):  # buffers, plan, optimizer state, allocator, the delta's base, the harness's connections
        step(-1 - i)
        cluster.sync(weight_version=f"warm{i}", verify=i % 2 == 1)
    before = [a.call("soak:resources") for a in procs]
    harness = {a.address.port for a in procs}  # the actors' listeners: the harness's own calls
    trace = [{"sync": 0, **sample(cluster)}]
    t0, verified, checked, last, changed = time.perf_counter(), 0, 0, {}, 0
    for i in range(1, syncs + 1):
        if i % 10 == 1:
            step(i)
        sampled = i % max(1, syncs // samples) == 0 or i == syncs
        check = i % verify_every == 0 or sampled  # (samples follow verified syncs: verify keys included)
        last = cluster.sync(weight_version=f"soak{i}", verify=check)
        changed += (last.get("delta") or {}).get("changed") or 0
        checked += check
        verified += check and last["verified"] is True
        if sampled:
            trace.append({"sync": i, **sample(cluster)})
    seconds = time.perf_counter() - t0
    after = [a.call("soak:resources") for a in procs]
    exact = not any(cluster.verify().values())
    rows = [{"process": a.name, "rss_mib": (x["rss"] / MIB, y["rss"] / MIB),
             "rss_growth_mib": (y["rss"] - x["rss"]) / MIB, "fds": (x["fds"], y["fds"]),
             "new_fds": _new_fds(x["fd_kinds"], y["fd_kinds"], harness),
             "threads": (x["threads"], y["threads"])} for a, x, y in zip(procs, before, after)]
    keys = [t["store_keys"] for t in trace]
    return {"mode": mode, "change": change, "transport": layout.backend, "delta": bool(fields.get("delta")),
            "delta_base_last": (last.get("delta") or {}).get("base"),
            "delta_changed_values": changed, "syncs": syncs, "verified_syncs": checked,
            "verified": verified, "bit_exact_after": exact, "seconds": seconds, "seconds_per_sync": seconds / syncs,
            "trainer0_rss_growth_mib": trace[-1]["rss_mib"] - trace[0]["rss_mib"],
            "store_keys": (min(keys), max(keys)), "trace": trace, "processes": rows}


def _new_fds(before: dict[str, int], after: dict[str, int], harness: set[int]) -> dict[str, int]:
    """The fds a process gained, by kind; a TCP connection from or to an actor's listener (the harness's
    pooled call connections, one more per call that overlapped another to the same actor) marked as such."""
    new = {}
    for kind, n in after.items():
        if n > before.get(kind, 0):
            ports = {int(p) for p in kind[4:].split("->")} if kind.startswith("tcp ") else set()
            new[f"harness {kind}" if ports & harness else kind] = n - before.get(kind, 0)
    return new


def passed(r: dict) -> bool:
    flat = all(all(k.startswith("harness ") for k in p["new_fds"]) and p["threads"][1] <= p["threads"][0]
               for p in r["processes"])
    return (flat and r["verified"] == r["verified_syncs"] and r["bit_exact_after"]
            and r["trainer0_rss_growth_mib"] < RSS_LIMIT_MIB and r["store_keys"][0] == r["store_keys"][1])


def table(results: list[dict]) -> str:
    lines = ["| mode | syncs | verified | bit-exact after | s/sync | trainer0 RSS after warm-up -> end (MiB) | "
             "growth | store keys (min, max) |", "|---|---:|---:|---|---:|---|---:|---|"]
    for r in results:
        t = r["trace"]
        lines.append(f"| {r['mode']} | {r['syncs']} | {r['verified']}/{r['verified_syncs']} | {r['bit_exact_after']} | "
                     f"{r['seconds_per_sync']:.3f} | {t[0]['rss_mib']:.1f} -> {t[-1]['rss_mib']:.1f} | "
                     f"{r['trainer0_rss_growth_mib']:+.2f} MiB | {r['store_keys'][0]}, {r['store_keys'][1]} |")
    lines += ["", "| mode | process | RSS (MiB) | growth | fds | threads |", "|---|---|---|---:|---|---|"]
    for r in results:
        for p in r["processes"]:
            lines.append(f"| {r['mode']} | {p['process']} | {p['rss_mib'][0]:.1f} -> {p['rss_mib'][1]:.1f} | "
                         f"{p['rss_growth_mib']:+.2f} MiB | {p['fds'][0]} -> {p['fds'][1]}{_named(p)} | "
                         f"{p['threads'][0]} -> {p['threads'][1]} |")
    return "\n".join(lines)


def _named(p: dict) -> str:
    new = p.get("new_fds") or {}
    return f" (new: {', '.join(f'{n} {k}' for k, n in sorted(new.items()))})" if new else ""


def main() -> int:
    from weightsync.testing.cluster import LocalCluster

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--syncs", type=int, default=10000)
    ap.add_argument("--mode", nargs="+", default=["m2n-delta", "broadcast"], choices=list(modes()))
    ap.add_argument("--model", default="tiny_qwen3", help="a shipped config name or a config directory")
    ap.add_argument("--layers", type=int, default=None, help="cut the model to this many decoder layers")
    ap.add_argument("--verify-every", type=int, default=100, help="every N-th sync runs with verify=True")
    ap.add_argument("--change", choices=["perturb", "step"], default="perturb",
                    help="how the weights change every 10 syncs: in place (perturb) or an FSDP2 optimizer step")
    ap.add_argument("--warmup", type=int, default=10, help="syncs before the first measurement")
    ap.add_argument("--samples", type=int, default=20, help="RSS / key-count samples over the run")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "soak.json"))
    args = ap.parse_args()
    if min(args.syncs, args.verify_every, args.samples, args.warmup) < 1:
        ap.error(f"--syncs, --verify-every, --samples and --warmup must be >= 1, got {args.syncs}, "
                 f"{args.verify_every}, {args.samples}, {args.warmup}")
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    here = os.path.dirname(os.path.abspath(__file__))  # the commit the run's code is from (read before it starts)
    commit = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    load = [os.getloadavg()]
    tmp = tempfile.mkdtemp(prefix="soak-model-")
    model_dir = cut_model(args.model, args.layers, tmp)
    cluster = LocalCluster()
    try:
        results = []
        for m in args.mode:
            results.append(soak(cluster, m, model_dir, args.syncs, args.verify_every, args.samples, args.warmup,
                                args.change))
            load.append(os.getloadavg())
            print(table(results[-1:]), flush=True)
    finally:
        cluster.close()
    ok = all(passed(r) for r in results)
    meta = {"commit": commit, "started": started, "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "loadavg_1_5_15": load, "model": args.model, "layers": args.layers, "verify_every": args.verify_every,
            "warmup": args.warmup, "change": args.change, "ok": ok}
    print(table(results))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"run": meta, "results": results}, f, indent=1)
    print("soak:", "ok" if ok else "FAILED", json.dumps(meta))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
