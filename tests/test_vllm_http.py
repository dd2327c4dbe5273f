"""The ``vllm serve`` middleware (``weightsync.integrations.vllm_http``) on plain ASGI calls, no engine:
bad weight-sync bodies are refused with 400 naming the field before the app (vLLM's routes) sees them,
good ones reach it byte for byte, and a worker's out-of-order refusal (HTTP 500 from vLLM) goes out as 409.
Then ``HTTPVLLMWeightSyncClient`` against vLLM's own RL router (FastAPI, loopback) in front of real
receiver processes: vLLM's request types accept our requests and a sync lands bit-exact."""

from __future__ import annotations

import asyncio
import http.server
import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from helpers import init_info, mismatches
from weightsync import HTTPVLLMWeightSyncClient, RemoteCallError
from weightsync.clients import paused
from weightsync.integrations.vllm_http import WeightSyncRequestValidation, validate_request
from weightsync.registry import transport
from weightsync.testing.actors import Actor, RemoteError
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
                                                          api_server_count=1, host="127.0.0.1"))
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


# --- limits, the token, init during an update, malformed inits ---------------------------------------
IPC_INIT = {"master_address": "127.0.0.1", "master_port": 29500, "num_workers": 1, "worker_to_trainer": [0],
            "num_trainer_ranks": 1, "bucket_bytes": 1 << 20, "transport": "weightsync_ipc"}
CUDA_HANDLE = {"kind": "cuda", "handle": "AAAA", "size": 1 << 20, "offset": 0, "ref_counter": "AAAA",
               "ref_counter_offset": 0, "event": None, "event_sync_required": True}


def ipc_update(**handle):
    return {"sync_id": 1, "chunk": 0, "num_chunks": 1,
            "handles": {"0": {"trainer_rank": 0, "handle": {"cuda:GPU-0": {**CUDA_HANDLE, **handle}}}}}


def raw_call(mw, app, path: str, body: bytes, headers: list | None = None) -> tuple[int, dict]:
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(m):
        sent.append(m)

    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "app": app, "headers": headers or []}
    asyncio.run(mw(scope, receive, send))
    return sent[0]["status"], json.loads(sent[1]["body"])


@pytest.mark.parametrize("init_info, param, text", [
    ({**IPC_INIT, "bucket_bytes": 1 << 60}, "bucket_bytes", "init_info.bucket_bytes must be in [1, 1125899906842624]"),
    ({**M2N_INIT, "dst_mesh_dims": [0]}, "dst_mesh_dims", "init_info.dst_mesh_dims[0] must be in [1, 1048576], got 0"),
    ({**M2N_INIT, "num_trainer_ranks": 1 << 40}, "num_trainer_ranks", "must be in [1, 1048576]"),
    ({**NCCL_INIT, "timeout_s": 0}, "timeout_s", "init_info.timeout_s must be in (0, 604800] seconds, got 0"),
    ({**NCCL_INIT, "engine_index": 1 << 70}, "engine_index", "init_info.engine_index must be in [0, 1048576]"),
])
def test_init_numbers_out_of_range_are_400_naming_the_field(init_info, param, text):
    app = FakeApp()
    status, body = post(app, "/init_weight_transfer_engine", {"init_info": init_info})
    assert (status, body["error"]["param"]) == (400, param) and text in body["error"]["message"], body
    assert app.bodies == []


@pytest.mark.parametrize("update, param, text", [
    (ipc_update(size=-1), "size", "update_info.handles.0.handle.cuda:GPU-0.size must be in [1, 1125899906842624], "
                                  "got -1"),
    (ipc_update(size=0), "size", "size must be in [1, 1125899906842624], got 0"),
    (ipc_update(offset=1 << 62), "offset", "offset must be in [0, 1125899906842624], got 4611686018427387904"),
    (ipc_update(ref_counter_offset=-8), "ref_counter_offset", "ref_counter_offset must be in [0,"),
    (ipc_update(size="4096"), "size", "size must be an int, got '4096'"),
    (ipc_update(handle="not base64!"), "handle", "handle is not base64: 'not base64!'"),
    ({**ipc_update(), "handles": {"x": {}}}, "handles", "update_info.handles keys must be worker ranks"),
    ({**ipc_update(), "sync_id": -1}, "sync_id", "update_info.sync_id must be in [0, 9223372036854775807], got -1"),
    ({**ipc_update(), "shapes": [[2, -3]], "names": ["a"], "dtype_names": ["float32"]}, "shapes",
     "update_info.shapes[0][1] must be in [0, 1099511627776], got -3"),
])
def test_ipc_update_sizes_offsets_and_counts_out_of_range_are_400_before_any_worker(update, param, text):
    """IPC ``size``/``offset`` would reach ``torch.UntypedStorage._new_shared_cuda`` on the worker."""
    app = FakeApp()
    mw = WeightSyncRequestValidation(app)
    assert post(app, "/init_weight_transfer_engine", {"init_info": IPC_INIT}, mw)[0] == 200
    status, body = post(app, "/update_weights", {"update_info": update}, mw)
    assert (status, body["error"]["param"]) == (400, param) and text in body["error"]["message"], body
    assert len(app.bodies) == 1, "only the init reached vLLM"
    assert post(app, "/update_weights", {"update_info": ipc_update()}, mw)[0] == 200  # in range: it passes


@pytest.mark.parametrize("body, text", [
    (b'{"init_info": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "the request body nests deeper than 16 levels"),
    (b'{"init_info": ' + b"[" * 17 + b"]" * 17 + b"}", "the request body nests deeper than 16 levels"),
    (json.dumps({"init_info": {**NCCL_INIT, "timeout_s": float("nan")}}).encode(),
     "the request body holds NaN, which is not a JSON number"),
    (json.dumps({"init_info": {**NCCL_INIT, "timeout_s": float("inf")}}).encode(),
     "the request body holds Infinity, which is not a JSON number"),
])
def test_deep_nesting_and_non_finite_numbers_are_400_not_500(body, text):
    app = FakeApp()
    status, reply = call(WeightSyncRequestValidation(app), app, "/init_weight_transfer_engine", body, chunk=1 << 20)
    assert (status, reply["error"]["message"]) == (400, text) and app.bodies == []


def test_a_body_over_the_limit_is_413_and_never_read_to_the_end(monkeypatch):
    app = FakeApp()
    monkeypatch.setenv("WEIGHTSYNC_HTTP_MAX_BODY_BYTES", "1000")
    mw = WeightSyncRequestValidation(app)
    assert mw.max_body_bytes == 1000
    big = json.dumps({"init_info": {**NCCL_INIT, "partial": ["x" * 1000]}}).encode()
    status, body = call(mw, app, "/init_weight_transfer_engine", big, chunk=100)  # chunked, no length
    assert (status, body["error"]["type"]) == (413, "PayloadTooLargeError")
    assert body["error"]["message"] == ("the request body has more than the limit max_body_bytes=1000 bytes "
                                        "(WEIGHTSYNC_HTTP_MAX_BODY_BYTES)")
    status, body = raw_call(mw, app, "/update_weights", b"{}", [(b"content-length", b"5000")])
    assert (status, body["error"]["message"]) == (413, "the request body has 5000 bytes, more than the limit "
                                                       "max_body_bytes=1000 (WEIGHTSYNC_HTTP_MAX_BODY_BYTES)")
    assert app.bodies == []
    assert call(mw, app, "/init_weight_transfer_engine", json.dumps({"init_info": NCCL_INIT}).encode())[0] == 200
    with pytest.raises(ValueError, match="max_body_bytes must be an int >= 1, got 0"):
        WeightSyncRequestValidation(app, max_body_bytes=0)


def test_init_while_an_update_is_active_is_409_until_it_finishes():
    app = FakeApp()
    mw = WeightSyncRequestValidation(app)
    init = {"init_info": NCCL_INIT}
    assert post(app, "/init_weight_transfer_engine", init, mw)[0] == 200
    assert post(app, "/start_weight_update", {}, mw)[0] == 200 and mw.active
    status, body = post(app, "/init_weight_transfer_engine", init, mw)
    assert (status, body["error"]["type"]) == (409, "ConflictError")
    assert body["error"]["message"].startswith("init_weight_transfer_engine refused: a weight update is active on "
                                               "this server (started, not finished)")
    assert len(app.bodies) == 2, "the init never reached vLLM"
    assert post(app, "/finish_weight_update", {}, mw)[0] == 200 and not mw.active
    assert post(app, "/init_weight_transfer_engine", init, mw)[0] == 200
    failing = FakeApp(reply=(500, {"error": {"message": "disk on fire", "code": 500}}))
    mw = WeightSyncRequestValidation(failing)
    mw.active = True  # an update vLLM's worker left when update_weights failed (5xx)
    assert post(failing, "/update_weights", {"update_info": {"sync_id": 1}}, mw)[0] == 500 and not mw.active


def test_the_token_guards_the_weight_transfer_routes_only():
    app = FakeApp()
    mw = WeightSyncRequestValidation(app, token="s3cret")
    body = json.dumps({"init_info": NCCL_INIT}).encode()
    status, reply = raw_call(mw, app, "/init_weight_transfer_engine", body)
    assert (status, reply["error"]["type"]) == (401, "UnauthorizedError")
    assert reply["error"]["message"] == ("/init_weight_transfer_engine needs the weight-transfer token: send it in "
                                         "the X-Weightsync-Token header (none sent)")
    status, reply = raw_call(mw, app, "/collective_rpc", b"{}", [(b"x-weightsync-token", b"s3cre")])
    assert status == 401 and reply["error"]["message"].endswith("(wrong token)")
    assert app.bodies == []
    assert raw_call(mw, app, "/init_weight_transfer_engine", body, [(b"x-weightsync-token", b"s3cret")])[0] == 200
    assert raw_call(mw, app, "/v1/completions", b"{}")[0] == 200  # generation needs no token
    assert app.bodies == [body, b"{}"]


def test_the_token_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_HTTP_TOKEN", "from-env")
    assert WeightSyncRequestValidation(FakeApp()).token == b"from-env"
    monkeypatch.setenv("WEIGHTSYNC_HTTP_TOKEN", "")
    assert WeightSyncRequestValidation(FakeApp()).token is None


def test_the_client_sends_the_token():
    client = HTTPVLLMWeightSyncClient("http://127.0.0.1:1", token="s3cret")
    assert client._headers()["X-Weightsync-Token"] == "s3cret"
    assert "X-Weightsync-Token" not in HTTPVLLMWeightSyncClient("http://127.0.0.1:1")._headers()


def test_a_server_that_is_gone_fails_the_call_without_waiting_for_the_others():
    """One of two servers is gone (nothing listens), the other holds the request until released: the
    call raises at once, naming the gone one, as a dead replica should fail a sync without waiting out
    ``timeout_s`` on the live ones."""
    release, arrived = threading.Event(), threading.Event()

    class Holding(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            arrived.set()
            release.wait(120)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Holding)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    gone = free_port()
    client = HTTPVLLMWeightSyncClient([f"http://127.0.0.1:{server.server_port}", f"http://127.0.0.1:{gone}"],
                                      timeout_s=120)
    try:
        started = time.monotonic()
        with pytest.raises(RemoteCallError, match=f"POST http://127.0.0.1:{gone}/start_weight_update failed"):
            client.start_weight_update()
        assert time.monotonic() - started < 60  # the live server holds its request for 120 s
        assert arrived.wait(60)
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def test_a_refused_init_info_connects_nowhere():
    """The worker used to report a refused info to the host and port it named: anyone who could post an
    init could make every worker connect to any address. Now nothing connects out."""
    import torch

    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        port = server.getsockname()[1]
        engine = transport("weightsync_m2n").worker_engine(None, None, torch.device("cpu"), torch.nn.Linear(1, 1))
        for bad in ({**M2N_INIT, "master_port": port, "bogus": 1}, {**M2N_INIT, "master_port": port,
                                                                    "transport": "weightsync_nccl"}):
            with pytest.raises(ValueError, match="bogus|init_info.transport is 'weightsync_nccl'"):
                engine.parse_init_info(bad)
        with pytest.raises(BlockingIOError):  # the report, had there been one, connected before the raise
            server.accept()


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
    assert calls[-5:] == [("pause", "abort", True), ("start",), ("update", "WeightTransferUpdateRequest"),
                          ("finish", "http-v1"), ("resume",)]  # the harness syncs inside clients.paused


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


# --- issue 56: every engine-changing route under the token, abort read from the parsed body, no stall ----
ENGINE_ROUTES = ["/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
                 "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache", "/start_profile", "/stop_profile",
                 "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/scale_elastic_ep"]


@pytest.mark.parametrize("path", ENGINE_ROUTES)
def test_weight_cache_profile_lora_and_scaling_routes_answer_401_without_the_token(path):
    app = FakeApp()
    mw = WeightSyncRequestValidation(app, token="s3cret")
    status, reply = raw_call(mw, app, path, b"{}")
    assert (status, reply["error"]["type"]) == (401, "UnauthorizedError"), reply
    assert reply["error"]["message"].startswith(f"{path} needs the weight-transfer token")
    assert app.bodies == [], "nothing reached vLLM"


@pytest.mark.parametrize("host", [None, "0.0.0.0", "10.1.2.3", "::", "node7.cluster"])
def test_a_server_bound_beyond_loopback_refuses_engine_routes_without_a_token_unless_allowed(host, monkeypatch):
    monkeypatch.delenv("WEIGHTSYNC_HTTP_ALLOW_NO_TOKEN", raising=False)
    app = FakeApp()
    app.state.args.host = host
    status, reply = raw_call(WeightSyncRequestValidation(app, token=""), app, "/reset_prefix_cache", b"{}")
    assert (status, reply["error"]["type"]) == (403, "ForbiddenError"), reply
    assert f"this server listens on {host or '0.0.0.0'}, not on loopback, and no weight-transfer token is set: set " \
           "WEIGHTSYNC_HTTP_TOKEN" in reply["error"]["message"]
    assert raw_call(WeightSyncRequestValidation(app, token=""), app, "/v1/completions", b"{}")[0] == 200
    monkeypatch.setenv("WEIGHTSYNC_HTTP_ALLOW_NO_TOKEN", "1")
    assert raw_call(WeightSyncRequestValidation(app, token=""), app, "/reset_prefix_cache", b"{}")[0] == 200
    app.state.args.host = "127.0.0.1"
    monkeypatch.delenv("WEIGHTSYNC_HTTP_ALLOW_NO_TOKEN")
    assert raw_call(WeightSyncRequestValidation(app, token=""), app, "/reset_prefix_cache", b"{}")[0] == 200


def test_an_escaped_abort_leaves_resume_at_409():
    """``"ab\\u006frt"`` is the field ``abort`` to vLLM's JSON parser: the middleware reads it the same way."""
    app = FakeApp()
    mw = WeightSyncRequestValidation(app)
    assert post(app, "/init_weight_transfer_engine", {"init_info": NCCL_INIT}, mw)[0] == 200
    assert post(app, "/start_weight_update", {}, mw)[0] == 200
    escaped = b'{"update_info": {"sync_id": 1, "digest": "", "verify": false, "ab\\u006frt": "gave up"}}'
    assert json.loads(escaped)["update_info"]["abort"] == "gave up"
    assert call(mw, app, "/update_weights", escaped)[0] == 200
    assert post(app, "/finish_weight_update", {}, mw)[0] == 200
    status, body = post(app, "/resume", {}, mw)
    assert (status, body["error"]["type"]) == (409, "ConflictError"), body
    assert "the trainer aborted the update: gave up" in body["error"]["message"]


def test_a_large_body_is_validated_off_the_event_loop():
    """A request that arrives once a 14 MiB update's body is read completes before that update reaches
    vLLM: its validation runs in a thread (an ordering check, not a time bound)."""
    app = FakeApp()
    mw = WeightSyncRequestValidation(app)
    order: list[str] = []
    body = json.dumps({"update_info": {"sync_id": 1, "digest": "d" * (14 << 20), "verify": False}}).encode()

    async def main() -> None:
        read = asyncio.Event()
        pieces = [body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20)]

        async def receive():
            if not pieces:
                return {"type": "http.disconnect"}
            piece = pieces.pop(0)
            if not pieces:
                read.set()
            return {"type": "http.request", "body": piece, "more_body": bool(pieces)}

        async def send(m):
            if m["type"] == "http.response.start":
                order.append(f"update answered {m['status']}")

        async def other_request() -> None:
            await read.wait()
            order.append("other request done")

        scope = {"type": "http", "method": "POST", "path": "/update_weights", "root_path": "", "app": app}
        await asyncio.gather(mw(scope, receive, send), other_request())

    asyncio.run(main())
    assert order == ["other request done", "update answered 200"]
    assert app.bodies == [body]


def test_a_workers_refusal_of_an_unannounced_finish_is_403_and_the_update_stays_tracked():
    refusal = {"error": {"message": "Call to collective_rpc method failed: Worker failed with error 'worker 0 refuses "
                                    "this finish: a call its trainer session did not announce; it is bound to trainer "
                                    "session 'a', whose store announces no such call, not sync 1', please check the "
                                    "stack trace above for the root cause", "code": 500}}
    app = FakeApp(reply=(500, refusal))
    mw = WeightSyncRequestValidation(app)
    mw.active = True  # a trainer's update, live
    status, body = post(app, "/finish_weight_update", {"weight_version": "rogue"}, mw)
    assert (status, body["error"]["type"]) == (403, "ForbiddenError"), body
    assert body["error"]["message"].startswith("worker 0 refuses this finish: a call its trainer session did not")
    assert mw.active, "the live update is still tracked: an init during it is still answered 409"


# --- issue 58: a token the server refuses is ``Unauthorized`` naming the token, on every trainer rank --------
def _guarded_server(cluster, actor, token: str) -> str:
    """A second HTTP front to the cluster's receivers that requires ``token``; its URL."""
    port = free_port()
    actor.call("weightsync.testing.client:serve_http", [[a.address for a in cluster.active_receivers]], port,
               token=token)
    return f"http://127.0.0.1:{port}"


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_a_missing_or_wrong_token_is_unauthorized_naming_it(cluster, http_server):
    from weightsync import Refused, Unauthorized

    url, actor, layout = http_server
    guarded = _guarded_server(cluster, actor, "s3cret")
    for token, sent in ((None, "sent no token"), ("wrong", "sent a token that is not the server's")):
        with pytest.raises(Unauthorized) as e:
            HTTPVLLMWeightSyncClient(guarded, token=token).pause_generation()
        assert isinstance(e.value, Refused) and isinstance(e.value, RemoteCallError)
        assert str(e.value).startswith(f"POST {guarded}/pause?mode=abort&clear_cache=true -> HTTP 401: the server "
                                       f"requires its weight-transfer token and this client {sent}: pass "
                                       "token=<the server's WEIGHTSYNC_HTTP_TOKEN> to HTTPVLLMWeightSyncClient "
                                       "(server said: "), str(e.value)
    cluster.make_engines(init_info("weightsync_m2n", layout), source="local",
                         client=HTTPVLLMWeightSyncClient(guarded, token="s3cret"))
    cluster.train_step(4)
    cluster.sync(weight_version="token-v1")
    assert mismatches(cluster) == {}
    assert cluster.client().weight_versions() == ["token-v1", "token-v1"]


@pytest.mark.vllm
@pytest.mark.timeout(900)  # (run alone, the module's cluster and HTTP front start within it)
def test_a_missing_token_at_trainer_init_is_unauthorized_on_every_rank(cluster, http_server):
    url, actor, layout = http_server
    guarded = _guarded_server(cluster, actor, "s3cret")
    info = init_info("weightsync_m2n", layout, timeout_s=120.0)  # drawn once: every rank needs the same master_port
    futs = [a.submit("weightsync.testing.trainer:make_engine", info, HTTPVLLMWeightSyncClient(guarded),
                     source="local") for a in cluster.active_trainers]
    for f in futs:  # every rank: the client's own error, not "DataPlaneError: a party failed ... HTTP 401"
        with pytest.raises(RemoteError) as e:
            f.result(timeout=60)  # at once: well within timeout_s, which no rank waits out
        first = str(e.value).splitlines()[0].split(" failed: ", 1)[1]
        assert first.startswith(f"Unauthorized: POST {guarded}/init_weight_transfer_engine -> HTTP 401: the server "
                                "requires its weight-transfer token and this client sent no token: pass token=<the "
                                "server's WEIGHTSYNC_HTTP_TOKEN>"), first
