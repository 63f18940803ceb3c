"""TorchServe's APIs beside the KServe v2 routes: inference, management and metrics ports,
archives and configuration changes."""
