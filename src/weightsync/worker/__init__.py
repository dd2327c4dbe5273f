"""The worker side (inside vLLM): the engine base every transport's worker engine extends, where each
tensor lands (destinations, experts), the model agreement check, and the layerwise-reload applier."""
