"""Integrations with other systems: vLLM's plugin hook (``vllm_plugin``), the ``vllm serve`` request
validation middleware (``vllm_http``) and the FSDP2 reference trainer (``fsdp2``)."""

__all__: list[str] = []
