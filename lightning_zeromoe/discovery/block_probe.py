"""Reading a hand-written MoE block's routing off its own forward pass.

A Hugging Face block's routing is read from its config (:mod:`lightning_zeromoe.discovery.hf_semantics`).
A hand-written block has no config: its semantics live in its ``forward``. They are read here the
only way that does not depend on how the code is written: run the block on a seeded probe batch,
run its router projection and every expert on the same tokens, and find the routing under which
the block's output is the weighted sum of its experts' outputs. The candidates are what AutoEP's
router can compute (``deepspeed/moe/ep_router.py``): softmax or sigmoid scores, top-k, with or
without renormalising the k weights (top-k-then-softmax is softmax-then-top-k renormalised), and
one scale. Nothing matching means the block falls back, with the reason.

The same pass says what else the block does that AutoEP's layer would not: randomness in
training (noise, jitter, dropout: the output differs between two identical calls), tensors it
stores on itself during forward (an aux loss read by the model later), extra return values that
are not the raw router logits, an output not shaped like its input. Each is a reason to fall back.

The block runs in training mode (each submodule's mode is put back) under a forked RNG (the
model's random stream is not consumed). The result is a claim, not a proof: the setup-time probe
(:mod:`lightning_zeromoe.conversion.check`) then builds AutoEP's layer from it and compares.
Under ZeRO-3 the block's parameters are gathered for the pass and released; its buffers are put
back afterwards (a block that counts tokens per expert is left as it was).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from lightning_zeromoe.discovery.expert_list import find_expert_list, identify_mlp
from lightning_zeromoe.discovery.hf_semantics import Routing
from lightning_zeromoe.discovery.structure import BlockLayout

#: Attributes a block or its router may keep its top-k in (tried first; the probe decides).
TOP_K_ATTRS = ("top_k", "topk", "k", "num_experts_per_tok", "num_experts_per_token", "num_selected_experts",
               "n_activated_experts", "moe_top_k", "top_k_experts", "num_active_experts")
_READ = "read off the block's forward on a probe batch"


@dataclass(frozen=True)
class BlockReading:
    """What a block's forward showed: its routing, or why AutoEP's layer would compute otherwise."""

    layout: BlockLayout
    routing: Routing | None
    reason: str | None = None
    #: The block returns ``(output, router_logits)`` (raw logits ``[tokens, E]``), as AutoEP's layer can.
    returns_tuple: bool = False


def tolerance(dtype: torch.dtype) -> float:
    """Relative max-abs error between the block and a candidate that still counts as the same."""
    return {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 4e-2, torch.float16: 1e-2}.get(dtype, 1e-4)


@contextlib.contextmanager
def gathered(module: nn.Module) -> Iterator[None]:
    """``module``'s parameters whole for the pass: ZeRO-3 partitioned ones are gathered, read-only."""
    params = list(module.parameters())
    if not any(hasattr(p, "ds_id") for p in params):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield


@contextlib.contextmanager
def training_mode(module: nn.Module) -> Iterator[None]:
    """Every submodule in training mode (what the block will do while training), modes put back after."""
    modes = [(m, m.training) for m in module.modules()]
    module.train()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def read_experts(block: nn.Module, layout: BlockLayout) -> BlockLayout:
    """A ``module_list`` layout with the expert roles and activation read off expert 0 (parameters
    whole); the reason AutoEP cannot stack them in ``unsupported``. Other layouts come back as they are."""
    if layout.storage != "module_list" or layout.unsupported:
        return layout
    found = find_expert_list(block, layout.num_experts)
    if found is None:
        return layout
    expert = getattr(block, layout.experts)[0]
    ref = next(expert.parameters())
    mlp = identify_mlp(expert, found, tol=tolerance(ref.dtype))
    activation = None if mlp.activation == "swiglu" else mlp.activation
    return dataclasses.replace(layout, w1=mlp.w1, w2=mlp.w2, w3=mlp.w3, expert_activation=activation,
                               unsupported=mlp.unsupported)


def read_block(block: nn.Module, layout: BlockLayout, *, tokens: int = 16, seed: int = 1234) -> BlockReading:
    """Read ``block``'s routing (and experts, for module lists) off its forward; see the module docstring."""
    with gathered(block), torch.no_grad():
        layout = read_experts(block, layout)
        if layout.unsupported:
            return BlockReading(layout, None, layout.unsupported)
        ref = next(block.parameters())
        tol = tolerance(ref.dtype)
        x = torch.randn(2, tokens // 2, layout.hidden_size,
                        generator=torch.Generator().manual_seed(seed)).to(device=ref.device, dtype=ref.dtype)
        saved = {n: b.clone() for n, b in block.named_buffers()}
        before = _stored(block)
        try:
            with training_mode(block), torch.random.fork_rng(devices=[ref.device.index or 0] if ref.is_cuda else []):
                first, second = block(x), block(x)
        except Exception as exc:  # noqa: BLE001 - a block we cannot call is a verdict, not a crash
            return BlockReading(layout, None, f"the block cannot be called on a [batch, seq, hidden] probe ({exc})")
        finally:
            for name, value in saved.items():
                block.get_buffer(name).copy_(value)
        stashed = sorted(set(_stored(block).items()) - set(before.items()))
        out, extras = (first[0], first[1:]) if isinstance(first, tuple) else (first, ())
        again = second[0] if isinstance(second, tuple) else second
        xf = x.reshape(-1, layout.hidden_size)
        logits = _router_logits(block, layout, xf)
        problem = _contract_problem(x, out, again, extras, logits, stashed, tol)
        if problem:
            return BlockReading(layout, None, problem)
        found = _fit(block, layout, xf, out.reshape(-1, layout.hidden_size), logits, x, tol)
    if isinstance(found, str):
        return BlockReading(layout, None, found)
    return BlockReading(layout, found, returns_tuple=bool(extras))


def _stored(block: nn.Module) -> dict[tuple[str, str], tuple[int, int]]:
    """Tensors and lists each submodule keeps as plain attributes: (module, attr) -> (id, length)."""
    out = {}
    for path, module in block.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                out[(path, attr)] = (id(value), -1)
            elif isinstance(value, (list, dict)) and not attr.startswith("_"):
                out[(path, attr)] = (id(value), len(value))
    return out


def _router_logits(block: nn.Module, layout: BlockLayout, xf: torch.Tensor) -> torch.Tensor:
    router = block.get_submodule(layout.router_linear)
    return F.linear(xf, router.weight, getattr(router, "bias", None))


def _contract_problem(x: torch.Tensor, out: Any, again: Any, extras: tuple[Any, ...], logits: torch.Tensor,
                      stashed: list[tuple[tuple[str, str], Any]], tol: float) -> str | None:
    """What the block does besides routing that AutoEP's layer would not (None: nothing)."""
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        shape = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return f"the block returns {shape} for a {list(x.shape)} input; AutoEP's layer returns the input's shape"
    # Not torch.equal: on GPUs index_add_ accumulates in any order, so identical calls differ by rounding.
    if float((out - again).abs().max()) > tol * float(out.abs().max().clamp_min(1e-12)):
        return ("the block's forward is random in training mode (noise, jitter or dropout: two identical calls "
                "differ), which AutoEP's layer would silently drop")
    if stashed:
        names = ", ".join(f"{p + '.' if p else ''}{a}" for (p, a), _ in stashed)
        return (f"the block stores {names} on itself during forward (an aux loss or statistics the model reads "
                "later), which AutoEP's layer would not")
    if extras:
        extra = extras[0]
        if len(extras) > 1 or not isinstance(extra, torch.Tensor) or extra.shape != logits.shape \
                or float((extra - logits).abs().max()) > tol * float(logits.abs().max().clamp_min(1e-12)):
            what = ", ".join(list(e.shape).__repr__() if isinstance(e, torch.Tensor) else type(e).__name__
                             for e in extras)
            return (f"the block returns ({what}) besides its output, which is not its raw router logits "
                    "[tokens, experts], the only extra value AutoEP's layer returns")
    return None


def _expert_outputs(block: nn.Module, layout: BlockLayout, xf: torch.Tensor) -> torch.Tensor | None:
    """Every expert's output on every token, ``[E, tokens, hidden]``."""
    experts = getattr(block, layout.experts)
    if layout.storage == "module_list":
        outs = [experts[i](xf) for i in range(layout.num_experts)]
        return torch.stack([o[0] if isinstance(o, tuple) else o for o in outs])
    w1, w2 = getattr(experts, layout.w1), getattr(experts, layout.w2)
    if layout.w3 is not None:
        w3 = getattr(experts, layout.w3)
        hidden = F.silu(torch.einsum("th,efh->etf", xf, w1)) * torch.einsum("th,efh->etf", xf, w3)
        return torch.einsum("etf,ehf->eth", hidden, w2)
    if layout.layout == "hidden_first":
        h = torch.einsum("th,ehf->etf", xf, w1)
        ffn = h.shape[-1] // 2
        return torch.einsum("etf,efh->eth", F.silu(h[..., :ffn]) * h[..., ffn:], w2)
    if layout.layout == "gate_up_first":
        h = torch.einsum("th,efh->etf", xf, w1)
        ffn = h.shape[-1] // 2
        return torch.einsum("etf,ehf->eth", F.silu(h[..., :ffn]) * h[..., ffn:], w2)
    return None


def _shared_output(block: nn.Module, layout: BlockLayout, x: torch.Tensor) -> torch.Tensor | None:
    if layout.shared_experts is None:
        return None
    shared = getattr(block, layout.shared_experts)(x)
    if layout.shared_experts_gate is not None:
        shared = torch.sigmoid(getattr(block, layout.shared_experts_gate)(x)) * shared
    return shared.reshape(-1, x.shape[-1])


def _top_k_hint(block: nn.Module, layout: BlockLayout) -> tuple[int | None, str]:
    for owner, where in ((block, "block"), (block.get_submodule(layout.router_linear), "router")):
        for attr in TOP_K_ATTRS:
            value = getattr(owner, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= layout.num_experts:
                return value, f"{where}.{attr}"
    return None, ""


def _fit(block: nn.Module, layout: BlockLayout, xf: torch.Tensor, out: torch.Tensor, logits: torch.Tensor,
         x: torch.Tensor, tol: float) -> Routing | str:
    """The routing under which ``out`` is the weighted sum of the experts' outputs, or why none is."""
    experts = _expert_outputs(block, layout, xf)
    if experts is None:
        return f"its expert tensors have layout {layout.layout!r}, which the probe cannot evaluate"
    shared = _shared_output(block, layout, x)
    target = (out - shared if shared is not None else out).double()
    experts, logits = experts.double(), logits.double()
    scale_ref = float(target.abs().max())
    if scale_ref == 0.0:
        return "the block outputs zeros on the probe batch, so its routing cannot be read"
    hint, hint_src = _top_k_hint(block, layout)
    ks = ([hint] if hint else []) + [k for k in range(1, layout.num_experts + 1) if k != hint]
    best: tuple[float, int, str, bool, float] | None = None
    for k in ks:
        chosen = torch.topk(logits, k, dim=-1).indices
        for score_func in ("softmax", "sigmoid"):
            scores = torch.softmax(logits, dim=-1) if score_func == "softmax" else torch.sigmoid(logits)
            picked = scores.gather(-1, chosen)
            for norm in (True, False):
                w = picked / picked.sum(dim=-1, keepdim=True) if norm else picked
                weights = torch.zeros_like(scores).scatter(-1, chosen, w)
                pred = torch.einsum("te,eth->th", weights, experts)
                scale = float((pred * target).sum() / (pred * pred).sum().clamp_min(1e-300))
                err = float((scale * pred - target).abs().max()) / scale_ref
                if best is None or err < best[0] - 1e-12:
                    best = (err, k, score_func, norm, scale)
        if best is not None and best[0] <= tol and k == hint:
            break  # the block's own top-k fits: do not look for a coincidence at another k
    assert best is not None
    err, k, score_func, norm, scale = best
    if err > tol:
        return (f"its output is not a top-k mixture of its experts that AutoEP's router can compute (softmax or "
                f"sigmoid scores, with or without renormalisation, one scale; best candidate off by {err:.3g} "
                "relative): token dropping, capacity limits or another routing scheme")
    scale = _round_scale(scale, lambda s: _error(s, k, score_func, norm, logits, experts, target) / scale_ref, tol)
    k_src = f"{hint_src}, {_READ}" if k == hint else _READ
    origin = (("score_func", f"{score_func!r} ({_READ})"), ("route_norm", f"{norm!r} ({_READ})"),
              ("route_scale", f"{scale!r} ({_READ})"), ("top_k", f"{k} ({k_src})"))
    return Routing(score_func=score_func, route_norm=norm, route_scale=scale, top_k=k,
                   shared_experts=layout.shared_experts, shared_experts_gate=layout.shared_experts_gate,
                   expert_activation=layout.expert_activation, origin=origin)


def _error(scale: float, k: int, score_func: str, norm: bool, logits: torch.Tensor, experts: torch.Tensor,
           target: torch.Tensor) -> float:
    """Max-abs error of one candidate routing at a given scale."""
    chosen = torch.topk(logits, k, dim=-1).indices
    scores = torch.softmax(logits, dim=-1) if score_func == "softmax" else torch.sigmoid(logits)
    picked = scores.gather(-1, chosen)
    w = picked / picked.sum(dim=-1, keepdim=True) if norm else picked
    pred = torch.einsum("te,eth->th", torch.zeros_like(scores).scatter(-1, chosen, w), experts)
    return float((scale * pred - target).abs().max())


def _round_scale(scale: float, error: Any, tol: float) -> float:
    """The fitted scale with the fewest decimals that still fits (every block then states the same
    value, and 2.5000000217 reads as 2.5)."""
    for decimals in range(0, 8):
        rounded = round(scale, decimals)
        if rounded != 0.0 and error(rounded) <= tol:
            return float(rounded)
    return scale


__all__ = ["BlockReading", "TOP_K_ATTRS", "gathered", "read_block", "read_experts", "tolerance"]
