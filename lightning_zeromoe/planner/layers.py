"""What a model's decoder layers run beside attention, read from its modules: how many hold a MoE
block, the FFN width of the dense layers (DeepSeek's and GLM-4 MoE's ``first_k_dense_replace``,
Qwen-MoE's ``mlp_only_layers``, Llama 4's interleaved layers), and the shared experts inside a
block (DeepSeek, GLM-4 MoE, Qwen2-MoE, Llama 4, Granite-MoE-Shared). The activation estimate and the
all-to-all count use it; parameter counts are exact without it (:mod:`.counts`).

A MoE block is a module with an ``experts`` child, the rule the strategy's leaf modules use. Inside
it, a child with two or more weight matrices is a shared MLP (SwiGLU, or a fused ``2f x h`` input and
an ``f x h`` output: ``3 * h * f`` either way), a single ``[1, h]`` matrix is a gate on the shared
output, and the rest is the router. A dense layer's MLP is the module at the same place in a layer
without a block (``layers.0.mlp`` beside ``layers.3.mlp``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_zeromoe.planner.counts import layer_index


@dataclass(frozen=True)
class LayerMix:
    """The decoder layers by kind (module docstring). Widths are in elements; 0: none."""

    moe_layers: int
    dense_layers: int = 0
    #: The FFN width of a dense layer's MLP.
    dense_ffn: int = 0
    #: All shared experts of one block together (DeepSeek's ``n_shared_experts * moe_intermediate_size``).
    shared_ffn: int = 0
    #: Whether a sigmoid gate scales the shared experts' output (Qwen2-MoE's ``shared_expert_gate``).
    shared_gate: bool = False

    def describe(self) -> str:
        """``", shared experts' FFN 5632 (gated), 1 dense layer of FFN 10944"``: what the planner
        CLI's header adds after the experts' sizes (empty when there is neither)."""
        parts = []
        if self.shared_ffn:
            parts.append(f"shared experts' FFN {self.shared_ffn}" + (" (gated)" if self.shared_gate else ""))
        if self.dense_layers:
            parts.append(f"{self.dense_layers} dense layer{'s' * (self.dense_layers > 1)} of FFN {self.dense_ffn}")
        return "".join(f", {p}" for p in parts)


def _shape(param: Any) -> tuple[int, ...]:
    return tuple(getattr(param, "ds_shape", None) or param.shape)


def _matrices(module: Any) -> list[tuple[int, ...]]:
    """The module's weight matrices, PEFT's LoRA factors left out (a router under LoRA stays one)."""
    return [s for name, p in module.named_parameters() if "lora_" not in name and len(s := _shape(p)) == 2]


def _mlp_width(module: Any, hidden_size: int) -> int:
    """FFN width of a gated MLP from its weights: ``3 * h * f`` elements."""
    return sum(math.prod(s) for s in _matrices(module)) // (3 * hidden_size)


def layer_mix(model: Any, hidden_size: int, num_layers: int) -> LayerMix | None:
    """``model``'s :class:`LayerMix`, or None when it has no MoE block to read (then every layer is
    taken to be a MoE layer without shared experts)."""
    if not hasattr(model, "named_modules") or not hidden_size:
        return None
    blocks, skip = [], None
    for name, module in model.named_modules():
        if skip is not None and name.startswith(skip):
            continue
        if name and hasattr(module, "experts"):
            blocks.append((name, module))
            skip = name + "."
    if not blocks:
        return None
    num_layers = num_layers or len(blocks)
    name, block = blocks[0]
    shared, gate = 0, False
    for child_name, child in block.named_children():
        if child_name == "experts":
            continue
        matrices = _matrices(child)
        if len(matrices) >= 2:
            shared += _mlp_width(child, hidden_size)
        elif len(matrices) == 1 and 1 in matrices[0] and hidden_size in matrices[0]:
            gate = True
    layers_with_blocks = {layer_index(n) for n, _ in blocks}
    dense_ffn, dense = 0, 0
    if None not in layers_with_blocks and num_layers > len(layers_with_blocks):
        # the block's place in its layer (``model.layers.3`` + ``.mlp``), looked up in the other layers
        index = layer_index(name)
        marker = f".{index}."
        prefix, _, rest = (f".{name}").rpartition(marker)
        modules = dict(model.named_modules())
        for i in range(num_layers):
            if i in layers_with_blocks:
                continue
            mlp = modules.get(f"{prefix}.{i}.{rest}"[1:])
            if mlp is None:  # a layer laid out otherwise: count it as a MoE layer, as without a mix
                continue
            dense += 1
            dense_ffn = dense_ffn or _mlp_width(mlp, hidden_size)
    return LayerMix(moe_layers=num_layers - dense, dense_layers=dense, dense_ffn=dense_ffn, shared_ffn=shared,
                    shared_gate=gate)
