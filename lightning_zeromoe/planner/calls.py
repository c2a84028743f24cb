"""Collective calls per optimizer step, as DeepSpeed 0.19.8 makes them: the step-time model's
latency term (:mod:`lightning_zeromoe.planner.step_time`).

Checked against the ledger's call counts on CPU ranks, every (collective, group) cell, on 2 and 4
ranks (``tests/test_comm_ledger.py``). The rules, from DeepSpeed's code:

- ZeRO-1/2: one all-reduce per reduce bucket (stage 2 every micro-batch, stage 1 once per step), one
  norm all-reduce per flat group, the 16-bit overflow flag, one all-gather per flat group;
- ZeRO-3: one coalesced gather per ``stage3_prefetch_bucket_size`` elements of a pass, at most one per
  module (``partitioned_param_coordinator.py``), one per module on the first micro-batch, which
  records the trace; one reduction per bucket and per change of group in backward order
  (``stage3.py``'s ``reduce_independent_p_g_buckets_and_remove_grads``);
- AutoEP: its per-layer all-to-alls; Lightning: its per-batch flag broadcast.

Pure module: no torch import.
"""

from __future__ import annotations

import math

from lightning_zeromoe.planner.comm import CommPrediction, CommShape, forward_order, regathered
from lightning_zeromoe.planner.setups import _PRECISION_BYTES, normalize_precision


def _gather_calls(tensors: list[tuple[int, str]], bucket: int) -> int:
    """All-gather calls of one pass over ``tensors`` (elements, module) under ZeRO-3's prefetcher
    (``partitioned_param_coordinator.py``): each module fetch gathers what is not in flight yet
    and then prefetches up to ``bucket`` elements ahead in one coalesced call, so a pass makes about
    one call per ``bucket`` elements, at most one per module; without prefetching one per module."""
    if not tensors:
        return 0
    modules = len({m for _, m in tensors})
    return modules if bucket <= 0 else min(modules, math.ceil(sum(n for n, _ in tensors) / bucket))


def _reduce_calls(order: list[tuple[int, bool, str]], bucket: int) -> dict[bool, int]:
    """ZeRO-3's gradient reductions per micro-batch, by group (True: expert-data-parallel). Gradients
    arrive in backward order into one bucket, which is reduced when it is full and whenever the
    next gradient belongs to the other group (``reduce_independent_p_g_buckets_and_remove_grads``)."""
    calls = {False: 0, True: 0}
    group, filled = None, 0
    for n, expert, _ in reversed(order):
        if group is not None and (expert != group or (filled + n > bucket and filled > 0)):
            calls[group] += 1
            filled = 0
        group, filled = expert, filled + n
    if group is not None:
        calls[group] += 1
    return calls


def calls_per_step(shape: CommShape, prediction: CommPrediction) -> dict[tuple[str, str], int]:
    """Collective calls per optimizer step, for the latency term. Checked against the ledger's
    call counts on CPU ranks (``tests/test_comm_ledger.py``)."""
    W, ep, A = shape.world, shape.ep_size, shape.accumulation
    apart = ep > 1
    dense = list(shape.counts.dense) + ([] if apart else list(shape.counts.expert))
    local = [n // ep for n in shape.counts.expert] if apart else []
    p = _PRECISION_BYTES[normalize_precision(shape.precision)][0]
    calls: dict[tuple[str, str], int] = {}

    def buckets(sizes: list[int], bucket: int) -> int:
        return math.ceil(sum(sizes) / bucket) if sizes and bucket > 0 else (1 if sizes else 0)

    if shape.stage in (1, 2):
        reductions = A if shape.stage == 2 else 1
        groups = shape.dense_param_groups + (1 if apart else 0)
        # the bucketed gradients, one norm per flat group, and the 16-bit overflow flag
        calls[("all_reduce", "world")] = reductions * buckets(dense, shape.reduce_bucket_size) + groups + (p == 2)
        calls[("all_reduce", "expert_data_parallel")] = reductions * buckets(local, shape.reduce_bucket_size) + 1
        calls[("all_gather", "world")] = shape.dense_param_groups
        calls[("all_gather", "expert_data_parallel")] = 1 if apart else 0
    elif shape.stage == 3:
        threshold, bucket = shape.param_persistence_threshold, shape.prefetch_bucket_size
        order = forward_order(shape)

        def gathers(tensors: list[tuple[int, bool, str]], expert: bool, prefetch: int) -> int:
            return _gather_calls([(n, m) for n, e, m in tensors if e == expert and n > threshold], prefetch)

        # Forward every micro-batch, backward re-gathers as in comm.predict. The first micro-batch of
        # the first step records the trace: nothing to prefetch from, one fetch per module both ways.
        recording = shape.first_step
        passes = [(order, 0 if recording else bucket)] + [(order, bucket)] * (A - 1)
        passes += [(regathered(shape, recording), 0 if recording else bucket)]
        passes += [(regathered(shape, False), bucket)] * (A - 1)
        reduce = _reduce_calls(order, shape.reduce_bucket_size)
        calls[("all_gather", "world")] = sum(gathers(t, False, b) for t, b in passes)
        calls[("all_gather", "expert_data_parallel")] = sum(gathers(t, True, b) for t, b in passes)
        calls[("reduce_scatter", "world")] = A * reduce[False]
        calls[("reduce_scatter", "expert_data_parallel")] = A * reduce[True]
        calls[("all_reduce", "world")] = 1
        calls[("all_reduce", "expert_data_parallel")] = 1 if apart else 0
        calls[("all_reduce", "expert_parallel")] = 1 if apart else 0
    if apart and shape.moe_layers:
        forwards = 2 if shape.activation_checkpointing else 1
        calls[("all_to_all", "expert_parallel")] = A * shape.moe_layers * (3 * forwards + 2)
    if W > 1 and shape.lightning:
        calls[("broadcast", "world")] = A
    return {k: v for k, v in calls.items() if k in prediction.bytes}


__all__ = ["calls_per_step"]
