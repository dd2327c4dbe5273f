"""Integrations with other systems (vLLM's plugin hook; the FSDP2 reference trainer comes later)."""

__all__: list[str] = []
