"""Frozen parameters across a resume on another shape, which DeepSpeed's universal checkpoint drops.

``ds_to_universal`` converts the optimizer's (trainable) partitions only. A ZeRO-3 checkpoint keeps
each frozen parameter as per-rank fragments (``frozen_param_fragments`` in every rank's
``*_model_states.pt``, with the full shapes in ``frozen_param_shapes``), and nothing loads them
back through the universal path: the resumed model silently keeps whatever its ``__init__`` or
``from_pretrained`` gave it. Frozen routing biases are common (AFMoE's ``expert_bias``, carried by
AutoEP as ``router.e_score_correction_bias``), so are frozen embeddings and LoRA bases.

:func:`restore_frozen` puts them back: it rebuilds each full tensor from the fragments, maps AutoEP
names to the model's own and back (the source and the target may differ in expert parallelism;
:mod:`lightning_zeromoe.autoep_names`), and copies each into the running ZeRO-3 model.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any, Mapping

import torch

from lightning_zeromoe.autoep_names import BlockNames, autoep_layers, block_names, names_for, own_name

if TYPE_CHECKING:
    from lightning_zeromoe.resume import SavedCheckpoint


def saved_frozen(saved: "SavedCheckpoint") -> dict[str, torch.Tensor]:
    """Every frozen parameter of a ZeRO-3 checkpoint, full, by DeepSpeed name (empty for stage 1/2,
    whose model states hold the frozen tensors whole and load them themselves)."""
    files = [f for f in saved.tag_dir.glob("*_model_states.pt") if not f.name.startswith(("layer_", "expert_"))]
    # DeepSpeed's model states pickle its own config objects; it loads them the same way on resume.
    states = [torch.load(f, map_location="cpu", weights_only=False) for f in sorted(files, key=_data_parallel_rank)]
    shapes = (states[0].get("frozen_param_shapes") or {}) if states else {}
    out = {}
    for name, shape in shapes.items():
        fragments = [s.get("frozen_param_fragments", {}).get(name) for s in states]
        if any(f is None for f in fragments):
            continue
        flat = torch.cat([f.reshape(-1) for f in fragments])
        out[name] = flat[: math.prod(shape)].reshape(tuple(shape))
    return out


def _data_parallel_rank(path: Any) -> int:
    """The rank in ``zero_pp_rank_<R>_mp_rank_00_model_states.pt``: fragments concatenate in that order."""
    match = re.search(r"zero_pp_rank_(\d+)", path.name)
    return int(match.group(1)) if match else 0


def _own(name: str, blocks: Mapping[str, BlockNames]) -> str:
    """A DeepSpeed name with an AutoEP layer's local name replaced by the block's own."""
    for path, names in blocks.items():
        if name.startswith(path + "."):
            own = own_name(name[len(path) + 1:], names)
            return f"{path}.{own}" if own else name
    return name


def restore_frozen(module: torch.nn.Module, saved: "SavedCheckpoint", target_ep_section: Mapping[str, Any] | None,
                   layouts: Mapping[str, Any] | None = None) -> tuple[list[str], list[str]]:
    """Copy the checkpoint's frozen parameters into ``module`` (the engine's, ZeRO-3), on every rank.

    Returns ``(restored, not_in_checkpoint)``: target names loaded, and frozen target parameters
    the checkpoint has no value for (left as they are; the caller says so).
    """
    import deepspeed

    source = saved_frozen(saved)
    if not source:
        return [], []
    src_blocks = {b: names_for(b, block_names(saved.ep_section), layouts) for b in saved.experts}
    tgt_blocks = {p: names_for(p, block_names(target_ep_section or {}), layouts) for p in autoep_layers(module)}
    by_own = {_own(name, src_blocks): value for name, value in source.items()}
    restored, missing = [], []
    for name, param in module.named_parameters():
        if param.requires_grad:
            continue
        value = by_own.get(_own(name, tgt_blocks))
        shape = tuple(getattr(param, "ds_shape", param.shape))
        if value is None or tuple(value.shape) != shape:
            missing.append(name)
            continue
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            with torch.no_grad():
                param.data.copy_(value.to(param.dtype))
        restored.append(name)
    return restored, missing


__all__ = ["restore_frozen", "saved_frozen"]
