"""Bytes received are what the data plane delivered, counted by the workers: a plan that sends one
piece twice moves the bytes-on-the-wire ratio off 1.00, while the plan's lower bound stays put."""

from __future__ import annotations

import pytest

from weightsync.testing.cluster import Layout, free_port
from weightsync.transport.m2n import M2NTrainerInitInfo

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

LAYOUT = Layout(trainers=2, tp=2, backend="weightsync_m2n")


def duplicate_one_piece(on: bool) -> None:
    """Inside a trainer or receiver: M2N schedules trainer 0 -> worker 0's first piece twice (on
    both ends, in the same place, so the rounds still match), or restores the real schedule."""
    import weightsync.transport.m2n as m2n
    from weightsync.layout.records import dtype_itemsize
    from weightsync.layout.schedule import pair_messages, rounds
    from weightsync.transport import m2n_exec

    if not on:
        m2n.my_messages = m2n_exec.my_messages
        return

    def doubled(plan, sources, *, rank, sender, cap):
        size = {s.name: dtype_itemsize(s.dtype) for s in sources}
        items = list(plan.items_for_src(rank) if sender else plan.items_for_dst(rank))
        if rank == 0:
            first = next(i for i, it in enumerate(items) if (it.dst_rank if sender else it.src_rank) == 0)
            items.insert(first + 1, items[first])
        return rounds(pair_messages(items, by="dst" if sender else "src", cap=cap, itemsize_of=size.__getitem__))

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
