"""Hand-written MoE blocks (a router ``nn.Linear`` + ``nn.ModuleList`` of expert MLPs) and a tiny LM.

Three shapes, each the way research code writes them (written for these tests, not copied):

* ``topk_softmax``: SwiGLU experts ``gate_proj/up_proj/down_proj``; top-k over the router logits,
  softmax over the k chosen (= softmax, top-k, renormalise); experts that got no token are skipped.
* ``legacy_mixtral``: modelled on Hugging Face transformers 4.x ``MixtralSparseMoeBlock`` (before
  the experts were fused): experts ``w1/w2/w3`` with ``act_fn``, softmax in float32, top-k,
  renormalise, a loop over the experts hit only, and ``(hidden, router_logits)`` returned for the
  model's load-balancing loss.
* ``switch``: Switch-Transformer style (labml.ai's ``SwitchFeedForward`` names the router
  ``switch``): top-1 of the softmax, experts ``fc1 -> GELU -> fc2`` with biases; not gated, so it
  cannot be expert-parallel under AutoEP and must fall back.

Plus variants the unit tests use: sigmoid routing without renormalisation, a scale, packed
``w13``, and blocks AutoEP's layer would get wrong (noise in training, an aux loss stored on the
block, token dropping by capacity).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

KINDS = ("topk_softmax", "legacy_mixtral", "switch")
VOCAB = 32


class SwiGLUExpert(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TopKSoftmaxMoE(nn.Module):
    """Top-k of the logits, softmax over the chosen ones; empty experts skipped."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLUExpert(hidden, ffn) for _ in range(num_experts))
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        values, chosen = torch.topk(self.router(flat), self.top_k, dim=-1)
        weights = torch.softmax(values, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            if token.numel() == 0:
                continue
            out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.reshape(b, t, h)


class Top2MLP(nn.Module):
    """transformers 4.x ``MixtralBlockSparseTop2MLP``'s shape: w1 gate, w3 up, w2 down."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class LegacyMixtralBlock(nn.Module):
    """Softmax (float32), top-k, renormalise; loop over the experts hit; returns (hidden, logits)."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(Top2MLP(hidden, ffn) for _ in range(num_experts))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, h = hidden_states.shape
        flat = hidden_states.view(-1, h)
        router_logits = self.gate(flat)
        routing = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing, selected = torch.topk(routing, self.top_k, dim=-1)
        routing = (routing / routing.sum(dim=-1, keepdim=True)).to(flat.dtype)
        final = torch.zeros_like(flat)
        mask = F.one_hot(selected, num_classes=self.num_experts).permute(2, 1, 0)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist():
            slot, token = torch.where(mask[e])
            final.index_add_(0, token, self.experts[e](flat[token]) * routing[token, slot, None])
        return final.reshape(b, t, h), router_logits


def load_balancing_loss(router_logits: list[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """Switch/Mixtral load balancing over all layers' logits: E * sum(fraction routed * mean prob)."""
    logits = torch.cat(router_logits, dim=0)
    probs = torch.softmax(logits.float(), dim=-1)
    _, selected = torch.topk(probs, top_k, dim=-1)
    routed = F.one_hot(selected, num_experts).float().mean(dim=0)  # [k, E]
    return num_experts * (routed * probs.mean(dim=0)).sum()


class FFNExpert(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SwitchBlock(nn.Module):
    """Top-1 of the softmax, weighted by its probability; GELU experts with biases."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int = 1) -> None:
        super().__init__()
        self.switch = nn.Linear(hidden, num_experts)
        self.experts = nn.ModuleList(FFNExpert(hidden, ffn) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        prob, route = torch.softmax(self.switch(flat), dim=-1).max(dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token = torch.nonzero(route == e).flatten()
            if token.numel():
                out[token] = expert(flat[token]) * prob[token, None]
        return out.reshape(b, t, h)


# --------------------------------------------------------------------------- variants for unit tests


class SigmoidMoE(nn.Module):
    """Sigmoid scores, top-k, no renormalisation, times 2.5; w13 packed gate+up (gate rows first)."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.gating = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(PackedExpert(hidden, ffn) for _ in range(num_experts))
        self.k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        scores = torch.sigmoid(self.gating(flat))
        weights, chosen = torch.topk(scores, self.k, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            if token.numel():
                out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        return (2.5 * out).reshape(x.shape)


class PackedExpert(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w13 = nn.Linear(hidden, 2 * ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class SoftmaxTopKNoNorm(nn.Module):
    """Softmax over all experts, then top-k, weights not renormalised (OLMoE-style); no top-k attribute
    under any usual name, so the probe must find k itself."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.wg = nn.Linear(hidden, num_experts, bias=False)
        self.mlps = nn.ModuleList(Top2MLP(hidden, ffn) for _ in range(num_experts))
        self.chosen_per_token = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(torch.softmax(self.wg(flat), dim=-1), self.chosen_per_token, dim=-1)
        out = torch.zeros_like(flat)
        for e, mlp in enumerate(self.mlps):
            token, slot = torch.where(chosen == e)
            if token.numel():
                out.index_add_(0, token, mlp(flat[token]) * weights[token, slot, None])
        return out.reshape(x.shape)


class NoisyTopK(TopKSoftmaxMoE):
    """Noisy top-k gating (Shazeer et al.): Gaussian noise on the logits in training."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            x = x + 0.1 * torch.randn_like(x)
        return super().forward(x)


class StashesAuxLoss(TopKSoftmaxMoE):
    """Computes its load-balancing loss in forward and keeps it as ``self.aux_loss``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x.reshape(-1, x.shape[-1])), dim=-1)
        self.aux_loss = probs.mean(dim=0).pow(2).sum() * probs.shape[-1]
        return super().forward(x)


class CapacityLimited(TopKSoftmaxMoE):
    """Each expert takes at most ``ceil(tokens * k / E * 0.5)`` tokens; the rest are dropped."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        values, chosen = torch.topk(self.router(flat), self.top_k, dim=-1)
        weights = torch.softmax(values, dim=-1)
        capacity = math.ceil(flat.shape[0] * self.top_k / len(self.experts) * 0.5)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            token, slot = token[:capacity], slot[:capacity]
            if token.numel():
                out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.reshape(b, t, h)


BLOCKS = {"topk_softmax": TopKSoftmaxMoE, "legacy_mixtral": LegacyMixtralBlock, "switch": SwitchBlock,
          "sigmoid": SigmoidMoE, "no_norm": SoftmaxTopKNoNorm, "noisy": NoisyTopK, "stash": StashesAuxLoss,
          "capacity": CapacityLimited}


# --------------------------------------------------------------------------- a tiny LM around them


class Layer(nn.Module):
    def __init__(self, kind: str, hidden: int, ffn: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.mix = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.LayerNorm(hidden)
        self.moe = BLOCKS[kind](hidden, ffn, num_experts, top_k)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The new hidden state, and the block's router logits when it returns them. (Returned, not
        appended to a list argument: ZeRO-3's module hooks rebuild list arguments, so an append
        would land in a copy.)"""
        # a causal running mean mixes the tokens of a sequence (no parameters)
        steps = torch.arange(1, h.shape[1] + 1, device=h.device, dtype=h.dtype)[None, :, None]
        h = h + self.mix(self.norm1(h).cumsum(dim=1) / steps)
        out = self.moe(self.norm2(h))
        router_logits = None
        if isinstance(out, tuple):
            out, router_logits = out
        return h + out, router_logits


class HandMoELM(nn.Module):
    """Embedding, ``layers`` x (mixing + MoE), LM head; loss = next-token CE + 0.02 x aux (if any)."""

    def __init__(self, kind: str, *, hidden: int = 16, ffn: int = 24, num_layers: int = 2, num_experts: int = 4,
                 top_k: int = 2, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.num_experts, self.top_k = num_experts, top_k
        self.embed = nn.Embedding(VOCAB, hidden)
        self.layers = nn.ModuleList(Layer(kind, hidden, ffn, num_experts, top_k) for _ in range(num_layers))
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        h = self.embed(ids)
        logits: list[torch.Tensor] = []
        for layer in self.layers:
            h, router_logits = layer(h)
            if router_logits is not None:
                logits.append(router_logits)
        return self.lm_head(self.norm(h)), logits

    def loss(self, ids: torch.Tensor) -> tuple[torch.Tensor, float | None]:
        """Next-token loss (+ 0.02 x load-balancing loss when the blocks return router logits)."""
        logits, router_logits = self(ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))
        if not router_logits:
            return loss, None
        aux = load_balancing_loss(router_logits, self.num_experts, self.top_k)
        return loss + 0.02 * aux, float(aux.detach())


def router_of(block: nn.Module) -> nn.Module:
    """The router projection of a block, original or AutoEP-converted (``router.gate``)."""
    if getattr(type(block), "_is_autoep_layer", False):
        return block.router.gate
    for name in ("router", "gate", "switch", "gating"):
        if isinstance(getattr(block, name, None), nn.Linear):
            return getattr(block, name)
    raise LookupError(f"no router in {type(block).__name__}")


class Skew:
    """A rank-dependent offset on every router's logits: rank 0's tokens go to the second half of
    the experts, rank 1's to the first half, so the two ranks route to disjoint experts. ``rank``
    is read at every call, so a plain run can replay each rank's batch with that rank's offset."""

    def __init__(self) -> None:
        self.rank = 0
        self.handles: list[Any] = []

    def install(self, net: HandMoELM) -> int:
        self.remove()
        for layer in net.layers:
            router = router_of(layer.moe)
            self.handles.append(router.register_forward_hook(self._hook))
        return len(self.handles)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _hook(self, _m: nn.Module, _a: Any, out: torch.Tensor) -> torch.Tensor:
        e = out.shape[-1]
        offset = torch.zeros(e, dtype=out.dtype, device=out.device)
        offset[: e // 2] = -50.0 if self.rank == 0 else 50.0
        return out + offset
