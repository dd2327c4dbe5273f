"""A local CPU cluster: FSDP2 trainer processes and vLLM receiver processes (TP over gloo).

Used by ``weightsync demo``, the examples' ``--cpu`` modes, the benchmarks and the tests. Processes
are started once and re-laid-out for each scenario (trainer count, TP, replicas, dtype, model),
since each vLLM process costs seconds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from typing import Any

from .actors import Actor, free_port, gather
from .client import LocalWeightSyncClient
from .receiver import VLLM_CPU_ENV

__all__ = ["Layout", "LocalCluster", "model_config_dir", "free_port", "init_info"]

_T = "weightsync.testing.trainer:"
_R = "weightsync.testing.receiver:"


def model_config_dir(name: str) -> str:
    """Directory of a config shipped in ``weightsync/configs`` (or ``name`` itself if it is a path)."""
    if os.path.isdir(name):
        return os.path.abspath(name)
    path = resources.files("weightsync") / "configs" / name
    if not path.joinpath("config.json").is_file():
        raise ValueError(f"model config {name!r} is neither a directory nor one of the shipped configs")
    return str(path)


@dataclass(frozen=True)
class Layout:
    """One scenario: who trains, who serves, in which dtype, on which model."""

    trainers: int = 2
    tp: int = 2
    replicas: int = 1
    dtype: str = "float32"
    model: str = "tiny_qwen3"
    backend: str = "weightsync_nccl"
    seed: int = 0
    fsdp: bool = True
    tp_aligned: bool = False
    """Trainers shard row-parallel weights on dim 1 (``ModelConfig.tp_aligned_shards``)."""
    device: str = "cpu"
    """Receivers' model device; ``"meta"`` builds layouts only (no weights, no transfers)."""
    trainer_model: str | None = None
    """The trainer's model config when it differs from the receivers' (to test mismatches)."""
    trainer_dtype: str | None = None
    """The trainer's dtype when it differs from the receivers' (to test mismatches)."""
    ep: bool = False
    """vLLM's ``enable_expert_parallel``: each worker holds a subset of a MoE layer's experts whole."""
    per_expert: bool = False
    """The trainer's routed experts are per-expert modules (``testing.trainer.split_experts``), not fused 3-D."""

    @property
    def num_workers(self) -> int:
        return self.tp * self.replicas


def init_info(layout: Layout, *, buffer_bytes: int | None = None, **fields: Any) -> Any:
    """The init info of ``layout.backend`` for ``layout``'s deployment on this machine, from the
    registry (``Transport.init_info.for_deployment``): loopback address, a free port, CPU; ``fields``
    (``timeout_s``, ``rollback``, ...) are passed through and override those."""
    from ..registry import transport

    fields = {"master_address": "127.0.0.1", "master_port": free_port(), "device": "cpu", **fields}
    return transport(layout.backend).init_info.for_deployment(
        num_trainer_ranks=layout.trainers, replicas=layout.replicas, tp=layout.tp, buffer_bytes=buffer_bytes, **fields)


class LocalCluster:
    """Holds the actor processes; ``setup(layout)`` (re)builds trainers and receivers."""

    def __init__(self) -> None:
        self.trainers: list[Actor] = []
        self.receivers: list[Actor] = []
        self.layout: Layout | None = None
        self._keys: tuple[Any, Any] | None = None

    def _grow(self, trainers: int, receivers: int) -> None:
        env = {"OMP_NUM_THREADS": "1"}
        while len(self.trainers) < trainers:
            self.trainers.append(Actor(f"trainer{len(self.trainers)}", env))
        while len(self.receivers) < receivers:
            self.receivers.append(Actor(f"receiver{len(self.receivers)}", VLLM_CPU_ENV))
        for a in self.trainers + self.receivers:
            _ = a.address  # all processes start in parallel; wait for each once

    def replace_dead(self) -> list[str]:
        """Start a new process in the slot of every actor that died (a killed or crashed peer);
        returns their names. Call ``setup(..., fresh=True)`` afterwards."""
        dead = []
        for group, env in ((self.trainers, {"OMP_NUM_THREADS": "1"}), (self.receivers, VLLM_CPU_ENV)):
            for i, a in enumerate(group):
                if not a.alive():
                    a.close()
                    group[i] = Actor(a.name, env)
                    dead.append(a.name)
        for a in self.trainers + self.receivers:
            _ = a.address
        self._keys = None
        return dead

    def setup(self, layout: Layout, *, fresh: bool = False) -> None:
        """Build ``layout`` on the processes. A side (trainers or receivers) whose part of the layout
        is unchanged is kept as it is (trained weights and all) unless ``fresh``."""
        if layout.trainers < 0 or layout.tp < 1 or layout.replicas < 1:
            raise ValueError(f"trainers >= 0, tp >= 1 and replicas >= 1 are needed, got {layout}")
        self._grow(layout.trainers, layout.num_workers)
        model_dir = model_config_dir(layout.model)
        trainer_dir = model_config_dir(layout.trainer_model or layout.model)
        tdtype = layout.trainer_dtype or layout.dtype
        tkey = (layout.trainers, tdtype, trainer_dir, layout.seed, layout.fsdp, layout.tp_aligned,
                layout.per_expert)
        rkey = (layout.tp, layout.replicas, layout.dtype, model_dir, layout.backend, layout.device, layout.ep)
        old = self._keys
        self._keys, self.layout = None, None
        futs = []
        if fresh or old is None or old[0] != tkey:
            futs += [a.submit(_T + "teardown") for a in self.trainers]
            tport = free_port()
            futs += [a.submit(_T + "setup", trainer_dir, world=layout.trainers, rank=r, port=tport,
                              dtype=tdtype, seed=layout.seed, fsdp=layout.fsdp, tp_aligned=layout.tp_aligned,
                              per_expert=layout.per_expert)
                     for r, a in enumerate(self.trainers[: layout.trainers])]
        if fresh or old is None or old[1] != rkey:
            gather([a.submit(_R + "teardown") for a in self.receivers])
            for rep in range(layout.replicas):
                rport = free_port()
                for r in range(layout.tp):
                    a = self.receivers[rep * layout.tp + r]
                    futs.append(a.submit(_R + "setup", model_dir, tp=layout.tp, rank=r, replica=rep, port=rport,
                                         dtype=layout.dtype, backend=layout.backend, device=layout.device,
                                         ep=layout.ep))
        gather(futs)
        self._keys, self.layout = (tkey, rkey), layout

    @property
    def active_trainers(self) -> list[Actor]:
        assert self.layout is not None, "setup() first"
        return self.trainers[: self.layout.trainers]

    @property
    def active_receivers(self) -> list[Actor]:
        assert self.layout is not None, "setup() first"
        return self.receivers[: self.layout.num_workers]

    def client(self, timeout_s: float = 300.0) -> LocalWeightSyncClient:
        tp = self.layout.tp if self.layout else 1
        addrs = [a.address for a in self.active_receivers]
        return LocalWeightSyncClient([addrs[i : i + tp] for i in range(0, len(addrs), tp)], timeout_s=timeout_s)

    def on_trainers(self, fn: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``fn`` (a ``weightsync.testing.trainer`` function, or any ``"module:function"``) on every trainer."""
        fn = fn if ":" in fn else _T + fn
        return gather([a.submit(fn, *args, **kwargs) for a in self.active_trainers])

    def on_receivers(self, fn: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``fn`` (a ``weightsync.testing.receiver`` function, or any ``"module:function"``) on every receiver."""
        fn = fn if ":" in fn else _R + fn
        return gather([a.submit(fn, *args, **kwargs) for a in self.active_receivers])

    def init_info(self, *, buffer_bytes: int | None = None, **fields: Any) -> Any:
        """``init_info(layout, ...)`` for the current layout."""
        assert self.layout is not None, "setup() first"
        return init_info(self.layout, buffer_bytes=buffer_bytes, **fields)

    def make_engines(self, init_info: Any, *, source: str | None = None, fault: str | None = None,
                     bucket_bytes: int | None = None, client: Any = None, factory: str = "weightsync",
                     wire_dtype: str | None = None, fuse_experts: bool = False) -> None:
        """``trainer.make_engine`` on every trainer rank (see there for ``source``, ``fault``, ``wire_dtype``,
        ``fuse_experts``); the
        source kind defaults to the one the init info's transport reads (``Transport.source``)."""
        if source is None:
            from ..registry import transport

            source = transport(type(init_info).backend).source
        self.on_trainers("make_engine", init_info, client or self.client(), source=source, fault=fault,
                         bucket_bytes=bucket_bytes, factory=factory, wire_dtype=wire_dtype,
                         fuse_experts=fuse_experts)

    def sync(self, weight_version: str | None = None, *, verify: bool = False) -> dict[str, Any]:
        """``send_weights`` on every trainer rank; returns rank 0's stats."""
        return self.on_trainers("send_weights", weight_version, verify=verify)[0]

    def train_step(self, seed: int, lr: float | None = None) -> float:
        return self.on_trainers("train_step", seed, lr)[0]

    def verify(self) -> dict[str, list[str]]:
        """Receiver name -> parameters that differ from vLLM's ``load_weights`` of the trainer's
        full state dict (all lists empty = bit-exact)."""
        sd = self.on_trainers("full_state_dict")[0]
        bad = self.on_receivers("compare_with_oracle", sd)
        return {a.name: b for a, b in zip(self.active_receivers, bad)}

    def teardown(self) -> None:
        """Release the current layout's groups (processes stay)."""
        futs = [a.submit(_T + "teardown") for a in self.trainers] + [a.submit(_R + "teardown") for a in self.receivers]
        gather(futs)
        self.layout, self._keys = None, None

    def close(self) -> None:
        if self.layout is not None:  # vLLM's groups unlink their shared memory (the actors exit hard)
            futs = [a.submit(_T + "teardown", timeout_s=30) for a in self.trainers if a.alive()]
            futs += [a.submit(_R + "teardown", timeout_s=30) for a in self.receivers if a.alive()]
            for f in futs:
                f.exception()  # best effort: a peer a test killed leaves its group broken
        for a in self.trainers + self.receivers:
            a.close()
        self.trainers, self.receivers, self.layout = [], [], None
