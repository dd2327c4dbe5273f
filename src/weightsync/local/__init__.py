"""Local multi-process runtime (CPU): trainer and vLLM receiver processes for the demo and tests."""

__all__: list[str] = []
