"""The decoder skeleton every supported architecture shares.

Parameter names mirror the HF checkpoints (``model.layers.{i}.self_attn...``) except where
projections are merged (q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``); the loader maps
checkpoint names onto them. Routed experts are not parameters here: they live behind the
dispatcher.

Shapes: T tokens in the step, H hidden, V vocab, B' rows whose logits are wanted.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from coordinator.model.batch import ForwardBatch
from coordinator.model.deferral import Carry
from coordinator.model.dispatch import Dispatcher
from coordinator.model.kv_cache import KVCache
from coordinator.model.models.layers import GatedMLP, RMSNorm, linear
from coordinator.model.models.moe import LoadHook, MoEBlock
from expertmesh.config import ModelConfig

AttentionFactory = Callable[[ModelConfig, int, torch.dtype], nn.Module]
MoEFactory = Callable[[ModelConfig, int, torch.dtype], MoEBlock]


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer: int, dtype: torch.dtype, attn: AttentionFactory, moe: MoEFactory
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = attn(cfg, layer, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp: nn.Module = (
            moe(cfg, layer, dtype)
            if cfg.moe_layers[layer]
            else GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype)
        )

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, kv: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, kv)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(
        self,
        x: torch.Tensor,  # [T, H]
        pending: torch.Tensor | None,  # [T, H] the previous layer's MLP output, not yet added
        batch: ForwardBatch,
        kv: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (residual stream, this layer's MLP output)
        """CUDA: each residual add happens inside the RMSNorm kernel that follows it."""
        from coordinator.model.kernels.fused_ops import rmsnorm

        norm = self.input_layernorm
        x, h = rmsnorm(x, norm.weight, norm.eps, residual=pending)
        a = self.self_attn(h, batch, kv)
        norm = self.post_attention_layernorm
        x, h = rmsnorm(x, norm.weight, norm.eps, residual=a)
        return x, self.mlp(h)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, attn: AttentionFactory, moe: MoEFactory) -> None:
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        # NOTE: given its (meta) weight, so it skips its random init: on the meta device that
        # init imports torch._dynamo, a second or more of a load that lasts about as long
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.model.layers = nn.ModuleList(
            DecoderLayer(cfg, i, dtype, attn, moe) for i in range(cfg.num_layers)
        )
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = linear(cfg.hidden_size, cfg.vocab_size, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.dispatcher: Dispatcher | None = None  # set by attach()

    def decoder_layers(self) -> list[DecoderLayer]:
        return [layer for layer in self.model.layers if isinstance(layer, DecoderLayer)]

    def moe_blocks(self) -> list[MoEBlock]:
        return [layer.mlp for layer in self.decoder_layers() if isinstance(layer.mlp, MoEBlock)]

    def attach(self, dispatcher: Dispatcher, load_hook: LoadHook | None = None) -> None:
        self.dispatcher = dispatcher  # the model takes deferred CPU-expert sums from it
        for block in self.moe_blocks():
            block.dispatcher = dispatcher
            block.load_hook = load_hook

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:  # [B', V] float32
        x = self.model.embed_tokens(batch.input_ids)  # [T, H]
        carry = Carry(self.dispatcher)  # --cpu-defer-experts (coordinator/model/deferral.py)
        if x.is_cuda:
            pending: torch.Tensor | None = None
            for i, layer in enumerate(self.decoder_layers()):
                x, pending = layer.forward_fused(x, pending, batch, (cache.k[i], cache.v[i]))
                pending = carry.after_layer(pending)
            assert pending is not None
            pending = carry.finish(pending)
            x = x[batch.logits_index] + pending[batch.logits_index]
        else:
            for i, layer in enumerate(self.decoder_layers()):
                x = carry.after_layer(layer(x, batch, (cache.k[i], cache.v[i])))
            x = carry.finish(x)[batch.logits_index]
        return self.lm_head(self.model.norm(x)).float()

    @torch.inference_mode()
    def forward_micro(self, batches: list[ForwardBatch], cache: KVCache) -> torch.Tensor:  # [sum B', V]
        """One step as micro-batches of whole sequences, pipelined over the layers: a
        micro-batch's wait for its routed experts of layer i comes after the other
        micro-batches' attention, so that attention overlaps the experts on the wire. The same
        maths as :meth:`forward` row by row (no deferred CPU experts here: the caller runs
        those steps whole)."""
        xs = [self.model.embed_tokens(b.input_ids) for b in batches]  # [T_m, H] each
        # per micro-batch: (residual after attention [T_m, H], the MLP output's finish) of the
        # layer in flight
        flight: list[tuple[torch.Tensor, Callable[[], torch.Tensor]] | None] = [None] * len(batches)
        for i, layer in enumerate(self.decoder_layers()):
            kv = (cache.k[i], cache.v[i])
            moe = layer.mlp if isinstance(layer.mlp, MoEBlock) else None
            # NOTE: the load hook sees the layer's routing once for the whole step, as in
            # forward (the EPLB recorder counts a step at each first MoE layer it is shown)
            hook = moe.load_hook if moe is not None else None
            seen: list[torch.Tensor] = []  # [T_m, K] routing ids per micro-batch
            if hook is not None:
                moe.load_hook = lambda _layer, ids, seen=seen: seen.append(ids)
            try:
                for m, b in enumerate(batches):
                    prev = flight[m]
                    if prev is not None:
                        xs[m] = prev[0] + prev[1]()
                    h = xs[m] + layer.self_attn(layer.input_layernorm(xs[m]), b, kv)
                    y = layer.post_attention_layernorm(h)
                    if moe is not None:
                        flight[m] = (h, moe.start(y))
                    else:
                        flight[m] = (h, _done(layer.mlp(y)))
            finally:
                if hook is not None:
                    moe.load_hook = hook
            if hook is not None and seen:
                hook(moe.layer, torch.cat(seen))
        outs = []
        for m, b in enumerate(batches):
            prev = flight[m]
            assert prev is not None
            outs.append((prev[0] + prev[1]())[b.logits_index])
        return self.lm_head(self.model.norm(torch.cat(outs))).float()


def _done(y: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A dense layer's MLP output, in the shape of an MoE block's finish."""
    return lambda: y
