"""What a deployment tells its operators: log lines, traces, and the statistics and
histograms workers keep in Redis (Triton's and a model's own metrics)."""
