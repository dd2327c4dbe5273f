"""Integrations with other systems: vLLM's plugin hook (``vllm_plugin``) and the FSDP2 reference trainer (``fsdp2``)."""

__all__: list[str] = []
