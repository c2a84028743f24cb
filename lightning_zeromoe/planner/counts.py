"""Parameter counts: dense vs expert, from a model or from a transformer's sizes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class ParamCounts:
    """Parameter tensor sizes (elements), dense and expert. Expert tensors are the *whole*
    layer's experts (all ``num_experts``), before expert parallelism splits them."""

    dense: tuple[int, ...]
    expert: tuple[int, ...]
    #: False when only totals were given: then partitions are computed without rounding.
    exact: bool = True

    @property
    def dense_total(self) -> int:
        return sum(self.dense)

    @property
    def expert_total(self) -> int:
        return sum(self.expert)

    @property
    def total(self) -> int:
        return self.dense_total + self.expert_total


#: Config attributes that name the number of routed experts / experts per token, by model family.
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")
#: Per-expert FFN width: MoE configs that also carry a dense ``intermediate_size`` name it first.
EXPERT_FFN_KEYS = ("moe_intermediate_size", "expert_intermediate_size", "intermediate_size", "ffn_hidden_size")

#: Module names of per-head query/key norms (Qwen3, OLMoE, GLM-4 MoE with ``use_qk_norm``).
QK_NORM_NAMES = ("q_norm", "k_norm", "q_layernorm", "k_layernorm")


def has_qk_norm(model: Any) -> bool:
    """Whether ``model``'s attention normalises queries and keys (for the activation estimate)."""
    return hasattr(model, "named_modules") and any(name.rpartition(".")[2] in QK_NORM_NAMES
                                                   for name, _ in model.named_modules())


def is_expert_param(name: str) -> bool:
    """Routed-expert weights: a path component named ``experts`` (ours, Hugging Face Mixtral /
    Qwen-MoE / DeepSeek, AutoEP's replacement). ``shared_experts`` are dense: every rank runs them."""
    return "experts" in name.split(".")


def count_params(model: Any, is_expert: Callable[[str], bool] = is_expert_param) -> ParamCounts:
    """Sizes of a model's trainable parameters, split into dense and expert. Works on a plain
    module (before AutoEP); tied parameters are counted once, as ``named_parameters`` yields them."""
    dense, expert = [], []
    for name, param in model.named_parameters():
        if not getattr(param, "requires_grad", True):
            continue
        numel = int(math.prod(getattr(param, "ds_shape", None) or param.shape))
        (expert if is_expert(name) else dense).append(numel)
    return ParamCounts(tuple(dense), tuple(expert))


def moe_transformer_counts(*, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
                           num_kv_heads: int, ffn_hidden_size: int, num_experts: int,
                           head_dim: int | None = None, tie_embeddings: bool = False) -> ParamCounts:
    """Parameter tensors of a Mixtral-style decoder: GQA attention without biases, RMSNorm,
    a router ``Linear(hidden, num_experts)`` and SwiGLU experts (3 matrices of hidden x ffn) in
    every layer. Used for models too large to build, even on the meta device, in a test."""
    head_dim = head_dim or hidden_size // num_heads
    per_layer = [
        hidden_size * num_heads * head_dim,  # q
        hidden_size * num_kv_heads * head_dim,  # k
        hidden_size * num_kv_heads * head_dim,  # v
        num_heads * head_dim * hidden_size,  # o
        hidden_size, hidden_size,  # input / post-attention RMSNorm
        num_experts * hidden_size,  # router
    ]
    dense = [vocab_size * hidden_size] + per_layer * num_layers + [hidden_size]
    if not tie_embeddings:
        dense.append(vocab_size * hidden_size)
    expert = [num_experts * 2 * ffn_hidden_size * hidden_size, num_experts * hidden_size * ffn_hidden_size] * num_layers
    return ParamCounts(tuple(dense), tuple(expert))


#: Mixtral-8x7B (``mistralai/Mixtral-8x7B-v0.1`` config.json): 46,702,792,704 parameters.
MIXTRAL_8X7B = dict(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                    ffn_hidden_size=14336, num_experts=8)


# ------------------------------------------------------------------------- modules, for the working set

@dataclass(frozen=True)
class GatherUnit:
    """The parameters ZeRO-3 gathers together: one module's own parameters, or all of a leaf
    module's (``set_z3_leaf_module``: a MoE block trained without EP, all experts at once).
    Sizes are whole tensors (experts: all ``num_experts``, before expert parallelism splits them)."""

    name: str
    sizes: tuple[int, ...]
    expert: tuple[bool, ...]
    leaf: bool = False
    #: Decoder layer index parsed from the name (``layers.3.``), None outside the layers.
    layer: int | None = None

    def local(self, ep_size: int) -> tuple[int, ...]:
        """Tensor sizes on one rank: expert tensors split over ``ep_size`` ranks."""
        return tuple(n // ep_size if e else n for n, e in zip(self.sizes, self.expert))


def layer_index(name: str) -> int | None:
    """The decoder layer a module belongs to, parsed from its name (``model.layers.3.mlp``: 3)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in ("layers", "layer", "h", "blocks") and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def gather_units(model: Any, is_leaf: Callable[[str, Any], bool] = lambda name, module: False,
                 is_expert: Callable[[str], bool] = is_expert_param) -> tuple[GatherUnit, ...]:
    """``model``'s gather units in module (forward) order; trainable parameters only, tied ones once."""
    units, seen, skip = [], set(), None
    for name, module in model.named_modules():
        if skip is not None and name.startswith(skip):
            continue
        leaf = bool(name) and is_leaf(name, module)
        skip = name + "." if leaf else None
        params = module.named_parameters(recurse=leaf) if leaf else module.named_parameters(recurse=False)
        sizes, expert = [], []
        for pname, param in params:
            if id(param) in seen or not getattr(param, "requires_grad", True):
                continue
            seen.add(id(param))
            sizes.append(int(math.prod(getattr(param, "ds_shape", None) or param.shape)))
            expert.append(is_expert(f"{name}.{pname}" if name else pname))
        if sizes:
            units.append(GatherUnit(name, tuple(sizes), tuple(expert), leaf, layer_index(name)))
    return tuple(units)
