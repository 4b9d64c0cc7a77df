"""Coordinator-side GPU kernels (Triton): attention over the paged KV cache."""
