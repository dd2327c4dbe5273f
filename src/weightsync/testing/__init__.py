"""The CPU multi-process harness that ``weightsync demo``, the examples' ``--cpu`` modes, the
benchmarks and the tests share: an RPC actor system (``actors``), FSDP2 trainer processes
(``trainer``), vLLM receiver processes building vLLM's real model classes (``receiver``), the
cluster that lays them out (``cluster``), and what tests inject into them (``faults``, ``probes``).

Not API: it may change without notice. ``LocalWeightSyncClient`` (``weightsync.LocalWeightSyncClient``)
is the one public name that lives here.
"""

__all__: list[str] = []
