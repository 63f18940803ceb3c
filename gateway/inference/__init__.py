"""The data plane's inference path, whatever the transport: a KServe v2 / Triton request
parsed and checked, queued on its stream, and its answer encoded."""
