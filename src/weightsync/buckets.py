"""Temporary: removed when transports switch imports.

Bucket planning moved to :mod:`weightsync.layout.buckets` (pure) and packing/checksums to
:mod:`weightsync.transport.packing`; this module re-exports both under the old names.
"""

from __future__ import annotations

from .layout.buckets import ALIGN, Bucket, BucketEntry, metadata_digest, plan_buckets
from .transport.packing import fold_checksum, pack, unpack

__all__ = ["ALIGN", "BucketEntry", "Bucket", "plan_buckets", "metadata_digest", "pack", "unpack", "fold_checksum"]
