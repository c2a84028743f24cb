"""A tiny Hugging Face Mixtral, and the plain single-process run a pretrained fine-tune is checked against.

Used by tests/test_pretrained.py (ZeRO-3) and tests/test_plan_for.py (stage="auto" planned from
``plan_for``); both run tests/jobs/pretrained_job.py on 2 ranks over the same synthetic data.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_zeromoe.reference.models import SyntheticLMData

#: What tests/jobs/pretrained_job.py trains with (its SEQ_LEN and LR).
SEQ_LEN, LR, VOCAB = 17, 3e-3, 128


def build_tiny_mixtral(seed: int = 0) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
                           output_router_logits=True, tie_word_embeddings=False, attn_implementation="sdpa")
    return MixtralForCausalLM(config)


def lm_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens, output_router_logits=True, use_cache=False).loss


def plain_reference(path: Path, ranks: list[dict], *, steps: int, accumulate: int, batch: int) -> list[list[float]]:
    """Plain loop from ``from_pretrained(path)``: per optimizer step, each rank's recorded micro-batches
    (rank 0's, then rank 1's), the loss divided by ranks x accumulation, one AdamW step. Returns each
    rank's per-micro-batch losses."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    data = SyntheticLMData(batch * 2 * steps * accumulate, SEQ_LEN, VOCAB, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses: list[list[float]] = [[], []]
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            k = step * accumulate + micro
            for r in (0, 1):
                loss = lm_loss(model, data.tokens[ranks[r]["steps"][k]["indices"]])
                (loss / (2 * accumulate)).backward()
                losses[r].append(loss.item())
        opt.step()
    return losses
