"""Which part of the routing differs, when the conversion probe fails: the first differing quantity.

A failed probe says the block's output (or a gradient) differs; this module says where the two
computations part: it runs the original block and the AutoEP layer once more, forward only, in
fp32, on the probe's tokens, with a hook on each router, and compares in order

1. the **router scores**: the router's logits (the original router's ``[T, E]`` output, AutoEP's
   ``router.gate``);
2. the **top-k choice**: which experts each token goes to (as sets: the order within a token's
   top-k does not matter);
3. the **combine weights**: each chosen expert's weight, matched by expert id;
4. otherwise the router agrees, and it is the **expert outputs** (or what the block adds after
   them: shared experts, norms) that differ.

The original's choice and weights are read from its router's output where it returns them (the
``(logits, weights, indices)`` of the routers of transformers 5.x, or dense ``[T, E]`` weights with
``k`` non-zeros per token, as Llama-4's); a router that returns its logits only lets this compare
the scores alone, and the verdict says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_zeromoe.conversion.probe import Side, relative_error, run_side
from lightning_zeromoe.conversion.report import COMPARE_TOLERANCE


@dataclass(frozen=True)
class RouterView:
    """What one router produced for the probe's tokens (``[T, E]``, ``[T, K]``, ``[T, K]``; None if not read)."""

    logits: torch.Tensor | None
    weights: torch.Tensor | None
    indices: torch.Tensor | None


def _view(out: Any, num_experts: int, reference: torch.Tensor | None = None) -> RouterView:
    """The logits, weights and indices among a router's outputs, found by dtype and shape.

    The indices are its integer ``[T, k]`` tensor and the weights the float one of the same shape.
    Among several float ``[T, E]`` outputs the logits are the one closest to ``reference`` (AutoEP's
    logits: Llama-4 returns its scattered scores first). Without integer indices, a ``[T, E]`` output
    with the same number ``k < E`` of non-zeros in every row is read as dense combine weights.
    """
    parts = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
    flat = [t.detach().reshape(-1, t.shape[-1]) for t in parts if t.dim() >= 2]
    indices = next((t for t in flat if not t.is_floating_point()), None)
    weights = None if indices is None else next(
        (t for t in flat if t.is_floating_point() and t.shape == indices.shape), None)
    square = [t for t in flat if t.is_floating_point() and t.shape[-1] == num_experts and t is not weights]
    logits = min(square, key=lambda t: relative_error(reference, t)) if square and reference is not None else \
        next(iter(square), None)
    if weights is None:
        for dense in (t for t in square if t is not logits):
            nonzero = (dense != 0).sum(-1)
            k = int(nonzero[0]) if nonzero.numel() else 0
            if 0 < k < num_experts and bool((nonzero == k).all()):
                indices = dense.abs().topk(k, dim=-1).indices
                weights, indices = dense.gather(1, indices), indices
                break
    return RouterView(logits, weights, indices if weights is not None else None)


def _recorder(path: str, into: list[Any]) -> Any:
    def install(module: nn.Module, _got: list[torch.Tensor]) -> list[Any]:
        return [module.get_submodule(path).register_forward_hook(lambda _m, _a, out: into.append(out))]
    return install


def _dense(view: RouterView, num_experts: int) -> torch.Tensor:
    """The combine weights as ``[T, E]`` (zero where not chosen)."""
    assert view.weights is not None and view.indices is not None
    dense = torch.zeros(view.indices.shape[0], num_experts, dtype=torch.float64)
    return dense.scatter_(1, view.indices.long(), view.weights.double())


def first_difference(original: RouterView, converted: RouterView, num_experts: int,
                     tol: float = COMPARE_TOLERANCE) -> str:
    """The first differing quantity, in the order of the module docstring, as a clause."""
    if original.logits is not None and converted.logits is not None:
        err = relative_error(original.logits, converted.logits)
        if err > tol:
            return f"first difference: the router scores (the router's logits differ by {err:.3g})"
    if original.indices is None or converted.indices is None:
        return ("the router's logits agree; the original router returns no top-k choice to compare, so the probe "
                "cannot tell whether the choice, the combine weights or the expert outputs differ")
    want, got = original.indices.long().sort(-1).values, converted.indices.long().sort(-1).values
    if want.shape != got.shape:
        return (f"first difference: the top-k choice (the original picks {want.shape[-1]} experts, "
                f"AutoEP {got.shape[-1]})")
    other = (want != got).any(-1)
    if bool(other.any()):
        t = int(other.nonzero()[0])
        return (f"first difference: the top-k choice (which experts): {int(other.sum())} of {other.numel()} tokens "
                f"go to other experts (token {t}: original {want[t].tolist()}, AutoEP {got[t].tolist()})")
    a, b = _dense(original, num_experts), _dense(converted, num_experts)
    err = relative_error(a, b)
    if err > tol:
        return (f"first difference: the combine weights (same experts, weights differ by {err:.3g}; per-token sum "
                f"{float(a.sum(-1).mean()):.4g} in the original, {float(b.sum(-1).mean()):.4g} in AutoEP's layer)")
    return ("first difference: the expert outputs (router scores, top-k choice and combine weights agree; the experts, "
            "where the weights are applied (to the experts' input or output: score_apply) or what the block adds "
            "after them, such as shared experts or norms, differ)")


def diagnose(original: Side, converted: Side, x: torch.Tensor, *, original_router: str, num_experts: int,
             seed: int) -> str:
    """Run both sides forward (fp32, training mode, as the probe did) with their routers hooked; see
    :func:`first_difference`. ``original_router``: the router's path in the original block."""
    seen: dict[str, list[Any]] = {"original": [], "router": [], "gate": []}
    for side, hooks in ((original, [(original_router, "original")]), (converted, [("router", "router"),
                                                                                  ("router.gate", "gate")])):
        def install(module: nn.Module, got: list[torch.Tensor], hooks: list[tuple[str, str]] = hooks) -> list[Any]:
            return [h for path, key in hooks for h in _recorder(path, seen[key])(module, got)]
        run_side(Side(side.module, None, (), install), x, x, None, dtype=torch.float32, seed=seed,
                 num_experts=num_experts, backward=False)
    if not seen["original"] or not seen["router"]:
        return "the routers could not be read (a router ran no forward)"
    auto = _view(seen["router"][0], num_experts)
    auto = RouterView(seen["gate"][0].detach().reshape(-1, num_experts) if seen["gate"] else None,
                      auto.weights, auto.indices)
    mine = _view(seen["original"][0], num_experts, auto.logits)
    return first_difference(mine, auto, num_experts)
