"""Experts kept as a list of modules: ``experts = nn.ModuleList([MLP() for _ in range(E)])``.

The most common hand-written MoE block (research code, older checkpoints, DeepSpeed's own
examples) is a router ``nn.Linear(hidden, E)`` next to a ``ModuleList`` of E identical expert MLPs,
each two or three ``nn.Linear``: ``gate_proj/up_proj/down_proj``, ``w1/w2/w3``, ``fc1/fc2``, or any
other names. This module recognises such a block by structure alone (:func:`find_expert_list`,
pure: shapes only) and then reads what one expert computes off the expert itself
(:func:`identify_mlp`: which projection is the gate, which activation, biases), numerically, on
a seeded probe, never from its names.

AutoEP takes such experts as they are: its ``module_list`` expert storage
(``deepspeed/moe/ep_repack.py::_repack_module_list``) stacks each rank's experts' ``expert_w1`` /
``expert_w3`` / ``expert_w2`` Linear weights into its grouped ``[E_local, ffn, hidden]`` /
``[E_local, hidden, ffn]`` tensors. It reads only the weights: biases and ungated MLPs are
reasons to fall back, given here.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

#: Router child names that make a block MoE-looking even when its experts are no recognised MLP.
ROUTER_HINTS = ("router", "gate", "gating", "wg", "switch")

#: Plain activations tried for ungated experts (``down(act(up(x)))``): only to name the reason.
_PLAIN_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "squared relu": lambda t: F.relu(t) ** 2,
}
#: Gated forms AutoEP does not compute, tried only to name the reason.
_OTHER_GATED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"gelu(gate) * up (GEGLU, erf)": F.gelu,
                                                                   "relu(gate) * up (ReGLU)": F.relu}


def shape_of(tensor: torch.Tensor) -> tuple[int, ...]:
    """The full shape, also for a ZeRO-3 partitioned parameter (``ds_shape``)."""
    return tuple(int(s) for s in getattr(tensor, "ds_shape", tensor.shape))


@dataclass(frozen=True)
class ExpertList:
    """A router and a list of identical experts found under one block (names relative to it)."""

    router: str                 #: child holding the router projection
    experts: str                #: the ``ModuleList`` child
    num_experts: int
    hidden_size: int
    #: Linear children of one expert: name -> weight shape ``(out, in)``, in definition order.
    linears: tuple[tuple[str, tuple[int, int]], ...]
    expert_class: str
    #: Why the experts are no MLP AutoEP could stack (None: an MLP of 2 or 3 Linear layers).
    unsupported: str | None = None
    #: The ``[E, hidden]`` weight: ``router.weight``, or one level down (``router.gate.weight``).
    router_weight: str = ""

    def guess_roles(self) -> tuple[str, str, str | None]:
        """``(w1, w2, w3)`` from shapes and names (gate, down, up); :func:`identify_mlp` decides."""
        names = [n for n, _ in self.linears]
        shapes = dict(self.linears)
        down = [n for n in names if shapes[n] == (self.hidden_size, shapes[n][1]) and shapes[n][1] != self.hidden_size]
        down = down or [n for n in names if any(w in n for w in ("down", "w2", "wo", "fc2", "out"))] or names[-1:]
        rest = [n for n in names if n != down[0]]
        if len(rest) == 1:
            return rest[0], down[0], None
        gate = [n for n in rest if any(w in n for w in ("gate", "w1", "wi_0"))] or rest[:1]
        up = next(n for n in rest if n != gate[0])
        return gate[0], down[0], up


@dataclass(frozen=True)
class ExpertMLP:
    """What one expert computes, read off it numerically (:func:`identify_mlp`)."""

    w1: str            #: the gate projection (gated), or gate+up packed in one Linear, or the only input one
    w2: str            #: the down projection
    w3: str | None     #: the up projection when stored apart from the gate
    #: AutoEP's name of the gated form (``swiglu``, ``geglu_tanh``), or a description of what it is.
    activation: str
    #: Why AutoEP's experts cannot compute it (None: they can).
    unsupported: str | None = None


def _linear_children(expert: nn.Module) -> list[tuple[str, tuple[int, int]]] | None:
    """The expert's direct children holding a 2-D ``weight`` (and maybe a bias), if those are *all*
    its parameters; None when it has parameters elsewhere (its own, or deeper)."""
    linears: list[tuple[str, tuple[int, int]]] = []
    owned: set[int] = set()
    for name, child in expert.named_children():
        weight = getattr(child, "weight", None)
        params = dict(child.named_parameters())
        if not isinstance(weight, torch.Tensor) or len(shape_of(weight)) != 2:
            if params:
                return None
            continue  # an activation module
        if set(params) - {"weight", "bias"}:
            return None
        linears.append((name, shape_of(weight)))
        owned |= {id(p) for p in params.values()}
    if any(id(p) not in owned for p in expert.parameters()):
        return None
    return linears


def _same_experts(experts: nn.ModuleList) -> bool:
    first = experts[0]
    shapes = [(n, shape_of(p)) for n, p in first.named_parameters()]
    return all(type(e) is type(first) and [(n, shape_of(p)) for n, p in e.named_parameters()] == shapes
               for e in experts)


def weight_shapes(child: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """``(path, full shape)`` of ``child.weight`` and of each of its own children's ``weight`` (a
    router module holding ``self.gate = nn.Linear``, HunYuan's ``gate.wg``): where a router's
    ``[E, H]`` projection can sit."""
    candidates = [("weight", getattr(child, "weight", None))]
    candidates += [(f"{sub}.weight", getattr(grand, "weight", None)) for sub, grand in child.named_children()]
    return [(rel, shape_of(weight)) for rel, weight in candidates if isinstance(weight, torch.Tensor)]


def _router_for(block: nn.Module, skip: str, num_experts: int,
                hidden: int | None) -> tuple[str, str, int] | None:
    """``(child, weight path, hidden)`` of the child whose ``weight`` (or whose own child's, as in a
    router module holding ``self.gate = nn.Linear``) is ``[num_experts, hidden]`` (``hidden`` None: any)."""
    for name, child in block.named_children():
        if name == skip or isinstance(child, nn.ModuleList):
            continue
        for rel, shape in weight_shapes(child):
            if len(shape) == 2 and shape[0] == num_experts and (hidden is None or shape[1] == hidden):
                return name, f"{name}.{rel}", shape[1]
    return None


def _mlp_shape_problem(linears: list[tuple[str, tuple[int, int]]], hidden: int) -> str | None:
    """None if 2 or 3 Linear layers form ``hidden -> ffn -> hidden``, else what is wrong."""
    if len(linears) not in (2, 3):
        return f"{len(linears)} Linear layers, where an expert MLP has 2 or 3"
    ins = [s for _, s in linears if s[1] == hidden]
    outs = [s for _, s in linears if s[0] == hidden]
    if not outs or len(ins) < len(linears) - 1:
        return f"Linear shapes {[list(s) for _, s in linears]} that do not map hidden {hidden} -> ffn -> hidden"
    return None


def find_expert_list(block: nn.Module, num_experts: int | None = None) -> ExpertList | None:
    """The router + expert list of ``block``, if it is such an MoE block (pure: reads shapes only).

    A ``ModuleList`` child of E >= 2 modules of one class with equal parameter shapes, next to a
    child whose weight is ``[E, hidden]``. Experts that are an MLP of 2 or 3 Linear layers
    (``hidden -> ffn -> hidden``) are recognised whatever their names; other expert modules make
    the block MoE-looking only when the names say so (a router named like :data:`ROUTER_HINTS`,
    an experts list named ``*expert*``), and come back with the reason AutoEP cannot stack them.
    """
    for list_name, experts in block.named_children():
        if not isinstance(experts, nn.ModuleList) or len(experts) < 2:
            continue
        count = len(experts)
        if (num_experts is not None and count != num_experts) or not _same_experts(experts):
            continue
        if not any(True for _ in experts[0].parameters()):
            continue
        linears = _linear_children(experts[0])
        hidden = None
        if linears:
            outs = [s[0] for _, s in linears]
            ins = [s[1] for _, s in linears]
            hidden = next((h for h in ins if h in outs), None)
        found = _router_for(block, list_name, count, hidden)
        if found is None:
            continue
        router, router_weight, router_hidden = found
        problem = (f"its experts ({type(experts[0]).__name__}) are not an MLP of Linear layers only"
                   if linears is None else _mlp_shape_problem(linears, router_hidden))
        if problem is not None:
            named = "expert" in list_name.lower() or any(w in router.lower() for w in ROUTER_HINTS)
            if not named:
                continue
            if linears is not None:
                problem = f"its experts ({type(experts[0]).__name__}) have {problem}"
        return ExpertList(router=router, experts=list_name, num_experts=count, hidden_size=router_hidden,
                          linears=tuple(linears or ()), expert_class=type(experts[0]).__name__, unsupported=problem,
                          router_weight=router_weight)
    return None


def _close(compute: Callable[[], torch.Tensor], b: torch.Tensor, tol: float) -> bool:
    """Whether ``compute()`` reproduces ``b``; an assignment whose shapes do not chain is no match."""
    try:
        a = compute()
    except RuntimeError:
        return False
    scale = float(b.abs().max().clamp_min(1e-12))
    return a.shape == b.shape and float((a - b).abs().max()) / scale <= tol


def _gated_forms() -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """AutoEP's ``gate_fn(gate) * up`` forms without clamping, from its own registry."""
    from deepspeed.moe.ep_experts import EXPERT_ACTIVATIONS

    return {name: entry.gate_fn for name, entry in EXPERT_ACTIVATIONS.items()
            if entry.gate_fn is not None and not entry.uses_limit and not entry.uses_alpha}


def identify_mlp(expert: nn.Module, found: ExpertList, *, tokens: int = 8, seed: int = 4321,
                 tol: float = 1e-4) -> ExpertMLP:
    """Read off ``expert`` (its parameters whole: gathered by the caller under ZeRO-3) which of its
    Linear layers is the gate, the up and the down projection and which activation joins them.

    Every assignment of roles and every candidate form is computed with the expert's own weights
    and compared with ``expert(x)`` on a seeded batch; names are not trusted. The result says
    which AutoEP form it is, or why AutoEP's experts cannot compute it (biases, an ungated MLP, a
    gated form AutoEP lacks, nothing recognised).
    """
    mods = {name: getattr(expert, name) for name, _ in found.linears}
    ref = next(expert.parameters())
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, found.hidden_size, generator=gen).to(device=ref.device, dtype=ref.dtype)
    with torch.no_grad():
        want = expert(x)
        if isinstance(want, tuple):
            want = want[0]

        def lin(name: str, t: torch.Tensor) -> torch.Tensor:
            return F.linear(t, mods[name].weight, getattr(mods[name], "bias", None))

        biases = [n for n, m in mods.items() if isinstance(getattr(m, "bias", None), torch.Tensor)]
        match = _match_forms(list(mods), lin, x, want, tol)
    if match is None:
        return ExpertMLP(*found.guess_roles(), activation="unknown",
                         unsupported=f"its experts ({found.expert_class}) compute none of the MLP forms "
                                     "down(act(gate(x)) * up(x)) or down(act(up(x))) on a probe batch")
    w1, w2, w3, activation, gated, autoep = match
    problems = []
    if not gated:
        problems.append(f"its experts are not gated ({w1} -> {activation} -> {w2}), unlike AutoEP's gated "
                        "(SwiGLU-style) experts")
    elif not autoep:
        problems.append(f"its experts compute {activation}, which AutoEP's experts do not")
    if biases:
        owner = "their" if problems else "its experts'"
        problems.append(f"{owner} Linear layers have biases ({', '.join(biases)}), which AutoEP's grouped experts "
                        "do not carry")
    return ExpertMLP(w1=w1, w2=w2, w3=w3, activation=activation, unsupported="; ".join(problems) or None)


def _match_forms(names: list[str], lin: Callable[[str, torch.Tensor], torch.Tensor], x: torch.Tensor,
                 want: torch.Tensor, tol: float) -> tuple[str, str, str | None, str, bool, bool] | None:
    """``(w1, w2, w3, activation, gated, autoep_form)`` of the first form that reproduces ``want``."""
    autoep_forms = _gated_forms()
    gated = [(n, f, True) for n, f in autoep_forms.items()] + [(n, f, False) for n, f in _OTHER_GATED.items()]
    for down in names:
        ins = [n for n in names if n != down]
        if len(ins) == 2:
            for gate, up in itertools.permutations(ins):
                for form, fn, ok in gated:
                    if _close(lambda: lin(down, fn(lin(gate, x)) * lin(up, x)), want, tol):
                        return gate, down, up, form, True, ok
            continue
        try:
            packed = lin(ins[0], x)
        except RuntimeError:
            continue
        if packed.shape[-1] % 2 == 0:
            half = packed.shape[-1] // 2
            for form, fn, ok in gated:
                if _close(lambda: lin(down, fn(packed[..., :half]) * packed[..., half:]), want, tol):
                    return ins[0], down, None, form, True, ok
                if _close(lambda: lin(down, fn(packed[..., half:]) * packed[..., :half]), want, tol):
                    return ins[0], down, None, f"{form} with up before gate in {ins[0]}", True, False
        for form, fn in _PLAIN_ACTIVATIONS.items():
            if _close(lambda: lin(down, fn(packed)), want, tol):
                return ins[0], down, None, form, False, False
    return None


__all__ = ["ExpertList", "ExpertMLP", "find_expert_list", "identify_mlp"]
