"""Triton kernels of the GPU attention backend: KV-cache write, paged decode, prefill/extend."""
