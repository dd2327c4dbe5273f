"""Bytes received are what the data plane delivered, counted by the workers: a plan that sends one
piece twice moves the bytes-on-the-wire ratio off 1.00, while the plan's lower bound stays put."""

from __future__ import annotations

import pytest
import torch

from oracle import items_for_dst, items_for_src, pair_messages, rounds
from weightsync.plan.buckets import ALIGN
from weightsync.testing.cluster import Layout, free_port
from weightsync.transports.m2n import M2NTrainerInitInfo

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

LAYOUT = Layout(trainers=2, tp=2, backend="weightsync_m2n")


def duplicate_one_piece(on: bool) -> None:
    """Inside a trainer or receiver: M2N schedules trainer 0 -> worker 0's first piece twice (on
    both ends, in the same place, so the rounds still match), or restores the real schedule."""
    import weightsync.reshard.engines as m2n
    from weightsync.plan.transfer import dtype_itemsize
    from weightsync.reshard import handshake

    if not on:
        m2n.my_messages = handshake.my_messages
        return

    def doubled(plan, sources, *, rank, sender, cap, dense_only=()):  # (this layout processes no param)
        size = {s.name: dtype_itemsize(s.dtype) for s in sources}
        items = list(items_for_src(plan, rank) if sender else items_for_dst(plan, rank))
        if rank == 0:
            first = next(i for i, it in enumerate(items) if (it.dst_rank if sender else it.src_rank) == 0)
            items.insert(first + 1, items[first])
        listed = Listed(rounds(pair_messages(items, by="dst" if sender else "src", cap=cap,
                                             itemsize_of=size.__getitem__)))
        listed.nbytes = sum(m.nbytes for r in listed for m in r)
        return listed

    class Listed(list):  # the rounds as handshake.Rounds offers them: iterable, len, nbytes
        nbytes = 0

    m2n.my_messages = doubled


def m2n_info() -> M2NTrainerInitInfo:
    return M2NTrainerInitInfo.for_deployment(num_trainer_ranks=LAYOUT.trainers, replicas=LAYOUT.replicas, tp=LAYOUT.tp,
                                             buffer_bytes=1 << 16, master_port=free_port(), device="cpu", timeout_s=60)


def test_a_duplicated_piece_shows_in_bytes_received_not_in_the_lower_bound(cluster):
    cluster.setup(LAYOUT, fresh=True)
    cluster.make_engines(m2n_info())
    honest = cluster.sync(weight_version="honest")
    assert honest["bytes_received_per_worker"] == honest["lower_bound_per_worker"]

    procs = cluster.active_trainers + cluster.active_receivers
    for a in procs:
        a.call("test_wire_bytes:duplicate_one_piece", True)
    try:
        cluster.make_engines(m2n_info())
        doubled = cluster.sync(weight_version="doubled")
    finally:
        for a in procs:
            a.call("test_wire_bytes:duplicate_one_piece", False)
    assert doubled["lower_bound_per_worker"] == honest["lower_bound_per_worker"]
    extra = doubled["bytes_received_per_worker"][0] - doubled["lower_bound_per_worker"][0]
    assert extra > 0, doubled
    assert doubled["bytes_received_per_worker"][1] == doubled["lower_bound_per_worker"][1]
    assert doubled["bytes_received_per_worker"][0] / doubled["lower_bound_per_worker"][0] > 1.0
    assert {k: v for k, v in cluster.verify().items() if v} == {}, "a piece written twice is still the right value"


@pytest.mark.parametrize("backend", ["weightsync_m2n", "weightsync_nccl", "weightsync_ipc"])
def test_fp32_trainer_sends_bf16_pieces_to_a_bf16_engine(cluster, backend):
    """An fp32 master copy with the sources' ``dtype=torch.bfloat16``: every piece is cast as it is
    packed and the wire carries half the bytes of the same sync sent as fp32 (``cast_dtypes=True``,
    cast by the engine), measured in the same run; both leave the engine equal to vLLM's load of the
    fp32 state dict into its bf16 model (a round-to-nearest cast either way)."""
    from helpers import init_info

    layout = Layout(trainers=2, tp=2, dtype="bfloat16", trainer_dtype="float32", backend=backend)
    cluster.setup(layout)
    cluster.train_step(3)
    received = {}
    for wire in ("float32", "bfloat16"):
        cast = {"cast_dtypes": True} if wire == "float32" else {}
        cluster.make_engines(init_info(backend, layout, **cast), wire_dtype=None if wire == "float32" else wire)
        stats = cluster.sync(weight_version=wire)
        assert {k: v for k, v in cluster.verify().items() if v} == {}, wire
        received[wire] = stats["bytes_received_per_worker"]
        if backend == "weightsync_m2n":
            assert stats["bytes_received_per_worker"] == stats["lower_bound_per_worker"], wire
    if backend == "weightsync_m2n":  # pieces packed back to back: exactly half
        assert {w: 2 * n for w, n in received["bfloat16"].items()} == received["float32"]
    else:  # full tensors, each at a 256-byte aligned offset of its bucket: the payload, plus that padding
        full = cluster.on_trainers("full_state_dict")[0]
        payload = {wire: sum(t.numel() * getattr(torch, wire).itemsize for t in full.values()) for wire in received}
        for wire, per_worker in received.items():
            assert all(payload[wire] <= n < payload[wire] + len(full) * ALIGN for n in per_worker.values()), wire
