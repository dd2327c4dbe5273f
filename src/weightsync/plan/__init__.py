"""The plan, pure: regions and placements, the transfer plan (compact: one template per layout
signature), its one schedule of messages and rounds, buckets for the broadcast and IPC, FP8 blocks.

Nothing here imports torch, torch.distributed or vLLM: plain data in, frozen records and arrays out.
The item-by-item listings and schedule, and the single-process reference executor that every
transport is tested against, live with the tests (``tests/oracle.py``, ``tests/helpers.py``).
"""

from weightsync.plan.regions import (
    Placement,
    Region,
    Replicate,
    Shard,
    local_region,
    mesh_coordinates,
    placements_from_torch,
    source_regions,
)
from weightsync.plan.transfer import (
    DestPiece,
    PlanCoverage,
    TensorSource,
    TransferItem,
    TransferPlan,
    align_up,
    build_plan,
    dtype_itemsize,
)

__all__ = [
    "DestPiece",
    "Placement",
    "PlanCoverage",
    "Region",
    "Replicate",
    "Shard",
    "TensorSource",
    "TransferItem",
    "TransferPlan",
    "align_up",
    "build_plan",
    "dtype_itemsize",
    "local_region",
    "mesh_coordinates",
    "placements_from_torch",
    "source_regions",
]
