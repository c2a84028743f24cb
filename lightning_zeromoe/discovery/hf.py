"""Finding the MoE blocks of a Hugging Face model inside a LightningModule.

Two ways, tried in this order by :func:`lightning_zeromoe.discovery.find.discover`: a model whose
``config.model_type`` has an AutoEP preset and whose blocks sit where the preset expects
(:func:`from_hf_model`), and any Hugging Face MoE model by structure, its routing read from its own
config (:func:`from_hf_structure`, :mod:`lightning_zeromoe.discovery.hf_semantics`). AutoEP matches
patterns from the engine's root (the LightningModule), so every pattern returned here is rooted
there, and the model's config is returned for the strategy to lend to the root while
``deepspeed.initialize`` runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_zeromoe.discovery.block_probe import gathered, read_experts
from lightning_zeromoe.discovery.result import (NUM_EXPERTS_FROM_ROUTER, Discovery, FallbackBlock, MoEBlock,
                                               blocks_matching, config_holder, join, num_experts_of, one_kind,
                                               prefix_pattern)
from lightning_zeromoe.discovery.hf_semantics import Routing, routing_from_config, text_config, training_only_difference
from lightning_zeromoe.discovery.tensor_conditions import weights_difference
from lightning_zeromoe.discovery.structure import BlockLayout, analyse_block, expected_num_experts, find_blocks
from lightning_zeromoe.knowledge import say


def from_hf_structure(root: nn.Module) -> Discovery | None:
    """Any Hugging Face MoE model, by structure, its routing read from its own config."""
    layouts: dict[str, BlockLayout] = {}
    for name, module in root.named_modules():
        config = getattr(module, "config", None)
        if not isinstance(getattr(config, "model_type", None), str):
            continue
        for layout in find_blocks(module, expected_num_experts(text_config(config)), prefix=name):
            layouts.setdefault(layout.path, layout)
    if not layouts:
        return None
    groups: dict[int, tuple[Any, list[BlockLayout]]] = {}
    for layout in layouts.values():
        holder = config_holder(root, layout.path)
        assert holder is not None  # every layout was found under a module with a config
        groups.setdefault(id(holder[1]), (holder[1], []))[1].append(layout)
    if len(groups) > 1:
        where = ", ".join(f"{blocks[0].path} ({cfg.model_type})" for cfg, blocks in groups.values())
        raise ValueError(say("autoep-several-models", "several-models", "choose-blocks", where=where))
    config, found = next(iter(groups.values()))
    tconfig = text_config(config)
    model_type = getattr(tconfig, "model_type", "?")
    convertible: list[tuple[BlockLayout, Routing]] = []
    fallback: list[FallbackBlock] = []
    for layout in found:
        if layout.storage == "module_list":  # which Linear is the gate, which activation: read off the experts
            with gathered(root.get_submodule(layout.path)), torch.no_grad():
                layout = read_experts(root.get_submodule(layout.path), layout)
        routing = routing_from_config(tconfig, shared_experts=layout.shared_experts,
                                      shared_experts_gate=layout.shared_experts_gate)
        if not isinstance(routing, str) and layout.expert_activation and routing.expert_activation is None:
            routing = dataclasses.replace(routing, expert_activation=layout.expert_activation)
        # The family's own reason (e.g. LongCat's zero experts) says more than the structural one.
        reason = (routing if isinstance(routing, str) else None) or layout.unsupported
        if reason is None:
            reason = weights_difference(tconfig, root.get_submodule(layout.path))
        if reason is None and routing.num_expert_groups and routing.group_score_func != "top2_sum":
            reason = (f"its group-limited routing scores groups by '{routing.group_score_func}'; AutoEP's config "
                      "selects only top2_sum")
        if reason is not None:
            fallback.append(FallbackBlock(layout.path, reason, layout.block_class, layout))
        else:
            convertible.append((layout, routing))
    blocks, autoep = one_kind(convertible, fallback, _num_experts_attr(tconfig, convertible[0][0].num_experts)
                              if convertible else NUM_EXPERTS_FROM_ROUTER)
    return Discovery(source=f"hf:custom:{model_type}", blocks=blocks, autoep=autoep, root_config=config,
                     fallback=fallback)


def _num_experts_attr(config: Any, num_experts: int) -> str:
    """The config attribute holding the expert count, or a name AutoEP will not find (it then
    takes the count from the router weight)."""
    for attr in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"):
        if getattr(config, attr, None) == num_experts:
            return attr
    return NUM_EXPERTS_FROM_ROUTER


@dataclass(frozen=True)
class _HFModel:
    path: str
    model: nn.Module
    preset_name: str
    relative: str  # the preset's block pattern, relative to ``model``
    blocks: list[tuple[str, nn.Module]]  # names relative to ``model``


def _hf_models(root: nn.Module) -> list[_HFModel]:
    """Outermost submodules whose HF config has an AutoEP preset *and* that hold the preset's blocks.

    Carrying the config is not enough: a LightningModule that keeps ``self.config = hf_config``
    next to ``self.model = MixtralForCausalLM(hf_config)`` has the config but not the blocks
    under the preset's names, and must not hide the real model inside it. If no candidate holds
    blocks, the outermost one is returned anyway, so the "nothing found" error names its preset.
    """
    holding: list[_HFModel] = []
    empty: list[_HFModel] = []
    for name, module in root.named_modules():
        model_type = getattr(getattr(module, "config", None), "model_type", None)
        preset_name = _preset_for_model_type(model_type) if isinstance(model_type, str) else None
        if preset_name is None or any(t.path == "" or name.startswith(t.path + ".") for t in holding):
            continue
        preset = _autoep_preset(preset_name)
        relative = preset.moe_layer_pattern
        local = blocks_matching(module, relative, preset.router_pattern, preset.experts_pattern)
        if not local and relative.startswith(r"model\."):
            # A base model (e.g. MixtralModel) has no ".model" level: its blocks are "layers.N.mlp".
            relative = relative[len(r"model\."):]
            local = blocks_matching(module, relative, preset.router_pattern, preset.experts_pattern)
        (holding if local else empty).append(_HFModel(name, module, preset_name, relative, local))
    return holding or empty[:1]


def from_hf_model(root: nn.Module) -> Discovery | None:
    """A Hugging Face model whose ``model_type`` has an AutoEP preset, with the preset rooted at it."""
    models = _hf_models(root)
    if not models:
        return None
    if len(models) > 1:
        where = ", ".join(f"{m.path or '<root>'} ({m.preset_name})" for m in models)
        raise ValueError(say("autoep-several-models", "several-models", "choose-blocks", where=where))
    found = models[0]
    preset = _autoep_preset(found.preset_name)
    top_k = getattr(found.model.config, preset.top_k_attr, None)
    blocks = [MoEBlock(join(found.path, name), num_experts_of(m, preset.router_pattern), top_k,
                       analyse_block(join(found.path, name), m, num_experts_of(m, preset.router_pattern)))
              for name, m in found.blocks]
    autoep = {"preset_model": found.preset_name}
    if found.path or found.relative != preset.moe_layer_pattern:
        autoep["moe_layer_pattern"] = prefix_pattern(found.path) + found.relative
    jitter = training_only_difference(text_config(found.model.config))
    if jitter:
        return Discovery(source=f"hf:{found.preset_name}", blocks=[], autoep=autoep, root_config=found.model.config,
                         fallback=[FallbackBlock(b.path, jitter, b.layout.block_class if b.layout else "", b.layout)
                                   for b in blocks])
    return Discovery(source=f"hf:{found.preset_name}", blocks=blocks, autoep=autoep,
                     root_config=found.model.config)


def _preset_for_model_type(model_type: str) -> str | None:
    """The AutoEP preset that AutoEP itself would pick for an HF ``config.model_type``.

    Asked of DeepSpeed's own registry (each preset's ``hf_model_types``) rather than a copy of
    it, because the preset *name* is not the model type: ``qwen3_5_moe`` converts the text
    backbone ``qwen3_5_moe_text``, ``minimax_m3`` converts ``minimax_m3_vl_text``, and
    ``qwen3_moe`` also covers ``qwen2_moe``. The composite configs (``qwen3_5_moe``,
    ``minimax_m3_vl``) map to no preset, which AutoEP refuses at initialize; returning None for
    them lets the search descend to the text backbone inside, whose config AutoEP accepts.
    Imported lazily: only modules that carry an HF config get here, and they need DeepSpeed anyway.
    """
    from deepspeed.module_inject.auto_ep_presets.registry import preset_name_for_hf_model_type

    return preset_name_for_hf_model_type(model_type)


def _autoep_preset(name: str) -> Any:
    from deepspeed.module_inject.auto_ep_presets.registry import get_preset

    return get_preset(name)

