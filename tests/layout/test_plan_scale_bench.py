"""benchmarks/plan_scale.py's DeepSeek-V3-class scenario at toy size: every worker gets exactly its shard."""

from __future__ import annotations

import argparse
import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "plan_scale.py"
_spec = importlib.util.spec_from_file_location("plan_scale_bench", _PATH)
plan_scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_scale)


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
