"""What a DeepSpeed checkpoint directory records about the run that wrote it: its shape and files.

Read from DeepSpeed's own files (``latest``, the rank-0 ``*_model_states.pt``: ``dp_world_size``,
``ds_config``, ``ds_autoep_layers``), as DeepSpeed itself reads them on resume. Used by
:mod:`lightning_zeromoe.checkpoint.resume.reshape`, :mod:`lightning_zeromoe.checkpoint.resume.universal_names` and
:mod:`lightning_zeromoe.checkpoint.resume.module_state`; it imports none of them.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_zeromoe.checkpoint.autoep_names import ResumeShapeError
from lightning_zeromoe.config.schema import DeepSpeedConfig
from lightning_zeromoe.knowledge import say


@dataclass(frozen=True)
class Shape:
    """The parallel layout of a run: what a ZeRO checkpoint's partitioning depends on."""

    world_size: int
    ep_size: int
    stage: int

    def __str__(self) -> str:
        return f"{self.world_size} ranks, ep_size={self.ep_size}, ZeRO stage {self.stage}"


@dataclass(frozen=True)
class SavedCheckpoint:
    """What a DeepSpeed checkpoint directory records about the run that wrote it."""

    path: Path
    tag: str
    shape: Shape
    #: AutoEP layers: module path -> number of experts (empty without expert parallelism).
    experts: dict[str, int] = field(default_factory=dict)
    #: The ``expert_parallel`` config section the run used (names of routers and expert weights).
    ep_section: dict[str, Any] = field(default_factory=dict)
    #: Names of the parameters the optimizer owned (``param_shapes``), in its order.
    trainable: tuple[str, ...] = ()

    @property
    def tag_dir(self) -> Path:
        return self.path / self.tag


def model_states_files(tag_dir: Path) -> list[Path]:
    """Every rank's ``*_model_states.pt`` of a tag, in data-parallel rank order (ZeRO-3 fragments
    concatenate in that order; rank 0's file comes first)."""
    files = [f for f in tag_dir.glob("*_model_states.pt") if not f.name.startswith(("layer_", "expert_"))]
    return sorted(files, key=_data_parallel_rank)


def _data_parallel_rank(path: Path) -> int:
    """The rank in ``zero_pp_rank_<R>_mp_rank_00_model_states.pt``."""
    match = re.search(r"zero_pp_rank_(\d+)", path.name)
    return int(match.group(1)) if match else 0


def load_model_states(path: Path) -> dict[str, Any]:
    """One model-states file. DeepSpeed pickles its own config objects in it and loads it the same
    way on resume (``weights_only=False``): only load checkpoints you trust, as with DeepSpeed."""
    return torch.load(path, map_location="cpu", weights_only=False)


def read_saved(ckpt_dir: str | os.PathLike) -> SavedCheckpoint:
    """Read the shape from the ``latest`` tag's rank-0 model states (as DeepSpeed itself does on resume)."""
    path = Path(ckpt_dir)
    latest = path / "latest"
    if not latest.is_file():
        raise ResumeShapeError(say("resume-shape-unsupported", "no-latest", "earlier-checkpoint", path=path))
    tag = latest.read_text().strip()
    files = model_states_files(path / tag)
    if not files:
        raise ResumeShapeError(say("resume-shape-unsupported", "no-model-states", tag_dir=path / tag))
    state = load_model_states(files[0])
    config = DeepSpeedConfig.from_dict(state.get("ds_config") or {})  # the dict deepspeed.initialize got
    stage = config.stage
    layers = state.get("ds_autoep_layers") or []
    experts = {layer["module_path"]: int(layer["num_experts"]) for layer in layers}
    ep_sizes = {int(layer["ep_size"]) for layer in layers} or {1}
    if len(ep_sizes) > 1:
        raise ResumeShapeError(say("resume-shape-unsupported", "mixed-ep-size-saved", path=path,
                                   sizes=sorted(ep_sizes)))
    world = int(state.get("dp_world_size", len(files))) * int(state.get("mp_world_size", 1))
    trainable = tuple(name for group in state.get("param_shapes") or [] for name in group)
    return SavedCheckpoint(path=path, tag=tag, shape=Shape(world, ep_sizes.pop(), stage), experts=experts,
                           ep_section=config.expert_parallel_dict(), trainable=trainable)


@dataclass(frozen=True)
class SavedTensors:
    """Every whole tensor a checkpoint's model states hold besides the optimizer's partitions, by the
    source run's names."""

    buffers: dict[str, torch.Tensor]
    #: Frozen parameters: rebuilt from ZeRO-3 fragments, or whole from a ZeRO-1/2 module state dict.
    frozen: dict[str, torch.Tensor]


def read_saved_tensors(saved: SavedCheckpoint) -> SavedTensors:
    """Buffers and frozen parameters of a checkpoint, whole, by DeepSpeed (source) name."""
    files = model_states_files(saved.tag_dir)
    if not files:
        return SavedTensors({}, {})
    states = [load_model_states(f) for f in files] if saved.shape.stage == 3 else [load_model_states(files[0])]
    module = states[0].get("module") or {}
    buffer_names = set(states[0].get("buffer_names") or [])
    buffers = {n: t for n, t in module.items() if n in buffer_names and torch.is_tensor(t)}
    frozen: dict[str, torch.Tensor] = {}
    shapes = states[0].get("frozen_param_shapes") or {}
    for name, shape in shapes.items():
        fragments = [s.get("frozen_param_fragments", {}).get(name) for s in states]
        if any(f is None for f in fragments):
            continue
        flat = torch.cat([f.reshape(-1) for f in fragments])
        frozen[name] = flat[: math.prod(shape)].reshape(tuple(shape))
    if saved.shape.stage != 3:  # ZeRO-1/2: the module state dict holds every parameter whole
        frozen.update({n: t for n, t in module.items()
                       if n not in buffer_names and torch.is_tensor(t) and t.numel() and n not in frozen})
    return SavedTensors(buffers, frozen)


__all__ = ["SavedCheckpoint", "SavedTensors", "Shape", "load_model_states", "model_states_files", "read_saved",
           "read_saved_tensors"]
