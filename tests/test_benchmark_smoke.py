"""benchmarks/transfer_throughput.py at its smallest, run as the docs run it: every path that makes a
number in docs/benchmarks.md (separate rows, the paired M2N / naive / raw runs with their CPU seconds,
the report and its plots) runs end to end, so a change that breaks a driver fails here and not in the
next benchmark run (its scenarios record failures and go on)."""

import json
import os
import subprocess
import sys

import pytest

from helpers import HAS_VLLM

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed"),
              pytest.mark.timeout(600)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_throughput_benchmark_runs_every_path_verified_and_reports_the_paired_ratios(tmp_path):
    cmd = [sys.executable, "benchmarks/transfer_throughput.py", "--sizes", "16MB", "--transports", "weightsync_m2n",
           "naive", "--layouts", "--staging-sweep", "--no-extras", "--repeats", "1", "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=500, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    with open(tmp_path / "transfer_throughput.json") as f:
        result = json.load(f)
    assert result["errors"] == []
    rows = {r["transport"]: r for r in result["rows"]}
    assert sorted(rows) == ["naive", "weightsync_m2n"]
    assert all(r["verified"] is True for r in rows.values())
    m2n = rows["weightsync_m2n"]
    assert m2n["received_per_worker"] == m2n["lower_bound_per_worker"]  # each worker got exactly its shard
    assert rows["naive"]["wire_over_lower_bound"] > 1.9  # the naive sync broadcasts whole tensors
    paired = result["paired"]["16MB"]
    assert len(paired["samples"]) == 5
    for key in ("m2n_s", "naive_s", "raw_plan_s", "m2n_cpu_s", "raw_plan_cpu_s", "p2p_gbps", "m2n_first_s",
                "naive_first_s", "fraction_of_raw_plan_first", "m2n_trainer_s", "fraction_of_raw_plan_driver"):
        assert paired[key] > 0, key
    assert paired["speedup"] == pytest.approx(sorted(s["speedup"] for s in paired["samples"])[2])
    report = (tmp_path / "transfer_throughput.md").read_text()
    assert "| 15 | fraction of the plan's traffic moved raw |" in report
    assert "M2N's extra CPU per sync" in report and "each side the mean of 3 runs after a warm-up run" in report
    for png in ("transfer_size.png", "transfer_memory.png"):
        assert (tmp_path / png).stat().st_size > 10_000, png
    assert "UserWarning" not in out.stderr
