"""Triton kernels of the GPU expert backend (fused MoE)."""

from gpu_server.kernels.config import ConfigTable, GemmConfig, MoeConfig, default_config, table_for_gpu
from gpu_server.kernels.fused_moe import fused_moe

__all__ = ["ConfigTable", "GemmConfig", "MoeConfig", "default_config", "fused_moe", "table_for_gpu"]
