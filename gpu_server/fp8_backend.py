"""The GPU expert backend for FP8 block-quantised checkpoints: routed experts stay FP8 in GPU
memory (half the bytes of bf16) and run through the block-scaled fused-MoE kernel.

The worker's slot table stacks and indexes one tensor per projection with the slot as dim 0, so
each expert's FP8 weight and its float32 block scales travel together as one byte row:

    w13 row (uint8) = [ 2I*H bytes of float8_e4m3fn | 4 * (2I/bn) * ceil(H/bk) bytes of scales ]
    w2  row (uint8) = [ H*I bytes of float8_e4m3fn  | 4 * ceil(H/bn) * ceil(I/bk) bytes of scales ]

``forward`` takes strided views of the two parts (no copy). Shapes: S slots, H hidden,
I intermediate, (bn, bk) the scale block.
"""

from __future__ import annotations

import torch

from expertmesh.checkpoint import CheckpointReader
from expertmesh.errors import Unimplemented
from expertmesh.experts import ExpertBackend
from expertmesh.quant import FP8_DTYPE, FP8BlockQuant
from gpu_server.kernels.fp8_moe import fused_moe_fp8


def has_fp8(device: str | torch.device) -> bool:
    """FP8 tensor cores and conversions: Ada (sm_89) and Hopper (sm_90) on."""
    dev = torch.device(device)
    return dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 9)


class Fp8TritonBackend(ExpertBackend):
    """Packed FP8 experts (see the module docstring) through :func:`fused_moe_fp8`."""

    name = "triton-fp8"
    weight_dtype = "float8_e4m3fn"

    def __init__(self, hidden: int, inter: int, quant: FP8BlockQuant, act_fp8: bool = False) -> None:
        self.h, self.i, self.block, self.act_fp8 = hidden, inter, quant.block, act_fp8
        self.s13 = quant.scale_shape(2 * inter, hidden)
        self.s2 = quant.scale_shape(hidden, inter)
        assert inter % self.block[0] == 0, "gate and up must not share a scale block"
        assert (2 * inter * hidden) % 4 == 0 and (hidden * inter) % 4 == 0, "scales must stay 4-byte aligned"

    def row_bytes(self) -> tuple[int, int]:
        n13 = 2 * self.i * self.h + 4 * self.s13[0] * self.s13[1]
        n2 = self.h * self.i + 4 * self.s2[0] * self.s2[1]
        return n13, n2

    def pack(self, q13, sc13, q2, sc2) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert: fp8 [2I, H] + scales, fp8 [H, I] + scales -> uint8 rows [1, n13], [1, n2]."""
        assert q13.dtype == FP8_DTYPE and q2.dtype == FP8_DTYPE, f"{q13.dtype=} {q2.dtype=}"
        assert tuple(sc13.shape) == self.s13 and tuple(sc2.shape) == self.s2, f"{sc13.shape=} {sc2.shape=}"
        row13 = torch.cat([q13.reshape(-1).view(torch.uint8), sc13.float().reshape(-1).view(torch.uint8)])
        row2 = torch.cat([q2.reshape(-1).view(torch.uint8), sc2.float().reshape(-1).view(torch.uint8)])
        return row13[None], row2[None]

    def read_expert(
        self, reader: CheckpointReader, layer: int, expert: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot table's hook: one expert's packed rows, read as stored (no dequantisation)."""
        w = reader.expert_weights(layer, expert, keep_fp8=True)
        assert w.w13_scale is not None and w.w2_scale is not None
        row13, row2 = self.pack(w.w13, w.w13_scale, w.w2, w.w2_scale)
        return row13[0].to(device), row2[0].to(device)

    def unpack(self, p13: torch.Tensor, p2: torch.Tensor):
        """[S, n13], [S, n2] uint8 -> (q13 [S, 2I, H], s13, q2 [S, H, I], s2) views."""
        s = p13.shape[0]
        a, b = 2 * self.i * self.h, self.h * self.i
        q13 = p13[:, :a].view(FP8_DTYPE).unflatten(1, (2 * self.i, self.h))
        sc13 = p13[:, a:].view(torch.float32).unflatten(1, self.s13)
        q2 = p2[:, :b].view(FP8_DTYPE).unflatten(1, (self.h, self.i))
        sc2 = p2[:, b:].view(torch.float32).unflatten(1, self.s2)
        assert q13.shape[0] == sc13.shape[0] == q2.shape[0] == s
        return q13, sc13, q2, sc2

    def forward(self, x, w13, w2, slot_ids, weights, lora=None):
        if lora is not None:
            # LoRA changes gate/up before the activation, so it cannot be added to this kernel's
            # output; refusing beats computing without it
            raise Unimplemented(
                "MoE LoRA on FP8-resident experts is not implemented: serve this checkpoint's "
                "adapters from a server that holds the experts dequantised (e.g. a CPU expert server)"
            )
        if w13.shape[0] == 0:  # no expert of this layer here: every slot id is -1
            return torch.zeros_like(x)
        if w13.dtype != torch.uint8:
            raise TypeError(f"{self.name} computes on packed FP8 experts, got {w13.dtype}")
        q13, sc13, q2, sc2 = self.unpack(w13, w2)
        return fused_moe_fp8(x, q13, sc13, q2, sc2, slot_ids, weights, self.block, act_fp8=self.act_fp8)


def fp8_backend_for(model_dir: str, device: str) -> Fp8TritonBackend | None:
    """The FP8 backend when the checkpoint's routed experts are block FP8 and the GPU has FP8;
    None otherwise (the caller then dequantises to its compute dtype)."""
    if not has_fp8(device):
        return None
    reader = CheckpointReader(model_dir)
    cfg, q = reader.config, reader.quant
    if q is None or not reader.fp8_experts():
        return None
    return Fp8TritonBackend(cfg.hidden_size, cfg.moe_intermediate_size, q)
