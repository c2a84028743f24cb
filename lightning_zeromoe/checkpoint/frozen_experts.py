"""Frozen AutoEP experts under ZeRO-3 (LoRA on attention, experts frozen): saved beside DeepSpeed's files.

DeepSpeed 0.19.8 keeps a ZeRO-3 AutoEP layer's experts only in the optimizer's shards, which never
hold a frozen parameter, so it refuses the save ("AutoEP with ZeRO Stage 3 checkpointing does not
support frozen expert parameters yet", ``runtime/engine.py``), and its universal converter refuses
such a checkpoint too. The strategy saves them itself:

* **Save** (:class:`FrozenExpertSave`): DeepSpeed writes everything else while the frozen experts
  are presented to it as not its business (:func:`lightning_zeromoe._private.deepspeed
  .frozen_experts_presented`: nothing trains or computes meanwhile). Then each expert-parallel
  rank's local experts are gathered over their expert-data-parallel group and written *once per
  group*, by its first rank, to ``<ckpt>/zeromoe_frozen_experts/ep_rank_<R>.pt`` (``module``: the
  AutoEP tensors ``<block>.experts.w1/w2/w3`` ``[local experts, ...]`` in the training dtype;
  ``experts``: their global ids), each file written under a temporary name and renamed. Rank 0
  writes ``manifest.json`` last, before DeepSpeed's ``latest``; a stale directory from an earlier
  save to the same path is removed first.
* **Resume** (:func:`restore`): on the same shape after DeepSpeed's own load, on another shape
  after the universal load; each rank's frozen experts come back bit for bit: the rows of its own
  experts (AutoEP to AutoEP, any ``ep_size``), the model's own fused tensors rebuilt from all of
  them (AutoEP to none), or AutoEP's split out of the model's own tensors the checkpoint kept as
  ordinary frozen fragments (none to AutoEP).
* **Export** reads the files through :func:`pieces` (no DeepSpeed, :mod:`.loading`'s safe reader).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from lightning_zeromoe._private import deepspeed as ds_private
from lightning_zeromoe.checkpoint.autoep_names import (EXPERT_WEIGHTS, autoep_layers, block_names, fuse_experts, local_experts,
                                            names_for, own_expert_names, split_experts)
from lightning_zeromoe.checkpoint.loading import load_shard
from lightning_zeromoe.knowledge import say
from lightning_zeromoe.checkpoint.resume.saved import SavedCheckpoint, read_saved_tensors

#: Knowledge-base entry of every refusal here.
ENTRY_ID = "autoep-frozen-experts"
DIR = "zeromoe_frozen_experts"
MANIFEST = "manifest.json"
FORMAT = "lightning_zeromoe.frozen_experts"
VERSION = 1


class FrozenExpertsError(RuntimeError):
    """Frozen AutoEP experts cannot be saved or restored: ``knowledge.say(ENTRY_ID, ...)``, which says
    why and what to do."""

    entry_id = ENTRY_ID


def frozen_expert_params(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The frozen expert weights of ``module``'s AutoEP layers: ``<block>.experts.w1`` -> parameter."""
    out = {}
    for path, layer in autoep_layers(module).items():
        for w in EXPERT_WEIGHTS:
            param = getattr(layer.experts, w)
            if not param.requires_grad:
                out[f"{path}.experts.{w}"] = param
    return out


# ------------------------------------------------------------------ save


@dataclass
class FrozenExpertSave:
    """One save's frozen experts (none: every step is a no-op). Called by ``ZeroMoEStrategy.save_checkpoint``."""

    module: torch.nn.Module
    ckpt_dir: Path
    params: dict[str, torch.nn.Parameter] = field(default_factory=dict)
    #: ``exclude_frozen_parameters``: DeepSpeed keeps no frozen parameter; neither do we.
    excluded: bool = False

    @classmethod
    def of(cls, module: torch.nn.Module, ckpt_dir: Any, *, stage_3: bool, excluded: bool) -> "FrozenExpertSave":
        return cls(module, Path(ckpt_dir), frozen_expert_params(module) if stage_3 else {}, excluded)

    @property
    def active(self) -> bool:
        return bool(self.params)

    def begin(self) -> None:
        """Rank 0, before any rank writes: remove what an earlier save to this path left."""
        shutil.rmtree(self.ckpt_dir / DIR, ignore_errors=True)

    def presented(self, *, saving: bool = True) -> Any:
        """Around DeepSpeed's save (or its load on the same shape): see
        :func:`lightning_zeromoe._private.deepspeed.frozen_experts_presented`."""
        return ds_private.frozen_experts_presented(self.params, saving=saving)

    def write(self) -> Path | None:
        """Every rank (collective: each layer's frozen experts are gathered over their group); the
        first rank of each expert-data-parallel group writes its expert-parallel rank's file."""
        if not self.params or self.excluded:
            return None
        import deepspeed
        import torch.distributed as dist

        tensors: dict[str, torch.Tensor] = {}
        experts: dict[str, list[int]] = {}
        num_experts: dict[str, int] = {}
        writer, ep_rank = False, 0
        for path, layer in autoep_layers(self.module).items():
            frozen = [(n, p) for n, p in self.params.items() if n.rsplit(".experts.", 1)[0] == path]
            if not frozen:
                continue
            group = getattr(frozen[0][1], "ds_process_group", None)
            writer = group is None or not dist.is_initialized() or dist.get_rank(group) == 0
            with deepspeed.zero.GatheredParameters([p for _, p in frozen]):
                if writer:
                    tensors.update({n: p.data.detach().to("cpu", copy=True).contiguous() for n, p in frozen})
            experts[path], num_experts[path] = local_experts(layer), int(layer.num_experts)
            ep_rank = int(layer.ep_rank)
        if not writer:
            return None
        out = self.ckpt_dir / DIR / f"ep_rank_{ep_rank}.pt"
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".partial")
        torch.save({"format": FORMAT, "version": VERSION, "ep_rank": ep_rank, "experts": experts,
                    "num_experts": num_experts, "module": tensors}, tmp)
        os.replace(tmp, out)
        return out

    def commit(self) -> None:
        """Rank 0, once every rank's :meth:`write` is done: the manifest, the directory's last file."""
        if not self.params:
            return
        sizes = {int(layer.ep_size) for layer in autoep_layers(self.module).values()}
        ep_size = sizes.pop() if len(sizes) == 1 else 1
        manifest = {"format": FORMAT, "version": VERSION, "excluded": self.excluded, "ep_size": ep_size,
                    "names": sorted(self.params),
                    "files": [] if self.excluded else [f"ep_rank_{r}.pt" for r in range(ep_size)]}
        path = self.ckpt_dir / DIR / MANIFEST
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(MANIFEST + ".partial")
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, path)

    def refusal(self, err: BaseException) -> FrozenExpertsError | None:
        """DeepSpeed's own refusal, should it still get through, as a one-line error with the way out."""
        if not ds_private.is_frozen_expert_refusal(err):
            return None
        return FrozenExpertsError(say(ENTRY_ID, "refused-by-deepspeed", "save-through-zeromoe", "train-experts-or-stage-2",
                                      ckpt_dir=self.ckpt_dir, error_type=type(err).__name__,
                                      error=str(err).splitlines()[0][:200]))


# ------------------------------------------------------------------ read


@dataclass(frozen=True)
class Piece:
    """One expert-parallel rank's file: its frozen expert tensors and their global expert ids."""

    file: Path
    experts: dict[str, tuple[int, ...]]
    num_experts: dict[str, int]
    names: tuple[str, ...]


def manifest(ckpt_dir: Path) -> dict[str, Any] | None:
    path = Path(ckpt_dir) / DIR / MANIFEST
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT or int(data.get("version", 0)) > VERSION:
        raise FrozenExpertsError(say(ENTRY_ID, "manifest-version", "upgrade-zeromoe", path=path,
                                     version=data.get("version"), format=data.get("format"), supported=VERSION))
    return data


def pieces(ckpt_dir: Path, *, trust_checkpoint: bool = False) -> list[Piece]:
    """Every file the manifest lists (empty when the checkpoint has no frozen experts)."""
    found = manifest(ckpt_dir)
    out = []
    for name in (found or {}).get("files", []):
        path = Path(ckpt_dir) / DIR / name
        if not path.is_file():
            raise FrozenExpertsError(say(ENTRY_ID, "file-missing", "copy-whole-checkpoint", path=path))
        data = load_shard(path, trust_checkpoint=trust_checkpoint)
        out.append(Piece(path, {k: tuple(v) for k, v in data["experts"].items()},
                         {k: int(v) for k, v in data["num_experts"].items()}, tuple(data["module"])))
    return out


def source_frozen(saved: SavedCheckpoint) -> list[str]:
    """AutoEP expert weights the checkpoint's run kept frozen (ZeRO-3: not in the optimizer's shards)."""
    if saved.shape.stage != 3 or not saved.trainable:
        return []
    trained = set(saved.trainable)
    return [f"{p}.experts.{w}" for p in saved.experts for w in EXPERT_WEIGHTS if f"{p}.experts.{w}" not in trained]


def check_saved(saved: SavedCheckpoint) -> None:
    """Refuse, before anything loads, a checkpoint with frozen experts whose files are not all there."""
    wanted = source_frozen(saved)
    if not wanted:
        return
    found = manifest(saved.path)
    if found is None:
        raise FrozenExpertsError(say(ENTRY_ID, "no-manifest", "copy-whole-checkpoint", "resume-from-zeromoe",
                                     ckpt=saved.path, shape=saved.shape, first=wanted[0], manifest=f"{DIR}/{MANIFEST}"))
    if found.get("excluded"):
        return
    have = {n for p in pieces(saved.path) for n in p.names}
    lost = [n for n in wanted if n not in have]
    if lost:
        raise FrozenExpertsError(say(ENTRY_ID, "values-missing", "save-again", folder=f"{saved.path}/{DIR}",
                                     count=len(lost), names=", ".join(lost[:3])))


def _rows(found: list[Piece], name: str, ids: list[int], opened: dict[Path, Any] | None = None) -> torch.Tensor:
    """Experts ``ids`` (global, in this order) of AutoEP tensor ``name``, from the files that hold them
    (memory-mapped: only those rows are read; ``opened`` keeps the files loaded across calls)."""
    opened = {} if opened is None else opened
    path = name.rsplit(".experts.", 1)[0]
    where: dict[int, tuple[Piece, int]] = {}
    for piece in found:
        if name in piece.names:
            where.update({e: (piece, i) for i, e in enumerate(piece.experts.get(path, ()))})
    lost = [e for e in ids if e not in where]
    if lost:
        raise FrozenExpertsError(say(ENTRY_ID, "experts-missing", "copy-from-one-save", folder=DIR, lost=lost,
                                     name=name))
    rows = []
    for e in ids:
        piece, i = where[e]
        if piece.file not in opened:
            opened[piece.file] = load_shard(piece.file)
        rows.append(opened[piece.file]["module"][name][i])
    return torch.stack(rows)


# ------------------------------------------------------------------ restore


@dataclass(frozen=True)
class Plan:
    """Where one frozen parameter of the running model gets its value."""

    #: ``rows``: this rank's experts from the files; ``fuse``: the model's own tensor rebuilt from
    #: AutoEP's; ``split``: AutoEP's cut from the model's own frozen tensors.
    kind: str
    block: str
    weight: str  # AutoEP weight (w1/w2/w3) for rows and split; the own name relative to the experts for fuse
    ids: tuple[int, ...] = ()


def plans(module: torch.nn.Module, saved: SavedCheckpoint, target_ep_section: Mapping[str, Any] | None,
          layouts: Mapping[str, Any] | None = None) -> dict[str, Plan]:
    """Each frozen parameter of ``module`` whose value this module restores, by name. No tensor is read.

    A weight the checkpoint trained (in the optimizer's shards) is not here: the universal load
    brings it (:mod:`lightning_zeromoe.checkpoint.resume.module_state`, "trained then, frozen now").
    """
    if saved.shape.stage != 3:
        return {}
    frozen_then = set(source_frozen(saved))
    trained = set(saved.trainable)
    layers = autoep_layers(module)
    target_section = block_names(target_ep_section or {})
    out: dict[str, Plan] = {}
    for path, layer in layers.items():
        for w in EXPERT_WEIGHTS:
            name = f"{path}.experts.{w}"
            if getattr(layer.experts, w).requires_grad:
                continue
            if path in saved.experts:
                if name in frozen_then:
                    out[name] = Plan("rows", path, w, tuple(local_experts(layer)))
                continue
            names = names_for(path, target_section, layouts)
            own = [f"{path}.{names.experts}.{n}" for n in own_expert_names(names, int(layer.num_experts))]
            if saved.experts == {} and not any(n in trained for n in own):
                out[name] = Plan("split", path, w, tuple(local_experts(layer)))
    source_section = block_names(saved.ep_section)
    params = dict(module.named_parameters())
    for path in saved.experts:
        if path in layers:
            continue
        names = names_for(path, source_section, layouts)
        prefix = f"{path}.{names.experts}."
        targets = {n: p for n, p in params.items() if n.startswith(prefix) and not p.requires_grad}
        sources = {f"{path}.experts.{w}" for w in EXPERT_WEIGHTS}
        if not targets or not sources & frozen_then:
            continue
        if not sources <= frozen_then:
            raise FrozenExpertsError(say(ENTRY_ID, "mixed-frozen", "same-ep-size", path=path,
                                         names=sorted(sources & frozen_then)))
        out.update({n: Plan("fuse", path, n[len(prefix):]) for n in targets})
    return out


@dataclass(frozen=True)
class Restored:
    restored: list[str] = field(default_factory=list)
    #: Frozen experts the checkpoint holds no value for (saved with ``exclude_frozen_parameters``).
    missing: list[str] = field(default_factory=list)


def restore(module: torch.nn.Module, saved: SavedCheckpoint, target_ep_section: Mapping[str, Any] | None,
            layouts: Mapping[str, Any] | None = None,
            source_tensors: Callable[[], Mapping[str, torch.Tensor]] | None = None) -> Restored:
    """Put the checkpoint's frozen experts into ``module`` (the engine's), on every rank (collective
    under ZeRO-3: each parameter is gathered, set and re-partitioned, in the same order everywhere).

    ``source_tensors``: the checkpoint's ordinary frozen parameters by name, whole (read only for
    ``split``; :func:`lightning_zeromoe.checkpoint.resume.saved.read_saved_tensors` by default).
    """
    todo = plans(module, saved, target_ep_section, layouts)
    if not todo:
        return Restored()
    import deepspeed

    excluded = bool((manifest(saved.path) or {}).get("excluded"))
    files = [] if excluded or all(p.kind == "split" for p in todo.values()) else pieces(saved.path)
    opened: dict[Path, Any] = {}
    params = dict(module.named_parameters())
    own: Mapping[str, torch.Tensor] | None = None
    fused: dict[str, dict[str, torch.Tensor]] = {}
    restored, missing = [], []
    for name, plan in todo.items():
        param = params[name]
        value: torch.Tensor | None
        if plan.kind == "split":
            if own is None:
                own = _read_own(saved, source_tensors)
            value = _split(own, plan, target_ep_section, layouts)
        elif excluded:
            value = None
        elif plan.kind == "rows":
            value = _rows(files, name, list(plan.ids), opened)
        else:
            if plan.block not in fused:
                fused[plan.block] = _fuse(files, saved, plan.block, module, layouts, opened)
            value = fused[plan.block][plan.weight]
        if value is None:  # saved with exclude_frozen_parameters: the model keeps its own values
            missing.append(name)
            continue
        shape = tuple(getattr(param, "ds_shape", param.shape))
        if tuple(value.shape) != shape:
            raise FrozenExpertsError(say(ENTRY_ID, "shape-mismatch", "same-model", name=name,
                                         saved_shape=list(value.shape), shape=list(shape)))
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            with torch.no_grad():
                param.data.copy_(value.to(param.dtype))
        restored.append(name)
    return Restored(restored, missing)


def _read_own(saved: SavedCheckpoint,
              source_tensors: Callable[[], Mapping[str, torch.Tensor]] | None) -> Mapping[str, torch.Tensor]:
    if source_tensors is not None:
        return source_tensors()
    return read_saved_tensors(saved).frozen


def _split(own: Mapping[str, torch.Tensor], plan: Plan, target_ep_section: Mapping[str, Any] | None,
           layouts: Mapping[str, Any] | None) -> torch.Tensor | None:
    """None when the checkpoint kept no frozen parameter (``exclude_frozen_parameters``)."""
    names = names_for(plan.block, block_names(target_ep_section or {}), layouts)
    prefix = f"{plan.block}.{names.experts}."
    tensors = {n[len(prefix):]: t for n, t in own.items() if n.startswith(prefix)}
    if not tensors:
        return None
    return split_experts(tensors, names)[plan.weight][list(plan.ids)].contiguous()


def _fuse(files: list[Piece], saved: SavedCheckpoint, block: str, module: torch.nn.Module,
          layouts: Mapping[str, Any] | None, opened: dict[Path, Any]) -> dict[str, torch.Tensor]:
    names = names_for(block, block_names(saved.ep_section), layouts)
    prefix = f"{block}.{names.experts}."
    count = saved.experts[block]
    full = {w: _rows(files, f"{block}.experts.{w}", list(range(count)), opened) for w in EXPERT_WEIGHTS}
    shapes = {n[len(prefix):]: tuple(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters()
              if n.startswith(prefix)}
    return fuse_experts(full["w1"], full["w2"], full["w3"], names, shapes)


__all__ = ["DIR", "ENTRY_ID", "FORMAT", "FrozenExpertSave", "FrozenExpertsError", "Piece", "Plan", "Restored",
           "check_saved", "frozen_expert_params", "manifest", "pieces", "plans", "restore", "source_frozen"]
