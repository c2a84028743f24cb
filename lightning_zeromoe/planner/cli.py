"""``zeromoe-plan`` / ``python -m lightning_zeromoe.planner``: a plan from a Hugging Face config
(``--config config.json`` or ``--model-type``), from parameter counts (``--dense``/``--experts``), or
the worked Mixtral-8x7B example (``--mixtral-8x7b``). With no arguments it prints its help.

No weights are downloaded or allocated: the model is built from its config on the meta device
(``AutoModelForCausalLM.from_config`` under ``torch.device("meta")``) and its parameters are
counted with :func:`lightning_zeromoe.planner.count_params` (fused 3-D expert tensors and
``ModuleList`` experts alike: every parameter under a path component named ``experts``). For each
ZeRO stage and each ``ep_size`` that divides both the experts and the GPUs the CLI prints the
per-GPU model states, the activation estimate, the predicted communication per optimizer step
(:mod:`lightning_zeromoe.planner.comm`), the recommendation, and the ``Trainer(...)`` line to paste.

Bad input (a config without routed experts, an ``ep_size`` that does not divide, an unknown
``model_type``, an unreadable file) ends with one ``[entry-id]`` line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_zeromoe import invocation
from lightning_zeromoe.knowledge import say
from lightning_zeromoe.planner.counts import (EXPERT_FFN_KEYS, EXPERT_KEYS, TOP_K_KEYS, GatherUnit, ParamCounts,
                                             count_params, gather_units, has_qk_norm, is_expert_param)
from lightning_zeromoe.planner.activations import LatentAttention
from lightning_zeromoe.planner.layers import LayerMix, layer_mix
from lightning_zeromoe.planner.native_ep import NativeTensor, NativeUnit, fsdp_units
from lightning_zeromoe.planner.plan import Plan, plan
from lightning_zeromoe.planner.reports import mixtral_report
from lightning_zeromoe.planner.setups import GB, LADDER, Setup
from lightning_zeromoe.planner.step_time import EXPERT_LOOPS, format_seconds



ENTRY = "planner-hf-config"


class PlannerInputError(ValueError):
    """Input the planner cannot plan from; the message starts with its knowledge-base entry id."""


@dataclass(frozen=True)
class ModelFacts:
    """What the planner needs from a Hugging Face model, read off its config and meta-device build."""

    model_type: str
    counts: ParamCounts
    num_experts: int
    top_k: int
    hidden_size: int
    num_layers: int
    num_heads: int
    expert_ffn: int
    vocab_size: int
    #: Layers that hold routed experts (those with an ``experts`` module), from the built model.
    moe_layers: int
    #: (elements, is_expert, module) per trainable parameter tensor, in the model's order (ZeRO-3's reuse distance).
    param_order: tuple[tuple[int, bool, str], ...] = ()
    #: Size of one attention head (``head_dim``, or hidden / heads): attention FLOPs use heads x head_dim.
    head_dim: int = 0
    #: ZeRO-3's gather units (:func:`~lightning_zeromoe.planner.counts.gather_units`) at ``ep_size`` 1,
    #: where each MoE block is one leaf module, and with expert parallelism: for the modelled peak.
    units_leaf: tuple[GatherUnit, ...] = ()
    units_ep: tuple[GatherUnit, ...] = ()
    #: For the activations: key/value heads (grouped-query attention), per-head q/k norms, multi-head
    #: latent attention's widths, and the dense layers and shared experts beside the MoE blocks.
    num_kv_heads: int = 0
    qk_norm: bool = False
    latent_attention: LatentAttention | None = None
    mix: LayerMix | None = None
    #: For the peer's layout (:mod:`~lightning_zeromoe.planner.native_ep`): every trainable tensor with its
    #: shape, and the model's own ``fsdp_plan`` and ``ep_plan`` (transformers' plans, as (key, style) pairs).
    native_tensors: tuple[NativeTensor, ...] = ()
    fsdp_plan: tuple[tuple[str, str], ...] = ()
    ep_plan: tuple[tuple[str, str], ...] = ()

    def units(self, ep_size: int) -> tuple[GatherUnit, ...]:
        return self.units_leaf if ep_size == 1 else self.units_ep

    def native_units(self, ep_size: int) -> tuple[NativeUnit, ...]:
        """The ``fully_shard`` units transformers' FSDP2 + EP builds for this model at ``ep_size``."""
        return fsdp_units(self.native_tensors, dict(self.fsdp_plan), dict(self.ep_plan), ep_size)


def load_config(config_path: str | None = None, model_type: str | None = None) -> Any:
    """A ``PretrainedConfig`` from a ``config.json`` (file or directory) or transformers' default
    config for ``model_type``. Nothing is downloaded."""
    if config_path:
        path = Path(config_path)
        path = path / "config.json" if path.is_dir() else path
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise PlannerInputError(say(ENTRY, "unreadable", "readable-config", path=path, error=err)) from None
        model_type = (raw.pop("model_type", None) if isinstance(raw, dict) else None) or model_type
        if not model_type:
            raise PlannerInputError(say(ENTRY, "no-model-type", "add-model-type", path=path))
    else:
        raw = {}
    if not isinstance(raw, dict):
        raise PlannerInputError(say(ENTRY, "not-an-object", "readable-config", path=config_path))
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError):
        raise PlannerInputError(say(ENTRY, "unknown-model-type", "known-model-type", model_type=model_type,
                                    version=_transformers_version())) from None


def model_facts(config: Any) -> ModelFacts:
    """Build the model on the meta device and read its counts and shapes."""
    import torch
    from transformers import AutoModelForCausalLM

    model_type = getattr(config, "model_type", "?")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except ValueError as err:
        raise PlannerInputError(say(ENTRY, "no-causal-lm", "plan-a-decoder", model_type=model_type,
                                    error=str(err).splitlines()[0][:120])) from None
    counts = count_params(model)
    if not counts.expert_total:
        raise PlannerInputError(say(ENTRY, "no-experts", "moe-config", model_type=model_type))
    moe_layers = len({name.split(".experts.")[0] for name, _ in model.named_parameters() if ".experts." in name})
    text = getattr(config, "get_text_config", lambda: config)()

    def first(keys: tuple[str, ...]) -> int:
        for key in keys:
            value = getattr(text, key, None)
            if isinstance(value, int) and value > 0:
                return value
        raise PlannerInputError(say(ENTRY, "missing-key", "add-config-key", model_type=model_type,
                                    keys=", ".join(keys)))

    return ModelFacts(model_type=model_type, counts=counts, num_experts=first(EXPERT_KEYS), top_k=first(TOP_K_KEYS),
                      hidden_size=first(("hidden_size", "d_model")), num_layers=first(("num_hidden_layers",)),
                      num_heads=first(("num_attention_heads",)), expert_ffn=first(EXPERT_FFN_KEYS),
                      vocab_size=first(("vocab_size",)), moe_layers=moe_layers,
                      param_order=tuple((p.numel(), is_expert_param(n), n.rpartition(".")[0])
                                        for n, p in model.named_parameters() if p.requires_grad),
                      head_dim=getattr(text, "head_dim", None) or first(("hidden_size", "d_model"))
                      // first(("num_attention_heads",)),
                      units_leaf=gather_units(model, lambda name, module: hasattr(module, "experts")),
                      units_ep=gather_units(model),
                      num_kv_heads=getattr(text, "num_key_value_heads", None) or first(("num_attention_heads",)),
                      qk_norm=has_qk_norm(model), latent_attention=LatentAttention.of(text),
                      mix=layer_mix(model, first(("hidden_size", "d_model")), first(("num_hidden_layers",))),
                      native_tensors=native_tensors(model), fsdp_plan=tuple(getattr(model, "fsdp_plan", {}).items()),
                      ep_plan=tuple((getattr(model, "ep_plan", None) or {}).items()))


def native_tensors(model: Any) -> tuple[NativeTensor, ...]:
    """``model``'s trainable tensors with their shapes, for the peer's layout."""
    return tuple(NativeTensor(name, tuple(int(d) for d in p.shape), is_expert_param(name))
                 for name, p in model.named_parameters() if p.requires_grad)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


# ---------------------------------------------------------------------------------------- plans

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


def paste_lines(row: Row, args: argparse.Namespace) -> str:
    kwargs = [f"ep_size={row.ep_size}", f"stage={row.setup.stage}"]
    if row.setup.offload_optimizer:
        kwargs.append("offload_optimizer=True")
    if row.setup.offload_parameters:
        kwargs.append("offload_parameters=True")
    if args.bucket_size != 50_000_000:
        kwargs += [f"reduce_bucket_size={args.bucket_size}", f"allgather_bucket_size={args.bucket_size}"]
    per_node = args.gpus_per_node or args.gpus
    nodes = -(-args.gpus // per_node)
    precision = {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32-true"}[row.plan.precision]
    trainer = ['accelerator="gpu"', f"devices={min(per_node, args.gpus)}"]
    if nodes > 1:
        trainer.append(f"num_nodes={nodes}")
    trainer += [f"strategy=ZeroMoEStrategy({', '.join(kwargs)})", f'precision="{precision}"']
    if args.accumulation > 1:
        trainer.append(f"accumulate_grad_batches={args.accumulation}")
    return f"trainer = L.Trainer({', '.join(trainer)})"


def report(facts: ModelFacts, args: argparse.Namespace) -> str:
    rows = plan_all(facts, args)
    per_node = args.gpus_per_node or args.gpus
    c = facts.counts
    act = rows[0].plan.activations
    lines = [f"{facts.model_type}: {c.total:,} parameters = {c.dense_total:,} dense + {c.expert_total:,} expert "
             f"({facts.num_experts} experts, top-{facts.top_k}, {facts.moe_layers} MoE layers, hidden "
             f"{facts.hidden_size}, expert FFN {facts.expert_ffn}{facts.mix.describe() if facts.mix else ''}). "
             f"{args.gpus} GPUs ({per_node} per node) x "
             f"{args.gpu_gb:g} GB, {rows[0].plan.precision}, AdamW; micro-batch {args.micro_batch} x {args.seq_len} "
             f"tokens, accumulation {args.accumulation}, activation checkpointing "
             f"{'on' if args.activation_checkpointing else 'off'}: activations {act.total / GB:.1f} GB, buckets "
             f"{rows[0].plan.buffer_bytes / GB:.1f} GB per GPU.", "", table(rows), ""]
    inter = getattr(args, "allow_inter_node_ep", False)
    ranked = ranked_fitting(rows, per_node, inter)
    if not ranked:
        lines.append("Recommendation: nothing fits at any ep_size. " + rows[-1].plan.recommend().reason)
        return "\n".join(lines)
    best = ranked[0]
    t = best.time
    why = (f"Recommendation: ep_size={best.ep_size}, {best.setup.label}: {best.total / GB:.1f} GB per GPU of "
           f"{best.plan.usable_bytes / GB:.1f} GB usable, predicted step {t.describe()}")
    if len(ranked) > 1:
        other = ranked[1]
        why += (f"; runner-up ep_size={other.ep_size}, {other.setup.label}: {other.total / GB:.1f} GB, "
                f"{format_seconds(other.time.total)}")
    why += (f". The fastest of {len(ranked)} setups that fit; links: {_link_text(args)}; no overlap of "
            "communication with compute assumed (serial sum).")
    crossing = ranked_fitting(rows, per_node, True)[0]
    if crossing.ep_size > per_node and crossing is not best:
        why += (f" ep_size={crossing.ep_size} ({crossing.setup.label}) is predicted faster "
                f"({format_seconds(crossing.time.total)}), but its all-to-all crosses nodes (considered with "
                "--allow-inter-node-ep).")
    auto = [r for r in ranked if r.ep_size == best.ep_size and not r.setup.offload_optimizer]
    if auto:
        why += f' stage="auto" at ep_size={best.ep_size} picks ZeRO-{auto[0].setup.stage}.'
    else:
        why += (f' stage="auto" at ep_size={best.ep_size} picks ZeRO-3 and names the offload flag that fits '
                "(it never turns offload on by itself).")
    lines += [why, "", "from lightning_zeromoe import ZeroMoEStrategy", paste_lines(best, args)]
    if getattr(args, "compare_native", False):
        lines += ["", native_report(facts, args, rows)]
    return "\n".join(lines)


# ------------------------------------------------------------------------------- the peer's layout

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


def hardware_from(args: argparse.Namespace) -> Any:
    """``Hardware`` with the command line's overrides (``--tflops``, ``--intra-gbps``, ``--inter-gbps``)."""
    from lightning_zeromoe.planner.step_time import Hardware, Link

    hw = Hardware()
    return Hardware(flops_per_second=(getattr(args, "tflops", None) or hw.flops_per_second / 1e12) * 1e12,
                    intra=Link((getattr(args, "intra_gbps", None) or hw.intra.bandwidth / 1e9) * 1e9, hw.intra.latency),
                    inter=Link((getattr(args, "inter_gbps", None) or hw.inter.bandwidth / 1e9) * 1e9, hw.inter.latency))


def _link_text(args: argparse.Namespace) -> str:
    hw = hardware_from(args)
    return (f"{hw.flops_per_second / 1e12:g} TFLOP/s per GPU, {hw.intra.bandwidth / 1e9:g} GB/s inside a node, "
            f"{hw.inter.bandwidth / 1e9:g} GB/s between nodes")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a Hugging Face config.json (or its directory); no weights are read")
    parser.add_argument("--model-type", help="transformers' default config for this model_type (e.g. qwen3_moe)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--accumulation", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--bucket-size", type=int, default=50_000_000, help="ZeRO bucket sizes, elements")
    parser.add_argument("--allow-inter-node-ep", action="store_true",
                        help="let the recommendation pick an ep_size larger than the GPUs per node")
    parser.add_argument("--tflops", type=float, help="achieved TFLOP/s per GPU for the step time (default 400)")
    parser.add_argument("--intra-gbps", type=float, help="bus bandwidth inside a node, GB/s (default 450, NVLink)")
    parser.add_argument("--inter-gbps", type=float, help="bus bandwidth between nodes per GPU, GB/s (default 50, IB)")
    parser.add_argument("--compare-native", action="store_true",
                        help="also print transformers' native FSDP2 + EP layout (DistributedConfig(fsdp_size=GPUs, "
                             "ep_size=E)) at the same ep_sizes: memory per GPU, bytes per step, step time, and "
                             "where the two layouts differ by design")
    parser.add_argument("--expert-loop", choices=EXPERT_LOOPS, default="grouped",
                        help="how the model's MoE blocks run their experts at ep_size=1: grouped GEMMs (transformers "
                             "5's default where it can), a loop over a ModuleList, or a loop over fused-tensor "
                             "slices (experts_implementation='eager'); default grouped")


def run_hf(args: argparse.Namespace) -> int:
    """The ``--config`` / ``--model-type`` path of ``main``; returns the exit code."""
    try:
        facts = model_facts(load_config(args.config, args.model_type))
        print(report(facts, args))
    except PlannerInputError as err:
        print(str(err), file=sys.stderr)
        return 2
    return 0


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """Every option of ``zeromoe-plan``; ``prog`` defaults to the name it was started by."""
    parser = argparse.ArgumentParser(prog=prog or invocation.prog("zeromoe-plan"),
                                     description="Memory planner: what each GPU holds under ZeRO stages 1-3, with "
                                                 "expert parallelism and offload, the communication and the step "
                                                 "time. Give --config/--model-type (a Hugging Face model), --dense "
                                                 "(parameter counts) or --mixtral-8x7b (the worked example).")
    parser.add_argument("--mixtral-8x7b", action="store_true",
                        help="print the worked example: Mixtral-8x7B on --gpus x --gpu-gb GPUs (default 8 x 80 GB)")
    parser.add_argument("--dense", type=float, help="dense parameters (e.g. 1.6e9)")
    parser.add_argument("--experts", type=float, default=0, help="expert parameters, all experts (e.g. 45e9)")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpus-per-node", type=int)
    parser.add_argument("--gpu-gb", type=float, default=80)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--ep-size", type=int, help="expert-parallel size (default: 1; with --config: every valid one)")
    add_arguments(parser)  # --config / --model-type: plan a Hugging Face config
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    invocation.help_when_empty(parser, argv)
    args = parser.parse_args(argv)
    if args.config or args.model_type:
        raise SystemExit(run_hf(args))
    if args.mixtral_8x7b:
        print(mixtral_report(num_gpus=args.gpus, gpu_memory_gb=args.gpu_gb))
        return
    if args.dense is None:
        parser.error("nothing to plan: give --config or --model-type (a Hugging Face model), --dense (parameter "
                     "counts), or --mixtral-8x7b (the worked example)")
    p = plan(dense_params=int(args.dense), expert_params=int(args.experts), num_gpus=args.gpus,
             gpus_per_node=args.gpus_per_node, gpu_memory_bytes=args.gpu_gb * GB, precision=args.precision,
             ep_size=args.ep_size or 1)
    print(p.table())
    print("\nRecommendation: " + p.recommend().reason)


__all__ = ["DESIGN_DIFFERENCES", "ModelFacts", "NativeRow", "PlannerInputError", "Row", "TableRow", "add_arguments",
           "build_parser", "main", "load_config", "model_facts", "native_report", "native_rows", "native_table",
           "native_tensors", "plan_all", "ranked_fitting", "recommend", "render_table", "report", "run_hf",
           "valid_ep_sizes"]
