"""The executor, ``sluice up``: the private redis-server, the supervised gateways and
workers, their instances and model control; on Kubernetes, Deployment replicas instead."""
