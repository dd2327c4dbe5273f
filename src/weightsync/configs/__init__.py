"""The tiny model configs weightsync ships (``config.json`` only: no weights, no tokenizer).

``path(name)`` is the directory to hand to vLLM (``LLM(model=path("tiny_qwen3"), load_format="dummy",
skip_tokenizer_init=True)``) and to HF transformers (``AutoConfig.from_pretrained(path(name))``).
"""

from __future__ import annotations

from importlib import resources

__all__ = ["names", "path"]


def names() -> list[str]:
    """The shipped configs, sorted (``tiny_qwen3``, ``small_qwen3``, ...)."""
    root = resources.files(__name__)
    return sorted(d.name for d in root.iterdir() if d.is_dir() and d.joinpath("config.json").is_file())


def path(name: str) -> str:
    """The directory of the shipped config ``name`` (it holds ``config.json``); ``ValueError``
    listing the shipped names for any other ``name``."""
    if not isinstance(name, str) or name not in names():
        raise ValueError(f"name must be one of the shipped configs {names()}, got {name!r}")
    return str(resources.files(__name__).joinpath(name))
