"""Loads a PEFT LoRA adapter and validates it against the served model.

Two kinds of targets:

- routed experts, in either form seen in practice:
  per-expert linears ``model.layers.{l}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}``
  (Mixtral: ``block_sparse_moe.experts.{e}.{w1,w3,w2}``), A ``[r, in]`` and B ``[out, r]``; or
  PEFT's ``target_parameters`` on the fused 3-D tensors ``experts.gate_up_proj [E, 2I, H]`` and
  ``experts.down_proj [E, H, I]``. PEFT (tuners/lora/layer.py, ParamWrapper) reads such an
  ``[E, d1, d2]`` parameter as in=d1, out=d2 and then swaps the two unless the experts module
  says ``is_transposed`` (none of the served architectures does), so here in = H, out = 2I for
  gate_up: A is stored ``[E*r, in]`` (expert-major: reshape ``[E, r, in]``) and B ``[out, r*E]``
  (rank-major: reshape ``[out, r, E]``). Two targeted parameters on one module nest, so their
  tensors are ``experts.base_layer.lora_*`` and ``experts.lora_*``; which is which is read
  from the shapes (in = H for gate_up, I for down; H != I or else 2I != H decides).
- projections the coordinator runs: attention, shared experts, dense MLPs (any ``nn.Linear`` or
  merged part of one in the coordinator's model except the LM head).

Everything else (embeddings, lm_head, DoRA magnitudes, biases, modules_to_save) is refused with
the tensor's name; shape mismatches name the layer, expert and shapes. Nothing is half-loaded:
the result is built in full or an :class:`AdapterError` is raised.

Shapes: H hidden, I expert intermediate, E experts, r rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from coordinator.lora.config import AdapterConfig, AdapterError
from coordinator.model.models import build_model
from coordinator.model.models.layers import MergedLinear
from expertmesh.config import ModelConfig
from expertmesh.lora import ExpertLoRA

_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_]+)?\.weight$")
_PER_EXPERT = re.compile(
    r"^model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)$"
)
_FUSED = re.compile(r"^model\.layers\.(?P<layer>\d+)\.mlp\.experts(?P<nest>(\.base_layer)*)$")
# Mixtral's checkpoint names; w1 = gate, w3 = up, w2 = down
_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


@dataclass(frozen=True)
class Projection:
    """Where a checkpoint linear lives in the coordinator's model."""

    module: str  # module path in the coordinator's model (an nn.Linear or MergedLinear)
    row_start: int  # first output row of this part in the module's weight
    rows: int
    in_features: int
    out_features: int  # the module's total output rows


@dataclass(frozen=True)
class ProjectionLoRA:
    """LoRA of one coordinator module (all its targeted parts), scaling folded into B."""

    a: torch.Tensor  # [R, in]
    b: torch.Tensor  # [out, R]


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str
    config: AdapterConfig
    experts: dict[int, ExpertLoRA]  # MoE layer -> LoRA of all E experts (zeros where untargeted)
    projections: dict[str, ProjectionLoRA]  # coordinator module path -> LoRA

    @property
    def max_rank(self) -> int:
        ranks = [max(e.ranks) for e in self.experts.values()] + [
            p.a.shape[0] for p in self.projections.values()
        ]
        return max(ranks, default=0)


def projection_table(cfg: ModelConfig) -> dict[str, Projection]:
    """Every checkpoint linear name the coordinator computes -> its place (model built on meta)."""
    model = build_model(cfg, torch.float32)
    out: dict[str, Projection] = {}
    for path, mod in model.named_modules():
        if path == "lm_head":
            continue
        if isinstance(mod, MergedLinear):
            parent = path.rpartition(".")[0]
            for part in mod.parts:
                start, rows = mod.part_rows(part)
                out[f"{parent}.{part}"] = Projection(
                    path, start, rows, mod.weight.shape[1], mod.weight.shape[0]
                )
        elif isinstance(mod, nn.Linear):
            out[path] = Projection(path, 0, mod.out_features, mod.in_features, mod.out_features)
    return out


def _normalise(key: str) -> str:
    name = key[len(_PREFIX) :] if key.startswith(_PREFIX) else key
    return name.replace(".block_sparse_moe.", ".mlp.")


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise AdapterError(f"{path}: no adapter_model.safetensors (only safetensors adapters are read)")
    try:
        return load_file(file)
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"{file}: cannot read: {e}") from e


def _pairs(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """module name -> {"A": tensor, "B": tensor}; refuses every tensor that is not a LoRA A/B."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            what = "a DoRA magnitude" if "lora_magnitude_vector" in key else "not a LoRA A/B weight"
            raise AdapterError(f"tensor {key!r} is {what}: unsupported")
        if not t.is_floating_point() or t.dim() != 2:
            raise AdapterError(f"tensor {key!r}: expected a 2-D float tensor, got {t.dtype} {list(t.shape)}")
        if not bool(torch.isfinite(t).all()):
            # NOTE: refused here, once: a non-finite weight would make the expert servers refuse
            # every layer of every step its requests take part in
            bad = int((~torch.isfinite(t)).sum())
            raise AdapterError(f"tensor {key!r}: {bad} of its {t.numel()} values are NaN or infinite")
        out.setdefault(_normalise(m["module"]), {})[m["ab"]] = t.float()
    for module, ab in out.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{module}: has lora_{''.join(ab)} but not its pair")
        if ab["A"].shape[0] != ab["B"].shape[1]:
            raise AdapterError(
                f"{module}: lora_A {list(ab['A'].shape)} and lora_B {list(ab['B'].shape)} disagree on the rank"
            )
    return out


class _ExpertParts:
    """Per (layer, expert): LoRA parts of gate_up and down, each (A [r, in], B [out, r]) with B
    already placed in gate_up's 2I rows and scaled; concatenated along the rank at the end."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.parts13: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.parts2: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def add(self, layer: int, expert: int, proj: str, a: torch.Tensor, b: torch.Tensor) -> None:
        inter = self.cfg.moe_intermediate_size
        if proj == "down":
            self.parts2.setdefault((layer, expert), []).append((a, b))
            return
        if proj in ("gate", "up"):
            full = b.new_zeros(2 * inter, b.shape[1])  # [2I, r]
            off = 0 if proj == "gate" else inter
            full[off : off + inter] = b
            b = full
        self.parts13.setdefault((layer, expert), []).append((a, b))

    def build(self) -> dict[int, ExpertLoRA]:
        cfg = self.cfg
        h, inter, e_num = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        layers = sorted({k[0] for k in (*self.parts13, *self.parts2)})
        out: dict[int, ExpertLoRA] = {}
        for layer in layers:
            cat13 = [self._cat(self.parts13.get((layer, e), []), h, 2 * inter) for e in range(e_num)]
            cat2 = [self._cat(self.parts2.get((layer, e), []), inter, h) for e in range(e_num)]
            r13 = max(1, max(a.shape[0] for a, _ in cat13))
            r2 = max(1, max(a.shape[0] for a, _ in cat2))
            pad = [
                ExpertLoRA(a13[None], b13[None], a2[None], b2[None]).padded(r13, r2)
                for (a13, b13), (a2, b2) in zip(cat13, cat2)
            ]
            out[layer] = ExpertLoRA(
                *(torch.cat([getattr(p, f) for p in pad]) for f in ("a13", "b13", "a2", "b2"))
            )
        return out

    @staticmethod
    def _cat(parts: list[tuple[torch.Tensor, torch.Tensor]], fan_in: int, fan_out: int):
        if not parts:
            return torch.zeros(0, fan_in), torch.zeros(fan_out, 0)
        return torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts], dim=1)


def _check_rank(cfg: AdapterConfig, module: str, got: int, what: str) -> None:
    want = cfg.rank(module)
    if got != want:
        raise AdapterError(
            f"{what}: rank {got} in the tensors, but adapter_config.json says r={want} for {module}"
        )


def _per_expert(parts: _ExpertParts, cfg: AdapterConfig, module: str, m: re.Match, ab) -> None:
    mc = parts.cfg
    layer, expert, proj = int(m["layer"]), int(m["expert"]), _PROJ[m["proj"]]
    _check_moe_layer(mc, layer, module)
    if expert >= mc.num_experts:
        raise AdapterError(
            f"{module}: layer {layer} expert {expert} is out of range (the model has {mc.num_experts} experts)"
        )
    h, inter = mc.hidden_size, mc.moe_intermediate_size
    fan_in, fan_out = (inter, h) if proj == "down" else (h, inter)
    a, b = ab["A"], ab["B"]
    r = a.shape[0]
    if a.shape[1] != fan_in or b.shape[0] != fan_out:
        raise AdapterError(
            f"{module}: layer {layer} expert {expert} {m['proj']}: lora_A {list(a.shape)} / lora_B {list(b.shape)}, "
            f"expected [r, {fan_in}] / [{fan_out}, r]"
        )
    _check_rank(cfg, module, r, f"layer {layer} expert {expert} {m['proj']}")
    parts.add(layer, expert, proj, a, b * cfg.scaling(module, r))


def _fused(parts: _ExpertParts, cfg: AdapterConfig, module: str, layer: int, ab) -> None:
    mc = parts.cfg
    _check_moe_layer(mc, layer, module)
    h, inter, e_num = mc.hidden_size, mc.moe_intermediate_size, mc.num_experts
    a, b = ab["A"], ab["B"]
    # which fused parameter these tensors adapt: in = H for gate_up, I for down
    cands = [
        (p, fi, fo)
        for p, fi, fo in (("gate_up_proj", h, 2 * inter), ("down_proj", inter, h))
        if a.shape[1] == fi and b.shape[0] == fo
    ]
    if len(cands) != 1:
        raise AdapterError(
            f"{module}: layer {layer} fused experts: lora_A {list(a.shape)} / lora_B {list(b.shape)} fit neither "
            f"gate_up_proj (expected [r*{e_num}, {h}] / [{2 * inter}, r*{e_num}]) nor down_proj "
            f"(expected [r*{e_num}, {inter}] / [{h}, r*{e_num}])"
        )
    param, fan_in, fan_out = cands[0]
    if a.shape[0] % e_num:
        raise AdapterError(
            f"{module}: layer {layer} {param}: lora_A has {a.shape[0]} rows, not a multiple of {e_num} experts"
        )
    r = a.shape[0] // e_num
    pname = f"model.layers.{layer}.mlp.experts.{param}"
    _check_rank(cfg, pname, r, f"layer {layer} {param}")
    scale = cfg.scaling(pname, r)
    a_e = a.reshape(e_num, r, fan_in)  # expert-major rows
    b_e = b.reshape(fan_out, r, e_num).permute(2, 0, 1)  # rank-major columns -> [E, out, r]
    proj = "down" if param == "down_proj" else "gate_up"
    for e in range(e_num):
        parts.add(layer, e, proj, a_e[e], b_e[e] * scale)


def _check_moe_layer(mc: ModelConfig, layer: int, module: str) -> None:
    if layer >= mc.num_layers or not mc.moe_layers[layer]:
        raise AdapterError(
            f"{module}: layer {layer} is not an MoE layer of this model ({mc.num_layers} layers, MoE: {mc.moe_layer_ids})"
        )


def _projection(
    table: dict[str, Projection], acc: dict[str, list], cfg: AdapterConfig, module: str, ab
) -> None:
    if module.endswith(("embed_tokens", "lm_head")) or "embed" in module.rsplit(".", 1)[-1]:
        raise AdapterError(f"tensor {module}.lora_A.weight: LoRA on embeddings / lm_head is not supported")
    p = table.get(module)
    if p is None:
        raise AdapterError(
            f"tensor {module}.lora_A.weight: {module!r} is not a projection of this model that LoRA can target"
        )
    a, b = ab["A"], ab["B"]
    if a.shape[1] != p.in_features or b.shape[0] != p.rows:
        raise AdapterError(
            f"{module}: lora_A {list(a.shape)} / lora_B {list(b.shape)}, expected [r, {p.in_features}] / [{p.rows}, r]"
        )
    r = a.shape[0]
    _check_rank(cfg, module, r, module)
    full = b.new_zeros(p.out_features, r)
    full[p.row_start : p.row_start + p.rows] = b * cfg.scaling(module, r)
    acc.setdefault(p.module, []).append((a, full))


def load_adapter(
    name: str, path: str | Path, model_cfg: ModelConfig, table: dict[str, Projection] | None = None
) -> LoRAAdapter:
    """Reads and validates the adapter at ``path`` for ``model_cfg``; float32 on the CPU."""
    path = Path(path)
    if not path.is_dir():
        raise AdapterError(f"{path}: not a directory")
    cfg = AdapterConfig.from_dir(path)
    pairs = _pairs(_read_tensors(path))
    if not pairs:
        raise AdapterError(f"{path}: the adapter has no LoRA tensors")
    table = table if table is not None else projection_table(model_cfg)
    experts = _ExpertParts(model_cfg)
    proj: dict[str, list] = {}
    for module, ab in sorted(pairs.items()):
        if (m := _PER_EXPERT.match(module)) is not None:
            _per_expert(experts, cfg, module, m, ab)
        elif (m := _FUSED.match(module)) is not None:
            _fused(experts, cfg, module, int(m["layer"]), ab)
        else:
            _projection(table, proj, cfg, module, ab)
    projections = {
        mod: ProjectionLoRA(torch.cat([a for a, _ in ps]), torch.cat([b for _, b in ps], dim=1))
        for mod, ps in proj.items()
    }
    return LoRAAdapter(name, str(path), cfg, experts.build(), projections)
