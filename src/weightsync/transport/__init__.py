"""Transports, one file each (``m2n``, ``nccl``, ``ipc``), on the shared core in ``base`` / ``worker_base``;
each declares itself as ``TRANSPORT`` and is listed in ``weightsync.registry.TRANSPORTS``."""

__all__: list[str] = []
