"""The model state DeepSpeed's universal load leaves behind, put back: buffers and frozen parameters.

On a resume through a universal checkpoint DeepSpeed 0.19.8 skips the module state dict
(``runtime/engine.py``: ``if not self.load_universal_checkpoint(): self.load_module_state_dict(...)``)
and restores only what the optimizer owns (``runtime/zero/stage3.py``). Without this module a model
resumed on another shape silently keeps, from its ``__init__`` or ``from_pretrained``:

* every **persistent buffer**: DeepSeek-V3's ``e_score_correction_bias`` (the state aux-loss-free
  balancing keeps, so routing changes), counters a LightningModule keeps, ...;
* every **frozen parameter**: AFMoE's ``expert_bias``, frozen embeddings, LoRA bases;
* every parameter **trained when saved but frozen now** (the optimizer no longer owns it).

:func:`restore_module_state` puts each back from where the checkpoint keeps it, by the model's own
names (AutoEP names are mapped both ways, :mod:`lightning_zeromoe.checkpoint.autoep_names`; the source and the
target may differ in expert parallelism):

=========================================  ==================================================
what                                       where the checkpoint keeps it
=========================================  ==================================================
persistent buffers                         rank 0's ``*_model_states.pt``, ``module`` (whole)
frozen parameters, ZeRO-3                  every rank's ``frozen_param_fragments`` (rebuilt)
frozen parameters, ZeRO-1/2                rank 0's ``module`` (whole)
frozen AutoEP experts, ZeRO-3              ``zeromoe_frozen_experts/`` (:mod:`.checkpoint.frozen_experts`)
trained then, frozen now                   the universal checkpoint's ``zero/<name>/fp32.pt``
=========================================  ==================================================

Whatever the model has and the checkpoint has no value for is returned in ``missing``; the caller
names it in a warning. Buffers are read from rank 0's file: a buffer that differs between ranks
(none in a language model; BatchNorm statistics would) resumes with rank 0's value on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from lightning_zeromoe.checkpoint.meta import same_values
from lightning_zeromoe.checkpoint.autoep_names import BlockNames, autoep_layers, block_names, local_experts, names_for, own_name
from lightning_zeromoe.checkpoint.resume.saved import SavedCheckpoint, read_saved_tensors


@dataclass(frozen=True)
class RestoredState:
    """What :func:`restore_module_state` put back (target names), and what it could not."""

    buffers: list[str] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)
    #: Frozen now, trained when saved: from the universal checkpoint's fp32 master weights.
    trained_then: list[str] = field(default_factory=list)
    #: Persistent buffers and frozen parameters the checkpoint holds no value of the right shape for.
    missing: list[str] = field(default_factory=list)

    def summary(self, trainable: int) -> str:
        """``"12 trained parameters, 3 buffers, 1 frozen tensor restored"`` for the resume line."""
        frozen = len(self.frozen) + len(self.trained_then)
        return (f"{trainable} trained parameter(s), {len(self.buffers)} buffer(s), {frozen} frozen tensor(s) "
                "restored")


def _own(name: str, blocks: Mapping[str, BlockNames]) -> str:
    """A DeepSpeed name with an AutoEP layer's local name replaced by the block's own."""
    for path, names in blocks.items():
        if name.startswith(path + "."):
            own = own_name(name[len(path) + 1:], names)
            return f"{path}.{own}" if own else name
    return name


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers that are part of ``module``'s state dict (``persistent=True``), by name."""
    buffers = dict(module.named_buffers())
    return {name: buffers[name] for name in module.state_dict(keep_vars=True) if name in buffers}


def _universal_value(uc_dir: Path | None, saved: SavedCheckpoint, name: str, param: torch.nn.Parameter,
                     layers: Mapping[str, Any]) -> torch.Tensor | None:
    """A parameter's fp32 master weights from the universal checkpoint (written under the target's
    names by :func:`lightning_zeromoe.checkpoint.resume.universal_names.add_target_names`), cut to this rank's
    experts for an AutoEP expert weight."""
    if uc_dir is None:
        return None
    path = uc_dir / saved.tag / "zero" / name / "fp32.pt"
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    value = state["param"] if isinstance(state, dict) else state
    block, _, local = name.rpartition(".experts.")
    if block in layers and local in ("w1", "w2", "w3"):
        value = value[local_experts(layers[block])]
    shape = tuple(getattr(param, "ds_shape", param.shape))
    return value.reshape(shape) if value.numel() == math.prod(shape) else None


def restore_module_state(module: torch.nn.Module, saved: SavedCheckpoint, target_ep_section: Mapping[str, Any] | None,
                         layouts: Mapping[str, Any] | None = None, uc_dir: Path | None = None) -> RestoredState:
    """Copy the checkpoint's buffers and frozen parameters into ``module`` (the engine's), on every rank.

    Collective under ZeRO-3: every rank must call it (each frozen parameter is gathered, set, and
    re-partitioned). ``uc_dir`` is the universal checkpoint the trainable parameters came from; it
    also holds parameters trained when saved and frozen now.
    """
    import deepspeed

    source = read_saved_tensors(saved)
    src_blocks = {b: names_for(b, block_names(saved.ep_section), layouts) for b in saved.experts}
    layers = autoep_layers(module)
    tgt_blocks = {p: names_for(p, block_names(target_ep_section or {}), layouts) for p in layers}
    buffers_by_own = {_own(n, src_blocks): v for n, v in source.buffers.items()}
    frozen_by_own = {_own(n, src_blocks): v for n, v in source.frozen.items()}

    from lightning_zeromoe.checkpoint.frozen_experts import restore as restore_frozen_experts

    experts = restore_frozen_experts(module, saved, target_ep_section, layouts, lambda: source.frozen)
    skip = set(experts.restored) | set(experts.missing)
    restored_buffers, frozen, trained_then, missing = [], list(experts.restored), [], list(experts.missing)
    for name, buffer in persistent_buffers(module).items():
        value = buffers_by_own.get(_own(name, tgt_blocks))
        if value is not None and same_values(list(value.shape), list(buffer.shape)):
            value = value.reshape(buffer.shape)
        if value is None or tuple(value.shape) != tuple(buffer.shape):
            missing.append(name)
            continue
        with torch.no_grad():
            buffer.copy_(value.to(dtype=buffer.dtype))
        restored_buffers.append(name)
    for name, param in module.named_parameters():
        if param.requires_grad or name in skip:
            continue
        shape = tuple(getattr(param, "ds_shape", param.shape))
        value = frozen_by_own.get(_own(name, tgt_blocks))
        if value is not None and same_values(list(value.shape), list(shape)):  # ERNIE's [1, E] bias <-> AutoEP's [E]
            value = value.reshape(shape)
        found = frozen
        if value is None or tuple(value.shape) != shape:
            value, found = _universal_value(uc_dir, saved, name, param, layers), trained_then
        if value is None:
            missing.append(name)
            continue
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            with torch.no_grad():
                param.data.copy_(value.to(param.dtype))
        found.append(name)
    return RestoredState(restored_buffers, frozen, trained_then, missing)


def frozen_parameter_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Frozen parameters of ``module`` by name, with the full shapes DeepSpeed records (``ds_shape``)."""
    return {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in module.named_parameters()
            if not p.requires_grad}


__all__ = ["RestoredState", "frozen_parameter_shapes", "persistent_buffers",
           "restore_module_state"]
