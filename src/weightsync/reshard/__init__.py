"""The shard-to-shard core every reshard transport uses: the plan agreed at init (:mod:`.handshake`), the
executor that moves a rank's rounds over any data plane (:mod:`.executor`), its staging and checksums
(:mod:`.packing`), delta encoding (:mod:`.delta`), FP8 on the wire (:mod:`.fp8`) and the trainer and
worker engines (:mod:`.engines`), which a transport declares over its data plane."""

__all__: list[str] = []
