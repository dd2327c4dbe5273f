"""Shared test utilities (the one test helper module; the harness itself is ``weightsync.testing``).

* the pytest side: what is installed, init infos per transport, the cluster's verification, the FSDP2
  rank processes, checkpoints, configs and scripted rollouts;
* inside FSDP2 rank processes (``ranks().run("helpers:NAME")``): negative controls and round trips
  the FSDP2 trainer tests need;
* the single-process reference executor, the specification every transport must match:
  :func:`execute_reference` performs a :class:`~weightsync.plan.transfer.TransferPlan` with plain tensor
  copies, all ranks' tensors in one process (a transport is correct when, for the same plan and inputs,
  its workers' params end up equal to what this writes); :func:`make_local_shards` cuts full tensors into
  each trainer rank's shards and :func:`write_destinations` writes what the destination pieces say a
  param must hold (the plan-free oracle).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from oracle import iter_items
from weightsync.integrations.fsdp2 import LossConfig, ModelConfig, OptimConfig, TrainerConfig
from weightsync.plan.regions import Region, box_slices
from weightsync.plan.transfer import DestPiece, TensorSource, TransferPlan
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


def until(condition: Any, what: str, timeout_s: float) -> None:
    """Wait (bounded by ``timeout_s``) for a condition another process brings about."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def listeners(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) of this host's sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, _, hex_port = local.partition(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.append(address)
    return found


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


# --- the single-process reference executor ------------------------------------------------------

def shard_tensor(full: torch.Tensor, region: Region) -> torch.Tensor:
    """The part of ``full`` (a global tensor) that ``region`` covers, as a view."""
    if full.dim() != region.ndim:
        raise ValueError(f"region {region} has ndim {region.ndim}, tensor has shape {tuple(full.shape)}")
    return full[region.slices()]


def _box(tensor: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...], what: str) -> torch.Tensor:
    """View of ``tensor`` at ``offsets`` of ``sizes``; ValueError if it does not fit."""
    if tensor.dim() != len(sizes) or any(o < 0 or o + s > n for o, s, n in zip(offsets, sizes, tensor.shape)):
        raise ValueError(
            f"{what}: box at offsets {offsets} of sizes {sizes} does not fit a tensor of shape {tuple(tensor.shape)}"
        )
    return tensor[box_slices(offsets, sizes)]


def execute_reference(
    plan: TransferPlan,
    local_shards: Mapping[int, Mapping[str, torch.Tensor]],
    params: Mapping[int, Mapping[str, torch.Tensor]],
) -> None:
    """Copy every item of ``plan`` from ``local_shards[src][name]`` into ``params[dst][param]``.

    ``local_shards[r][name]`` is trainer rank r's local shard of tensor ``name`` (the data of
    its source region); ``params[w][param]`` is worker w's parameter, written in place.
    """
    for item in iter_items(plan):
        try:
            src = local_shards[item.src_rank][item.name]
        except KeyError:
            raise ValueError(f"local_shards has no tensor {item.name!r} for trainer rank {item.src_rank}") from None
        try:
            dst = params[item.dst_rank][item.param]
        except KeyError:
            raise ValueError(f"params has no param {item.param!r} for worker {item.dst_rank}") from None
        sizes = item.region.sizes
        piece = _box(src, item.src_offsets, sizes, f"{item.name!r} on trainer rank {item.src_rank}")
        _box(dst, item.param_offsets, sizes, f"{item.param!r} on worker {item.dst_rank}").copy_(piece)


def make_local_shards(
    full: Mapping[str, torch.Tensor], sources: Sequence[TensorSource]
) -> dict[int, dict[str, torch.Tensor]]:
    """``{rank: {name: shard}}``: each trainer rank's local shard (a clone) of every source tensor."""
    shards: dict[int, dict[str, torch.Tensor]] = {}
    for src in sources:
        tensor = full.get(src.name)
        if tensor is None:
            raise ValueError(f"full has no tensor {src.name!r}")
        if tuple(tensor.shape) != src.shape:
            raise ValueError(f"full[{src.name!r}] has shape {tuple(tensor.shape)}, the source says {src.shape}")
        for rank, region in enumerate(src.regions):
            shards.setdefault(rank, {})[src.name] = shard_tensor(tensor, region).clone()
    return shards


def write_destinations(
    full: Mapping[str, torch.Tensor],
    destinations: Sequence[Sequence[DestPiece]],
    params: Mapping[int, Mapping[str, torch.Tensor]],
) -> None:
    """Write every destination piece straight from the full tensors (the plan-free oracle)."""
    for worker, pieces in enumerate(destinations):
        for piece in pieces:
            try:
                dst = params[worker][piece.param]
            except KeyError:
                raise ValueError(f"params has no param {piece.param!r} for worker {worker}") from None
            region = piece.region
            box = _box(dst, piece.param_offsets, region.sizes, f"{piece.param!r} on worker {worker}")
            box.copy_(shard_tensor(full[piece.name], region))


# --- inside actor processes ------------------------------------------------------------------------
def stderr_to(path: str | None) -> None:
    """In an actor: send this process's stderr (fd 2, where C++ logs too) to the file ``path``, opening
    it with a marker line; None: back to where it went before."""
    import sys

    sys.stderr.flush()
    if path is None:
        saved = STATE.pop("saved_stderr", None)
        if saved is not None:
            os.dup2(saved, 2)
            os.close(saved)
        return
    STATE.setdefault("saved_stderr", os.dup(2))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    os.write(2, f"stderr of pid {os.getpid()} from here\n".encode())
