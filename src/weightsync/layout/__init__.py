"""Pure layout algebra and transfer planning: regions, placements, the M2N TransferPlan.

Nothing here imports torch, torch.distributed or vLLM. The single-process reference executor that
every transport is tested against lives with the tests (``tests/helpers.py``).
"""

from weightsync.layout.plan import TransferPlan, build_plan
from weightsync.layout.records import (
    DestPiece,
    PlanCoverage,
    TensorSource,
    TransferItem,
    align_up,
    dtype_itemsize,
)
from weightsync.layout.regions import (
    Placement,
    Region,
    Replicate,
    Shard,
    local_region,
    mesh_coordinates,
    placements_from_torch,
    source_regions,
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
