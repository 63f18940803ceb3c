"""``/metrics`` and the metrics port: Triton's metric families, Sluice's own, the host's
and the GPU's, read from Redis in one snapshot."""
