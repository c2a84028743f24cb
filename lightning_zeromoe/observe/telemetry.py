"""What a training run can report about itself: expert token shares and per-rank memory.

Token shares come from the ``tokens_per_expert`` counters that both AutoEP's
``AutoEPMoELayer`` and our ``MoEBlock`` keep (routed assignments per expert, cumulative). The
memory ledger reads what each rank *actually holds* from the DeepSpeed engine: partitioned
parameters, the fp32 master copy, the gradient partitions and the optimizer states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from lightning_zeromoe.engine import collectives


def expert_counters(module: nn.Module) -> dict[str, torch.Tensor]:
    """``{layer path: tokens_per_expert}`` for every MoE layer that keeps a counter."""
    return {name: m.tokens_per_expert for name, m in module.named_modules()
            if isinstance(getattr(m, "tokens_per_expert", None), torch.Tensor)}


def expert_shares(counts: torch.Tensor) -> list[float]:
    """Each expert's share of the routed assignments (sums to 1; zeros when nothing was routed)."""
    total = float(counts.sum())
    return [float(c) / total if total else 0.0 for c in counts.tolist()]


def global_counts(module: nn.Module, reset: bool = False) -> dict[str, torch.Tensor]:
    """Counters summed over all ranks (each rank counts only its own tokens), optionally reset."""
    counts = {name: c.detach().clone().float() for name, c in expert_counters(module).items()}
    if collectives.is_initialized():
        for tensor in counts.values():
            collectives.all_reduce(tensor)
    if reset:
        for counter in expert_counters(module).values():
            counter.zero_()
    return counts


@dataclass(frozen=True)
class StateBytes:
    """Bytes of model state one rank holds."""

    params: int
    master_params: int
    grads: int
    optimizer_states: int

    @property
    def total(self) -> int:
        return self.params + self.master_params + self.grads + self.optimizer_states


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj``: a tensor, or a (nested) list, tuple or dict of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


class _StorageLedger:
    """Counts each underlying storage once, under the first category that names it.

    DeepSpeed hands out views: ZeRO-3 parameter partitions are slices of one flat buffer, stage 1/2
    parameters are views of a flat copy, and ZeRO-3 with fp32 weights uses the parameter partition
    itself as the "fp32 master" (no second copy). Summing ``numel * element_size`` per tensor would
    count such memory twice; counting whole storages counts what is allocated, padding included.
    """

    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()

    def count(self, tensors: Iterator[torch.Tensor]) -> int:
        total = 0
        for tensor in tensors:
            if tensor is None or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
            if storage.nbytes() == 0 or key in self._seen:
                continue
            self._seen.add(key)
            total += storage.nbytes()
        return total


def state_bytes(engine: Any) -> StateBytes:
    """What this rank holds, read from a DeepSpeed engine (ZeRO stage 0-3).

    * params: ZeRO-3 partitions (``ds_tensor``) or, below stage 3, the full parameters (views of
      the optimizer's flat copy);
    * master_params: the fp32 master partition (stage 3 ``fp32_partitioned_groups_flat``, stage 1/2
      ``single_partition_of_fp32_groups``) *when it is a separate allocation*;
    * grads: stage 3's persistent ``grad_partitions_flat_buffer``; below stage 3 what exists at the
      moment of the call (reduced partitions after ``backward``, nothing after ``step``);
    * optimizer_states: the inner optimizer's per-parameter tensors (Adam ``exp_avg``/``exp_avg_sq``).

    Shared storage is counted once, in the first of these categories that holds it.
    """
    module, optimizer = engine.module, engine.optimizer
    ledger = _StorageLedger()
    params = ledger.count(getattr(p, "ds_tensor", p) for p in module.parameters())
    masters = [*_tensors(getattr(optimizer, "fp32_partitioned_groups_flat", [])),
               *_tensors(getattr(optimizer, "single_partition_of_fp32_groups", []))]
    master = ledger.count(iter(masters))
    grads = ledger.count(iter([
        *_tensors(getattr(optimizer, "grad_partitions_flat_buffer", None)),
        *_tensors(getattr(optimizer, "grads_in_partition", None)),
        *_tensors(getattr(optimizer, "averaged_gradients", None)),
        *(m.grad for m in masters if m.grad is not None),
        *(p.grad for p in module.parameters() if p.grad is not None),
    ]))
    inner = getattr(optimizer, "optimizer", optimizer)
    states = ledger.count(_tensors(list(getattr(inner, "state", {}).values())))
    return StateBytes(params=params, master_params=master, grads=grads, optimizer_states=states)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"
