"""Where each tensor DeepSpeed saved lives in the shard files, and reading one at a time.

:func:`catalog` opens every file once (memory-mapped; only pickles are read) and returns, per
DeepSpeed name, a *source*: the file pieces that make up the full tensor. :class:`Reader` then
rebuilds one tensor from its source on demand, and :meth:`Reader.release` unmaps the files so
that pages read for earlier output shards do not stay resident.

Layouts read:

* ZeRO-3: ``zero_pp_rank_R_mp_rank_00_model_states.pt`` (param_shapes, buffers, frozen fragments,
  ``ds_autoep_layers``) and ``..._optim_states.pt`` (``fp32_flat_groups``) for every rank R.
* ZeRO-1/2 (and 0): ``mp_rank_00_model_states.pt`` holds the full module state in the training
  dtype (expert weights removed), and ``layer_L_expert_E_mp_rank_00_model_states.pt`` one
  expert's ``w1``/``w2``/``w3`` each.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from lightning_zeromoe.checkpoint.errors import NOT_A_CHECKPOINT, SHARDS_MISMATCH, ExportError
from lightning_zeromoe.checkpoint.loading import load_shard
from lightning_zeromoe.checkpoint.meta import ExportMeta
from lightning_zeromoe.checkpoint.partition import (FlatSlice, flat_slices, global_expert_ids, group_records,
                                                    check_expert_ids, join_pieces, partition_members, read_slice)
from lightning_zeromoe.knowledge import say

_ZERO3_MODEL = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
_EXPERT_FILE = re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt")
_DENSE_MODEL = "mp_rank_00_model_states.pt"


@dataclass(frozen=True)
class FlatSource:
    """A ZeRO-3 trainable tensor: the same slice of each member's flat fp32 partition."""

    pieces: tuple[tuple[Path, int], ...]  # (optimizer file, sub-group), in partition-rank order
    slice: FlatSlice


@dataclass(frozen=True)
class FragmentSource:
    """A ZeRO-3 frozen parameter: each rank's fragment in its model file."""

    files: tuple[Path, ...]
    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ModuleSource:
    """A full tensor stored under ``key`` in a model file (ZeRO-1/2 weights, buffers)."""

    file: Path
    key: str


@dataclass(frozen=True)
class ExpertFileSource:
    """One expert's weight in a ZeRO-1/2 per-expert file (read as ``[1, ...]``)."""

    file: Path
    key: str


@dataclass(frozen=True)
class ExpertSource:
    """AutoEP's ``[E, ...]`` expert weight, from per-rank pieces holding the given global ids."""

    name: str
    num_experts: int
    parts: tuple[tuple[tuple[int, ...], "Source"], ...]


Source = Union[FlatSource, FragmentSource, ModuleSource, ExpertFileSource, ExpertSource]
#: Expert-weight rank pieces :meth:`Reader.read_expert` keeps (one each of w1, w2, w3).
KEPT_PIECES = 3


@dataclass
class Catalog:
    tensors: dict[str, Source] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)


class Reader:
    """Rebuilds full tensors from sources, keeping the files it opened until :meth:`release`."""

    def __init__(self, *, trust_checkpoint: bool = False) -> None:
        self.trust_checkpoint = trust_checkpoint
        self._open: dict[Path, dict[str, Any]] = {}
        #: Rank pieces of expert weights read for :meth:`read_expert`: (name, ids) -> tensor, newest last.
        self._pieces: dict[tuple[str, tuple[int, ...]], Any] = {}

    def file(self, path: Path) -> dict[str, Any]:
        if path not in self._open:
            self._open[path] = load_shard(path, trust_checkpoint=self.trust_checkpoint)
        return self._open[path]

    def release(self) -> None:
        """Drop the open files. ``torch.load``'s results hold reference cycles, so the mappings
        (and the pages read through them) go only once the cycle collector has run."""
        import gc

        self._open.clear()
        self._pieces.clear()
        gc.collect()

    def read(self, source: Source) -> Any:
        if isinstance(source, FlatSource):
            pieces = [read_slice(self.file(f)["optimizer_state_dict"]["fp32_flat_groups"][g], source.slice,
                                 where=f"{f.name} group {g}") for f, g in source.pieces]
            return join_pieces(pieces, source.slice.shape)
        if isinstance(source, FragmentSource):
            pieces = [self.file(f)["frozen_param_fragments"][source.name] for f in source.files]
            return join_pieces(pieces, source.shape)
        if isinstance(source, ModuleSource):
            return self.file(source.file)["module"][source.key]
        if isinstance(source, ExpertFileSource):
            return self.file(source.file)[source.key].unsqueeze(0)
        return self.fill(source, None)

    def read_expert(self, source: Source, index: int) -> Any:
        """Expert ``index``'s slice of an ``[E, ...]`` expert weight (for models that keep one module per
        expert). The rank piece holding it is read once and kept, the last :data:`KEPT_PIECES` of them
        (w1/w2/w3 of one rank), so exporting experts one by one reads each piece once."""
        if not isinstance(source, ExpertSource):
            return self.read(source)[index]
        for ids, sub in source.parts:
            if index in ids:
                key = (source.name, tuple(ids))
                if key not in self._pieces:
                    while len(self._pieces) >= KEPT_PIECES:
                        self._pieces.pop(next(iter(self._pieces)))
                    self._pieces[key] = self.read(sub)
                piece = self._pieces[key]
                if piece.shape[0] != len(ids):
                    raise ExportError(say(SHARDS_MISMATCH, "placement-fill", "copy-all-ranks",
                                          name=source.name, held=piece.shape[0], list_ids=list(ids)))
                return piece[list(ids).index(index)].clone()
        raise ExportError(say(SHARDS_MISMATCH, "expert-missing", "copy-all-ranks", name=source.name,
                              index=index, num_experts=source.num_experts))

    def fill(self, source: "ExpertSource", out: Any) -> Any:
        """Write an expert weight into ``out`` (``[E, ...]``, may be a strided view of a larger
        output), one rank's piece at a time; ``out=None`` allocates it. No intermediate stack."""
        import torch

        seen: list[int] = []
        for ids, sub in source.parts:
            local = self.read(sub)
            if local.shape[0] != len(ids):
                raise ExportError(say(SHARDS_MISMATCH, "placement-fill", "copy-all-ranks", name=source.name,
                                      held=local.shape[0], list_ids=list(ids)))
            if out is None:
                out = torch.empty((source.num_experts, *local.shape[1:]), dtype=local.dtype)
            out[list(ids)] = local
            seen += ids
            del local
        check_expert_ids(seen, source.num_experts, name=source.name)
        return out


def catalog(ckpt_dir: Path, meta: ExportMeta, *, trust_checkpoint: bool = False) -> Catalog:
    """Every tensor the shards of ``ckpt_dir / meta.tag`` hold, by DeepSpeed name."""
    tag_dir = ckpt_dir / meta.tag
    if not tag_dir.is_dir():
        raise ExportError(say(NOT_A_CHECKPOINT, "tag-dir-missing", "copy-with-tag", tag_dir=tag_dir,
                              tag=meta.tag))
    reader = Reader(trust_checkpoint=trust_checkpoint)
    if meta.zero_stage == 3:
        return _zero3(tag_dir, meta, reader)
    return _dense(tag_dir, meta, reader)


def _zero3(tag_dir: Path, meta: ExportMeta, reader: Reader) -> Catalog:
    found: dict[int, Path] = {}
    for f in tag_dir.iterdir():
        m = _ZERO3_MODEL.fullmatch(f.name)
        if m:
            if int(m.group(2)) != 0:
                raise ExportError(say(SHARDS_MISMATCH, "model-parallel", name=f.name))
            found[int(m.group(1))] = f
    world = meta.world_size
    missing = [r for r in range(world) if r not in found]
    if missing or len(found) != world:
        raise ExportError(say(SHARDS_MISMATCH, "ranks", "copy-every-rank", tag_dir=tag_dir,
                              found=sorted(found), world=world, missing=missing or 'none',
                              extra=sorted(set(found) - set(range(world))) or 'none'))
    models = [found[r] for r in range(world)]
    optims = [_optim_states_of(f) for f in models]
    for o in optims:
        if not o.is_file():
            raise ExportError(say(SHARDS_MISMATCH, "optim-missing", "copy-optim-states", o=o))
    out = Catalog(files=models + optims)
    shapes, records, layers = [], [], []
    for rank, (mf, of) in enumerate(zip(models, optims)):
        model, optim = reader.file(mf), reader.file(of)
        osd = optim.get("optimizer_state_dict") if isinstance(optim, dict) else None
        if not isinstance(osd, dict) or "fp32_flat_groups" not in osd or "param_shapes" not in model:
            raise ExportError(say(SHARDS_MISMATCH, "not-stage3", of=of, mf=mf))
        shapes.append([dict(s) for s in model["param_shapes"]])
        n = len(osd["fp32_flat_groups"])
        if n != len(shapes[-1]):
            raise ExportError(say(SHARDS_MISMATCH, "group-count", "both-from-one-save", mf=mf,
                                  groups=len(shapes[-1]), n=n, name=of.name))
        records.append(group_records(osd.get("ds_zero_partition_groups"), num_groups=n, rank=rank, world_size=world))
        if len(records[-1]) != len(records[0]):
            raise ExportError(say(SHARDS_MISMATCH, "rank-groups", "copy-all-ranks", mf=mf,
                                  groups=len(records[-1]), rank0_groups=len(records[0])))
        layers.append({e["expert_key_prefix"]: e for e in (model.get("ds_autoep_layers") or [])})
        if rank == 0:
            for name in model.get("buffer_names") or []:
                if name in model.get("module", {}):
                    out.tensors[name] = ModuleSource(mf, name)
            for name, shape in (model.get("frozen_param_shapes") or {}).items():
                out.tensors[name] = FragmentSource(tuple(models), name, tuple(int(s) for s in shape))
    reader.release()
    experts: dict[str, list[tuple[tuple[int, ...], Source]]] = {}
    for g in range(len(records[0])):
        for key, members in partition_members(records, g).items():
            names = shapes[members[0]][g]
            if any(shapes[m][g] != names for m in members):
                raise ExportError(say(SHARDS_MISMATCH, "group-members", "copy-all-ranks", g=g,
                                      members=members))
            for piece in flat_slices(names, len(key)):
                src = FlatSource(tuple((optims[m], g) for m in members), piece)
                if not records[members[0]][g].is_expert:
                    if piece.name in out.tensors:
                        raise ExportError(say(SHARDS_MISMATCH, "two-groups", name=piece.name))
                    out.tensors[piece.name] = src
                    continue
                layer = layers[members[0]].get(piece.name.rsplit(".", 1)[0])
                if layer is None:
                    raise ExportError(say(SHARDS_MISMATCH, "no-autoep-entry", name=models[members[0]].name,
                                          parameter=piece.name))
                experts.setdefault(piece.name, []).append((tuple(global_expert_ids(layer)), src))
    for name, parts in experts.items():
        total = layers[0][name.rsplit(".", 1)[0]]["num_experts"]
        out.tensors[name] = ExpertSource(name, int(total), tuple(parts))
    _frozen_experts(tag_dir.parent, out, reader, [f"{k}.{w}" for k in layers[0] for w in ("w1", "w2", "w3")])
    return out


def _frozen_experts(ckpt_dir: Path, out: Catalog, reader: Reader, expected: list[str]) -> None:
    """Frozen AutoEP experts, which the strategy saves beside the shards (:mod:`.frozen_experts`):
    each expert-parallel rank's ``[local experts, ...]`` tensor, a :class:`ModuleSource` of its file.
    ``expected``: every AutoEP expert weight of the checkpoint (those not in the shards were frozen)."""
    from lightning_zeromoe.checkpoint.frozen_experts import DIR, ENTRY_ID, FrozenExpertsError, manifest, pieces

    frozen = [n for n in expected if n not in out.tensors]
    if frozen and manifest(ckpt_dir) is None:
        raise ExportError(say(ENTRY_ID, "export-without-folder", "copy-whole-checkpoint", ckpt_dir=ckpt_dir,
                              first=frozen[0], folder=DIR))
    try:
        found = pieces(ckpt_dir, trust_checkpoint=reader.trust_checkpoint)
    except FrozenExpertsError as err:
        raise ExportError(str(err)) from None
    parts: dict[str, list[tuple[tuple[int, ...], Source]]] = {}
    totals: dict[str, int] = {}
    for piece in found:
        out.files.append(piece.file)
        for name in piece.names:
            block = name.rsplit(".experts.", 1)[0]
            parts.setdefault(name, []).append((piece.experts[block], ModuleSource(piece.file, name)))
            totals[name] = piece.num_experts[block]
    for name, pieces_of in parts.items():
        if name not in out.tensors:
            out.tensors[name] = ExpertSource(name, totals[name], tuple(pieces_of))


def _optim_states_of(model_states: Path) -> Path:
    """A rank's optimizer shard beside its model states: DeepSpeed prefixes it ``bf16_`` when the run
    trained in bf16 (``runtime/engine.py``, ``_get_zero_ckpt_prefix``), which every GPU run does."""
    plain = model_states.with_name(model_states.name.replace("_model_states.pt", "_optim_states.pt"))
    bf16 = plain.with_name("bf16_" + plain.name)
    return bf16 if bf16.is_file() and not plain.is_file() else plain


def _dense(tag_dir: Path, meta: ExportMeta, reader: Reader) -> Catalog:
    model_file = tag_dir / _DENSE_MODEL
    if not model_file.is_file():
        raise ExportError(say(SHARDS_MISMATCH, "model-file-missing", "copy-whole", model_file=model_file,
                              zero_stage=meta.zero_stage))
    model = reader.file(model_file)
    out = Catalog(files=[model_file])
    for name in model.get("module") or {}:
        out.tensors[name] = ModuleSource(model_file, name)
    by_layer: dict[int, dict[int, Path]] = {}
    for f in tag_dir.iterdir():
        m = _EXPERT_FILE.fullmatch(f.name)
        if m:
            by_layer.setdefault(int(m.group(1)), {})[int(m.group(2))] = f
            out.files.append(f)
    for entry in model.get("ds_autoep_layers") or []:
        files = by_layer.get(int(entry["moe_layer_id"]), {})
        prefix = entry["expert_key_prefix"]
        for w in ("w1", "w2", "w3"):
            parts = tuple(((e,), ExpertFileSource(f, f"{prefix}.{w}.{e}")) for e, f in sorted(files.items()))
            out.tensors[f"{prefix}.{w}"] = ExpertSource(f"{prefix}.{w}", int(entry["num_experts"]), parts)
    reader.release()
    return out


