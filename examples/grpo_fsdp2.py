"""GRPO with weightsync's FSDP2 reference trainer: vLLM samples answers, a rule-based reward scores them,
the FSDP2 trainer takes a step, and the new weights go shard-to-shard into vLLM (``weightsync_m2n``).

4xH100, one node: FSDP2 over GPUs 0-1 (2 Ray actors), one vLLM engine with TP=2 on GPUs 2-3:

    pip install -e '.[vllm,ray]'
    python examples/grpo_fsdp2.py --model Qwen/Qwen3-0.6B --steps 20

CPU, no GPU (1-2 minutes on 2 cores): a tiny random Qwen3 written to a temp dir, 2 FSDP2 ranks over
gloo, scripted rollouts in place of vLLM generation (vLLM cannot generate on CPU), and the real sync
into vLLM's Qwen3 model classes (TP=2 over gloo, in 2 local processes). After every sync each vLLM
rank's parameters are compared bit for bit with vLLM's own ``load_weights`` of the trainer's weights:

    python examples/grpo_fsdp2.py --cpu --steps 3

Each step: generate G answers per prompt -> reward -> ``trainer.train_step(samples)`` (GRPO, k3 KL to
the initial model, entropy bonus) -> ``trainer.sync_weights(engine)``: each trainer rank sends the
pieces of its own FSDP2 shards that each vLLM rank needs, straight into vLLM's parameters; nothing is
gathered on the trainer.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import socket
import tempfile
from dataclasses import replace

import torch
import torch.distributed as dist

from weightsync.integrations.fsdp2 import FSDP2Trainer, LossConfig, ModelConfig, OptimConfig, Sample, TrainerConfig
from weightsync.transport.m2n import M2NTrainerInitInfo

TRAINERS, TP = 2, 2


def trainer_config(path: str, args: argparse.Namespace, *, cpu: bool) -> TrainerConfig:
    return TrainerConfig(
        model=ModelConfig(path=path, param_dtype=None if cpu else "bfloat16"),
        optim=OptimConfig(lr=args.lr, warmup_samples=args.prompts * args.group, weight_decay=0.01, grad_clip=1.0),
        loss=LossConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.01, kl_type="k3", entropy_coef=0.001,
                        old_log_probs="current" if cpu else "rollout"),
        max_tokens_per_micro_batch=4096, device="cpu" if cpu else "cuda")


def print_step(step: int, m: dict, sync_s: float, check: str) -> None:
    print(f"step {step}: reward {m['reward_mean']:.3f} loss {m['loss']:+.4f} pg {m['pg_loss']:+.4f} "
          f"kl {m['kl']:.5f} entropy {m['entropy']:.3f} clip_frac {m['clip_frac']:.3f} "
          f"grad_norm {m['grad_norm']:.3f} lr {m['lr']:.2e} sync {sync_s * 1e3:.0f} ms {check}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# --- 4xH100: Ray actors for the trainer ranks, vLLM on the other two GPUs -------------------------
class TrainerRank:
    """One FSDP2 rank (a Ray actor with one GPU)."""

    def __init__(self, rank: int, addr: str, port: int, config: TrainerConfig) -> None:
        torch.cuda.set_device(0)  # Ray shows this actor only its own GPU
        dist.init_process_group("nccl", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=TRAINERS)
        self.trainer = FSDP2Trainer(config)

    def connect(self, info: M2NTrainerInitInfo, llm) -> None:
        from weightsync import RayVLLMWeightSyncClient

        self.engine = self.trainer.connect(replace(info, rank=self.trainer.rank), RayVLLMWeightSyncClient(llm))

    def train_step(self, samples: list[Sample]) -> dict:
        return self.trainer.train_step(samples)

    def sync(self, version: str) -> float:
        return self.trainer.sync_weights(self.engine, weight_version=version).seconds


def arithmetic_reward(text: str, answer: int) -> float:
    """1 if the first number in the answer is right, else 0."""
    found = re.search(r"-?\d+", text)
    return float(found is not None and int(found.group()) == answer)


def run_gpu(args: argparse.Namespace) -> None:
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig

    class VLLMOnBundles(LLM):
        """vLLM whose TP workers land on placement-group bundles 2 and 3 (GPUs 2-3)."""

        def __init__(self, *a, **kw) -> None:
            os.environ["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(TRAINERS + i) for i in range(TP))
            super().__init__(*a, **kw)

    ray.init()
    pg = placement_group([{"GPU": 1, "CPU": 2}] * (TRAINERS + TP))
    ray.get(pg.ready())
    addr, cfg = ray.util.get_node_ip_address(), trainer_config(args.model, args, cpu=False)
    dist_port, store_port = free_port(), free_port()
    on = [PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=r) for r in range(TRAINERS)]
    trainers = [ray.remote(num_gpus=1)(TrainerRank).options(scheduling_strategy=on[r]).remote(r, addr, dist_port, cfg)
                for r in range(TRAINERS)]
    llm = ray.remote(num_gpus=0)(VLLMOnBundles).options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_capture_child_tasks=True)).remote(
        model=args.model, tensor_parallel_size=TP, distributed_executor_backend="ray", dtype="bfloat16",
        gpu_memory_utilization=0.8, weight_transfer_config=WeightTransferConfig(backend="weightsync_m2n"))
    info = M2NTrainerInitInfo(master_address=addr, master_port=store_port, num_trainer_ranks=TRAINERS,
                              world_size=TRAINERS + TP, dst_mesh_dims=(1, TP), device="cuda", rank=0)
    ray.get([t.connect.remote(info, llm) for t in trainers])
    ray.get([t.sync.remote("0") for t in trainers])  # vLLM now serves exactly the trainer's weights
    rng = random.Random(0)
    params = SamplingParams(n=args.group, temperature=1.0, max_tokens=16, logprobs=0)
    for step in range(1, args.steps + 1):
        problems = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(args.prompts)]
        prompts = [f"Q: What is {a} + {b}? Reply with the number only.\nA:" for a, b in problems]
        outputs = ray.get(llm.generate.remote(prompts, params, use_tqdm=False))
        samples = []
        for group, (out, (a, b)) in enumerate(zip(outputs, problems)):
            for c in out.outputs:
                if not c.token_ids:
                    continue
                lps = [pos[tok].logprob for pos, tok in zip(c.logprobs, c.token_ids)]
                samples.append(Sample(list(out.prompt_token_ids), list(c.token_ids),
                                      arithmetic_reward(c.text, a + b), group, lps))
        metrics = ray.get([t.train_step.remote(samples) for t in trainers])[0]
        sync_s = ray.get([t.sync.remote(str(step)) for t in trainers])[0]
        print_step(step, metrics, sync_s, f"vLLM weight version {step}")
    ray.shutdown()


# --- CPU: gloo trainer ranks, vLLM model classes in local processes --------------------------------
def scripted_rollouts(step: int, args: argparse.Namespace, vocab: int) -> list[Sample]:
    """Stand-in for generation: seeded random prompts and answers; the rule rewards low token ids."""
    rng = random.Random(step)
    samples = []
    for group in range(args.prompts):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(4, 10))]
        for _ in range(args.group):
            answer = [rng.randrange(vocab) for _ in range(rng.randint(3, 12))]
            samples.append(Sample(prompt, answer, sum(t < vocab // 2 for t in answer) / len(answer), group))
    return samples


def verify(trainer: FSDP2Trainer, client, version: str) -> str:
    """Every vLLM rank's parameters vs vLLM's ``load_weights`` of the trainer's full weights (collective)."""
    from weightsync.testing.actors import call

    weights = trainer.full_state_dict()
    if trainer.rank != 0:
        return ""
    bad = {a.name: call(a, "weightsync.testing.receiver:compare_with_oracle", weights) for a in client.workers}
    bad = {k: v for k, v in bad.items() if v}
    if bad or client.weight_versions() != [version] * len(client.workers):
        raise RuntimeError(f"after sync {version}: vLLM parameters differ from the trainer's: {bad}")
    return f"verified: {len(client.workers)} vLLM ranks == load_weights(trainer weights)"


def cpu_rank(rank: int, port: int, path: str, info: M2NTrainerInitInfo, client, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TRAINERS)
    trainer = FSDP2Trainer(trainer_config(path, args, cpu=True))
    engine = trainer.connect(replace(info, rank=rank), client)
    trainer.sync_weights(engine, weight_version="0")
    verify(trainer, client, "0")
    for step in range(1, args.steps + 1):
        metrics = trainer.train_step(scripted_rollouts(step, args, trainer.hf_config.vocab_size))
        stats = trainer.sync_weights(engine, weight_version=str(step))
        check = verify(trainer, client, str(step))
        if rank == 0:
            print_step(step, metrics, stats.seconds, check)
    engine.shutdown()
    dist.destroy_process_group()


def run_cpu(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    from weightsync.testing.cluster import Layout, LocalCluster
    from weightsync.testing.fsdp2 import write_checkpoint

    tmp = tempfile.mkdtemp(prefix="grpo-fsdp2-")
    cluster = LocalCluster()
    try:
        path = write_checkpoint(os.path.join(tmp, "tiny_qwen3"), seed=0)  # a seeded random tiny Qwen3
        cluster.setup(Layout(trainers=0, tp=TP, backend="weightsync_m2n", model=path))  # vLLM ranks, TP over gloo
        info = M2NTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), num_trainer_ranks=TRAINERS,
                                  world_size=TRAINERS + TP, dst_mesh_dims=(1, TP), device="cpu", rank=0)
        mp.spawn(cpu_rank, args=(free_port(), path, info, cluster.client(), args), nprocs=TRAINERS)
    finally:
        cluster.close()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="tiny random model, scripted rollouts, vLLM model classes on CPU")
    p.add_argument("--model", default="Qwen/Qwen3-0.6B", help="Hugging Face model (GPU mode)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="answers per prompt (GRPO group size)")
    p.add_argument("--lr", type=float, default=None, help="default 1e-6 (GPU), 1e-3 (CPU)")
    args = p.parse_args()
    if args.lr is None:
        args.lr = 1e-3 if args.cpu else 1e-6
    if args.cpu:
        args.prompts, args.group = min(args.prompts, 4), min(args.group, 4)
        run_cpu(args)
    else:
        run_gpu(args)


if __name__ == "__main__":
    main()
