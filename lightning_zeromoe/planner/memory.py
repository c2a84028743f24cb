"""Per-rank model states (ZeRO's partitioning, DeepSpeed's rounding); activations are in :mod:`.activations`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from lightning_zeromoe.planner.setups import Setup, _PRECISION_BYTES, _STAGE12_ALIGNMENT
from lightning_zeromoe.planner.counts import ParamCounts


@dataclass(frozen=True)
class StateEstimate:
    """Bytes one GPU holds for one setup. ``host`` is what offload keeps in CPU memory per GPU."""

    setup: Setup
    params: float
    grads: float
    master: float
    optimizer: float
    host: float
    dense: float
    expert: float
    #: Extra bytes that exist only while ``optimizer.step()`` runs (see :func:`_states`).
    step_transient: float = 0.0

    @property
    def device_total(self) -> float:
        """What the rank holds between steps (measured equal on CPU ranks, fp32 and bf16)."""
        return self.params + self.grads + self.master + self.optimizer

    @property
    def step_peak(self) -> float:
        """The most the rank holds while ``step()`` runs: :attr:`device_total` plus the transient."""
        return self.device_total + self.step_transient


def _partition(sizes: Iterable[int], group: int, total: int, stage: int, exact: bool) -> float:
    """Elements of ``sizes`` one rank of a ZeRO group of ``group`` ranks holds, rounded like
    DeepSpeed when ``exact`` (ZeRO-3: per tensor; stage 1/2: the flat group, padded)."""
    if group == 1:
        return float(total)
    if not exact:
        return total / group
    if stage == 3:
        return float(sum(-(-n // group) for n in sizes))
    align = _STAGE12_ALIGNMENT * group
    return float(-(-total // align) * align // group)


def _states(counts: ParamCounts, setup: Setup, world: int, ep_size: int, precision: str,
            optimizer_bytes: int) -> StateEstimate:
    p, g, m = _PRECISION_BYTES[precision]
    o = optimizer_bytes
    stage = setup.stage
    parts = []  # (full local elements, partitioned local elements) for dense, then experts
    parts.append((counts.dense_total, _partition(counts.dense, world, counts.dense_total, stage, counts.exact)))
    edp = world // ep_size
    local_expert = [n // ep_size for n in counts.expert]
    local_total = sum(local_expert) if counts.exact else counts.expert_total / ep_size
    parts.append((local_total, _partition(local_expert, edp, int(local_total), stage, counts.exact)))

    sums = {"params": 0.0, "grads": 0.0, "master": 0.0, "optimizer": 0.0, "host": 0.0, "step_transient": 0.0}
    split = []
    for full, shard in parts:
        w = (full if stage < 3 else shard) * p
        gr = (full if stage < 2 else shard) * g
        ms = shard * m
        op = shard * o
        if stage == 0:
            gr, ms, op = full * g, full * m, full * o
        host = 0.0
        if setup.offload_optimizer:
            host += ms + op
            ms = op = 0.0
            if stage == 3:  # DeepSpeed keeps stage-3 gradient partitions with the optimizer
                host += gr
            else:  # stages 1/2: reduced gradients are copied into an fp32 host partition
                host += shard * 4
            gr = 0.0  # on the device only transiently, in the reduce bucket
        if setup.offload_parameters:
            host += w
            w = 0.0
        # During step() (stage 3, DeepSpeed 0.19.8 _prepare_fp32_grad_for_sub_group): the gradient
        # partition is flattened (g bytes) and, for 16-bit gradients, copied to fp32 (m bytes) for the
        # optimizer; both are freed after the step. Measured on 2 CPU ranks in bf16: the first step
        # grows the process by 16.3-23.4 B per element, the Adam states' 8 plus the transient, of
        # which these 6 are accounted for; the rest is Adam scratch and allocator slack.
        transient = 0.0
        if stage == 3 and not setup.offload_optimizer:
            transient = shard * (g + m if g != m else g)
        for key, value in zip(("params", "grads", "master", "optimizer", "host", "step_transient"),
                              (w, gr, ms, op, host, transient)):
            sums[key] += value
        split.append(w + gr + ms + op)
    return StateEstimate(setup=setup, dense=split[0], expert=split[1], **sums)
