"""The arithmetic of the two load-balancing remedies, with torch only (no Lightning, no DeepSpeed).

* :func:`bias_update`: the aux-loss-free balancing step, one sign per expert (what
  :class:`lightning_zeromoe.balance.balancer.ExpertBiasBalancer` applies after each optimizer step, and what
  the troubleshooter's reproduction applies in its plain loop);
* :func:`router_z_loss`: ST-MoE's router z-loss, ``mean(logsumexp(router_logits) ** 2)``.

Both are pure functions so that a plain training loop, the Lightning callback and the tests apply
the same rule.

**The bias rule, and its published variants.** A *choice-only* bias ``b`` is added to each
token's routing scores for the top-k choice only; the weights that multiply the experts' outputs
come from the unbiased scores, so ``b`` receives no gradient and changes which experts are picked,
never how much a picked expert contributes. After each step, with ``c_i`` the number of top-k
assignments expert ``i`` received in the step (summed over every data-parallel rank) and ``mean(c)``
their mean::

    b_i += rate * sign(mean(c) - c_i)

* Loss-Free Balancing (Wang et al. 2024, arXiv:2408.15664) and the DeepSeek-V3 report
  (arXiv:2412.19437, section 2.1.2 "Auxiliary-Loss-Free Load Balancing") describe this rule: at
  the end of each step an overloaded expert's bias falls by the "bias update speed" ``gamma``, an
  underloaded one's rises by ``gamma``. DeepSeek-V3 adds the bias to sigmoid affinities, used
  ``gamma = 0.001`` for the first 14.3T tokens and ``0`` for the last 500B, and kept a small
  sequence-wise balance loss (``alpha = 0.0001``) beside it.
* torchtitan's MoE (``load_balance_coeff``, default ``1e-3``) accumulates each layer's counts in a
  buffer during the forward passes, all-reduces them over the data-parallel (and context-parallel)
  ranks in an optimizer *pre*-step hook, applies the same sign step and then subtracts the step's
  mean (``delta - delta.mean()``), so the biases keep a zero sum; it zeroes the counts after.

Which is used here: the paper's rule by default (``centered=False``); ``centered=True`` is
torchtitan's. Adding one constant to every expert's bias changes no top-k choice (and no
group-limited choice, whose group scores all move by the same amount), so the two give the same
routing, losses and loads step for step; only the stored bias values differ by a constant. The
update runs after the optimizer step (torchtitan: just before it), on the counts of the step just
taken, in fp32.

**The z-loss** (Zoph et al. 2022, ST-MoE, arXiv:2202.08906, eq. 5): the mean over routed tokens
of the squared log-partition function of the router logits. It pushes router logits towards
small magnitudes, which keeps the softmax (and routing) numerically stable; the paper uses a
weight of 1e-3. It does not balance the load by itself.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["bias_update", "router_z_loss"]


def bias_update(counts: torch.Tensor, rate: float, *, centered: bool = False) -> torch.Tensor:
    """The step to add to one layer's choice-only bias: ``rate * sign(mean(counts) - counts)``.

    ``counts``: top-k assignments per expert over the step, summed over every rank (``[E]``).
    Returned in fp32: an expert that received more than the mean gets ``-rate``, fewer gets
    ``+rate``, exactly the mean ``0``. ``centered`` subtracts the step's mean (torchtitan's variant).
    """
    counts = counts.detach().float()
    delta = rate * torch.sign(counts.mean() - counts)
    return delta - delta.mean() if centered else delta


def router_z_loss(router_logits: torch.Tensor | Sequence[torch.Tensor], batch_size: int | None = None) -> torch.Tensor:
    """``mean(logsumexp(logits, -1) ** 2)`` over every routed token of every layer (in fp32).

    ``router_logits``: one tensor ``[..., num_experts]`` per MoE layer (what Hugging Face models
    return as ``router_logits`` with ``output_router_logits=True``, or what
    :func:`lightning_zeromoe.reference.models.capture_router_logits` records), or one such tensor. Layers
    may differ in expert count. With ``batch_size``, each layer's tokens are read as
    ``[batch_size, tokens per sequence]`` and the loss is returned per sequence (``[batch_size]``,
    the mean over that sequence's tokens and the layers); the mean of that over sequences is the
    scalar form when every sequence has as many tokens.
    """
    layers = [router_logits] if isinstance(router_logits, torch.Tensor) else list(router_logits)
    if not layers:
        raise ValueError("router_z_loss: no router logits were recorded (no MoE layer ran, or the model "
                         "does not return them: Hugging Face models need output_router_logits=True)")
    if batch_size is None:
        total = sum(torch.logsumexp(t.float(), dim=-1).square().sum() for t in layers)
        count = sum(t.numel() // t.shape[-1] for t in layers)
        return total / count
    per_layer = [torch.logsumexp(t.float(), dim=-1).square().reshape(batch_size, -1).mean(dim=1) for t in layers]
    return torch.stack(per_layer).mean(dim=0)
