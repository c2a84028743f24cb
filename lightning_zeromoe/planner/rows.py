"""Every setup the planner weighs for a model: one :class:`Row` per ``ep_size`` x ZeRO stage x offload
(its plan, communication and predicted step time), the ranking by step time among those that fit,
and the Markdown table the CLI, the docs and ``--compare-native`` print.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from lightning_zeromoe.knowledge import say
from lightning_zeromoe.planner.model_facts import ModelFacts, PlannerInputError
from lightning_zeromoe.planner.plan import Plan, plan
from lightning_zeromoe.planner.setups import GB, LADDER, Setup
from lightning_zeromoe.planner.step_time import format_seconds


@dataclass(frozen=True)
class Row:
    ep_size: int
    setup: Setup
    plan: Plan
    comm: Any  # comm_model.CommPrediction
    time: Any = None  # step_time.StepTime

    @property
    def states(self) -> float:
        return self.plan.estimates[self.setup].device_total

    @property
    def total(self) -> float:
        return self.plan.device_bytes(self.setup)


def valid_ep_sizes(num_experts: int, num_gpus: int) -> list[int]:
    return [e for e in range(1, num_gpus + 1) if num_gpus % e == 0 and num_experts % e == 0]


def plan_all(facts: ModelFacts, args: argparse.Namespace) -> list[Row]:
    """Every ladder setup at every valid ep_size (or the one asked for)."""
    from lightning_zeromoe.planner.comm import CommShape, predict
    from lightning_zeromoe.planner.step_time import ModelShape, autoep_loop, predict_step_time

    gpus_per_node = args.gpus_per_node or args.gpus
    hardware = hardware_from(args)
    if args.ep_size is not None:
        if args.gpus % args.ep_size or facts.num_experts % args.ep_size:
            raise PlannerInputError(say("ep-size-divisibility", "planner", ep_size=args.ep_size,
                                        num_experts=facts.num_experts, gpus=args.gpus,
                                        valid=valid_ep_sizes(facts.num_experts, args.gpus)))
        eps = [args.ep_size]
    else:
        eps = valid_ep_sizes(facts.num_experts, args.gpus)
    rows = []
    for ep in eps:
        p = plan(counts=facts.counts, num_gpus=args.gpus, gpus_per_node=gpus_per_node,
                 gpu_memory_bytes=args.gpu_gb * GB, precision=args.precision, ep_size=ep, micro_batch=args.micro_batch,
                 seq_len=args.seq_len, hidden_size=facts.hidden_size, num_layers=facts.num_layers,
                 num_heads=facts.num_heads, ffn_hidden_size=facts.expert_ffn, top_k=facts.top_k,
                 vocab_size=facts.vocab_size, num_experts=facts.num_experts, mix=facts.mix,
                 activation_checkpointing=args.activation_checkpointing, bucket_elements=args.bucket_size,
                 units=facts.units(ep), num_kv_heads=facts.num_kv_heads, head_dim=facts.head_dim, qk_norm=facts.qk_norm,
                 expert_loop=args.expert_loop, moe_layers=facts.moe_layers, latent_attention=facts.latent_attention)
        for setup in LADDER:
            shape = CommShape(counts=facts.counts, stage=setup.stage, world=args.gpus, ep_size=ep,
                              precision=args.precision, top_k=facts.top_k, hidden_size=facts.hidden_size,
                              moe_layers=facts.moe_layers, num_experts=facts.num_experts,
                              tokens_per_micro_batch=args.micro_batch * args.seq_len, accumulation=args.accumulation,
                              reduce_bucket_size=args.bucket_size, allgather_bucket_size=args.bucket_size,
                              activation_checkpointing=args.activation_checkpointing,
                              param_order=facts.param_order or None)
            comm = predict(shape)
            rows.append(Row(ep, setup, p, comm, predict_step_time(
                shape, hardware, model=ModelShape(attention_layers=facts.num_layers, seq_len=args.seq_len,
                                                  attention_width=facts.num_heads * facts.head_dim,
                                                  expert_loop=args.expert_loop,
                                                  autoep_expert_loop=autoep_loop(args.precision)),
                gpus_per_node=gpus_per_node, offload_optimizer=setup.offload_optimizer,
                offload_parameters=setup.offload_parameters, prediction=comm)))
    return rows


def recommend(rows: list[Row], gpus_per_node: int, inter_node_ep: bool = False) -> Row | None:
    """The fastest setup that fits (predicted step time) at an ep_size whose all-to-all stays inside
    a node (any ep_size with ``inter_node_ep``, or when none inside a node fits); ties: the less
    aggressive setup, then the smaller ep_size."""
    ranked = ranked_fitting(rows, gpus_per_node, inter_node_ep)
    return ranked[0] if ranked else None


def ranked_fitting(rows: list[Row], gpus_per_node: int, inter_node_ep: bool = False) -> list[Row]:
    """Setups that fit, fastest first (see :func:`recommend`)."""
    fitting = [r for r in rows if r.plan.fits(r.setup)]
    if not inter_node_ep and any(r.ep_size <= gpus_per_node for r in fitting):
        fitting = [r for r in fitting if r.ep_size <= gpus_per_node]
    if not fitting:
        return []
    best = min(r.time.total for r in fitting)
    return sorted(fitting, key=lambda r: (max(best * (1 + 1e-9), r.time.total), r.setup,
                                          r.ep_size > gpus_per_node, r.ep_size))


def table(rows: list[Row]) -> str:
    """Markdown: per-GPU GB (10^9 bytes) and predicted GB per optimizer step passed to collectives
    (gradient reductions, parameter gathers, AutoEP's all-to-all; the total adds the few bytes of
    norms and flags). Offload rows appear for an ep_size only when no on-device setup fits there."""
    return render_table([TableRow(r.ep_size, r.setup.label, r.states, r.total, r.plan.fits(r.setup),
                                  r.setup.offload_optimizer, r.comm, r.time.total) for r in rows])


@dataclass(frozen=True)
class TableRow:
    """One line of the planner's tables (ours and the peer's)."""

    ep_size: int
    label: str
    states: float
    peak: float
    fits: bool
    offload: bool
    comm: Any  # anything with by_kind() and total
    seconds: float


def render_table(rows: list[TableRow]) -> str:
    """Markdown of :class:`TableRow` s; offload rows only at an ep_size where no on-device row fits."""
    out = ["| ep_size | setup | model states | peak | fits | comm/step: grads | params | all-to-all "
           "| total | step time |", "|---:|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for ep in sorted({r.ep_size for r in rows}):
        mine = [r for r in rows if r.ep_size == ep]
        on_device_fits = any(r.fits for r in mine if not r.offload)
        for r in mine:
            if r.offload and on_device_fits:
                continue
            k = r.comm.by_kind()
            out.append(f"| {ep} | {r.label} | {r.states / GB:.1f} | {r.peak / GB:.1f} | "
                       f"{'yes' if r.fits else 'no'} | {k['grads'] / GB:.2f} | {k['params'] / GB:.2f} | "
                       f"{k['all_to_all'] / GB:.2f} | {r.comm.total / GB:.2f} | {format_seconds(r.seconds)} |")
    return "\n".join(out)


def hardware_from(args: argparse.Namespace) -> Any:
    """``Hardware`` with the command line's overrides (``--tflops``, ``--intra-gbps``, ``--inter-gbps``)."""
    from lightning_zeromoe.planner.step_time import Hardware, Link

    hw = Hardware()
    return Hardware(flops_per_second=(getattr(args, "tflops", None) or hw.flops_per_second / 1e12) * 1e12,
                    intra=Link((getattr(args, "intra_gbps", None) or hw.intra.bandwidth / 1e9) * 1e9, hw.intra.latency),
                    inter=Link((getattr(args, "inter_gbps", None) or hw.inter.bandwidth / 1e9) * 1e9, hw.inter.latency))


__all__ = ["Row", "TableRow", "hardware_from", "plan_all", "ranked_fitting", "recommend", "render_table", "table",
           "valid_ep_sizes"]
