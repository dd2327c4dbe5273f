"""Transports, one file each (``m2n``, ``nccl``, ``ipc``), on the shared cores in
:mod:`weightsync.trainer.engine` and :mod:`weightsync.worker.engine`; each declares itself as
``TRANSPORT`` and is listed in ``weightsync.registry.TRANSPORTS``."""

__all__: list[str] = []
