"""Fusing a checkpoint's per-expert tensors one expert at a time, and only the experts this rank holds.

transformers 5 models keep each MoE block's experts fused (``experts.gate_up_proj`` of shape
``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``), while most checkpoints on the Hub, and what
``save_pretrained`` writes, hold one tensor per expert. transformers' weight conversion
(``WeightConverter`` with ``MergeModulelist(dim=0)``, then ``Concatenate(dim>=1)`` for gate+up)
stacks every expert of a layer at once: for Mixtral-8x7B in bf16 that is ~4 GB of transient
memory per rank on top of its partitions, and every rank fuses every expert.

Row ``e`` of such a fused tensor depends only on expert ``e``'s tensors, and a ZeRO-3 partition is
a contiguous range of the flattened tensor: so each expert is converted on its own, through the
same transformers code, and only the experts whose rows overlap this rank's partition are read at
all. A conversion with any other operation (transposes, splits, quantisation) is left to
transformers whole, as before.

Measured in ``benchmarks/load_memory.py``. ``tests/test_expert_fusion.py`` checks the partitions equal
transformers' whole conversion; ``tests/test_pretrained.py`` the first loss, end to end on 2 ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch


@dataclass
class ExpertRows:
    """One fused target parameter, converted expert by expert: ``rows[e]`` are expert ``e``'s keys."""

    target: str
    param: torch.Tensor
    rows: list[list[str]]
    converter: Any  # transformers' WeightConverter that builds ``target``
    pattern_of: dict[str, str]  # checkpoint key -> the converter's source pattern it matched

    @property
    def keys(self) -> list[str]:
        return [k for row in self.rows for k in row]


def split_expert_rows(keys: list[str], weight_mapping: list[Any], params: Mapping[str, torch.Tensor],
                      base_model_prefix: str | None) -> tuple[list[str], list[ExpertRows]]:
    """Split one layer's checkpoint keys into those converted whole and per-expert conversions.

    A target qualifies when its converter's operations are ``[MergeModulelist(dim=0)]`` or
    ``[MergeModulelist(dim=0), Concatenate(dim>=1)]``, the target is a ZeRO-3 partitioned parameter
    (not gathered), and every source pattern supplies exactly ``ds_shape[0]`` tensors.
    """
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    renamings = [m for m in weight_mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in weight_mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta = dict.fromkeys(params, True)  # rename_source_key only asks which names exist
    whole: list[str] = []
    found: dict[str, dict[str, list[str]]] = {}
    pattern_of: dict[str, str] = {}
    for key in sorted(keys, key=dot_natural_key):  # the order transformers stacks them in
        target, pattern = rename_source_key(key, renamings, converters, base_model_prefix=base_model_prefix,
                                            meta_state_dict=meta)
        if pattern is None or not _row_separable(by_pattern[pattern]) or not _partitioned(params.get(target)):
            whole.append(key)
        else:
            found.setdefault(target, {}).setdefault(pattern, []).append(key)
            pattern_of[key] = pattern
    split: list[ExpertRows] = []
    for target, per_pattern in found.items():
        patterns = by_pattern[next(iter(per_pattern))].source_patterns
        experts = int(params[target].ds_shape[0])
        if sorted(per_pattern) != sorted(patterns) or any(len(v) != experts for v in per_pattern.values()):
            whole.extend(k for v in per_pattern.values() for k in v)
            continue
        rows = [sorted((per_pattern[p][e] for p in patterns), key=dot_natural_key) for e in range(experts)]
        converter = by_pattern[patterns[0]]
        split.append(ExpertRows(target, params[target], rows, converter, {k: pattern_of[k] for r in rows for k in r}))
    return whole, split


def convert_row(item: ExpertRows, part: Mapping[str, torch.Tensor], model: Any = None) -> torch.Tensor | None:
    """One expert's row of ``item.target``, ``[1, ...]``: transformers' converter run on that expert's
    tensors only (what ``_apply_weight_conversions_to_state_dict`` does for a whole layer)."""
    from transformers.core_model_loading import WeightConverter

    c = item.converter
    converter = WeightConverter(source_patterns=c.source_patterns, target_patterns=c.target_patterns,
                                operations=c.operations)
    for key, tensor in part.items():
        converter.add_tensor(item.target, key, item.pattern_of[key], tensor)
    value = converter.convert(item.target, model=model, config=getattr(model, "config", None)).get(item.target)
    return value[0] if isinstance(value, list) else value


def load_expert_rows(item: ExpertRows, state_dict: Mapping[str, torch.Tensor],
                     convert: Callable[[Mapping[str, torch.Tensor]], torch.Tensor | None],
                     release: Callable[[torch.Tensor], None]) -> bool:
    """Convert and copy the rows of ``item`` that overlap this rank's partition.

    ``convert`` turns one expert's tensors into its row (:func:`convert_row`) and ``release`` gives
    a source tensor's file pages back. Returns ``False``, having copied nothing, when the first
    converted row does not have the shape of one row of the target (the caller then converts the
    whole layer).
    """
    param = item.param
    shape = tuple(param.ds_shape)
    row_numel = math.prod(shape[1:])
    lo, hi = partition_range(param)
    first = True
    for e, keys in enumerate(item.rows):
        if not (e * row_numel < hi and (e + 1) * row_numel > lo):
            continue  # another rank's expert: never read
        row = convert({k: state_dict[k] for k in keys})
        if first and (row is None or tuple(row.shape) != (1,) + shape[1:]):
            return False
        first = False
        copy_range_into_partition(param, row.reshape(-1), e * row_numel)
        del row
        for k in keys:
            release(state_dict[k])
    return True


def partition_range(param: torch.Tensor) -> tuple[int, int]:
    """``[lo, hi)``: the flattened elements of ``param`` that this rank's ZeRO-3 partition holds.

    DeepSpeed 0.19's layout (``Init._partition_param``): rank ``r`` of ``param.ds_process_group``
    holds elements ``[r * n, (r + 1) * n)``, ``n = ds_tensor.ds_numel``; the last one is padded.
    """
    group = getattr(param, "ds_process_group", None)
    rank = torch.distributed.get_rank(group) if torch.distributed.is_initialized() else 0
    size = int(param.ds_tensor.ds_numel)
    return rank * size, min((rank + 1) * size, int(param.ds_numel))


def copy_range_into_partition(param: torch.Tensor, flat: torch.Tensor, offset: int) -> None:
    """Copy ``flat``, elements ``[offset, offset + len)`` of the flattened full tensor, into the part
    of them this rank's partition holds (nothing when they do not overlap)."""
    lo, hi = partition_range(param)
    start, stop = max(lo, offset), min(hi, offset + flat.numel())
    if stop > start:
        with torch.no_grad():
            param.ds_tensor.narrow(0, start - lo, stop - start).copy_(flat.narrow(0, start - offset, stop - start))


def _row_separable(converter: Any) -> bool:
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    if not ops or type(ops[0]) is not MergeModulelist or ops[0].dim != 0:
        return False
    return len(ops) == 1 or (len(ops) == 2 and type(ops[1]) is Concatenate and ops[1].dim >= 1)


def _partitioned(param: Any) -> bool:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return (param is not None and getattr(param, "ds_tensor", None) is not None
            and getattr(param, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE)


__all__ = ["ExpertRows", "convert_row", "copy_range_into_partition", "load_expert_rows", "partition_range",
           "split_expert_rows"]
