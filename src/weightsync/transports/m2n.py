"""``weightsync_m2n``: the reshard core (:mod:`weightsync.reshard`) over torch process groups.

Every trainer rank sends only the pieces of its local shards that each worker needs, point to point
(gloo on CPU, NCCL on CUDA), straight into live vLLM parameters: see :mod:`weightsync.reshard.engines`.
"""

from __future__ import annotations

from ..registry import Capabilities, Transport
from ..reshard.engines import (
                               M2NSyncStats,
                               M2NTrainerEngine,
                               M2NTrainerInitInfo,
                               M2NUpdateInfo,
                               M2NWorkerEngine,
                               M2NWorkerInitInfo,
)

__all__ = ["M2NSyncStats", "M2NTrainerEngine", "M2NTrainerInitInfo", "M2NUpdateInfo", "M2NWorkerEngine",
           "M2NWorkerInitInfo", "TRANSPORT"]

TRANSPORT = Transport(
    name="weightsync_m2n", trainer_engine=M2NTrainerEngine, worker_engine=M2NWorkerEngine,
    init_info=M2NTrainerInitInfo, source="local", colocated=False,
    summary="each trainer rank sends only the pieces of its local shards each worker holds, into live parameters",
    capabilities=Capabilities(shard_exact=True, delta=True, fp8_targets=True, fp8_wire=True, elastic=True))
