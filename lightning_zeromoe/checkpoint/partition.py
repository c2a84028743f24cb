"""How ZeRO-3 partitions live in the shard files: pure functions over plain records and tensors.

ZeRO-3 keeps the fp32 master weights as one flat partition per optimizer sub-group per rank
(``fp32_flat_groups``). Each parameter contributes ``ceil(numel / n)`` elements to each of the
``n`` ranks of its sub-group's partition group, in ``param_shapes`` order; the last rank's
piece is padded. Dense sub-groups are partitioned over all ranks; AutoEP expert sub-groups over
the expert-data-parallel group of one expert-parallel rank. Frozen parameters have no fp32 copy:
each rank keeps its ``ceil(numel / world)`` fragment in the model file.

Nothing here reads files or needs DeepSpeed: the unit tests run these on ``torch.arange`` ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from lightning_zeromoe.checkpoint.errors import SHARDS_MISMATCH, ExportError
from lightning_zeromoe.knowledge import say


@dataclass(frozen=True)
class GroupRecord:
    """What one rank's optimizer shard says about one of its sub-groups."""

    partition_ranks: tuple[int, ...]
    partition_rank: int
    families: tuple[str, ...] = ("replicated",)

    @property
    def is_expert(self) -> bool:
        return "autoep_expert" in self.families


@dataclass(frozen=True)
class FlatSlice:
    """Where one parameter sits in every member's flat partition: ``[offset, offset + length)``."""

    name: str
    shape: tuple[int, ...]
    offset: int
    length: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def group_records(raw: Sequence[Mapping[str, Any]] | None, *, num_groups: int, rank: int,
                  world_size: int) -> list[GroupRecord]:
    """``ds_zero_partition_groups`` of one rank as records; plain ZeRO-3 (no AutoEP) writes none,
    and then every sub-group is partitioned over all ranks."""
    if raw is None:
        return [GroupRecord(tuple(range(world_size)), rank) for _ in range(num_groups)]
    return [GroupRecord(tuple(int(r) for r in g["partition_ranks"]), int(g["partition_rank"]),
                        tuple(g.get("families") or ("replicated",))) for g in raw]


def partition_members(records: Sequence[Sequence[GroupRecord]], sub_group: int) -> dict[tuple[int, ...], list[int]]:
    """Which ranks' partitions hold sub-group ``sub_group``.

    ``records[r]`` are rank r's records. Returns, per partition group (its ranks as a tuple), the
    global ranks ordered by partition rank: concatenating their flats in that order rebuilds
    the sub-group. Raises :class:`ExportError` when a partition rank is missing or doubled.
    """
    groups: dict[tuple[int, ...], dict[int, int]] = {}
    for rank, recs in enumerate(records):
        rec = recs[sub_group]
        members = groups.setdefault(rec.partition_ranks, {})
        if rec.partition_rank in members:
            raise ExportError(say(SHARDS_MISMATCH, "partition-claimed", "copy-all-ranks", sub_group=sub_group,
                                  other=members[rec.partition_rank], rank=rank, partition_rank=rec.partition_rank,
                                  ranks=list(rec.partition_ranks)))
        members[rec.partition_rank] = rank
    out = {}
    for key, members in groups.items():
        if sorted(members) != list(range(len(key))):
            raise ExportError(say(SHARDS_MISMATCH, "partition-ranks", "copy-all-ranks", sub_group=sub_group,
                                  last=len(key) - 1, key=list(key), found=sorted(members)))
        out[key] = [members[p] for p in range(len(key))]
    return out


def flat_slices(param_shapes: Mapping[str, Sequence[int]], count: int) -> list[FlatSlice]:
    """How a flat partition of ``count`` ranks unflattens into named tensors (``param_shapes`` order)."""
    out, offset = [], 0
    for name, shape in param_shapes.items():
        shape = tuple(int(s) for s in shape)
        length = math.ceil(math.prod(shape) / count)
        out.append(FlatSlice(name, shape, offset, length))
        offset += length
    return out


def join_pieces(pieces: Sequence[Any], shape: Sequence[int]) -> Any:
    """One full tensor from its per-rank pieces (in partition-rank order), padding dropped."""
    import torch

    numel = math.prod(shape)
    have = sum(p.numel() for p in pieces)
    if have < numel:
        raise ExportError(say(SHARDS_MISMATCH, "partitions-size", "copy-all-ranks", shape=list(shape),
                              numel=numel, have=have))
    joined = pieces[0] if len(pieces) == 1 else torch.cat([p.reshape(-1) for p in pieces])
    return joined.reshape(-1)[:numel].reshape(tuple(shape))


def read_slice(flat: Any, piece: FlatSlice, *, where: str) -> Any:
    """``piece`` of one member's flat partition (a view; nothing is copied)."""
    if flat.numel() < piece.offset + piece.length:
        raise ExportError(say(SHARDS_MISMATCH, "partition-short", "copy-all-ranks", where=where,
                              end=flat.numel(), name=piece.name, needed=piece.offset + piece.length))
    return flat.narrow(0, piece.offset, piece.length)


def global_expert_ids(layer: Mapping[str, Any]) -> list[int]:
    """Global expert ids one expert-parallel rank holds, from its ``ds_autoep_layers`` entry."""
    placement = layer.get("expert_placement")
    if placement:
        for entry in placement["ranks"]:
            if int(entry["rank"]) == int(layer["ep_rank"]):
                return [int(e) for e in entry["experts"]]
    return list(range(int(layer["global_expert_start"]), int(layer["global_expert_end"])))


def check_expert_ids(found: Sequence[int], num_experts: int, *, name: str) -> None:
    """The expert-parallel ranks' pieces together hold every global id 0..E-1 exactly once."""
    if sorted(found) != list(range(num_experts)):
        raise ExportError(say(SHARDS_MISMATCH, "expert-ids", "copy-all-ranks", name=name, found=sorted(found),
                              last=num_experts - 1))


def stack_experts(parts: Mapping[int, Any], num_experts: int, *, name: str) -> Any:
    """``[E, ...]`` from ``{global_id: tensor}``; every id 0..E-1 exactly once."""
    import torch

    check_expert_ids(list(parts), num_experts, name=name)
    return torch.stack([parts[e] for e in range(num_experts)])
