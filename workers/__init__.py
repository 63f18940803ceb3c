"""Data plane: worker processes that pull micro-batches from a model's stream and run a backend."""
