"""The KServe v2 / Triton gRPC API (``inference.GRPCInferenceService``), served by each
gateway process beside its HTTP API, on the same state: one data plane for both wires."""
