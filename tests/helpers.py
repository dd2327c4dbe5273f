"""Shared test utilities (the one test helper module; the harness itself is ``weightsync.testing``).

* the pytest side: what is installed, init infos per transport, the cluster's verification, the FSDP2
  rank processes, checkpoints, configs and scripted rollouts;
* inside FSDP2 rank processes (``ranks().run("helpers:NAME")``): negative controls and round trips
  the FSDP2 trainer tests need.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import random
from dataclasses import replace
from typing import Any

import torch

from weightsync.integrations.fsdp2 import LossConfig, ModelConfig, OptimConfig, TrainerConfig
from weightsync.registry import transport, transport_names
from weightsync.testing.actors import STATE
from weightsync.testing.cluster import Layout
from weightsync.testing.cluster import init_info as cluster_init_info
from weightsync.testing.fsdp2 import FSDP2Ranks, write_checkpoint

HAS_VLLM = importlib.util.find_spec("vllm") is not None
HAS_CUDA = torch.cuda.is_available()


# --- transports and the local cluster -------------------------------------------------------
TRANSPORTS = transport_names()
"""Every registered transport: end-to-end tests parametrize over these."""
SOURCES = {name: transport(name).source for name in TRANSPORTS}
"""The source kind each transport reads (``make_engines(source=...)``: ``"full"`` or ``"local"``)."""


def init_info(backend: str, layout: Layout, *, buffer_bytes: int = 64 << 10, timeout_s: float = 60.0,
              **fields: Any) -> Any:
    """A valid CPU init info for ``backend`` on ``layout``'s deployment (bucket or staging ``buffer_bytes``)."""
    return cluster_init_info(replace(layout, backend=backend), buffer_bytes=buffer_bytes, timeout_s=timeout_s,
                             **fields)


def mismatches(cluster: Any) -> dict[str, list[str]]:
    """Receiver name -> parameters that differ from vLLM's loader of the trainer's weights (empty: exact)."""
    return {k: v for k, v in cluster.verify().items() if v}


# --- FSDP2 trainer ranks ----------------------------------------------------------------------
_RANKS: FSDP2Ranks | None = None
_CKPTS: dict[str, str] = {}


def ranks() -> FSDP2Ranks:
    """Two FSDP2 rank processes, started once per pytest process and reused by every test module."""
    global _RANKS
    if _RANKS is None:
        _RANKS = FSDP2Ranks(2)
        atexit.register(_RANKS.close)
    return _RANKS


def checkpoints() -> dict[str, str]:
    """Two seeded random tiny-Qwen3 checkpoints, written once per pytest process: ``actor`` (seed 0)
    and ``other`` (seed 1, a reference model that differs from the actor)."""
    if not _CKPTS:
        import shutil
        import tempfile

        root = tempfile.mkdtemp(prefix="fsdp2-ckpts-")
        atexit.register(shutil.rmtree, root, True)
        _CKPTS.update(actor=write_checkpoint(os.path.join(root, "actor"), seed=0),
                      other=write_checkpoint(os.path.join(root, "other"), seed=1))
    return dict(_CKPTS)


def config(ckpts: dict[str, str], *, ref: str | None = None, max_tokens: int = 40, optim: OptimConfig | None = None,
           **loss: Any) -> TrainerConfig:
    """A CPU trainer config on ``ckpts['actor']`` (reference ``ckpts[ref]``), lr 1e-3."""
    return TrainerConfig(model=ModelConfig(path=ckpts["actor"], reference_path=ckpts[ref] if ref else None),
                         loss=LossConfig(**loss), optim=optim or OptimConfig(lr=1e-3), device="cpu",
                         max_tokens_per_micro_batch=max_tokens)


def make_samples(n_groups: int, group_size: int, *, seed: int, vocab: int = 151, zero_rewards: bool = False,
                 with_rollout_log_probs: bool = False) -> list:
    """Scripted rollouts: random prompts (3-9 tokens) and responses (2-12 tokens), rewards in [0, 1]."""
    from weightsync.integrations.fsdp2 import Sample

    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 9))]
        for _ in range(group_size):
            resp = [rng.randrange(vocab) for _ in range(rng.randint(2, 12))]
            lps = [-5.0 + rng.uniform(-0.5, 0.5) for _ in resp] if with_rollout_log_probs else None
            out.append(Sample(prompt, resp, 0.0 if zero_rewards else rng.random(), g, lps))
    return out


# --- inside an FSDP2 rank process ---------------------------------------------------------------
def break_reference_swap_back() -> None:
    """Make the trainer keep the reference weights after the reference log-probs (negative control)."""
    from contextlib import contextmanager

    ref = STATE["trainer"].reference

    @contextmanager
    def swapped_in_and_kept(model):
        ref._exchange(model)
        yield

    ref.swapped_in = swapped_in_and_kept


def _local_state() -> dict[str, torch.Tensor]:
    from weightsync.integrations.fsdp2.offload import local_tensor

    t = STATE["trainer"]
    out = {f"param/{n}": local_tensor(p).clone() for n, p in t.model.named_parameters()}
    names = {id(p): n for n, p in t.model.named_parameters()}
    for p, state in t.optimizer.state.items():
        for k, v in state.items():
            out[f"optim/{names[id(p)]}/{k}"] = local_tensor(v).clone()
    return out


def sleep_wake_round_trip() -> dict[str, Any]:
    """Sleep, record what stayed allocated, wake; compare every shard and optimizer tensor bit for bit."""
    from weightsync.integrations.fsdp2.offload import local_tensor

    t = STATE["trainer"]
    before = _local_state()
    moved = t.sleep()
    allocated = sum(local_tensor(p).untyped_storage().nbytes() for p in t.model.parameters())
    allocated += sum(local_tensor(v).untyped_storage().nbytes() for s in t.optimizer.state.values()
                     for v in s.values())
    try:
        t.train_step([])
        refused = None
    except RuntimeError as e:
        refused = str(e)
    t.wake()
    after = _local_state()
    differ = [k for k in before if before[k].dtype != after[k].dtype or not torch.equal(
        before[k].view(-1).view(torch.uint8), after[k].view(-1).view(torch.uint8))]
    return {"moved": moved, "allocated_while_asleep": allocated, "refused": refused, "differ": differ,
            "tensors": len(before)}


def memory_saver_use(backend: str) -> list[bool]:
    """Run ``sync_weights`` on a stand-in engine with a stand-in ``torch_memory_saver`` installed;
    returns, per ``send_weights`` call, whether the saver's tracking was paused during it."""
    import sys
    import types
    from contextlib import contextmanager

    t = STATE["trainer"]
    region = {"on": True}

    class _Impl:
        class _binary_wrapper:
            class cdll:
                @staticmethod
                def tms_get_interesting_region() -> bool:
                    return region["on"]

    class _Saver:
        _impl = _Impl()

        @contextmanager
        def disable(self):
            region["on"] = False
            try:
                yield
            finally:
                region["on"] = True

    info_cls = type("_Info", (), {"backend": backend, "rank": 0})

    seen: list[bool] = []

    class _Engine:
        init_info = info_cls()
        source = t.weight_source(backend)

        def send_weights(self, *, weight_version=None):
            seen.append(not region["on"])

    module = types.ModuleType("torch_memory_saver")
    module.torch_memory_saver = _Saver()
    sys.modules["torch_memory_saver"] = module
    try:
        t.sync_weights(_Engine())
    finally:
        del sys.modules["torch_memory_saver"]
    return seen


def build_counting_checkpoint_reads(config: Any) -> int:
    """Build the trainer and return how many times this rank read weights with ``from_pretrained``."""
    from transformers import AutoModelForCausalLM

    from weightsync.testing.fsdp2 import build

    original = AutoModelForCausalLM.from_pretrained.__func__
    reads = []

    def counting(cls, *args, **kwargs):
        reads.append(args[0] if args else kwargs.get("pretrained_model_name_or_path"))
        return original(cls, *args, **kwargs)

    AutoModelForCausalLM.from_pretrained = classmethod(counting)
    try:
        build(config)
    finally:
        AutoModelForCausalLM.from_pretrained = classmethod(original)
    return len(reads)


def placements() -> dict[str, str]:
    """Each parameter's FSDP2 placement (``S(0)``, ``S(1)``, ...), from this rank's trainer."""
    return {n: str(p.placements[0]) for n, p in STATE["trainer"].model.named_parameters()}
