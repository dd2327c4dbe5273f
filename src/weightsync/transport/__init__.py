"""Transports: one file each (``nccl`` broadcast today; ``ipc`` and ``nccl_m2n`` plug in the same way)."""

__all__: list[str] = []
