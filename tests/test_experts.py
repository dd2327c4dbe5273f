"""Fused expert tensors on 1-D and 2-D trainer meshes (FSDP x expert-parallel).

* Planned, checked against an oracle written from vLLM's layout rules directly: w13 = [gate TP slice;
  up TP slice] of each expert this worker holds, w2 = the down TP slice.
* ``DTensorModuleSource`` on a 2-D mesh: the layout it describes is exactly each rank's local shard of a
  fused expert tensor, uneven counts included (4 gloo ranks).
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from helpers import execute_reference, make_local_shards
from weightsync.plan import Shard, TensorSource, build_plan, mesh_coordinates, source_regions
from weightsync.testing.cluster import free_port
from weightsync.worker.experts import W2, W13, expert_runs, fused_expert_pieces

pytestmark = pytest.mark.timeout(300)

E, I, H = 7, 8, 6  # 7 experts: uneven over every mesh below


def _want(full: dict[str, torch.Tensor], experts: list[int], tp_rank: int, tp: int) -> dict[str, torch.Tensor]:
    s = I // tp
    gate_up, down = full["gate_up"][experts], full["down"][experts]
    w13 = torch.cat([gate_up[:, tp_rank * s:(tp_rank + 1) * s], gate_up[:, I + tp_rank * s:I + (tp_rank + 1) * s]], 1)
    return {"w13": w13, "w2": down[:, :, tp_rank * s:(tp_rank + 1) * s]}


def _workers(tp: int, ep: bool, round_robin: bool) -> list[tuple[list[int], int, int]]:
    """``(global experts held, moe tp rank, moe tp size)`` per worker of one TP-``tp`` engine."""
    if not ep:
        return [(list(range(E)), r, tp) for r in range(tp)]
    if round_robin:
        return [(list(range(r, E, tp)), 0, 1) for r in range(tp)]
    per = -(-E // tp)
    return [(list(range(r * per, min(E, (r + 1) * per))), 0, 1) for r in range(tp)]


@pytest.mark.parametrize("mesh,placements", [((3,), [Shard(0)]), ((2, 2), [Shard(0), Shard(0)]),
                                             ((2, 2), [Shard(0), Shard(1)])], ids=["fsdp3", "fsdp2xep2", "fsdp2xtp2"])
@pytest.mark.parametrize("tp,ep,round_robin", [(1, False, False), (2, False, False), (4, False, False),
                                               (2, True, False), (4, True, False), (4, True, True)],
                         ids=["tp1", "tp2", "tp4", "ep2", "ep4", "ep4-round-robin"])
def test_expert_pieces_plan_matches_vllm_layout(mesh, placements, tp, ep, round_robin):
    shapes = {"gate_up": (E, 2 * I, H), "down": (E, H, I)}
    sources = [TensorSource(n, s, "float64", source_regions(s, mesh, placements, mesh_coordinates(mesh)))
               for n, s in shapes.items()]
    workers = _workers(tp, ep, round_robin)
    dests, params = [], {}
    for w, (experts, r, size) in enumerate(workers):
        local_of = [(g, l) for l, g in enumerate(experts)]
        n = len(experts)
        dests.append(fused_expert_pieces("gate_up", shapes["gate_up"], W13, "w13", (n, 2 * I // size, H),
                                         local_of=local_of, tp_rank=r, tp_size=size)
                     + fused_expert_pieces("down", shapes["down"], W2, "w2", (n, H, I // size),
                                           local_of=local_of, tp_rank=r, tp_size=size))
        params[w] = {"w13": torch.full((n, 2 * I // size, H), -1.0, dtype=torch.float64),
                     "w2": torch.full((n, H, I // size), -1.0, dtype=torch.float64)}
    plan = build_plan(sources, dests)
    cov = plan.coverage()
    assert cov.ratio == 1.0 and cov.recv_bytes == cov.lower_bound
    full = {n: torch.randn(s, dtype=torch.float64) for n, s in shapes.items()}
    execute_reference(plan, make_local_shards(full, sources), params)
    for w, (experts, r, size) in enumerate(workers):
        want = _want(full, experts, r, size)
        assert torch.equal(params[w]["w13"], want["w13"]) and torch.equal(params[w]["w2"], want["w2"]), w
    pieces_per_run = 3  # gate + up + down
    assert len(dests[0]) == pieces_per_run * len(expert_runs([(g, l) for l, g in enumerate(workers[0][0])]))


def test_expert_runs_merge_only_consecutive_pairs():
    assert expert_runs([(0, 0), (1, 1), (2, 2)]) == [(0, 0, 3)]
    assert expert_runs([(0, 0), (2, 1), (4, 2)]) == [(0, 0, 1), (2, 1, 1), (4, 2, 1)]
    assert expert_runs([(3, 0), (4, 1), (0, 2)]) == [(0, 2, 1), (3, 0, 2)]


def test_shape_errors_name_the_tensor():
    with pytest.raises(ValueError, match=r"parameter 'g': the trainer's shape \(5, 96, 16\) .* expects \(5, 64, 16\)"):
        fused_expert_pieces("g", (5, 96, 16), W13, "w13", (5, 32, 16), local_of=[(0, 0)], tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match=r"parameter 'd': fused experts are 3-D"):
        fused_expert_pieces("d", (16, 32), W2, "w2", (2, 16, 32), local_of=[(0, 0)], tp_rank=0, tp_size=1)
    with pytest.raises(ValueError, match="experts \\[\\(9, 0\\)\\]"):
        fused_expert_pieces("d", (5, 16, 32), W2, "w2", (1, 16, 32), local_of=[(9, 0)], tp_rank=0, tp_size=1)


# --- DTensorModuleSource on a 2-D mesh ----------------------------------------------------------------

_SHAPE = (5, 8, 6)  # [experts, rows, cols]: 5 experts do not divide over 2 x 2


def _rank(rank: int, world: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from weightsync.plan import Region
    from weightsync.trainer.sources import DTensorModuleSource, tensor_sources

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "ep"))
        full = torch.arange(torch.Size(_SHAPE).numel(), dtype=torch.float32).reshape(_SHAPE)
        module = torch.nn.Module()
        module.experts_ep = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0), Shard(0)]))
        module.experts_cols = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0), Shard(2)]))
        src = DTensorModuleSource(module, world)
        regions = {s.name: s.regions for s in tensor_sources(src.metadata)}
        out = {}
        for name, local in src.iter_local():
            region: Region = regions[name][rank]
            out[name] = (region.offsets, region.sizes, torch.equal(full[region.slices()], local))
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def test_2d_mesh_layout_is_each_ranks_local_shard():
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, 4, port, queue)) for r in range(4)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(30)
    assert all(ok for r in got.values() for _, _, ok in r.values()), got
    # Shard(0) twice: 5 experts -> fsdp halves of 3 and 2, then ep halves of those: 2+1, 1+1
    assert [got[r]["experts_ep"][:2] for r in range(4)] == [
        ((0, 0, 0), (2, 8, 6)), ((2, 0, 0), (1, 8, 6)), ((3, 0, 0), (1, 8, 6)), ((4, 0, 0), (1, 8, 6))]
    assert [got[r]["experts_cols"][:2] for r in range(4)] == [
        ((0, 0, 0), (3, 8, 3)), ((0, 0, 3), (3, 8, 3)), ((3, 0, 0), (2, 8, 3)), ((3, 0, 3), (2, 8, 3))]
