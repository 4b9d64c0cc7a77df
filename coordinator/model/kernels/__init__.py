"""Coordinator-side GPU kernels (Triton): attention over the paged KV cache (MHA and MLA) and
the fused small ops of a decoder layer (RMSNorm, rotary, SiLU-and-mul). Each is checked against
plain torch and runs in Triton's interpreter on a CPU."""
