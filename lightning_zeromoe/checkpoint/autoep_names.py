"""AutoEP's names for a MoE block's tensors, and the original block's: the one mapping both ways.

AutoEP (``deepspeed/module_inject/auto_ep*.py``) replaces each MoE block with a layer holding
``router.gate.weight`` and ``experts.w1/w2/w3`` (``w1``/``w3`` gate and up ``[E, ffn, hidden]``,
``w2`` down ``[E, hidden, ffn]``, this rank's experts only), repacked from the block's own tensors
(e.g. ``gate.weight`` and a fused ``gate_up_proj``; ``deepspeed/moe/ep_repack.py``). Resuming
between expert parallelism and none, and loading full weights into AutoEP layers, both need that
repacking and its inverse; they live here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from lightning_zeromoe._private import deepspeed as ds_private
from lightning_zeromoe.knowledge import say

#: Knowledge-base entry for every refusal of a checkpoint that does not fit the run.
ENTRY_ID = "resume-shape-unsupported"
EXPERT_WEIGHTS = ("w1", "w2", "w3")
#: ``BlockLayout.storage`` of experts kept as 2-D ``[E * ffn, hidden]`` tensors (DBRX;
#: ``lightning_zeromoe.discovery.flat_experts.FLAT``).
FLAT = "flattened_2d"


class ResumeShapeError(RuntimeError):
    """A checkpoint does not fit the run now starting (shape or model); the message says why and what to do."""

    entry_id = ENTRY_ID

    def __init__(self, message: str) -> None:  # message: knowledge.say(ENTRY_ID, ...)
        super().__init__(message)


@dataclass(frozen=True)
class BlockNames:
    """How the original MoE block names what AutoEP calls ``router.gate`` and ``experts.w1/w2/w3``."""

    router: str = "gate"
    experts: str = "experts"
    w1: str = "gate_up_proj"
    w2: str = "down_proj"
    w3: str | None = None
    shared: str = ""
    shared_gate: str = ""
    #: ``fused_3d`` (one ``[E, ...]`` tensor per weight) or a preset's per-expert module storage.
    storage: str = "fused_3d"
    #: The block's own name for what AutoEP's router holds as ``e_score_correction_bias``
    #: (empty: ``<router>.e_score_correction_bias``, DeepSeek-V3's).
    score_bias: str = ""
    #: Experts per block, for ``storage="flattened_2d"`` (DBRX's ``[E * ffn, hidden]`` tensors); 0 otherwise.
    num_experts: int = 0


def block_names(ep_section: Mapping[str, Any]) -> BlockNames:
    """The names AutoEP resolved from its preset and the config's overrides."""
    values: dict[str, Any] = {}
    preset_name = ep_section.get("preset_model")
    if preset_name:
        from deepspeed.module_inject.auto_ep_presets.registry import get_preset

        preset = get_preset(preset_name)
        values = dict(router=preset.router_pattern, experts=preset.experts_pattern, w1=preset.expert_w1,
                      w2=preset.expert_w2, w3=preset.expert_w3, storage=preset.expert_storage,
                      shared=preset.shared_experts_pattern if preset.has_shared_experts else "",
                      shared_gate=preset.shared_experts_gate_pattern if preset.has_shared_experts else "")
    for key, ours in (("router_pattern", "router"), ("expert_pattern", "experts"), ("expert_w1", "w1"),
                      ("expert_w2", "w2"), ("expert_w3", "w3"), ("shared_experts_pattern", "shared"),
                      ("shared_experts_gate_pattern", "shared_gate")):
        if key in ep_section:
            values[ours] = ep_section[key]
    return BlockNames(**values)


def names_of_block(layout: Any, section: BlockNames) -> BlockNames:
    """The names of one block as the model itself spells them, from discovery's ``BlockLayout``.

    The AutoEP section may name a nested router projection by its alias (``zeromoe_router``, see
    :data:`lightning_zeromoe.discovery.structure.ROUTER_ALIAS`), which leaves the model with the block;
    the layout has the real path (HunYuan's ``gate.wg``, AFMoE's ``router.gate``), the
    shared-expert modules and the score bias (AFMoE's ``expert_bias``) discovery found.
    """
    storage = getattr(layout, "storage", "fused_3d")  # per-expert modules, flattened 2-D: the block's own fact
    own_storage = storage in ("module_list", FLAT)
    return BlockNames(router=layout.router_linear, experts=layout.experts, w1=layout.w1, w2=layout.w2,
                      w3=layout.w3, shared=layout.shared_experts or section.shared,
                      shared_gate=layout.shared_experts_gate or section.shared_gate,
                      storage=storage if own_storage else section.storage,
                      score_bias=layout.score_bias or "", num_experts=layout.num_experts if storage == FLAT else 0)


def names_for(path: str, section: BlockNames, layouts: Mapping[str, Any] | None) -> BlockNames:
    """The block at ``path``'s own names: from its ``BlockLayout`` when the caller has one (see
    :func:`names_of_block`), else the AutoEP section's."""
    layout = (layouts or {}).get(path)
    return names_of_block(layout, section) if layout is not None else section


def own_name(autoep_local: str, names: BlockNames) -> str | None:
    """``router.gate.weight`` -> ``gate.weight`` (dense tensors of an AutoEP layer; experts excluded)."""
    if autoep_local.startswith("router.gate."):
        return f"{names.router}.{autoep_local[len('router.gate.'):]}"
    if autoep_local == "router.e_score_correction_bias":  # copied by AutoEP from the source block
        return names.score_bias or f"{names.router}.e_score_correction_bias"
    for ours, theirs in (("shared_experts_gate.", names.shared_gate), ("shared_experts.", names.shared)):
        if autoep_local.startswith(ours) and theirs:
            return theirs + "." + autoep_local[len(ours):]
    return None


def fuse_experts(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, names: BlockNames,
                 target_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """AutoEP's ``w1/w3 [E, ffn, hidden]``, ``w2 [E, hidden, ffn]`` -> the original block's tensors.

    The inverse of ``deepspeed/moe/ep_repack.py::_repack_fused_3d``: the target's own shapes tell
    the fused layout (``gate_up_first [E, 2*ffn, hidden]`` or ``hidden_first [E, hidden, 2*ffn]``).
    For per-expert modules (``storage="module_list"``, the inverse of ``_repack_module_list``) the
    names are ``{i}.<w1>.weight`` etc., relative to the experts list.
    """
    if names.storage == "module_list":
        return per_expert_tensors(w1, w2, w3, names)
    if names.storage == FLAT:  # DBRX: [E * ffn, hidden] each; its down is AutoEP's w2 transposed per expert
        hidden = w1.shape[-1]
        return {names.w1: w1.reshape(-1, hidden), names.w3: w3.reshape(-1, hidden),
                names.w2: w2.transpose(1, 2).reshape(-1, hidden)}
    if names.w3 is not None:
        return {names.w1: w1, names.w3: w3, names.w2: w2}
    num, ffn, hidden = w1.shape
    fused = tuple(target_shapes.get(names.w1, ()))
    if fused == (num, 2 * ffn, hidden):
        return {names.w1: torch.cat([w1, w3], dim=1), names.w2: w2}
    if fused == (num, hidden, 2 * ffn):
        return {names.w1: torch.cat([w1, w3], dim=1).transpose(1, 2).contiguous(),
                names.w2: w2.transpose(1, 2).contiguous()}
    raise ResumeShapeError(say(ENTRY_ID, "fused-layout", w1=names.w1, shape=list(fused), num=num,
                               ffn=ffn, hidden=hidden))


def own_expert_names(names: BlockNames, num_experts: int) -> list[str]:
    """The block's own expert tensor names, relative to its experts module: ``gate_up_proj``,
    ``down_proj`` (fused 3-D), or ``0.gate_proj.weight``, ... (one module per expert)."""
    own = [n for n in (names.w1, names.w2, names.w3) if n]
    if names.storage != "module_list":
        return own
    return [f"{i}.{n}.weight" for i in range(num_experts) for n in own]


def per_expert_tensors(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                       names: BlockNames) -> dict[str, torch.Tensor]:
    """AutoEP's ``[E, ...]`` tensors -> each expert's Linear weights (``{i}.<w1>.weight``: gate ``[ffn,
    hidden]``, up, down ``[hidden, ffn]``; gate and up stacked in one ``[2*ffn, hidden]`` Linear when
    the experts pack them, ``names.w3`` None: ``_repack_module_list`` splits it in halves)."""
    out: dict[str, torch.Tensor] = {}
    for i in range(w1.shape[0]):
        if names.w3 is not None:
            out[f"{i}.{names.w1}.weight"], out[f"{i}.{names.w3}.weight"] = w1[i], w3[i]
        else:
            out[f"{i}.{names.w1}.weight"] = torch.cat([w1[i], w3[i]], dim=0)
        out[f"{i}.{names.w2}.weight"] = w2[i]
    return out


def split_experts(tensors: Mapping[str, torch.Tensor], names: BlockNames) -> dict[str, torch.Tensor]:
    """The original block's expert tensors (all experts) -> AutoEP's ``w1, w2, w3``."""
    if names.storage == "module_list":
        count = len({k.split(".", 1)[0] for k in tensors})
        w1 = torch.stack([tensors[f"{i}.{names.w1}.weight"] for i in range(count)])
        w2 = torch.stack([tensors[f"{i}.{names.w2}.weight"] for i in range(count)])
        if names.w3 is not None:
            return {"w1": w1, "w2": w2, "w3": torch.stack([tensors[f"{i}.{names.w3}.weight"] for i in range(count)])}
        ffn = w1.shape[1] // 2
        return {"w1": w1[:, :ffn], "w2": w2, "w3": w1[:, ffn:]}
    if names.storage == FLAT:  # the inverse of fuse_experts' flattened case
        rows, hidden = tensors[names.w1].shape
        shape = (names.num_experts, rows // names.num_experts, hidden)
        return {"w1": tensors[names.w1].reshape(shape), "w3": tensors[names.w3].reshape(shape),
                "w2": tensors[names.w2].reshape(shape).transpose(1, 2)}
    if names.w3 is not None:
        return {"w1": tensors[names.w1], "w2": tensors[names.w2], "w3": tensors[names.w3]}
    from deepspeed.moe.fused_expert_layout import classify_fused_gate_up_layout

    gate_up, down = tensors[names.w1], tensors[names.w2]
    layout = classify_fused_gate_up_layout(tuple(gate_up.shape), tuple(down.shape))
    if layout is None:
        raise ResumeShapeError(say(ENTRY_ID, "split-layout", w1=names.w1,
                                   gate_up=list(gate_up.shape), w2=names.w2, down=list(down.shape)))
    ffn = layout.ffn_hidden_size
    if layout.layout == "gate_up_first":
        return {"w1": gate_up[:, :ffn], "w3": gate_up[:, ffn:], "w2": down}
    return {"w1": gate_up[:, :, :ffn].transpose(1, 2), "w3": gate_up[:, :, ffn:].transpose(1, 2),
            "w2": down.transpose(1, 2)}



def autoep_layers(module: torch.nn.Module) -> dict[str, Any]:
    """The AutoEP layers of a module, by path."""
    return {name: m for name, m in module.named_modules() if ds_private.is_autoep_layer(m)}


def local_experts(layer: Any) -> list[int]:
    """Global ids of the experts this rank's AutoEP layer holds, in its packed order."""
    from deepspeed.checkpoint.autoep_affine import autoep_experts_for_rank

    return list(autoep_experts_for_rank(layer.expert_placement_descriptor, layer.ep_rank))



__all__ = ["ENTRY_ID", "BlockNames", "ResumeShapeError", "autoep_layers", "block_names", "fuse_experts",
           "local_experts", "own_expert_names", "own_name", "per_expert_tensors", "split_experts"]
