"""The ``vllm serve`` middleware (``weightsync.integrations.vllm_http``) on plain ASGI calls, no engine:
bad weight-sync bodies are refused with 400 naming the field before the app (vLLM's routes) sees them,
good ones reach it byte for byte, and a worker's out-of-order refusal (HTTP 500 from vLLM) goes out as 409.
Then ``HTTPVLLMWeightSyncClient`` against vLLM's own RL router (FastAPI, loopback) in front of real
receiver processes: vLLM's request types accept our requests and a sync lands bit-exact."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from helpers import init_info, mismatches
from weightsync import HTTPVLLMWeightSyncClient, RemoteCallError
from weightsync.clients import paused
from weightsync.integrations.vllm_http import WeightSyncRequestValidation, validate_request
from weightsync.testing.actors import Actor
from weightsync.testing.cluster import Layout, free_port
from weightsync.testing.receiver import VLLM_CPU_ENV

M2N_INIT = {"master_address": "127.0.0.1", "master_port": 29500, "num_trainer_ranks": 2, "world_size": 3,
            "dst_mesh_dims": [1], "transport": "weightsync_m2n"}
NCCL_INIT = {"master_address": "127.0.0.1", "master_port": 29500, "world_size": 3, "transport": "weightsync_nccl"}
OUT_OF_ORDER_500 = {"error": {"message": "Call to collective_rpc method failed: Worker failed with error 'start_weight_"
                              "update must be called before update_weights.', please check the stack trace above for "
                              "the root cause", "type": "InternalServerError", "param": None, "code": 500}}


class FakeApp:
    """vLLM's app as the middleware sees it: ``state.args.weight_transfer_config``; answers ``reply``."""

    def __init__(self, backend: str | None = "weightsync", reply: tuple[int, dict] = (200, {"message": "ok"})) -> None:
        self.state = SimpleNamespace(args=SimpleNamespace(weight_transfer_config=SimpleNamespace(backend=backend),
                                                          api_server_count=1))
        self.reply, self.bodies = reply, []

    async def __call__(self, scope, receive, send):
        chunks, more = [], True
        while more:
            m = await receive()
            chunks.append(m.get("body", b""))
            more = m.get("more_body", False)
        self.bodies.append(b"".join(chunks))
        status, payload = self.reply
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(payload).encode()})


def call(mw: WeightSyncRequestValidation, app: FakeApp, path: str, body: bytes, chunk: int = 7) -> tuple[int, dict]:
    """POST ``body`` (in ``chunk``-byte pieces) through ``mw``; the status and JSON body sent back."""
    pieces = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1} for i, p in enumerate(pieces)]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(m):
        sent.append(m)

    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "app": app}
    asyncio.run(mw(scope, receive, send))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    return sent[0]["status"], json.loads(sent[1]["body"])


def post(app: FakeApp, path: str, payload, mw: WeightSyncRequestValidation | None = None) -> tuple[int, dict]:
    mw = mw or WeightSyncRequestValidation(app)
    return call(mw, app, path, json.dumps(payload).encode())


@pytest.mark.parametrize("init_info, param, text", [
    ({**M2N_INIT, "bogus": 1}, "bogus", "init_info for M2NWorkerInitInfo: unknown field(s) ['bogus']"),
    ({**M2N_INIT, "master_port": "29500"}, "master_port",
     "init_info for M2NWorkerInitInfo: field 'master_port' must be an int, got '29500'"),
    ({**M2N_INIT, "dst_mesh_dims": [1.5]}, "dst_mesh_dims", "field 'dst_mesh_dims' element 0 must be an int"),
    ({k: v for k, v in NCCL_INIT.items() if k != "world_size"}, "world_size",
     "missing 1 required keyword-only argument: 'world_size'"),
    ({**NCCL_INIT, "master_port": 70000}, "master_port", "init_info.master_port must be a port number in [0, 65535]"),
    ({k: v for k, v in M2N_INIT.items() if k != "transport"}, "transport",
     "init_info.transport must name a weightsync transport for vLLM's 'weightsync' backend"),
    ({**M2N_INIT, "transport": "nccl"}, "transport", "got 'nccl'"),
])
def test_bad_init_info_is_refused_with_400_naming_the_field(init_info, param, text):
    app = FakeApp()
    status, body = post(app, "/init_weight_transfer_engine", {"init_info": init_info})
    assert (status, body["error"]["code"], body["error"]["type"], body["error"]["param"]) == (400, 400,
                                                                                             "BadRequestError", param)
    assert text in body["error"]["message"]
    assert app.bodies == [], "vLLM's route never saw the request"


@pytest.mark.parametrize("payload, param, text", [
    ({"init_info": M2N_INIT, "extra": 1}, "extra",
     "unknown field(s) ['extra'] in the request body; expected ['init_info']"),
    ({}, "init_info", "the request body misses the field 'init_info'"),
    ({"init_info": [M2N_INIT]}, "init_info", "init_info must be a JSON object, got list"),
    ([1], None, "the request body must be a JSON object {'init_info': ...}, got list"),
])
def test_bad_init_body_is_refused(payload, param, text):
    app = FakeApp()
    status, body = post(app, "/init_weight_transfer_engine", payload)
    assert (status, body["error"]["param"], body["error"]["message"]) == (400, param, text) and app.bodies == []


def test_server_backend_of_one_transport_refuses_another_transports_info():
    app = FakeApp(backend="weightsync_m2n")
    status, body = post(app, "/init_weight_transfer_engine", {"init_info": NCCL_INIT})
    assert status == 400 and body["error"]["message"].startswith(
        "init_info.transport is 'weightsync_nccl', but this server's weight-transfer backend is 'weightsync_m2n'")
    assert post(app, "/init_weight_transfer_engine", {"init_info": {**M2N_INIT, "transport": ""}})[0] == 200


def test_good_requests_reach_vllm_byte_for_byte_and_updates_follow_the_initialized_transport():
    app = FakeApp()
    mw = WeightSyncRequestValidation(app)
    init = json.dumps({"init_info": NCCL_INIT}).encode()
    assert call(mw, app, "/init_weight_transfer_engine", init) == (200, {"message": "ok"})
    assert app.bodies == [init] and mw.current == "weightsync_nccl"
    update = {"sync_id": 1, "digest": "d", "names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2, 3]]}
    assert post(app, "/update_weights", {"update_info": update}, mw)[0] == 200
    status, body = post(app, "/update_weights", {"update_info": {**update, "shapes": [["2"]]}}, mw)
    assert (status, body["error"]["param"]) == (400, "shapes")
    assert ("update_info for NCCLUpdateInfo: field 'shapes' element 0 element 0 must be an int"
            in body["error"]["message"])
    status, body = post(app, "/update_weights", {"update_info": [{"sync_id": 1}, {"sync_id": "1"}]}, mw)
    assert (status, body["error"]["param"]) == (400, "sync_id")
    assert "update_info[1] for NCCLUpdateInfo" in body["error"]["message"]
    assert len(app.bodies) == 2, "only the good requests reached vLLM"


def test_update_before_any_init_accepts_any_transports_update_info():
    app = FakeApp()
    assert post(app, "/update_weights", {"update_info": {"sync_id": 1, "chunk": 0, "num_chunks": 1}})[0] == 200
    status, body = post(app, "/update_weights", {"update_info": {"sync_id": 1, "nope": 2}})
    assert status == 400 and "unknown field(s) ['nope']" in body["error"]["message"]


def test_a_failed_init_does_not_change_the_transport_updates_are_checked_against():
    app = FakeApp(reply=(500, {"error": {"message": "boom", "code": 500}}))
    mw = WeightSyncRequestValidation(app)
    assert post(app, "/init_weight_transfer_engine", {"init_info": M2N_INIT}, mw) == (500, {"error": {"message": "boom",
                                                                                                      "code": 500}})
    assert mw.current is None


def test_out_of_order_worker_refusal_is_409_with_the_workers_words():
    app = FakeApp(reply=(500, OUT_OF_ORDER_500))
    status, body = post(app, "/update_weights", {"update_info": {"sync_id": 1}})
    assert (status, body["error"]) == (409, {"message": "start_weight_update must be called before update_weights.",
                                             "type": "ConflictError", "param": None, "code": 409})
    assert post(app, "/start_weight_update", {})[0] == 409


class Raising(FakeApp):
    """A route that lets the engine's error propagate, as vLLM's RL routes do."""

    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error

    async def __call__(self, scope, receive, send):
        raise RuntimeError(self.error)


def test_out_of_order_worker_error_raised_through_the_route_is_409():
    """vLLM's RL routes let the engine's ``RuntimeError`` propagate (Starlette's outermost handler, outside
    every middleware, makes it a 500): the middleware answers 409 for an out-of-order one, re-raises the rest."""
    status, body = post(Raising(OUT_OF_ORDER_500["error"]["message"]), "/finish_weight_update", {"weight_version": "v"})
    assert (status, body["error"]["message"]) == (409, "start_weight_update must be called before update_weights.")
    with pytest.raises(RuntimeError, match="disk on fire"):
        post(Raising("disk on fire"), "/start_weight_update", {})


def test_other_failures_and_other_backends_pass_through():
    app = FakeApp(reply=(500, {"error": {"message": "disk on fire", "code": 500}}))
    assert post(app, "/start_weight_update", {}) == (500, {"error": {"message": "disk on fire", "code": 500}})
    vllm_own = FakeApp(backend="nccl")
    assert post(vllm_own, "/init_weight_transfer_engine", {"init_info": {"anything": "goes"}})[0] == 200
    other_route = FakeApp()
    assert post(other_route, "/v1/completions", {"prompt": [1, 2]})[0] == 200


def test_validate_request_returns_the_transport_an_init_names():
    body = json.dumps({"init_info": M2N_INIT}).encode()
    assert validate_request("/init_weight_transfer_engine", body, "weightsync") == "weightsync_m2n"
    assert validate_request("/init_weight_transfer_engine", body, "weightsync_m2n") == "weightsync_m2n"
    assert validate_request("/init_weight_transfer_engine", b"not json", "nccl") is None


# --- HTTPVLLMWeightSyncClient through vLLM's RL routes ------------------------------------------------

@pytest.fixture(scope="module")
def http_server(cluster):
    layout = Layout(trainers=2, tp=2, replicas=1, backend="weightsync_m2n")
    cluster.setup(layout)
    actor = Actor("http", VLLM_CPU_ENV)
    port = free_port()
    actor.call("weightsync.testing.client:serve_http", [[a.address for a in cluster.active_receivers]], port)
    yield f"http://127.0.0.1:{port}", actor, layout
    actor.close()


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_sync_through_vllm_http_routes_is_bit_exact(cluster, http_server):
    url, actor, layout = http_server
    cluster.make_engines(init_info("weightsync_m2n", layout), source="local", client=HTTPVLLMWeightSyncClient(url))
    cluster.train_step(3)
    cluster.sync(weight_version="http-v1")
    assert mismatches(cluster) == {}
    assert cluster.client().weight_versions() == ["http-v1", "http-v1"]
    calls = actor.call("weightsync.testing.client:http_calls")
    assert calls[0] == ("init", "WeightTransferInitRequest")
    assert calls[-3:] == [("start",), ("update", "WeightTransferUpdateRequest"), ("finish", "http-v1")]


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_http_errors_carry_status_and_pause_modes_reach_vllm(http_server):
    url, actor, _ = http_server
    client = HTTPVLLMWeightSyncClient(url)
    with pytest.raises(RemoteCallError, match=r"POST .*/update_weights -> HTTP 422"):
        client._post("update_weights", {"wrong": 1})  # vLLM's own validation rejects the body
    with paused(client, mode="wait", clear_cache=False):
        pass
    assert actor.call("weightsync.testing.client:http_calls")[-2:] == [("pause", "wait", False), ("resume",)]
    with pytest.raises(ValueError, match=r"mode must be one of \('abort', 'wait', 'keep'\), got 'drain'"):
        client.pause_generation(mode="drain")
    with pytest.raises(ValueError, match="base_url must be http"):
        HTTPVLLMWeightSyncClient("localhost:8000")
