"""Finding the MoE blocks in a LightningModule, and telling AutoEP where they are.

AutoEP (``deepspeed/module_inject/auto_ep.py``, 0.19.8) matches ``moe_layer_pattern`` with
``re.fullmatch`` against module names *from the engine's root* and reads ``num_experts`` /
``top_k`` / ``model_type`` from ``root.config``. Under Lightning the root is the LightningModule,
so a Hugging Face model held as ``self.net`` has blocks named ``net.model.layers.0.mlp`` and the
preset's ``model\\.layers\\.\\d+\\.mlp`` finds nothing; and the LightningModule has no ``.config``.
This module finds the blocks wherever they sit and returns an AutoEP section whose pattern is
rooted at the LightningModule, plus the config object the strategy lends to the root while
``deepspeed.initialize`` runs.

Three sources, in order: an explicit :class:`MoEPattern`; a Hugging Face model whose
``config.model_type`` has an AutoEP preset; a module that describes itself with an
``autoep_pattern`` dict (our :class:`~lightning_zeromoe.models.TinyMoELM` does).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass(frozen=True)
class MoEPattern:
    """Where a custom model's MoE blocks are, in AutoEP's terms.

    ``block`` is a regex over module names *relative to the LightningModule* (what
    ``named_modules()`` prints), e.g. ``r"model\\.layers\\.\\d+\\.moe"``. The block must have a
    router child (``router``, a Linear of shape ``[num_experts, hidden]``) and an experts child
    holding fused 3-D weights (``w1`` = ``[E, 2*ffn, hidden]`` gate+up when ``w3`` is None, or
    separate ``w1``/``w3`` of ``[E, ffn, hidden]``; ``w2`` = ``[E, hidden, ffn]``).
    """

    block: str
    top_k: int
    router: str = "gate"
    experts: str = "experts"
    w1: str = "gate_up_proj"
    w2: str = "down_proj"
    w3: str | None = None

    def autoep_section(self) -> dict[str, Any]:
        return {
            "moe_layer_pattern": self.block,
            "router_pattern": self.router,
            "expert_pattern": self.experts,
            "expert_w1": self.w1,
            "expert_w2": self.w2,
            "expert_w3": self.w3,
            "top_k": self.top_k,
        }


@dataclass(frozen=True)
class MoEBlock:
    """One MoE block found in the module tree."""

    path: str
    num_experts: int
    top_k: int | None


@dataclass
class Discovery:
    """What the strategy learned about the model's MoE layers before any engine exists."""

    source: str  # "pattern" | "hf:<preset>" | "self-described" | "none"
    blocks: list[MoEBlock] = field(default_factory=list)
    #: The ``expert_parallel`` keys that locate the blocks (no ``enabled``/``autoep_size``).
    autoep: dict[str, Any] = field(default_factory=dict)
    #: Lent to the root as ``.config`` during ``deepspeed.initialize`` (HF models only).
    root_config: Any = None
    #: Paths of native ``deepspeed.moe.layer.MoE`` modules (refused under ZeRO-3).
    native_moe: list[str] = field(default_factory=list)
    #: Module names that look MoE-ish, for the "nothing found" error.
    candidates: list[str] = field(default_factory=list)


def discover(root: nn.Module, pattern: MoEPattern | dict[str, Any] | None = None) -> Discovery:
    """Find the MoE blocks under ``root`` (a LightningModule) and how AutoEP should address them."""
    if isinstance(pattern, dict):
        pattern = MoEPattern(**pattern)
    native = native_moe_paths(root)
    if pattern is not None:
        found = _from_pattern(root, pattern)
    else:
        found = _from_hf_model(root) or _from_self_described(root) or Discovery(source="none")
    found.native_moe = native
    if not found.blocks:
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


def _blocks_matching(root: nn.Module, regex: str, router: str, experts: str) -> list[tuple[str, nn.Module]]:
    compiled = re.compile(regex)
    return [(name, m) for name, m in root.named_modules()
            if compiled.fullmatch(name) and hasattr(m, router) and hasattr(m, experts)]


def _num_experts(block: nn.Module, router: str) -> int:
    weight = getattr(getattr(block, router), "weight")
    shape = getattr(weight, "ds_shape", weight.shape)  # ZeRO-3 partitioned params keep ds_shape
    return int(shape[0])


def _from_pattern(root: nn.Module, pattern: MoEPattern) -> Discovery:
    blocks = [MoEBlock(name, _num_experts(m, pattern.router), pattern.top_k)
              for name, m in _blocks_matching(root, pattern.block, pattern.router, pattern.experts)]
    return Discovery(source="pattern", blocks=blocks, autoep=pattern.autoep_section())


def _prefix(path: str) -> str:
    return re.escape(path + ".") if path else ""


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
        local = _blocks_matching(module, relative, preset.router_pattern, preset.experts_pattern)
        if not local and relative.startswith(r"model\."):
            # A base model (e.g. MixtralModel) has no ".model" level: its blocks are "layers.N.mlp".
            relative = relative[len(r"model\."):]
            local = _blocks_matching(module, relative, preset.router_pattern, preset.experts_pattern)
        (holding if local else empty).append(_HFModel(name, module, preset_name, relative, local))
    return holding or empty[:1]


def _from_hf_model(root: nn.Module) -> Discovery | None:
    models = _hf_models(root)
    if not models:
        return None
    if len(models) > 1:
        where = ", ".join(f"{m.path or '<root>'} ({m.preset_name})" for m in models)
        raise ValueError(f"Found several Hugging Face MoE models ({where}); AutoEP converts one model "
                         "family per engine. Pass moe_pattern=MoEPattern(...) to choose the blocks.")
    found = models[0]
    preset = _autoep_preset(found.preset_name)
    top_k = getattr(found.model.config, preset.top_k_attr, None)
    blocks = [MoEBlock(_join(found.path, name), _num_experts(m, preset.router_pattern), top_k)
              for name, m in found.blocks]
    autoep = {"preset_model": found.preset_name}
    if found.path or found.relative != preset.moe_layer_pattern:
        autoep["moe_layer_pattern"] = _prefix(found.path) + found.relative
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
            block=_prefix(path) + described["moe_layer_pattern"],
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


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name
