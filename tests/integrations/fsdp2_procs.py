"""Test helpers for the FSDP2 trainer: two long-lived rank processes, and the functions that run in them.

The pytest process calls ``ranks()`` (started once, reused by every test module) and runs
``fsdp2_procs:<function>`` on both ranks concurrently; functions keep the trainer in ``STATE``.
The unsharded fp32 references (``plain_*``) run in the pytest process itself.
"""

from __future__ import annotations

import atexit
import os
import random
from datetime import timedelta
from typing import Any

import torch

from weightsync.integrations.fsdp2 import LossConfig, ModelConfig, OptimConfig, TrainerConfig
from weightsync.local.actors import STATE, Actor, gather
from weightsync.local.cluster import free_port

_M = "fsdp2_procs:"
_RANKS: "Ranks | None" = None
_CKPTS: dict[str, str] = {}


# --- pytest side ----------------------------------------------------------------------------
class Ranks:
    """Two trainer processes; ``run`` calls a function of this module on the given ranks at once."""

    def __init__(self, n: int = 2) -> None:
        self.actors = [Actor(f"fsdp2-rank{r}", {"OMP_NUM_THREADS": "1"}) for r in range(n)]
        self.world = 0

    def run(self, fn: str, *args: Any, ranks: list[int] | None = None, **kwargs: Any) -> list[Any]:
        ranks = list(range(self.world)) if ranks is None else ranks
        return gather([self.actors[r].submit(_M + fn, *args, **kwargs) for r in ranks])

    def init(self, world: int) -> None:
        """(Re)form the default process group over the first ``world`` processes."""
        port = free_port()
        gather([a.submit(_M + "init_group", world, r, port) for r, a in enumerate(self.actors[:world])])
        self.world = world

    def build(self, config: Any) -> None:
        self.run("build", config)

    def close(self) -> None:
        for a in self.actors:
            a.close()


def ranks() -> Ranks:
    global _RANKS
    if _RANKS is None:
        _RANKS = Ranks()
        atexit.register(_RANKS.close)
    return _RANKS


def write_checkpoint(path: str, *, seed: int, config: str = "tiny_qwen3") -> str:
    """A seeded random Hugging Face checkpoint (``save_pretrained``) of a shipped tiny config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from weightsync.local.cluster import model_config_dir

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_config_dir(config)),
                                             dtype=torch.float32)
    model.save_pretrained(path)
    return path


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
           **loss) -> TrainerConfig:
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


# --- inside a rank process ------------------------------------------------------------------
def init_group(world: int, rank: int, port: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    STATE.pop("trainer", None)
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))


def build(config: Any) -> None:
    from weightsync.integrations.fsdp2 import FSDP2Trainer

    STATE.pop("trainer", None)
    STATE["trainer"] = FSDP2Trainer(config)


def call(method: str, *args: Any, **kwargs: Any) -> Any:
    """``trainer.<method>(*args, **kwargs)``."""
    return getattr(STATE["trainer"], method)(*args, **kwargs)


def full_grads() -> dict[str, torch.Tensor] | None:
    """Every parameter's gradient, gathered, on rank 0 (collective)."""
    import torch.distributed as dist

    out = {}
    for name, p in STATE["trainer"].model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()
    return out if dist.get_rank() == 0 else None


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


def pid() -> int:
    return os.getpid()


def connect(init_info: Any, client: Any) -> None:
    """``trainer.connect`` with this rank's copy of ``init_info`` (collective)."""
    import dataclasses

    t = STATE["trainer"]
    STATE["engine"] = t.connect(dataclasses.replace(init_info, rank=t.rank), client)


def sync(weight_version: str) -> int:
    """``trainer.sync_weights(engine)``; returns the bytes this rank sent."""
    return STATE["trainer"].sync_weights(STATE["engine"], weight_version=weight_version).bytes_sent


def shutdown_engine() -> None:
    engine = STATE.pop("engine", None)
    if engine is not None:
        engine.shutdown()


def build_counting_checkpoint_reads(config: Any) -> int:
    """Build the trainer and return how many times this rank read weights with ``from_pretrained``."""
    from transformers import AutoModelForCausalLM

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
