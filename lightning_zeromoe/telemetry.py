"""What a training run can report about itself: expert token shares and per-rank memory.

Token shares come from the ``tokens_per_expert`` counters that both AutoEP's
``AutoEPMoELayer`` and our ``MoEBlock`` keep (routed assignments per expert, cumulative). The
memory ledger reads what each rank *actually holds* from the DeepSpeed engine: partitioned
parameters, the fp32 master copy, the gradient partitions and the optimizer states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


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
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        for tensor in counts.values():
            torch.distributed.all_reduce(tensor)
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


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def state_bytes(engine: Any) -> StateBytes:
    """What this rank holds, read from a DeepSpeed engine (ZeRO-3 partitions, or plain tensors)."""
    module, optimizer = engine.module, engine.optimizer
    params = sum(_nbytes(getattr(p, "ds_tensor", p)) for p in module.parameters())
    master = sum(_nbytes(t) for t in getattr(optimizer, "fp32_partitioned_groups_flat", []))
    grads = _nbytes(getattr(optimizer, "grad_partitions_flat_buffer", None))
    inner = getattr(optimizer, "optimizer", optimizer)
    states = sum(_nbytes(v) for state in getattr(inner, "state", {}).values()
                 for v in state.values() if isinstance(v, torch.Tensor))
    return StateBytes(params=params, master_params=master, grads=grads, optimizer_states=states)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"
