"""Triton's system and CUDA shared memory extensions: the regions clients register, where
a host records them, and how tensors travel through them."""
