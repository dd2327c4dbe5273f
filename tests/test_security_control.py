"""Hardening of the control flow (issue 34 items 4, 6, 9, 10): trainer sessions are fenced from each
other, a failed finish is reported rather than raised into vLLM, a delta base that vLLM changed is
dropped, and a stuck-but-alive worker makes every trainer rank raise within ``timeout_s``."""

from __future__ import annotations

import time

import pytest
import torch

from helpers import mismatches, until
from weightsync import RemoteCallError
from weightsync.testing.actors import RemoteError
from weightsync.testing.faults import JsonRoundTripClient

pytestmark = [pytest.mark.timeout(600)]
TIMEOUT_S = 20.0


# ---- fencing, finish, delta base (issue 34 items 4, 9, 10) ----------------------------------------
_NCCL = dict(trainers=2, tp=2, backend="weightsync_nccl")


def _on(actor, code: str) -> None:
    actor.call("builtins:exec", code, {})


def _active(actor) -> bool:
    expr = "__import__('weightsync.testing.actors', fromlist=['STATE']).STATE['active']"
    return actor.call("builtins:eval", expr, {})


@pytest.mark.vllm
def test_a_failed_applier_finish_is_reported_on_the_store_not_raised_into_vllm(cluster):
    from helpers import init_info, mismatches
    from weightsync.testing.cluster import Layout

    layout = Layout(**_NCCL)
    cluster.setup(layout)
    worker1 = cluster.active_receivers[1]
    cluster.make_engines(init_info("weightsync_nccl", layout, timeout_s=TIMEOUT_S))
    _on(worker1, "import weightsync.worker.applier as a\na._kept = a.LayerwiseApplier.finish\n"
                 "def broken(self):\n    raise RuntimeError('the applier broke at finish')\n"
                 "a.LayerwiseApplier.finish = broken")
    try:
        futs = [a.submit("weightsync.testing.trainer:send_weights", "v1") for a in cluster.active_trainers]
        for f in futs:  # the worker's own report, not the client's error from vLLM's RPC
            with pytest.raises(RemoteError, match=r"SyncFailed: weight sync 1 failed: worker 1: RuntimeError: "
                                                  r"finish_weight_update of weight sync 1 failed: RuntimeError: "
                                                  r"the applier broke at finish"):
                f.result(timeout=4 * TIMEOUT_S)
    finally:
        _on(worker1, "import weightsync.worker.applier as a\na.LayerwiseApplier.finish = a._kept")
    cluster.make_engines(init_info("weightsync_nccl", layout, timeout_s=TIMEOUT_S))  # re-init recovers
    cluster.sync(weight_version="v2")
    assert mismatches(cluster) == {}


_LOAD_NORM = ("import torch\nfrom weightsync.testing.actors import STATE\n"
              "from weightsync.testing.receiver import _ctx\n"
              "m = STATE['model']\nw = dict(m.named_parameters())['model.norm.weight']\n"
              "with _ctx():\n    m.load_weights([('model.norm.weight', torch.full_like(w, 0.5))])")


@pytest.mark.vllm
def test_vllm_load_weights_drops_the_delta_base_so_the_next_delta_is_refused_not_patched(cluster):
    from helpers import init_info, mismatches
    from weightsync.testing.cluster import Layout

    layout = Layout(**_NCCL)
    cluster.setup(layout)
    info = init_info("weightsync_nccl", layout, timeout_s=TIMEOUT_S, delta=True)
    cluster.make_engines(info)
    cluster.sync(weight_version="dense")
    cluster.train_step(5, lr=1e-4)
    assert cluster.sync(weight_version="delta")["delta"]["base"] == 1  # a delta against sync 1
    _on(cluster.active_receivers[0], _LOAD_NORM)  # vLLM's own load_weights, on the live model
    cluster.train_step(6, lr=1e-4)
    futs = [a.submit("weightsync.testing.trainer:send_weights", "patched") for a in cluster.active_trainers]
    for f in futs:
        with pytest.raises(RemoteError, match=r"weight sync 3 failed: worker 0: ValueError: update_info\.delta_base "
                                              r"is sync 2, but worker 0 holds no complete sync \(vLLM changed its "
                                              r"weights since weight sync 2 \(load_weights, reload_weights or a "
                                              r"level-2 sleep\)"):
            f.result(timeout=4 * TIMEOUT_S)
    cluster.make_engines(info)  # after re-init the first sync is dense: exact again
    stats = cluster.sync(weight_version="dense again")
    assert stats["delta"] is None or stats["delta"]["base"] is None
    assert mismatches(cluster) == {}


def test_the_fingerprint_sees_load_weights_and_new_tensors_not_reads():
    from weightsync.worker.agreement import fingerprint, weights_changed

    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.LayerNorm(30)).to(torch.bfloat16)
    before = fingerprint(model)
    model(torch.randn(2, 40, dtype=torch.bfloat16))
    model[1].weight.data.copy_(model[1].weight.data.clone())  # the same values again: still the base
    assert not weights_changed(before, model)
    model[0].weight.data.copy_(torch.randn(30, 40))  # as vLLM's loaders write: through .data, no version bump
    assert weights_changed(before, model)
    before = fingerprint(model)
    model[1].weight = torch.nn.Parameter(model[1].weight.detach().clone())  # reload_weights' fresh tensors
    assert weights_changed(before, model)


def test_the_fingerprint_samples_each_dtype_in_order_and_never_formats_a_tensor(monkeypatch):
    """It runs at every worker start and finish: sorting its samples with ``key=str`` once formatted every
    sampled tensor as text (~10 ms per call on the 268 MB benchmark model)."""
    from weightsync.worker.agreement import fingerprint, weights_changed

    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.LayerNorm(30).to(torch.bfloat16))

    def no_text(self):
        raise AssertionError("the fingerprint formatted a tensor")

    monkeypatch.setattr(torch.Tensor, "__repr__", no_text)
    before = fingerprint(model)
    assert [len(s) for s in before[1]] == [2 * 17 * 2, 2 * 17 * 4]  # bfloat16 then float32: 17 values a parameter
    assert not weights_changed(before, model)
    model[1].bias.data[-1] += 1  # the last value is always sampled
    assert weights_changed(before, model)


def _trainer_b(layout, **fields):
    """A second trainer (one rank, in this process) for the same engines, with the model's architecture."""
    from transformers import AutoModelForCausalLM

    from helpers import init_info
    from weightsync import FullTensorSource, WeightTransferTrainerFactory
    from weightsync.integrations.fsdp2.model import load_hf_config
    from weightsync.testing.cluster import Layout, model_config_dir

    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(load_hf_config(model_config_dir(layout.model)), dtype=torch.float32)
    info = init_info("weightsync_nccl", Layout(trainers=1, tp=layout.tp), timeout_s=TIMEOUT_S, **fields)
    return model, lambda client: WeightTransferTrainerFactory.trainer_init(info, client=client,
                                                                            source=FullTensorSource(model))


class GatedClient(JsonRoundTripClient):
    """Trainer A's client: its update call waits until the file ``gate`` exists (meanwhile A's update is
    started, live, on every worker), then goes on."""

    def __init__(self, inner, gate: str) -> None:
        super().__init__(inner)
        self.gate = gate

    def update_weights(self, update_info):
        import os

        until(lambda: os.path.exists(self.gate), "the test opens the gate", 3 * TIMEOUT_S)
        super().update_weights(update_info)


_INFO = ("(lambda e: __import__('dataclasses').asdict(getattr(e, 'engine', e).info))"
         "(__import__('weightsync.testing.actors', fromlist=['STATE']).STATE['engine'])")


@pytest.mark.vllm
def test_a_second_trainer_is_refused_and_leaves_the_first_ones_live_update_alone(cluster, tmp_path):
    """Issues 34 and 56: while trainer A's update is live, B's init, an init repeating A's session, a finish,
    an abort and an update without A's session (or with another) are refused; A's update lands as A sends it.
    Then a start A never announced is refused, and A's next sync lands."""
    from helpers import mismatches
    from weightsync.testing.cluster import Layout

    layout = Layout(**_NCCL)
    cluster.setup(layout)
    gate = tmp_path / "go"
    cluster.make_engines(cluster.init_info(timeout_s=3 * TIMEOUT_S), client=GatedClient(cluster.client(), str(gate)))
    futs = [a.submit("weightsync.testing.trainer:send_weights", "A's") for a in cluster.active_trainers]
    until(lambda: all(_active(a) for a in cluster.active_receivers), "trainer A's update started", TIMEOUT_S)
    client = cluster.client()
    _, init_b = _trainer_b(layout)
    with pytest.raises(ValueError, match=r"worker \d is bound to trainer session '[0-9a-f]{16}': the init of trainer "
                                         r"session '[0-9a-f]{16}' is refused until '[0-9a-f]{16}' shuts down its "
                                         r"engines \(or the new init asks take_over=True"):
        init_b(client)
    a_info = cluster.active_receivers[0].call("builtins:eval", _INFO, {})
    with pytest.raises(RemoteCallError, match=r"an init repeating session '[0-9a-f]{16}' is refused"):
        client.init_weight_transfer_engine(a_info)  # a copied init info: A's own session
    with pytest.raises(RemoteCallError, match=r"worker \d refuses this finish: a call its trainer session did not "
                                              r"announce; it is bound to trainer session '[0-9a-f]{16}', whose store "
                                              r"announces no such call, not sync 1"):
        client.finish_weight_update("rogue")
    for session in ("", "b0b0b0b0b0b0b0b0"):  # no session, another one: ignored (vLLM keeps the update live)
        for update in ({"abort": "rogue", "sync_id": 1, "session": session}, {"sync_id": 1, "session": session}):
            client._fan("update_weights", update)  # (straight to the workers: not the client's own tracking)
    assert all(_active(a) for a in cluster.active_receivers)
    gate.touch()
    for f in futs:
        f.result(timeout=4 * TIMEOUT_S)
    assert mismatches(cluster) == {}
    assert client.weight_versions() == ["A's"] * layout.num_workers
    with pytest.raises(RemoteCallError, match=r"worker \d refuses this start: a call its trainer session did not "
                                              r"announce; it is bound to trainer session '[0-9a-f]{16}', whose store "
                                              r"announces start of sync 1 by trainer session '[0-9a-f]{16}', not a "
                                              r"sync after 1"):
        client.start_weight_update()
    assert not any(_active(a) for a in cluster.active_receivers)
    cluster.train_step(8)
    cluster.sync(weight_version="still A's", verify=True)
    assert mismatches(cluster) == {}


class HoldingClient(JsonRoundTripClient):
    """Trainer A's client: holds its update (the workers' update is active, started) until a failure is
    reported on A's store, then gives up."""

    def update_weights(self, update_info):
        from weightsync.testing.actors import STATE

        until(lambda: STATE["engine"].comm.peer_error() is not None, "a failure on trainer A's store", TIMEOUT_S)


@pytest.mark.vllm
def test_a_take_over_waits_then_aborts_the_first_trainers_update_as_its_failure(cluster):
    from weightsync.testing.cluster import Layout

    layout = Layout(**_NCCL)
    cluster.setup(layout)
    cluster.make_engines(cluster.init_info(timeout_s=TIMEOUT_S), client=HoldingClient(cluster.client()))
    futs = [a.submit("weightsync.testing.trainer:send_weights", "A's") for a in cluster.active_trainers]
    until(lambda: all(_active(a) for a in cluster.active_receivers), "trainer A's update started", TIMEOUT_S)
    model, init_b = _trainer_b(layout, take_over=True)
    t0 = time.monotonic()
    b = init_b(cluster.client())
    try:
        assert time.monotonic() - t0 >= TIMEOUT_S / 2  # it waited for A's update first
        for f in futs:
            with pytest.raises(RemoteError, match=r"SyncFailed: weight sync 1 failed: worker \d: RuntimeError: trainer "
                                                  r"session '[0-9a-f]{16}' took this engine over \(its init asked "
                                                  r"take_over=True\) while an update of trainer session "
                                                  r"'[0-9a-f]{16}' was active"):
                f.result(timeout=4 * TIMEOUT_S)
        b.send_weights(weight_version="B's")  # B's start finds A's update left active: that one is aborted
        sd = {n: t.detach() for n, t in model.state_dict().items()}
        assert cluster.on_receivers("compare_with_oracle", sd) == [[]] * layout.num_workers
        assert cluster.client().weight_versions() == ["B's"] * layout.num_workers
    finally:
        b.shutdown()
        cluster.on_trainers("shutdown_engine")


@pytest.mark.vllm
@pytest.mark.parametrize("backend", ["weightsync_m2n", "weightsync_nixl"])
def test_a_start_refused_by_one_worker_is_retried_without_poisoning_the_one_it_reached(cluster, backend):
    """A previous trainer left vLLM's update active on worker 1 only: the start reaches worker 0 and is
    refused by worker 1. The trainer aborts before any data moved and starts again; worker 0, which
    received nothing of the sync, is neither poisoned nor refused as a replayed start, and the sync lands."""
    from weightsync.testing.cluster import Layout

    cluster.setup(Layout(trainers=2, tp=2, backend=backend))
    cluster.make_engines(cluster.init_info(timeout_s=TIMEOUT_S))
    cluster.sync(weight_version="v1")
    _on(cluster.active_receivers[1], "from weightsync.testing.actors import STATE\nSTATE['active'] = True")
    cluster.train_step(1)
    try:
        cluster.sync(weight_version="v2")
        assert mismatches(cluster) == {}
        assert cluster.client().weight_versions() == ["v2", "v2"]
    finally:
        cluster.on_trainers("shutdown_engine")


class _LiveStore:
    """The bound session's store, reachable and without a failure."""

    def peer_error(self):
        return None


def test_the_any_transport_backend_fences_before_it_replaces_the_bound_engine():
    from weightsync.infos import WorkerInitInfo
    from weightsync.integrations.vllm_plugin import AnyTransportWorkerEngine
    from weightsync.registry import transport

    shut: list = []
    bound = object.__new__(transport("weightsync_m2n").worker_engine)  # bound to session A over M2N
    bound.info, bound.comm, bound.parallel_config = WorkerInitInfo(master_address="127.0.0.1", master_port=1,
                                                                   session="a" * 16), _LiveStore(), None
    bound.shutdown = lambda: shut.append(True)
    wrapper = object.__new__(AnyTransportWorkerEngine)
    wrapper.engine = bound
    b = {"transport": "weightsync_nccl", "master_address": "127.0.0.1", "master_port": 2, "world_size": 3,
         "session": "b" * 16}
    with pytest.raises(ValueError, match=r"worker 0 is bound to trainer session 'a{16}': the init of trainer session "
                                         r"'b{16}' is refused until 'a{16}' shuts down its engines"):
        wrapper.parse_init_info(b)
    assert wrapper.engine is bound and not shut  # session A's engine is left as it was

# ---- every wait bounded by timeout_s (issue 34 item 6) -------------------------------------------
STUCK_TIMEOUT_S = 8.0
"""The stuck-worker syncs' timeout_s: small, so that waiting it out is cheap, and large enough that a
sync that did not wait for it cannot pass for one that did."""


def _stuck_in(cluster, call: str, fn: str, *args, **kwargs) -> tuple[list[str], dict[int, float]]:
    """Worker 1's next ``call`` hangs (``faults.hang``) while every trainer rank runs ``fn(*args, **kwargs)``,
    which must raise: each rank's error text and seconds from the start until it raised. The worker is
    released on return."""
    import socket

    raised: dict[int, float] = {}
    with socket.create_server(("127.0.0.1", 0)) as release:  # closing it releases the stuck worker
        cluster.active_receivers[1].call("weightsync.testing.faults:hang", call, release.getsockname()[1])
        t0 = time.monotonic()
        futs = [a.submit(fn, *args, **kwargs) for a in cluster.active_trainers]
        for r, f in enumerate(futs):
            f.add_done_callback(lambda _, r=r: raised.setdefault(r, time.monotonic() - t0))
        errors = []
        for f in futs:
            with pytest.raises(RemoteError) as e:
                f.result(timeout=6 * STUCK_TIMEOUT_S)
            errors.append(str(e.value).split("\nTraceback")[0])
    return errors, raised


@pytest.mark.vllm
@pytest.mark.parametrize("call", ["start_weight_update", "update_weights", "finish_weight_update"])
@pytest.mark.parametrize("backend", ["weightsync_m2n", "weightsync_nccl", "weightsync_ipc"])
def test_a_stuck_worker_makes_every_trainer_rank_raise_within_timeout_s(cluster, backend, call):
    """A worker alive but stuck in a client call (``faults.hang``: it answers nothing, its process holds
    its connections) makes every trainer rank raise ``SyncFailed`` after about ``timeout_s``, never
    after the client's own timeout (300 s): each rank's wall-clock from the sync's start is in
    [timeout_s, timeout_s + 5), and generation stays paused (``SyncFailed.stuck``: ``clients.paused``
    does not wait on the stuck engine to resume). Once released, the engines take a re-initialized sync."""
    import re

    from helpers import SOURCES, init_info, mismatches
    from weightsync.testing.cluster import Layout

    layout = Layout(trainers=2, tp=2, backend=backend)
    cluster.setup(layout)
    make = lambda: init_info(backend, layout, timeout_s=STUCK_TIMEOUT_S)  # noqa: E731
    cluster.make_engines(make(), source=SOURCES[backend])
    cluster.sync(weight_version="good")
    errors, raised = _stuck_in(cluster, call, "weightsync.testing.trainer:send_weights", "stuck")
    print(f"{backend} stuck in {call}: every rank raised after", {r: f"{s:.2f} s" for r, s in sorted(raised.items())})
    for err in errors:
        assert "SyncFailed: weight sync 2 failed" in err, err
        # the first failure recorded: a wait that timed out, or a peer of the one that gave up (gloo
        # closes a pair whose operation timed out)
        assert re.search(r"[Tt]imed out|did not return within timeout_s=8.0|Connection closed by peer", err), err
    for r, seconds in raised.items():  # it waited for the timeout (a bound that is real), and not longer
        assert STUCK_TIMEOUT_S <= seconds < STUCK_TIMEOUT_S + 5, (r, seconds)
    # clients.paused did not wait on the stuck engine to resume it: generation stays paused
    assert set(cluster.client().generation_paused().values()) == {True}
    cluster.on_trainers("shutdown_engine")  # (waits for the client calls the failure left running)
    cluster.make_engines(make(), source=SOURCES[backend])
    cluster.sync(weight_version="after", verify=True)
    assert mismatches(cluster) == {}


@pytest.mark.vllm
@pytest.mark.parametrize("backend", ["weightsync_m2n", "weightsync_nccl", "weightsync_ipc"])
def test_a_worker_stuck_in_init_makes_every_trainer_rank_raise_within_timeout_s(cluster, backend):
    """Item 6 for the init: a worker stuck before its ``init_weight_transfer_engine`` reaches the engine
    makes every trainer rank's ``make_engine`` raise within [timeout_s, timeout_s + 5) of its start;
    once released, a re-init on the same layout syncs bit-exact."""
    from helpers import SOURCES, init_info, mismatches
    from weightsync.testing.cluster import Layout

    layout = Layout(trainers=2, tp=2, backend=backend)
    cluster.setup(layout)
    make = lambda: init_info(backend, layout, timeout_s=STUCK_TIMEOUT_S)  # noqa: E731
    errors, raised = _stuck_in(cluster, "init_weight_transfer_engine", "weightsync.testing.trainer:make_engine",
                               make(), cluster.client(), source=SOURCES[backend])  # (one master_port for all)
    print(f"{backend} stuck in init: every rank raised after", {r: f"{s:.2f} s" for r, s in sorted(raised.items())})
    for err in errors:
        assert "timeout_s=8.0" in err or "imed out" in err, err
    for r, seconds in raised.items():
        assert STUCK_TIMEOUT_S <= seconds < STUCK_TIMEOUT_S + 5, (r, seconds)
    cluster.on_trainers("shutdown_engine")
    cluster.make_engines(make(), source=SOURCES[backend])
    cluster.sync(weight_version="after-stuck-init", verify=True)
    assert mismatches(cluster) == {}
