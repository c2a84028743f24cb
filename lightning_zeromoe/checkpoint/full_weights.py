"""``load_full_weights=True`` under ZeRO-3 + AutoEP: every rank loads its own experts.

Lightning's ``DeepSpeedStrategy._restore_zero_state`` loads a full state dict on global rank 0
only, inside ``GatheredParameters(modifier_rank=0)``. That broadcasts a dense parameter from rank
0, but an AutoEP expert parameter from the first rank of *its* expert-data-parallel group, which
holds other experts than rank 0 and loaded nothing. It also drops missing keys and size
mismatches silently, so the model's own names (``gate_up_proj``) or AutoEP names with every
expert never reach the AutoEP layers at all (measured on 4 ranks with EP=2: no rank held the
saved experts). Here the state dict (which every rank has read) is first cut to what *this*
rank's layers hold, then every rank loads, and ``strict`` is honoured.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from lightning_zeromoe._private import torch as torch_private
from lightning_zeromoe.checkpoint.meta import same_values
from lightning_zeromoe.checkpoint.autoep_names import (EXPERT_WEIGHTS as _EXPERT_WEIGHTS, ResumeShapeError, autoep_layers,
                                            block_names, local_experts, names_for, own_name, split_experts)
from lightning_zeromoe.knowledge import say


def to_autoep_state_dict(state_dict: Mapping[str, torch.Tensor], module: torch.nn.Module,
                         ep_section: Mapping[str, Any],
                         layouts: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """A full state dict -> the tensors this rank's (AutoEP-converted) module holds.

    ``layouts``: discovery's ``BlockLayout`` per block path, for the block's own names where the
    AutoEP section only has aliases (a nested router, AFMoE's ``expert_bias``).

    Accepted for each AutoEP layer: the model's own names (``<block>.gate.weight``,
    ``<block>.experts.gate_up_proj`` with all experts: a plain single-process checkpoint) or
    AutoEP's names with all experts. Expert tensors are cut to this rank's experts. Other keys
    pass through unchanged.
    """
    out = dict(state_dict)
    layers = autoep_layers(module)
    if not layers:
        return out
    section = block_names(ep_section)
    for path, layer in layers.items():
        names = names_for(path, section, layouts)
        ids = local_experts(layer)
        for local_name, param in layer.named_parameters(remove_duplicate=True):
            if local_name.startswith("experts."):
                continue
            own = own_name(local_name, names)
            if own is not None and f"{path}.{own}" in out and f"{path}.{local_name}" not in out:
                value, shape = out.pop(f"{path}.{own}"), list(getattr(param, "ds_shape", param.shape))
                out[f"{path}.{local_name}"] = value.reshape(shape) if same_values(list(value.shape), shape) else value
        experts_prefix = f"{path}.{names.experts}."
        own_keys = [experts_prefix + n for n in (names.w1, names.w2, names.w3) if n]
        if all(k in out for k in own_keys):
            full = split_experts({k[len(experts_prefix):]: out.pop(k) for k in own_keys}, names)
        else:
            full = {w: out.pop(f"{path}.experts.{w}") for w in _EXPERT_WEIGHTS if f"{path}.experts.{w}" in out}
        for w, tensor in full.items():
            if tensor.shape[0] != layer.num_experts:
                raise ResumeShapeError(say("resume-shape-unsupported", "missing-experts", path=path, w=w,
                                           held=tensor.shape[0], num_experts=layer.num_experts))
            out[f"{path}.experts.{w}"] = tensor[ids].contiguous()
    return out


def load_gathered(module: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Load a state dict into a ZeRO-3 module, module by module, on *every* rank.

    Each module's own parameters are gathered, loaded, and broadcast from the first rank of their
    partition group (the world for dense parameters, the expert-data-parallel group for experts,
    whose members hold the same experts). Collective: every rank must call it.
    """
    import deepspeed

    metadata = torch_private.state_dict_metadata(state_dict)
    missing: list[str] = []
    unexpected: list[str] = []
    errors: list[str] = []

    def load(mod: torch.nn.Module, prefix: str) -> None:
        local_metadata = {} if metadata is None else metadata.get(prefix[:-1], {})
        with deepspeed.zero.GatheredParameters(list(mod.parameters(recurse=False)), modifier_rank=0):
            torch_private.load_own_state(mod, dict(state_dict), prefix, local_metadata, missing, unexpected, errors)
        for name, child in torch_private.child_table(mod).items():
            if child is not None:
                load(child, prefix + name + ".")

    load(module, "")
    known = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
    unexpected = sorted(k for k in state_dict if k not in known)
    if strict and (missing or unexpected or errors):
        parts = [f"missing {missing[:6]}" if missing else "", f"unexpected {unexpected[:6]}" if unexpected else "",
                 "; ".join(errors[:3])]
        raise ResumeShapeError(say("resume-shape-unsupported", "full-weights-mismatch", "this-model-or-not-strict",
                                   problems="; ".join(p for p in parts if p)))
    if errors:
        raise ResumeShapeError(say("resume-shape-unsupported", "full-weights-errors", errors="; ".join(errors[:3])))


__all__ = ["load_gathered", "to_autoep_state_dict"]
