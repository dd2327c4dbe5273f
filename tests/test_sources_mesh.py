"""``DTensorModuleSource`` on 2-D trainer meshes (FSDP x expert-parallel): the layout it describes is
exactly each rank's local shard of a fused expert tensor, uneven counts included (4 gloo ranks)."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from weightsync.testing.cluster import free_port

pytestmark = pytest.mark.timeout(300)

_SHAPE = (5, 8, 6)  # [experts, rows, cols]: 5 experts do not divide over 2 x 2


def _rank(rank: int, world: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from weightsync.layout import Region
    from weightsync.sources import DTensorModuleSource, tensor_sources

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
