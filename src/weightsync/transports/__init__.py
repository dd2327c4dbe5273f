"""Transports, one file each: ``m2n`` (the reshard core over torch groups), ``nccl`` (broadcast of
buckets), ``ipc`` (colocated hand-off), and LoRA adapters (``lora``). Each declares itself as ``TRANSPORT``
with its :class:`~weightsync.registry.Capabilities` and is listed in ``weightsync.registry.TRANSPORTS``."""

__all__: list[str] = []
