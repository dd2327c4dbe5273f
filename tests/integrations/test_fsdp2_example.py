"""``examples/grpo_fsdp2.py --cpu``, run exactly as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers import HAS_VLLM

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600),
              pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")]

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "grpo_fsdp2.py")


def test_grpo_fsdp2_cpu_three_steps_exits_0_with_verified_syncs():
    out = subprocess.run([sys.executable, EXAMPLE, "--cpu", "--steps", "3"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    steps = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert [s.split(":")[0] for s in steps] == ["step 1", "step 2", "step 3"], out.stdout
    metric = r"[-+]?\d+\.\d+(e[-+]\d+)?"
    for line in steps:
        for name in ("reward", "loss", "pg", "kl", "entropy", "clip_frac", "grad_norm", "lr"):
            assert re.search(rf" {name} {metric}", line), (name, line)
        assert line.endswith("verified: 2 vLLM ranks == load_weights(trainer weights)"), line


def test_example_opens_with_its_launch_commands():
    text = open(EXAMPLE).read()
    head = text[: text.index('"""', 3)]
    assert "4xH100" in head and "python examples/grpo_fsdp2.py --model Qwen/Qwen3-0.6B" in head
    assert "python examples/grpo_fsdp2.py --cpu --steps 3" in head
    assert len(text.splitlines()) <= 300
