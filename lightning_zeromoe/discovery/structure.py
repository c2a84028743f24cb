"""What an MoE block looks like, found by structure rather than by name.

A block is a module with two children: a *router* whose weight projects hidden -> E, and an
*experts* module holding 3-D weights whose first dimension is E, or a ``ModuleList`` of E identical
expert MLPs (:mod:`lightning_zeromoe.discovery.expert_list`: the hand-written kind). Names differ across the ~27
Hugging Face MoE families (``gate``, ``router``, ``gate.wg``, ``router.layer``; blocks at
``mlp``, ``block_sparse_moe``, ``feed_forward``); the structure does not. :func:`find_blocks`
returns one :class:`BlockLayout` per block, with the model's own parameter names (what export
needs to restore them) and, when AutoEP cannot take the block as it is, the reason.

Pure: walks ``named_modules`` and reads shapes (``ds_shape`` for ZeRO-3 partitioned params).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_zeromoe.discovery.expert_list import ExpertList, find_expert_list, shape_of, weight_shapes
from lightning_zeromoe.discovery.flat_experts import EXPERTS_ALIAS, FLAT, find_flat_experts

SHARED_EXPERT_NAMES = ("shared_expert", "shared_experts", "shared_mlp")
SHARED_GATE_NAMES = ("shared_expert_gate",)
#: Tensors a block may carry for routing besides the router weight (kept, and named for export).
ROUTING_TENSOR_NAMES = ("e_score_correction_bias", "expert_bias")
#: What AutoEP's router calls a bias added to the scores for the choice of experts only
#: (``deepspeed/moe/ep_router.py``); AutoEP copies it from any submodule of the block.
SCORE_BIAS = "e_score_correction_bias"
#: Child name under which a nested router projection (``gate.wg``) is shown to AutoEP, which reads
#: ``<router>.weight`` from a direct child (see :func:`lightning_zeromoe.conversion.check.router_aliases`).
ROUTER_ALIAS = "zeromoe_router"
_NUM_EXPERTS_ATTRS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class BlockLayout:
    """One MoE block, in the model's own names (all relative to the block)."""

    path: str
    num_experts: int
    hidden_size: int
    router: str                       # child attribute, e.g. "gate"
    router_weight: str                # e.g. "gate.weight" or "gate.wg.weight"
    experts: str                      # child attribute, e.g. "experts"
    w1: str                           # gate+up fused ("gate_up_proj") or gate alone when w3 is set
    w2: str                           # down projection
    w3: str | None = None             # up projection when stored apart from the gate
    #: ``gate_up_first``: w1 is [E, 2F, H] (Mixtral); ``hidden_first``: w1 is [E, H, 2F] (GPT-OSS, Llama-4);
    #: ``per_expert``: one module per expert (``storage="module_list"``); ``flattened``: 2-D ``[E * ffn, hidden]``
    #: gate/up/down (``storage="flattened_2d"``, DBRX; :mod:`lightning_zeromoe.discovery.flat_experts`).
    layout: str = "gate_up_first"
    router_bias: str | None = None
    shared_experts: str | None = None
    shared_experts_gate: str | None = None
    #: Other routing tensors in the block, e.g. ``gate.e_score_correction_bias`` (DeepSeek-V3).
    extra_tensors: tuple[str, ...] = ()
    #: Why AutoEP cannot take this block as it is (None: it can be tried).
    unsupported: str | None = None
    block_class: str = ""
    #: ``fused_3d`` (3-D ``[E, ...]`` tensors) or ``module_list`` (``experts.{i}.<w1>.weight``, AutoEP's
    #: name for per-expert modules): then ``w1``/``w2``/``w3`` name each expert's Linear children; or
    #: ``flattened_2d`` (DBRX's ``[E * ffn, hidden]`` tensors in the module ``experts``, e.g. ``experts.mlp``).
    storage: str = "fused_3d"
    #: AutoEP's name of the experts' activation where it was read off the experts (module lists);
    #: None: not read (AutoEP's default, ``swiglu``).
    expert_activation: str | None = None

    @property
    def router_linear(self) -> str:
        """The module whose ``weight`` is the router projection, e.g. ``gate`` or ``gate.wg``."""
        return self.router_weight.rsplit(".", 1)[0]

    @property
    def score_bias(self) -> str | None:
        """The block's own choice-only score bias, if it has one: DeepSeek-V3's
        ``gate.e_score_correction_bias`` (AutoEP's name), or the same bias kept as ``expert_bias``
        on the block by AFMoE and LFM2-MoE (``topk(sigmoid(logits) + expert_bias)``, weights
        from the unbiased scores: what AutoEP's router does with its bias)."""
        own = [t for t in self.extra_tensors if t.rsplit(".", 1)[-1] == SCORE_BIAS]
        return own[0] if own else ("expert_bias" if "expert_bias" in self.extra_tensors else None)

    @property
    def autoep_experts(self) -> str:
        """The experts child name AutoEP is given: the experts module itself, or the alias of a nested one."""
        return EXPERTS_ALIAS if "." in self.experts else self.experts

    @property
    def autoep_router(self) -> str:
        """The router child name AutoEP is given: the router itself, or the alias of a nested projection."""
        return self.router if self.router_linear == self.router else ROUTER_ALIAS


def expected_num_experts(config: object) -> int | None:
    for attr in _NUM_EXPERTS_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return value
    ffn = getattr(config, "ffn_config", None)  # DBRX
    value = getattr(ffn, "moe_num_experts", None)
    return value if isinstance(value, int) else None


def _router_weight(block: nn.Module, num_experts: int | None) -> tuple[str, str, tuple[int, ...]] | None:
    """The child whose weight is [E, H] (directly, or one level down as in ``gate.wg``).

    Children named like a router (``router``, ``gate``) are tried first: an experts module can hold
    an ``[E, H]`` tensor of its own (Ergo's per-expert ``post_expert_norm.weight``) and come first.
    """
    children = sorted(block.named_children(), key=lambda c: not any(w in c[0] for w in ("router", "gate")))
    for child_name, child in children:
        for rel, shape in weight_shapes(child):
            routerish = any(word in child_name for word in ("router", "gate"))
            # LongCat's router also scores its zero-computation experts: more rows than experts.
            fits = num_experts is None or shape[0] == num_experts or (routerish and shape[0] > num_experts)
            if len(shape) == 2 and shape[0] > 1 and fits:
                return child_name, f"{child_name}.{rel}", shape
    return None


def _three_d(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: shape_of(p) for n, p in module.named_parameters(recurse=False) if len(shape_of(p)) == 3}


def _expert_names(params: dict[str, tuple[int, ...]]) -> tuple[str, str, str | None] | None:
    """(w1, w2, w3) among an experts module's 3-D parameters."""
    names = list(params)
    down = [n for n in names if "down" in n or n in ("w2", "wo")]
    if len(names) == 2:
        w2 = down[0] if len(down) == 1 else names[1]
        w1 = next(n for n in names if n != w2)
        return w1, w2, None
    if len(names) == 3:
        gate = [n for n in names if "gate" in n or n == "w1"]
        up = [n for n in names if "up" in n or n == "w3"]
        if len(down) == 1 and len(gate) == 1 and len(up) == 1:
            return gate[0], down[0], up[0]
    return None


def _layout(w1: tuple[int, ...], w2: tuple[int, ...], fused: bool) -> str | None:
    """Which way round the expert matrices are stored ([E, out, in] or [E, in, out])."""
    _, a, b = w1
    _, c, d = w2
    mult = 2 if fused else 1
    if a == mult * d and b == c:
        return "gate_up_first"   # w1 [E, 2F, H], w2 [E, H, F]
    if b == mult * c and a == d:
        return "hidden_first"    # w1 [E, H, 2F], w2 [E, F, H]
    return None


def _routing_tensors(block: nn.Module) -> tuple[str, ...]:
    found = [n for n, _ in block.named_buffers() if n.rsplit(".", 1)[-1] in ROUTING_TENSOR_NAMES]
    found += [n for n, _ in block.named_parameters() if n.rsplit(".", 1)[-1] in ROUTING_TENSOR_NAMES]
    return tuple(dict.fromkeys(found))


def _list_layout(path: str, block: nn.Module, found: ExpertList) -> BlockLayout:
    """The layout of a block whose experts are a ``ModuleList`` (roles guessed from shapes and names;
    :func:`lightning_zeromoe.discovery.block_probe.read_experts` reads them off the experts)."""
    w1, w2, w3 = found.guess_roles() if found.linears else ("", "", None)
    bias = getattr(block.get_submodule(found.router_weight.rsplit(".", 1)[0]), "bias", None)
    shared = next((n for n in SHARED_EXPERT_NAMES if isinstance(getattr(block, n, None), nn.Module)), None)
    shared_gate = next((n for n in SHARED_GATE_NAMES if isinstance(getattr(block, n, None), nn.Module)), None)
    router_bias = f"{found.router_weight.rsplit('.', 1)[0]}.bias" if isinstance(bias, torch.Tensor) else None
    return BlockLayout(path=path, num_experts=found.num_experts, hidden_size=found.hidden_size, router=found.router,
                       router_weight=found.router_weight, experts=found.experts, w1=w1, w2=w2, w3=w3,
                       layout="per_expert", router_bias=router_bias,
                       shared_experts=shared, shared_experts_gate=shared_gate, extra_tensors=_routing_tensors(block),
                       unsupported=found.unsupported, block_class=type(block).__name__, storage="module_list")


def analyse_block(path: str, block: nn.Module, num_experts: int | None = None) -> BlockLayout | None:
    """The layout of ``block`` if it is an MoE block (router [E, H] + experts), else None."""
    listed = find_expert_list(block, num_experts)
    if listed is not None:
        return _list_layout(path, block, listed)
    router = _router_weight(block, num_experts)
    if router is None:
        return None
    router_name, router_weight, (n_exp, hidden) = router
    experts_name, params = None, {}
    for child_name, child in block.named_children():
        if child_name == router_name:
            continue
        found = {n: s for n, s in _three_d(child).items() if s[0] == n_exp}
        if found:
            experts_name, params = child_name, found
            break
    shared = next((n for n in SHARED_EXPERT_NAMES if isinstance(getattr(block, n, None), nn.Module)), None)
    shared_gate = next((n for n in SHARED_GATE_NAMES if isinstance(getattr(block, n, None), nn.Module)), None)
    router_mod = getattr(block, router_name)
    bias = getattr(router_mod, "bias", None)
    common = dict(path=path, num_experts=n_exp, hidden_size=hidden, router=router_name, router_weight=router_weight,
                  router_bias=f"{router_name}.bias" if isinstance(bias, torch.Tensor) else None,
                  shared_experts=shared, shared_experts_gate=shared_gate, extra_tensors=_routing_tensors(block),
                  block_class=type(block).__name__)
    if experts_name is None:
        has_expert_child = any("expert" in n for n, _ in block.named_children() if n != router_name)
        if num_experts is None or not has_expert_child:
            return None  # a lone [E, H] projection is not evidence of an MoE block
        flat = find_flat_experts(block, router_name, n_exp, hidden)
        if flat is not None:  # DBRX: [E * ffn, hidden] tensors, exact views of AutoEP's 3-D ones
            return BlockLayout(**common, experts=flat.module, w1=flat.gate, w2=flat.down, w3=flat.up,
                               layout="flattened", storage=FLAT)
        return BlockLayout(**common, experts="experts", w1="", w2="",
                           unsupported="its experts are not stored as 3-D [num_experts, ...] tensors")
    names = _expert_names(params)
    if names is None:
        return BlockLayout(**common, experts=experts_name, w1="", w2="",
                           unsupported=f"its experts module '{experts_name}' holds {sorted(params)}, not a "
                                       "gate/up + down pair of 3-D tensors")
    w1, w2, w3 = names
    layout = _layout(params[w1], params[w2], fused=w3 is None)
    experts_mod = getattr(block, experts_name)
    biases = [n for n, p in experts_mod.named_parameters(recurse=False) if len(shape_of(p)) == 2]
    unsupported = None
    if layout is None:
        unsupported = f"expert shapes {params[w1]} / {params[w2]} are neither [E,2F,H]/[E,H,F] nor [E,H,2F]/[E,F,H]"
    elif biases:
        unsupported = f"its experts have biases ({', '.join(biases)}), which AutoEP's grouped experts do not carry"
    return BlockLayout(**common, experts=experts_name, w1=w1, w2=w2, w3=w3, layout=layout or "unknown",
                       unsupported=unsupported)


def find_blocks(root: nn.Module, num_experts: int | None = None, prefix: str = "") -> list[BlockLayout]:
    """Every MoE block under ``root`` (outermost first; nothing inside a found block is searched)."""
    found: list[BlockLayout] = []
    for name, module in root.named_modules():
        if any(name == b.path or name.startswith(b.path + ".") for b in found if b.path):
            continue
        layout = analyse_block(name, module, num_experts)
        if layout is not None:
            found.append(layout)
    if prefix:
        found = [_reprefix(b, prefix) for b in found]
    return found


def _reprefix(block: BlockLayout, prefix: str) -> BlockLayout:
    from dataclasses import replace

    return replace(block, path=f"{prefix}.{block.path}" if block.path else prefix)
