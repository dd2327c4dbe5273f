"""``weightsync_nixl``: the reshard core (:mod:`weightsync.reshard`) over NIXL, one-sided.

The same plan as ``weightsync_m2n`` (every byte shard to shard, straight into live vLLM parameters),
moved by :class:`~weightsync.dataplane.nixl.NixlPlane`: each trainer rank registers what it sends and
announces it, each worker READs its pieces (one request per trainer rank per look) into its
registered parameters or staging. No collective group: each party runs one NIXL agent (UCX), whose
metadata goes through the sync group's store. NIXL is imported when an engine joins, not before.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ..dataplane.nixl import NixlPlane
from ..registry import Capabilities, Transport
from ..reshard.engines import M2NTrainerEngine, M2NTrainerInitInfo, M2NWorkerEngine

__all__ = ["NixlTrainerEngine", "NixlTrainerInitInfo", "NixlWorkerEngine", "TRANSPORT"]

NAME = "weightsync_nixl"


@dataclasses.dataclass(kw_only=True, frozen=True)
class NixlTrainerInitInfo(M2NTrainerInitInfo):
    """``weightsync_m2n``'s init info, naming this transport."""

    backend: ClassVar[str] = NAME


class NixlTrainerEngine(M2NTrainerEngine):
    init_info_cls = NixlTrainerInitInfo
    data_plane = NixlPlane


class NixlWorkerEngine(M2NWorkerEngine):
    data_plane = NixlPlane


TRANSPORT = Transport(
    name=NAME, trainer_engine=NixlTrainerEngine, worker_engine=NixlWorkerEngine,
    init_info=NixlTrainerInitInfo, source="local", colocated=False,
    summary="each worker READs the pieces of the trainer ranks' shards it holds over NIXL (one-sided)",
    capabilities=Capabilities(shard_exact=True, delta=True, fp8_targets=True, fp8_wire=True, elastic=True))
