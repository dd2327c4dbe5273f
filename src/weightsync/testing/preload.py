"""What the actors' fork server imports once, before it forks each actor (``weightsync.testing.actors``).

Every trainer and receiver process imports torch, the harness and vLLM's model classes: ~9 s of CPU per
process on a 2-core machine, paid again by every actor a test kills and replaces. Forked from a server
that imported them, an actor starts with them in memory. The receivers' environment (``VLLM_CPU_ENV``,
which vLLM reads as it is imported) is set here first, so every actor has it. Nothing here starts a
thread or a process (the server runs with ``OMP_NUM_THREADS=1``): a process with threads must not fork.
Where vLLM or transformers is not installed, the rest is still imported.
"""

from __future__ import annotations

import contextlib
import importlib
import os

from . import actors, receiver, trainer  # noqa: F401 - imported for the forked actors

os.environ.update(receiver.VLLM_CPU_ENV)

MODULES = (
    "transformers",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.llama.modeling_llama",
    "vllm.config",
    "vllm.distributed.parallel_state",
    "vllm.distributed.weight_transfer",
    "vllm.model_executor.model_loader",
    "vllm.model_executor.models.qwen3",
    "vllm.model_executor.models.llama",
    "vllm.plugins",
)
"""Imported when installed: what the receivers' ``setup`` and the trainers' models import."""

for _name in MODULES:
    with contextlib.suppress(ImportError):
        importlib.import_module(_name)
