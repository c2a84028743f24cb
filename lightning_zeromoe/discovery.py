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
AutoEP preset and whose blocks sit where the preset expects; any Hugging Face model, by structure
(:mod:`lightning_zeromoe.moe_structure`) with its routing read from its config
(:mod:`lightning_zeromoe.hf_semantics`); a module that describes itself with an
``autoep_pattern`` dict (our :class:`~lightning_zeromoe.models.TinyMoELM` does). Blocks AutoEP
cannot express are returned as :class:`FallbackBlock` with the reason; the strategy proves the
rest (:mod:`lightning_zeromoe.conversion_check`) before ``deepspeed.initialize``.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from lightning_zeromoe.hf_semantics import (Routing, default_routing, routing_from_config, text_config,
                                            training_only_difference)
from lightning_zeromoe.moe_structure import BlockLayout, analyse_block, expected_num_experts, find_blocks


@dataclass(frozen=True)
class MoEPattern:
    """Where a custom model's MoE blocks are, in AutoEP's terms, and how they route.

    ``block`` is a regex over module names *relative to the LightningModule* (what
    ``named_modules()`` prints), e.g. ``r"model\\.layers\\.\\d+\\.moe"``. The block must have a
    router child (``router``, a Linear of shape ``[num_experts, hidden]``) and an experts child
    holding fused 3-D weights (``w1`` = ``[E, 2*ffn, hidden]`` gate+up when ``w3`` is None, or
    separate ``w1``/``w3`` of ``[E, ffn, hidden]``; ``w2`` = ``[E, hidden, ffn]``).

    Routing fields left at None are read from the Hugging Face config of the model that holds the
    blocks (:func:`lightning_zeromoe.hf_semantics.routing_from_config`), never from AutoEP's
    custom defaults; for a model without an HF config they default to softmax, renormalised
    top-k, scale 1 (what :class:`~lightning_zeromoe.models.TinyMoELM` does). Either way the
    setup-time probe proves them per block before training.
    """

    block: str
    top_k: int | None = None
    router: str = "gate"
    experts: str = "experts"
    w1: str = "gate_up_proj"
    w2: str = "down_proj"
    w3: str | None = None
    score_func: str | None = None
    route_norm: bool | None = None
    route_scale: float | None = None
    shared_experts: str | None = None
    shared_experts_gate: str | None = None
    expert_activation: str | None = None

    def routing_overrides(self) -> dict[str, Any]:
        return {"score_func": self.score_func, "route_norm": self.route_norm, "route_scale": self.route_scale,
                "top_k": self.top_k, "shared_experts": self.shared_experts,
                "shared_experts_gate": self.shared_experts_gate, "expert_activation": self.expert_activation}

    def autoep_section(self, routing: Routing | None = None) -> dict[str, Any]:
        section = {
            "moe_layer_pattern": self.block,
            "router_pattern": self.router,
            "expert_pattern": self.experts,
            "expert_w1": self.w1,
            "expert_w2": self.w2,
            "expert_w3": self.w3,
        }
        if self.top_k is not None:
            section["top_k"] = self.top_k
        if routing is not None:
            section.update(routing.autoep_keys())
        return section


@dataclass(frozen=True)
class MoEBlock:
    """One MoE block found in the module tree, with what export needs to restore it.

    ``layout`` holds the model's own names (router weight, expert tensors, fused layout, extra
    routing tensors such as DeepSeek-V3's ``e_score_correction_bias``); ``routing`` the semantics
    the AutoEP section was built from. Both are None for self-described non-HF modules.
    """

    path: str
    num_experts: int
    top_k: int | None
    layout: BlockLayout | None = field(default=None, compare=False)
    routing: Routing | None = field(default=None, compare=False)
    #: The original block returns ``(hidden, router_logits)``; the converted layer must too (Llama-4).
    returns_tuple: bool = False


@dataclass(frozen=True)
class FallbackBlock:
    """An MoE block that trains under ZeRO-3 without expert parallelism, and why."""

    path: str
    reason: str
    block_class: str = ""
    layout: BlockLayout | None = field(default=None, compare=False)


@dataclass
class Discovery:
    """What the strategy learned about the model's MoE layers before any engine exists."""

    source: str  # "pattern" | "hf:<preset>" | "hf:custom:<model_type>" | "self-described" | "none"
    #: Blocks AutoEP will convert (expert parallel), pending the setup-time probe.
    blocks: list[MoEBlock] = field(default_factory=list)
    #: The ``expert_parallel`` keys that locate the blocks (no ``enabled``/``autoep_size``).
    autoep: dict[str, Any] = field(default_factory=dict)
    #: Lent to the root as ``.config`` during ``deepspeed.initialize`` (HF models only).
    root_config: Any = None
    #: Paths of native ``deepspeed.moe.layer.MoE`` modules (refused under ZeRO-3).
    native_moe: list[str] = field(default_factory=list)
    #: Module names that look MoE-ish, for the "nothing found" error.
    candidates: list[str] = field(default_factory=list)
    #: Blocks that train under plain ZeRO-3 (registered as ZeRO-3 leaf modules), with the reason.
    fallback: list[FallbackBlock] = field(default_factory=list)

    def summary(self, ep_enabled: bool = True) -> str:
        """One line: which blocks get EP and which do not, and why."""
        if not ep_enabled:
            paths = [b.path for b in self.blocks] + [b.path for b in self.fallback]
            return (f"{len(paths)} MoE block(s) train under ZeRO without expert parallelism (ep_size=1)"
                    + (f": {_abbrev(paths)}" if paths else ""))
        ep = f"{len(self.blocks)} MoE block(s) with expert parallelism"
        if self.blocks:
            ep += f" ({_abbrev([b.path for b in self.blocks])})"
        if not self.fallback:
            return ep
        reasons: dict[str, list[str]] = {}
        for block in self.fallback:
            reasons.setdefault(block.reason, []).append(block.path)
        rest = "; ".join(f"{_abbrev(paths)}: {reason}" for reason, paths in reasons.items())
        return f"{ep}; {len(self.fallback)} without EP ({rest})"

    def without(self, failed: dict[str, str]) -> "Discovery":
        """A copy with the ``failed`` blocks (path -> reason) moved to the fallback, pattern narrowed."""
        if not failed:
            return self
        kept = [b for b in self.blocks if b.path not in failed]
        fallback = list(self.fallback) + [
            FallbackBlock(b.path, failed[b.path], b.layout.block_class if b.layout else "", b.layout)
            for b in self.blocks if b.path in failed]
        autoep = dict(self.autoep)
        if kept:
            autoep["moe_layer_pattern"] = exact_pattern(b.path for b in kept)
        else:
            autoep = {}
        return replace(self, blocks=kept, fallback=fallback, autoep=autoep)


def _abbrev(paths: list[str], limit: int = 4) -> str:
    return ", ".join(paths[:limit]) + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def exact_pattern(paths: Any) -> str:
    """A ``re.fullmatch`` pattern matching exactly these module names."""
    return "|".join(re.escape(p) for p in paths)


def discover(root: nn.Module, pattern: MoEPattern | dict[str, Any] | None = None) -> Discovery:
    """Find the MoE blocks under ``root`` (a LightningModule) and how AutoEP should address them.

    Sources, in order: an explicit pattern; a Hugging Face model whose type has an AutoEP preset
    and whose blocks sit where the preset expects; any Hugging Face model, by structure (router
    [E, H] + 3-D experts) with the routing read from its config; a self-described module.
    """
    if isinstance(pattern, dict):
        pattern = MoEPattern(**pattern)
    native = native_moe_paths(root)
    if pattern is not None:
        found = _from_pattern(root, pattern)
    else:
        found = (_from_hf_model(root) or _from_hf_structure(root) or _from_self_described(root)
                 or Discovery(source="none"))
    found.native_moe = native
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


def _blocks_matching(root: nn.Module, regex: str, router: str, experts: str) -> list[tuple[str, nn.Module]]:
    compiled = re.compile(regex)
    return [(name, m) for name, m in root.named_modules()
            if compiled.fullmatch(name) and hasattr(m, router) and hasattr(m, experts)]


def _num_experts(block: nn.Module, router: str) -> int:
    weight = getattr(getattr(block, router), "weight")
    shape = getattr(weight, "ds_shape", weight.shape)  # ZeRO-3 partitioned params keep ds_shape
    return int(shape[0])


def _from_pattern(root: nn.Module, pattern: MoEPattern) -> Discovery:
    matched = _blocks_matching(root, pattern.block, pattern.router, pattern.experts)
    holder = _config_holder(root, matched[0][0]) if matched else None
    overrides = pattern.routing_overrides()
    if holder is not None:
        routing = routing_from_config(text_config(holder[1]), overrides=overrides,
                                      shared_experts=pattern.shared_experts,
                                      shared_experts_gate=pattern.shared_experts_gate)
    else:
        routing = default_routing(overrides)
    if isinstance(routing, str):
        raise ValueError(f"MoEPattern(block={pattern.block!r}): {routing}.")
    blocks = [MoEBlock(name, _num_experts(m, pattern.router), routing.top_k,
                       analyse_block(name, m, _num_experts(m, pattern.router)), routing)
              for name, m in matched]
    return Discovery(source="pattern", blocks=blocks, autoep=pattern.autoep_section(routing),
                     root_config=holder[1] if holder else None)


def _config_holder(root: nn.Module, path: str) -> tuple[str, Any] | None:
    """The innermost module on the way to ``path`` (itself included) that carries an HF config."""
    parts = path.split(".") if path else []
    for i in range(len(parts), -1, -1):
        prefix = ".".join(parts[:i])
        module = root.get_submodule(prefix) if prefix else root
        config = getattr(module, "config", None)
        if isinstance(getattr(config, "model_type", None), str):
            return prefix, config
    return None


def _from_hf_structure(root: nn.Module) -> Discovery | None:
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
        holder = _config_holder(root, layout.path)
        assert holder is not None  # every layout was found under a module with a config
        groups.setdefault(id(holder[1]), (holder[1], []))[1].append(layout)
    if len(groups) > 1:
        where = ", ".join(f"{blocks[0].path} ({cfg.model_type})" for cfg, blocks in groups.values())
        raise ValueError(f"Found several Hugging Face MoE models ({where}); AutoEP converts one model "
                         "family per engine. Pass moe_pattern=MoEPattern(...) to choose the blocks.")
    config, found = next(iter(groups.values()))
    tconfig = text_config(config)
    model_type = getattr(tconfig, "model_type", "?")
    convertible: list[tuple[BlockLayout, Routing]] = []
    fallback: list[FallbackBlock] = []
    for layout in found:
        routing = routing_from_config(tconfig, shared_experts=layout.shared_experts,
                                      shared_experts_gate=layout.shared_experts_gate)
        # The family's own reason (e.g. LongCat's zero experts) says more than the structural one.
        reason = (routing if isinstance(routing, str) else None) or layout.unsupported
        if reason is None and routing.num_expert_groups and routing.group_score_func != "top2_sum":
            reason = (f"its group-limited routing scores groups by '{routing.group_score_func}'; AutoEP's config "
                      "selects only top2_sum")
        if reason is not None:
            fallback.append(FallbackBlock(layout.path, reason, layout.block_class, layout))
        else:
            convertible.append((layout, routing))
    # AutoEP converts one block layout per engine: keep the most common one, the rest fall back.
    signatures = Counter(_signature(lay, rt) for lay, rt in convertible)
    keep = signatures.most_common(1)[0][0] if signatures else None
    blocks: list[MoEBlock] = []
    for layout, routing in convertible:
        if _signature(layout, routing) == keep:
            blocks.append(MoEBlock(layout.path, layout.num_experts, routing.top_k, layout, routing))
        else:
            fallback.append(FallbackBlock(layout.path, "it differs in layout or routing from the model's other "
                                          "MoE blocks, and AutoEP converts one kind per model",
                                          layout.block_class, layout))
    autoep: dict[str, Any] = {}
    if blocks:
        first, routing = blocks[0].layout, blocks[0].routing
        assert first is not None and routing is not None
        autoep = {"moe_layer_pattern": exact_pattern(b.path for b in blocks), "router_pattern": first.autoep_router,
                  "expert_pattern": first.experts, "expert_w1": first.w1, "expert_w2": first.w2,
                  "expert_w3": first.w3, "num_experts_attr": _num_experts_attr(tconfig, first.num_experts),
                  **routing.autoep_keys()}
    return Discovery(source=f"hf:custom:{model_type}", blocks=blocks, autoep=autoep, root_config=config,
                     fallback=fallback)


def _signature(layout: BlockLayout, routing: Routing) -> tuple[Any, ...]:
    return (layout.autoep_router, layout.experts, layout.w1, layout.w2, layout.w3, layout.num_experts, routing)


def _num_experts_attr(config: Any, num_experts: int) -> str:
    """The config attribute holding the expert count, or a name AutoEP will not find (it then
    takes the count from the router weight)."""
    for attr in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"):
        if getattr(config, attr, None) == num_experts:
            return attr
    return "zeromoe_num_experts_from_router_weight"


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
    blocks = [MoEBlock(_join(found.path, name), _num_experts(m, preset.router_pattern), top_k,
                       analyse_block(_join(found.path, name), m, _num_experts(m, preset.router_pattern)))
              for name, m in found.blocks]
    autoep = {"preset_model": found.preset_name}
    if found.path or found.relative != preset.moe_layer_pattern:
        autoep["moe_layer_pattern"] = _prefix(found.path) + found.relative
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
