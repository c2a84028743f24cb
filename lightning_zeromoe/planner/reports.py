"""Printed reports: Mixtral-8x7B's plan (``python -m lightning_zeromoe.planner --mixtral-8x7b``) and
the seeds' rule-of-thumb arithmetic, side by side."""

from __future__ import annotations

from lightning_zeromoe.planner.counts import MIXTRAL_8X7B, moe_transformer_counts
from lightning_zeromoe.planner.plan import _gb, plan
from lightning_zeromoe.planner.setups import GB


#: The seeds' arithmetic (16 bytes per parameter, and ZeRO-1 "~1/4", ZeRO-2 "~1/8", ZeRO-3 "1/N").
def seed_estimate(total_params: int, num_gpus: int) -> dict[str, float]:
    base = 16 * total_params
    return {"no ZeRO": base, "ZeRO-1": base / 4, "ZeRO-2": base / 8, "ZeRO-3": base / num_gpus}


def mixtral_report(num_gpus: int = 8, gpu_memory_gb: float = 80, ep_sizes: tuple[int, ...] = (1, 8),
                   micro_batch: int = 1, seq_len: int = 4096) -> str:
    counts = moe_transformer_counts(**MIXTRAL_8X7B)
    cfg = MIXTRAL_8X7B
    lines = [f"Mixtral-8x7B: {counts.total:,} parameters = {counts.dense_total:,} dense (attention, norms, "
             f"routers, embeddings, lm_head) + {counts.expert_total:,} expert "
             f"(8 experts x 32 layers x 3 x 4096 x 14336). {num_gpus} x {gpu_memory_gb:g} GB, bf16, AdamW.", ""]
    for ep in ep_sizes:
        p = plan(counts=counts, num_gpus=num_gpus, gpus_per_node=num_gpus, gpu_memory_bytes=gpu_memory_gb * GB,
                 precision="bf16", ep_size=ep, micro_batch=micro_batch, seq_len=seq_len,
                 hidden_size=cfg["hidden_size"], num_layers=cfg["num_layers"], num_heads=cfg["num_heads"],
                 ffn_hidden_size=cfg["ffn_hidden_size"], top_k=2, vocab_size=cfg["vocab_size"],
                 num_experts=cfg["num_experts"], activation_checkpointing=True)
        lines += [f"### ep_size={ep} (GB per GPU; activations {_gb(p.activations.total)} GB for micro-batch "
                  f"{micro_batch} x {seq_len} tokens with activation checkpointing, buckets {_gb(p.buffer_bytes)} GB)",
                  "", p.table(), "", "Recommendation: " + p.recommend().reason, ""]
    seed = seed_estimate(counts.total, num_gpus)
    lines += ["### The seeds' arithmetic applied to the same count",
              "", "| seeds' rule | GB per GPU |", "|---|---:|"]
    lines += [f"| {k} | {_gb(v)} |" for k, v in seed.items()]
    return "\n".join(lines)
