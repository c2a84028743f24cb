"""Writing a universal checkpoint's tensors under the names the target model uses.

Between expert parallelism and none the parameter names differ: AutoEP calls them
``<block>.router.gate.weight`` and ``<block>.experts.w1/w2/w3`` (``[E, ffn, hidden]`` gate and up,
``[E, hidden, ffn]`` down); without it the model's own blocks hold ``<block>.gate.weight`` and e.g. a
fused ``gate_up_proj``. :func:`add_target_names` writes the universal tensors (weights *and* Adam
moments, which are elementwise) under the names the target model uses; the mapping itself is
:mod:`lightning_zeromoe.checkpoint.autoep_names`. Used by :func:`lightning_zeromoe.checkpoint.resume.reshape.ensure_universal`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch

from lightning_zeromoe.checkpoint.autoep_names import (EXPERT_WEIGHTS as _EXPERT_WEIGHTS, BlockNames, ResumeShapeError,
                                            block_names, fuse_experts, names_for, own_expert_names, own_name,
                                            split_experts)
from lightning_zeromoe.checkpoint.resume.saved import SavedCheckpoint, load_model_states
from lightning_zeromoe.knowledge import say



def add_target_names(uc_dir: Path, saved: SavedCheckpoint, target_params: Mapping[str, tuple[int, ...]],
                     target_ep_section: Mapping[str, Any] | None = None,
                     layouts: Mapping[str, Any] | None = None,
                     optional_params: Mapping[str, tuple[int, ...]] | None = None) -> list[str]:
    """Make every parameter the target engine will look up exist in the universal checkpoint.

    ``target_params``: the trainable parameters of the engine's module, name -> shape as DeepSpeed
    records it (``ds_shape``). With expert parallelism on both sides the names already match.
    From AutoEP to none, the AutoEP tensors are written again under the model's own names; from
    none to AutoEP (``target_ep_section`` names the blocks' tensors), the other way round.
    ``layouts`` (discovery's ``BlockLayout`` per block path) give each block's own names where the
    sections have aliases (a nested router such as HunYuan's ``gate.wg``). Idempotent. Returns the
    names written. Raises listing what is still missing. ``optional_params`` (the target's frozen
    parameters) are written too where the checkpoint trained them, and never reported missing:
    :mod:`lightning_zeromoe.checkpoint.resume.module_state` restores them from there.
    """
    zero = uc_dir / saved.tag / "zero"
    written = []
    wanted = {**(optional_params or {}), **target_params}
    target_blocks = sorted({n[:-len(".experts.w1")] for n in wanted if n.endswith(".experts.w1")})
    if saved.experts and not target_blocks:
        section = block_names(saved.ep_section)
        for block in saved.experts:
            written += _write_own_names(zero, block, names_for(block, section, layouts), wanted)
    elif target_blocks and not saved.experts:
        section = block_names(target_ep_section or {})
        for block in target_blocks:
            written += _write_autoep_names(zero, block, names_for(block, section, layouts), wanted)
    missing = sorted(n for n in target_params if not (zero / n / "fp32.pt").is_file())
    if missing:
        shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
        raise ResumeShapeError(say("resume-shape-unsupported", "no-state", uc_dir=uc_dir, count=len(missing),
                                   shown=shown))
    return written


#: A tensor's ``fp32.pt`` is written after its moments: where it exists, the rest does too (a kill
#: half-way through leaves a tensor that is written again, never one that looks complete).
_KEYS_FP32_LAST = ("exp_avg", "exp_avg_sq", "fp32")


def _save_atomic(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary name, then rename: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".partial")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _copytree_atomic(src: Path, dest: Path) -> None:
    """Copy a tensor's directory under a temporary name, then rename it into place."""
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    os.replace(tmp, dest)


def _write_own_names(zero: Path, block: str, names: BlockNames, target_params: Mapping[str, tuple[int, ...]]) -> list[str]:
    written = []
    for entry in sorted(p for p in zero.iterdir() if p.name.startswith(block + ".") and p.suffix != ".partial"):
        local = entry.name[len(block) + 1:]
        if local.startswith("experts."):
            continue
        own = own_name(local, names)
        if own is None:
            raise ResumeShapeError(say("resume-shape-unsupported", "no-counterpart", "resume-with-ep", name=entry.name))
        dest = zero / f"{block}.{own}"
        if not dest.exists():
            _copytree_atomic(entry, dest)
            written.append(dest.name)
    experts_prefix = f"{block}.{names.experts}."
    shapes = {n[len(experts_prefix):]: tuple(s) for n, s in target_params.items() if n.startswith(experts_prefix)}
    if not shapes:  # the target's experts come from elsewhere (frozen then and now: checkpoint.frozen_experts)
        return written
    targets = own_expert_names(names, len({n.split(".", 1)[0] for n in shapes}))  # per-expert modules: one per expert
    if all((zero / (experts_prefix + t) / "fp32.pt").is_file() for t in targets):
        return written
    for key in _KEYS_FP32_LAST:
        parts = {}
        for w in _EXPERT_WEIGHTS:
            parts[w] = _load_state(zero / f"{block}.experts.{w}" / f"{key}.pt")
        for target, tensor in fuse_experts(parts["w1"], parts["w2"], parts["w3"], names, shapes).items():
            dest = zero / (experts_prefix + target)
            dest.mkdir(exist_ok=True)
            _save_atomic({"param": tensor.contiguous()}, dest / f"{key}.pt")
    written += [experts_prefix + t for t in targets]
    return written


def _load_state(path: Path) -> torch.Tensor:
    """One universal state file: DeepSpeed writes a bare tensor or ``{"param": tensor, ...}``."""
    if not path.is_file():
        raise ResumeShapeError(say("resume-shape-unsupported", "missing-file", path=path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state["param"] if isinstance(state, dict) else state


def saved_shapes(tag_dir: Path) -> dict[str, tuple[int, ...]]:
    """Full parameter shapes as the source run's model states list them (``param_shapes``), in the
    order its flat optimizer groups hold them."""
    files = sorted(tag_dir.glob("*_model_states.pt"))
    state = load_model_states(files[0]) if files else {}
    return {name: tuple(shape) for group in state.get("param_shapes") or [] for name, shape in group.items()}


def _write_autoep_names(zero: Path, block: str, names: BlockNames,
                        target_params: Mapping[str, tuple[int, ...]]) -> list[str]:
    """No expert parallelism -> AutoEP: the inverse of :func:`_write_own_names`."""
    from deepspeed.checkpoint.constants import CAT_DIM, EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS, PARAM

    written = []
    for name in target_params:
        local = name[len(block) + 1:] if name.startswith(block + ".") else None
        if local is None or local.startswith("experts."):
            continue
        own = own_name(local, names)
        src, dest = zero / f"{block}.{own}", zero / name
        if own is not None and src.is_dir() and not dest.exists():
            _copytree_atomic(src, dest)
            written.append(name)
    if all((zero / f"{block}.experts.{w}" / "fp32.pt").is_file() for w in _EXPERT_WEIGHTS):
        return written
    prefix = f"{block}.{names.experts}."
    shapes = saved_shapes(zero.parent)  # ZeRO-3 universal files of dense tensors are flat
    # one module per expert (experts.{i}.gate_proj.weight): as many as the source model had
    count = len({n[len(prefix):].split(".", 1)[0] for n in shapes if n.startswith(prefix)})
    sources = own_expert_names(names, count)
    for key in _KEYS_FP32_LAST:
        full = {}
        for n in sources:
            if prefix + n not in shapes:
                raise ResumeShapeError(say("resume-shape-unsupported", "no-such-parameter", "resume-same-model",
                                           name=prefix + n))
            full[n] = _load_state(zero / (prefix + n) / f"{key}.pt").reshape(shapes[prefix + n])
        parts = split_experts(full, names)
        for w, tensor in parts.items():
            dest = zero / f"{block}.experts.{w}"
            dest.mkdir(exist_ok=True)
            _save_atomic({PARAM: tensor.contiguous(), CAT_DIM: 0, EP_IS_EXPERT_PARAM: True,
                        EP_NUM_EXPERTS: int(tensor.shape[0])}, dest / f"{key}.pt")
    return written + [f"{block}.experts.{w}" for w in _EXPERT_WEIGHTS]


__all__ = ["add_target_names", "saved_shapes"]
