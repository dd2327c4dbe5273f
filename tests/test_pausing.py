"""Pausing by default (issue 34 item 5; the refusal of an unpaused sync: tests/test_security.py): after a
sync that failed with its weights partly applied (``rollback=False``) the engines stay paused and refuse to
resume until a full sync lands, in the harness's engines and in ``vllm serve``'s middleware; a client that
cannot report pausing is refused unless the init info allows unpaused syncs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from weightsync.errors import Refused
from weightsync.pausing import WeightsPartlyApplied, check_paused, preflight_error

pytestmark = [pytest.mark.timeout(600)]
TIMEOUT_S = 20.0
PARTLY = (r"resume_generation refused: engine 0 \(receiver\d+\): a failed weight sync left its weights partly "
          r"applied \(rollback=False; the trainer aborted the update: .*\); generation stays paused until a full "
          r"sync lands: re-initialize \(trainer_init on every trainer rank\) and sync again")


@pytest.mark.vllm
def test_partly_applied_weights_stay_paused_until_a_full_sync_lands(cluster):
    from helpers import init_info, mismatches
    from test_failures import on_every_trainer
    from weightsync.testing.cluster import Layout

    layout = Layout(trainers=2, tp=2, replicas=2, backend="weightsync_nccl")
    cluster.setup(layout)
    client = cluster.client()
    info = lambda **kw: init_info("weightsync_nccl", layout, buffer_bytes=1 << 16, timeout_s=TIMEOUT_S, **kw)  # noqa: E731
    cluster.make_engines(info())
    cluster.sync(weight_version="good")
    cluster.train_step(6)
    cluster.make_engines(info(), source="full", fault="shape", bucket_bytes=1 << 16)  # fails after data moved
    errors = on_every_trainer(cluster, "weightsync.testing.trainer:send_weights", "torn")  # inside clients.paused
    assert all("the engines' weights may be partly updated (rollback=False)" in e for e in errors), errors
    assert list(client.generation_paused().values()) == [True, True]
    with pytest.raises(WeightsPartlyApplied, match=PARTLY):
        client.resume_generation()
    assert list(cluster.client().generation_paused().values()) == [True, True]  # any client of them sees it
    cluster.make_engines(info(rollback=True))  # a re-init alone does not make the weights whole
    with pytest.raises(WeightsPartlyApplied, match=PARTLY):
        client.resume_generation()
    cluster.sync(weight_version="after", verify=True)  # a full sync lands: clients.paused resumes
    assert mismatches(cluster) == {} and list(client.generation_paused().values()) == [False, False]
    assert cluster.client().weight_versions() == ["after"] * layout.num_workers

def test_a_client_that_cannot_report_pausing_is_refused_unless_allowed():
    class Blind:
        def init_weight_transfer_engine(self, init_info): ...

    engine = SimpleNamespace(init_info=SimpleNamespace(rank=0, require_paused=True), client=Blind())
    with pytest.raises(Refused, match=r"^weight sync refused: the client Blind cannot report whether the engines' "
                                      r"generation is paused \(it has no generation_paused\(\)\)"):
        check_paused(engine)
    check_paused(SimpleNamespace(init_info=SimpleNamespace(rank=0, require_paused=False), client=Blind()))
    check_paused(SimpleNamespace(init_info=SimpleNamespace(rank=1, require_paused=True), client=None))
    assert type(preflight_error("weight sync refused: x")) is Refused
    assert type(preflight_error("parameter 'w': bad")) is ValueError


def test_the_middleware_refuses_resume_while_an_aborted_update_left_weights_partly_applied():
    from test_vllm_http import NCCL_INIT, FakeApp, post
    from weightsync.integrations.vllm_http import WeightSyncRequestValidation

    app = FakeApp()
    mw = WeightSyncRequestValidation(app)
    update = {"sync_id": 1, "digest": "", "verify": False, "abort": None}

    def sync(*, abort: str | None = None) -> None:
        assert post(app, "/start_weight_update", {}, mw)[0] == 200
        assert post(app, "/update_weights", {"update_info": {**update, "abort": abort}}, mw)[0] == 200
        assert post(app, "/finish_weight_update", {}, mw)[0] == 200

    assert post(app, "/init_weight_transfer_engine", {"init_info": NCCL_INIT}, mw)[0] == 200
    sync()
    assert post(app, "/resume", {}, mw) == (200, {"message": "ok"})  # whole weights: it reaches vLLM
    sync(abort="trainer rank 1: RuntimeError: boom")
    reached = len(app.bodies)
    status, body = post(app, "/resume", {}, mw)
    assert status == 409 and body["error"]["type"] == "ConflictError", body
    assert body["error"]["message"] == (
        "resume_generation refused: this server: a failed weight sync left its weights partly applied "
        "(rollback=False; the trainer aborted the update: trainer rank 1: RuntimeError: boom); generation stays "
        "paused until a full sync lands: re-initialize (trainer_init on every trainer rank) and sync again")
    assert len(app.bodies) == reached, "the refused /resume never reached vLLM"
    assert post(app, "/init_weight_transfer_engine", {"init_info": {**NCCL_INIT, "rollback": True}}, mw)[0] == 200
    assert post(app, "/resume", {}, mw)[0] == 409  # a re-init alone does not make the weights whole
    sync(abort="restored")  # under rollback=True an abort restores them: still partly applied from before
    assert post(app, "/resume", {}, mw)[0] == 409
    sync()  # a full sync lands
    assert post(app, "/resume", {}, mw) == (200, {"message": "ok"})
