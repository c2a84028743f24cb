"""Finding the MoE blocks in a LightningModule, and telling AutoEP where they are.

AutoEP (``deepspeed/module_inject/auto_ep.py``, 0.19.8) matches ``moe_layer_pattern`` with
``re.fullmatch`` against module names *from the engine's root* and reads ``num_experts`` /
``top_k`` / ``model_type`` from ``root.config``. Under Lightning the root is the LightningModule,
so a Hugging Face model held as ``self.net`` has blocks named ``net.model.layers.0.mlp`` and the
preset's ``model\\.layers\\.\\d+\\.mlp`` finds nothing; and the LightningModule has no ``.config``.
This module finds the blocks wherever they sit and returns an AutoEP section whose pattern is
rooted at the LightningModule, plus the config object the strategy lends to the root while
``deepspeed.initialize`` runs.

Sources, in order: an explicit :class:`MoEPattern` (its unset routing fields read from the HF
config of the model holding the blocks); a Hugging Face model whose ``config.model_type`` has an
AutoEP preset and whose blocks sit where the preset expects, or any Hugging Face model by
structure with its routing read from its config (:mod:`lightning_zeromoe.discovery.hf`); a module
that describes itself with an ``autoep_pattern`` dict (our
:class:`~lightning_zeromoe.reference.models.TinyMoELM` does); and any other module tree by structure
(:mod:`lightning_zeromoe.discovery.structure`: a router ``Linear(hidden, E)`` next to 3-D experts or a
``ModuleList`` of E expert MLPs, whatever the names), its routing read off the block's own forward
(:mod:`lightning_zeromoe.discovery.block_probe`). Blocks AutoEP cannot express are returned as
:class:`FallbackBlock` with the reason; the strategy proves the rest
(:mod:`lightning_zeromoe.conversion.check`) before ``deepspeed.initialize``, and registers every
block that is not converted as a ZeRO-3 leaf module.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from torch import nn

from lightning_zeromoe.discovery.block_probe import read_block
from lightning_zeromoe.discovery.hf import from_hf_model, from_hf_structure
from lightning_zeromoe.discovery.result import (NUM_EXPERTS_FROM_ROUTER, Discovery, FallbackBlock, MoEBlock, MoEPattern,
                                               blocks_matching, config_holder, exact_pattern, num_experts_of,
                                               one_kind, prefix_pattern)
from lightning_zeromoe.discovery.hf_semantics import Routing, default_routing, routing_from_config, text_config
from lightning_zeromoe.discovery.structure import BlockLayout, analyse_block, find_blocks
from lightning_zeromoe.knowledge import say

__all__ = ["Discovery", "FallbackBlock", "MoEBlock", "MoEPattern", "discover", "exact_pattern", "moe_like_names",
           "native_moe_paths"]


def discover(root: nn.Module, pattern: MoEPattern | dict[str, Any] | None = None) -> Discovery:
    """Find the MoE blocks under ``root`` (a LightningModule) and how AutoEP should address them.

    Sources, in order: an explicit pattern; a Hugging Face model whose type has an AutoEP preset
    and whose blocks sit where the preset expects; any Hugging Face model, by structure (router
    [E, H] + 3-D experts) with the routing read from its config; a self-described module; any
    other module tree by structure, with the routing read off each block's forward.
    """
    if isinstance(pattern, dict):
        pattern = MoEPattern(**pattern)
    native = native_moe_paths(root)
    if pattern is not None:
        found = _from_pattern(root, pattern)
    else:
        found = (from_hf_model(root) or from_hf_structure(root) or _from_self_described(root)
                 or _from_structure(root) or Discovery(source="none"))
    found.native_moe = native
    from lightning_zeromoe.discovery.peft_blocks import adapted_blocks

    found = found.without(adapted_blocks(root, [b.path for b in found.blocks]))  # LoRA inside a block: no EP
    found.native_ep_sizes = {path: int(getattr(root.get_submodule(path), "ep_size", 1)) for path in native}
    if not found.blocks and not found.fallback:
        found.candidates = moe_like_names(root)
    return found


def native_moe_paths(root: nn.Module) -> list[str]:
    """Modules that are DeepSpeed's native ``deepspeed.moe.layer.MoE`` (checked by class, no import)."""
    return [name for name, m in root.named_modules()
            if type(m).__name__ == "MoE" and type(m).__module__ == "deepspeed.moe.layer"]


def moe_like_names(root: nn.Module, limit: int = 12) -> list[str]:
    """Names that look like MoE blocks: words like moe/expert/router, or 3-D weight tensors."""
    hint = re.compile(r"moe|expert|router|gate", re.IGNORECASE)
    names = []
    for name, module in root.named_modules():
        has_3d = any(p.dim() == 3 for p in module.parameters(recurse=False))
        if name and (hint.search(name.rsplit(".", 1)[-1]) or has_3d):
            names.append(f"{name} ({type(module).__name__})")
        if len(names) >= limit:
            break
    return names


def _from_pattern(root: nn.Module, pattern: MoEPattern) -> Discovery:
    matched = blocks_matching(root, pattern.block, pattern.router, pattern.experts)
    holder = config_holder(root, matched[0][0]) if matched else None
    overrides = pattern.routing_overrides()
    if holder is not None:
        routing = routing_from_config(text_config(holder[1]), overrides=overrides,
                                      shared_experts=pattern.shared_experts,
                                      shared_experts_gate=pattern.shared_experts_gate)
    else:
        routing = default_routing(overrides)
    if isinstance(routing, str):
        raise ValueError(say("moe-pattern-routing", "unexpressible", "train-without-ep", block=pattern.block,
                             reason=routing))
    blocks = [MoEBlock(name, num_experts_of(m, pattern.router), routing.top_k,
                       _stated(analyse_block(name, m, num_experts_of(m, pattern.router)), pattern), routing)
              for name, m in matched]
    return Discovery(source="pattern", blocks=blocks, autoep=pattern.autoep_section(routing),
                     root_config=holder[1] if holder else None)


def _stated(layout: BlockLayout | None, pattern: MoEPattern) -> BlockLayout | None:
    """A module-list layout with the expert roles the pattern states (what AutoEP will stack)."""
    if layout is None or layout.storage != "module_list":
        return layout
    return replace(layout, w1=pattern.w1, w2=pattern.w2, w3=pattern.w3)


def _from_self_described(root: nn.Module) -> Discovery | None:
    for path, module in root.named_modules():
        described = getattr(type(module), "autoep_pattern", None)
        if not isinstance(described, dict):
            continue
        config = getattr(module, "config", None)
        top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k", None)
        if top_k is None:
            raise ValueError(f"{type(module).__name__} at '{path or '<root>'}' describes its MoE blocks "
                             "but its .config has neither num_experts_per_tok nor top_k.")
        pattern = MoEPattern(
            block=prefix_pattern(path) + described["moe_layer_pattern"],
            top_k=int(top_k),
            router=described.get("router_pattern", "gate"),
            experts=described.get("expert_pattern", "experts"),
            w1=described.get("expert_w1", "gate_up_proj"),
            w2=described.get("expert_w2", "down_proj"),
            w3=described.get("expert_w3"),
        )
        found = _from_pattern(root, pattern)
        found.source = "self-described"
        return found
    return None


def _from_structure(root: nn.Module) -> Discovery | None:
    """Hand-written MoE blocks (no Hugging Face config, no pattern), found by structure, their routing
    read off their own forward (:func:`lightning_zeromoe.discovery.block_probe.read_block`)."""
    layouts = [lay for lay in find_blocks(root) if not _inside_native(root, lay.path)]
    if not layouts:
        return None
    convertible: list[tuple[BlockLayout, Routing]] = []
    fallback: list[FallbackBlock] = []
    returns_tuple: set[str] = set()
    for layout in layouts:
        if layout.unsupported:
            fallback.append(FallbackBlock(layout.path, layout.unsupported, layout.block_class, layout))
            continue
        reading = read_block(root.get_submodule(layout.path), layout)
        if reading.routing is None:
            fallback.append(FallbackBlock(layout.path, reading.reason or "its routing could not be read",
                                          layout.block_class, reading.layout))
            continue
        convertible.append((reading.layout, reading.routing))
        if reading.returns_tuple:
            returns_tuple.add(layout.path)
    blocks, autoep = one_kind(convertible, fallback, NUM_EXPERTS_FROM_ROUTER)
    blocks = [MoEBlock(b.path, b.num_experts, b.top_k, b.layout, b.routing, returns_tuple=b.path in returns_tuple)
              for b in blocks]
    return Discovery(source="structure", blocks=blocks, autoep=autoep, fallback=fallback)


def _inside_native(root: nn.Module, path: str) -> bool:
    """Whether ``path`` is (inside) a native ``deepspeed.moe.layer.MoE``, which has its own rules."""
    return any(path == n or path.startswith(n + ".") for n in native_moe_paths(root))
