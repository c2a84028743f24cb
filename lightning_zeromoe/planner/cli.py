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
import sys

from lightning_zeromoe import invocation
from lightning_zeromoe.planner.model_facts import (ENTRY, ModelFacts, PlannerInputError, load_config, model_facts,
                                                  native_tensors)
from lightning_zeromoe.planner.native_report import native_report
from lightning_zeromoe.planner.plan import plan
from lightning_zeromoe.planner.reports import mixtral_report
from lightning_zeromoe.planner.rows import (Row, TableRow, hardware_from, plan_all, ranked_fitting, recommend,
                                           render_table, table, valid_ep_sizes)
from lightning_zeromoe.planner.setups import GB
from lightning_zeromoe.planner.step_time import EXPERT_LOOPS, format_seconds


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


# ModelFacts, load_config, model_facts, native_tensors and PlannerInputError live in .model_facts, the rows,
# ranking and table in .rows, both importable from here as before; --compare-native's comparison is .native_report.
__all__ = ["ENTRY", "ModelFacts", "PlannerInputError", "Row", "TableRow", "add_arguments", "build_parser", "main",
           "load_config", "model_facts", "native_tensors", "plan_all", "ranked_fitting", "recommend", "render_table",
           "report", "run_hf", "valid_ep_sizes"]
