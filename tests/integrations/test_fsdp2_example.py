"""``examples/grpo_fsdp2.py``: what it tells a user (its ``--cpu`` run is in ``tests/engine/test_examples.py``)."""

from __future__ import annotations

import os

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "grpo_fsdp2.py")


def test_example_opens_with_its_launch_commands():
    text = open(EXAMPLE).read()
    head = text[: text.index('"""', 3)]
    assert "4xH100" in head and "python examples/grpo_fsdp2.py --model Qwen/Qwen3-0.6B" in head
    assert "python examples/grpo_fsdp2.py --cpu --steps 3" in head
    assert len(text.splitlines()) <= 300
