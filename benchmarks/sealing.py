"""Sealing the store's values (issue 56): seconds to seal and to open one value with ``SealedStore``
(AES-256-GCM from ``cryptography``), against the target of 20 ms for 8 MiB.

    .venv/bin/python benchmarks/sealing.py [--repeats 20] [--out docs/results]

Seals and opens values of 1 KiB, 1 MiB and 8 MiB with the keys of a fresh group (HKDF from a
random 32-byte secret and group id), in this process, no store traffic (the write counter is
passed in). Reports the median of ``--repeats`` runs after one warm-up; exits 1 when sealing 8 MiB
takes more than 20 ms. Writes ``--out``/sealing.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import statistics
import sys
import time
from typing import Any

TARGET_8MIB_S = 0.020
SIZES = {"1 KiB": 1 << 10, "1 MiB": 1 << 20, "8 MiB": 8 << 20}


class _NoStore:
    """Where a ``SealedStore`` would keep its values: unused here (``seal``/``open`` only)."""


def _median_s(fn: Any, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(repeats: int) -> dict[str, Any]:
    from weightsync.sealed import SealedStore

    store = SealedStore(_NoStore(), secrets.token_bytes(32), secrets.token_bytes(16))
    rows = []
    for label, size in SIZES.items():
        value = os.urandom(size)
        counter = iter(range(1, 1 << 30))
        sealed = store.seal("sync1/plan", value, 1)
        seal_s = _median_s(lambda v=value, c=counter: store.seal("sync1/plan", v, next(c)), repeats)
        store.seen.clear()
        open_s = _median_s(lambda b=sealed: store.open("sync1/plan", b), repeats)
        rows.append({"size": label, "bytes": size, "seal_s": seal_s, "open_s": open_s,
                     "overhead_bytes": len(sealed) - size})
        print(f"{label:>6}: seal {seal_s * 1e3:8.3f} ms  open {open_s * 1e3:8.3f} ms  (+{len(sealed) - size} bytes)")
    import cryptography

    return {"what": "SealedStore.seal / open, AES-256-GCM (cryptography), median of repeats after a warm-up",
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
            "cryptography": cryptography.__version__, "repeats": repeats, "target_8mib_seal_s": TARGET_8MIB_S,
            "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      "docs", "results"))
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    result = run(args.repeats)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sealing.json"), "w") as f:
        json.dump(result, f, indent=1)
    eight = next(r for r in result["rows"] if r["size"] == "8 MiB")
    ok = eight["seal_s"] <= TARGET_8MIB_S
    print(f"8 MiB sealed in {eight['seal_s'] * 1e3:.2f} ms: {'within' if ok else 'over'} the "
          f"{TARGET_8MIB_S * 1e3:.0f} ms target")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
