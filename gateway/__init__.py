"""HTTP gateway: KServe v2 REST with Triton's extensions, in front of the Redis streams."""
