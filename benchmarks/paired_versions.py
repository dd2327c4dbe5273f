"""Two versions of weightsync measured in one run, interleaved (issue 52's "no slower" check).

Each repeat runs ``transfer_throughput.py --quick`` and every ``scale.py --quick`` shape once per
version, the order alternating (old first, then new first, ...) so that neither side always meets the
machine in the same state. A version is a checkout: its own ``src/`` on ``PYTHONPATH`` and its own
``benchmarks/`` scripts, run in a fresh process each time; nothing else differs. Per row: the median of
each version's seconds and the median of the per-repeat ratios new/old (taken moments apart: fair on a
shared machine). Targets are judged alike for both versions (this checkout's ``_report.acceptance`` and
``scale.targets``) on each version's last repeat.

    python benchmarks/paired_versions.py --old /work/wt-old --repeats 2 --out docs/results/paired_versions.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from _report import portable

HERE = os.path.dirname(os.path.abspath(__file__))
COMMON = ("weightsync_m2n", "weightsync_m2n/rollback", "weightsync_nccl", "weightsync_ipc", "naive")
"""The transports both versions know (this checkout's ``weightsync_nixl`` is not in the old one)."""
SCALE_SHAPES = ("qwen3-tp", "qwen3-ep", "dsv3-tp", "dsv3-ep", "k2-tp", "dense70b-tp")


def _run(repo: str, args: list[str], timeout_s: int) -> str:
    env = {**os.environ, "PYTHONPATH": os.path.join(repo, "src")}
    p = subprocess.run([sys.executable, *args], cwd=repo, env=env, capture_output=True, text=True,
                       timeout=timeout_s, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"{repo}: {' '.join(args)} exited {p.returncode}:\n{p.stderr[-3000:]}")
    return p.stdout


def transfer_rows(repo: str, transports: tuple[str, ...]) -> dict[str, Any]:
    """One ``transfer_throughput.py --quick`` of ``repo``: seconds per row, paired and accepted numbers."""
    with tempfile.TemporaryDirectory(prefix="paired-") as out:
        _run(repo, ["benchmarks/transfer_throughput.py", "--quick", "--no-extras", "--transports", *transports,
                    "--out", out], 3600)
        with open(os.path.join(out, "transfer_throughput.json")) as f:
            result = json.load(f)
    rows = {f"{r['sweep']} {r['size']} {r['transport']} @{r['staging_mib']:g} MiB": r["seconds"]
            for r in result["rows"]}
    for size, p in result["paired"].items():
        rows[f"paired {size} weightsync_m2n (trainer s)"] = p["m2n_trainer_s"]
        rows[f"paired {size} naive"] = p["naive_s"]
    return {"seconds": rows, "errors": result["errors"], "result": result}


def scale_row(repo: str, shape: str) -> dict[str, Any]:
    out = _run(repo, ["benchmarks/scale.py", "--quick", "--json", "--shape", shape], 1800)
    row: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return row


def _scale_seconds(row: dict[str, Any]) -> dict[str, float]:
    s = row["shape"]
    return {f"scale {s} plan s": row["plan_s"],
            **{f"scale {s} {side} host CPU s": row[side]["host_cpu_s"] for side in ("trainer", "worker")},
            **{f"scale {s} {side} init (list) s": row[side]["list_s"] for side in ("trainer", "worker")}}


def one_repeat(i: int, versions: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement of repeat ``i`` for both versions, the order alternating with ``i``."""
    order = list(versions) if i % 2 == 0 else list(versions)[::-1]
    rep: dict[str, Any] = {v: {"seconds": {}, "scale_rows": [], "errors": []} for v in versions}
    if not args.no_transfer:
        for v in order:
            t0 = time.perf_counter()
            tr = transfer_rows(versions[v], tuple(args.transports))
            rep[v]["seconds"].update(tr["seconds"])
            rep[v]["errors"] += tr["errors"]
            rep[v]["transfer_result"] = tr["result"]
            rep[v]["paired"] = {size: {k: x for k, x in p.items() if k != "samples"}
                                for size, p in tr["result"]["paired"].items()}  # in-run ratios, load-robust
            print(f"  repeat {i} {v}: transfer_throughput --quick {time.perf_counter() - t0:.0f} s", flush=True)
    for shape in args.shapes:
        for v in order:
            row = scale_row(versions[v], shape)
            rep[v]["scale_rows"].append(row)
            rep[v]["seconds"].update(_scale_seconds(row))
        print(f"  repeat {i}: scale {shape} done", flush=True)
    return rep


def summarize(reps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per row: each version's median seconds and the median of the per-repeat ratios new/old."""
    keys = [k for k in reps[0]["new"]["seconds"] if all(k in r[v]["seconds"] for r in reps for v in ("old", "new"))]
    out = []
    for k in keys:
        old = [r["old"]["seconds"][k] for r in reps]
        new = [r["new"]["seconds"][k] for r in reps]
        out.append({"row": k, "old_s": statistics.median(old), "new_s": statistics.median(new),
                    "ratio_new_over_old": statistics.median(n / o for n, o in zip(new, old) if o > 0),
                    "ratios": [n / o for n, o in zip(new, old) if o > 0]})
    return out


def targets(reps: list[dict[str, Any]], bench: str) -> dict[str, Any]:
    """The quick targets of both benchmarks, judged alike for each version (its last repeat's run) by the
    new checkout's ``bench`` folder."""
    sys.path.insert(0, bench)
    import _report
    import scale

    out: dict[str, Any] = {}
    for v in ("old", "new"):
        last = reps[-1][v]
        met: list[tuple[str, bool]] = []
        if "transfer_result" in last:
            for a in _report.acceptance(last["transfer_result"]):
                met.append((f"transfer {a['size']}: speedup over naive {a['speedup_over_naive']:.2f} >= 2",
                            a["speedup_over_naive"] >= 2))
                met.append((f"transfer {a['size']}: {a['fraction_of_p2p']:.2f} of raw p2p >= 0.80",
                            a["fraction_of_p2p"] >= 0.8))
        if last["scale_rows"]:
            met += scale.targets(last["scale_rows"])
        out[v] = {"met": sum(ok for _, ok in met), "of": len(met), "targets": [[t, ok] for t, ok in met]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the old checkout (its src/ and benchmarks/)")
    ap.add_argument("--new", default=os.path.dirname(HERE), help="the new checkout (default: this one)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--transports", nargs="+", default=list(COMMON))
    ap.add_argument("--shapes", nargs="*", default=list(SCALE_SHAPES), help="scale.py shapes (none: skip)")
    ap.add_argument("--no-transfer", action="store_true", help="skip transfer_throughput.py")
    ap.add_argument("--out", required=True, help="JSON path")
    args = ap.parse_args()
    versions = {"old": os.path.abspath(args.old), "new": os.path.abspath(args.new)}
    commits = {v: subprocess.run(["git", "-C", p, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 check=False).stdout.strip() for v, p in versions.items()}
    started, load0 = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), os.getloadavg()
    reps = []
    for i in range(args.repeats):
        reps.append(one_repeat(i, versions, args))
        summary = summarize(reps)
        with open(args.out, "w") as f:  # a checkpoint after every repeat
            json.dump({"versions": portable(versions), "commits": commits, "started": started, "loadavg_start": load0,
                       "loadavg_now": os.getloadavg(), "repeats_done": i + 1, "rows": summary,
                       "errors": {v: [e for r in reps for e in r[v]["errors"]] for v in versions},
                       "paired": [{v: r[v].get("paired") for v in versions} for r in reps]}, f, indent=1)
    with open(args.out) as f:
        doc = json.load(f)
    doc["targets"] = targets(reps, os.path.join(versions["new"], "benchmarks"))
    doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"| row | old s | new s | new/old (median of {args.repeats} paired) |\n|---|---:|---:|---:|")
    for r in doc["rows"]:
        print(f"| {r['row']} | {r['old_s']:.3f} | {r['new_s']:.3f} | {r['ratio_new_over_old']:.2f} |")
    for v, t in doc["targets"].items():
        print(f"{v} ({commits[v]}): targets {t['met']}/{t['of']} met")


if __name__ == "__main__":
    main()
