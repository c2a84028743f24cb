"""The peer beside ours (``zeromoe-plan --compare-native``): transformers' native FSDP2 + EP at the
``ep_size`` values the planner's own table has, in the same columns, the fastest setup that fits on
each side, and the differences between the two layouts by design. The peer's memory and traffic
come from :mod:`lightning_zeromoe.planner.native_ep`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from lightning_zeromoe.planner.model_facts import ModelFacts
from lightning_zeromoe.planner.rows import Row, TableRow, hardware_from, ranked_fitting, render_table
from lightning_zeromoe.planner.setups import GB
from lightning_zeromoe.planner.step_time import format_seconds


@dataclass(frozen=True)
class NativeRow:
    """One setup of transformers' FSDP2 + EP at one ``ep_size`` (:mod:`~lightning_zeromoe.planner.native_ep`)."""

    ep_size: int
    states: Any  # native_ep.NativeStates
    peak: float
    fits: bool
    comm: Any  # native_ep.NativeComm
    time: Any  # native_ep.NativeStepTime


def native_rows(facts: ModelFacts, args: argparse.Namespace, ours: list[Row]) -> list[NativeRow]:
    """The peer's two setups (on the device, ``fsdp_cpu_offload``) at every ``ep_size`` of ``ours``.
    The peak (:meth:`NativeStates.peak`) adds to the states the same activation estimate as ours and
    FSDP2's gathered units in backward, or AdamW's temporary in the update, whichever is larger."""
    from lightning_zeromoe.planner import native_ep
    from lightning_zeromoe.planner.step_time import ModelShape, flops_per_token

    per_node = args.gpus_per_node or args.gpus
    hardware = hardware_from(args)
    traffic = native_ep.NativeTraffic(tokens_per_micro_batch=args.micro_batch * args.seq_len, top_k=facts.top_k,
                                      hidden_size=facts.hidden_size, moe_layers=facts.moe_layers,
                                      num_experts=facts.num_experts, accumulation=args.accumulation,
                                      activation_checkpointing=args.activation_checkpointing)
    out = []
    for ep in sorted({r.ep_size for r in ours}):
        mine = next(r for r in ours if r.ep_size == ep)
        layout = native_ep.NativeLayout(args.gpus, ep)
        units = facts.native_units(ep)
        comm = native_ep.native_comm(units, layout, args.precision, traffic)
        shape = mine.comm.shape
        flops = flops_per_token(shape, ModelShape(attention_layers=facts.num_layers, seq_len=args.seq_len,
                                                  attention_width=facts.num_heads * facts.head_dim)) * (
            shape.tokens_per_micro_batch * shape.accumulation)
        act = mine.plan.activations.total if mine.plan.activations else 0.0
        for offload in (False, True):
            states = native_ep.native_states(units, layout, args.precision, offload=offload)
            peak = states.peak(act)
            time = native_ep.native_step_time(units, layout, comm, hardware, flops=flops, gpus_per_node=per_node,
                                              precision=args.precision, accumulation=args.accumulation,
                                              offload=offload)
            out.append(NativeRow(ep, states, peak, peak <= mine.plan.usable_bytes, comm, time))
    return out


#: One line per difference by design between the two layouts, printed under the peer's table.
DESIGN_DIFFERENCES = (
    "ZeRO-3 gathers each module's parameters (prefetching up to a bucket ahead, gathering again in backward only "
    "what the reuse distance released); FSDP2 gathers one flat buffer per unit (a decoder layer, a layer's "
    "experts) in forward and again in backward: fewer, larger calls.",
    "FSDP2 shards every tensor on dim 0, the expert dim of fused expert tensors: where an expert-FSDP group has "
    "more ranks than experts per rank, some ranks hold whole experts and the others padding; ZeRO-3 splits each "
    "tensor's elements evenly.",
    "The peer has no ZeRO-1/2 (replicated parameters, partitioned optimizer states) and no optimizer-only "
    "offload: fsdp_cpu_offload moves parameters, gradients and optimizer states to the host together.",
    "Mixed precision: ours keeps bf16 weights and gradients plus an fp32 master copy; FSDP2 keeps fp32 parameters "
    "and gradients (both 16 bytes per parameter with AdamW), gathers bf16 and reduce-scatters fp32 gradients, "
    "twice the gradient bytes of ours.",
    "The peer's token dispatch moves the same rows as AutoEP's (its counts are int64); both place expert groups "
    "on consecutive ranks and the expert-FSDP / expert-data-parallel groups strided.",
)


def native_table(rows: list[NativeRow]) -> str:
    """Markdown, the columns of :func:`table` for the peer."""
    return render_table([TableRow(r.ep_size, r.states.setup, r.states.device_total, r.peak, r.fits, bool(r.states.host),
                                  r.comm, r.time.total) for r in rows])


def native_report(facts: ModelFacts, args: argparse.Namespace, ours: list[Row]) -> str:
    """The peer's table (``--compare-native``), the fastest fitting setup of each side, and the
    differences by design."""
    rows = native_rows(facts, args, ours)
    lines = ["transformers' native FSDP2 + EP (DistributedConfig(fsdp_size=GPUs, ep_size=E, fsdp_mixed_precision="
             "True); modelled from transformers 5.24's code, lightning_zeromoe/planner/native_ep.py):", "",
             native_table(rows), ""]
    fitting = sorted((r for r in rows if r.fits), key=lambda r: r.time.total)
    per_node = args.gpus_per_node or args.gpus
    mine = ranked_fitting(ours, per_node, getattr(args, "allow_inter_node_ep", False))
    theirs = fitting[0] if fitting else None
    if theirs is None:
        lines.append("Peer: nothing fits at any ep_size.")
    else:
        lines.append(f"Peer's fastest that fits: ep_size={theirs.ep_size}, {theirs.states.setup}: "
                     f"{theirs.peak / GB:.1f} GB, {theirs.comm.total / GB:.2f} GB/step, "
                     f"{format_seconds(theirs.time.total)}.")
    if mine and theirs is not None:
        best = mine[0]
        lines.append(f"Ours: ep_size={best.ep_size}, {best.setup.label}: {best.total / GB:.1f} GB, "
                     f"{best.comm.total / GB:.2f} GB/step, {format_seconds(best.time.total)} "
                     f"({best.time.total / theirs.time.total:.2f}x the peer's predicted step time).")
    lines += ["", "Where the layouts differ by design:"] + [f"- {d}" for d in DESIGN_DIFFERENCES]
    return "\n".join(lines)


__all__ = ["DESIGN_DIFFERENCES", "NativeRow", "native_report", "native_rows", "native_table"]
