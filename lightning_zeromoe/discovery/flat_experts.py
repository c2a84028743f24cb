"""Experts kept as 2-D ``[E * ffn, hidden]`` tensors (DBRX), read as the 3-D tensors they are.

DBRX's ``DbrxExpertGLU`` holds ``w1`` (gate), ``v1`` (up) and ``w2`` (down), each ``[E * ffn,
hidden]``, and computes expert ``e`` as ``(act(x @ w1_e.T) * (x @ v1_e.T)) @ w2_e`` with
``w_e = w.view(E, ffn, hidden)[e]`` (``transformers/models/dbrx/modeling_dbrx.py``). So ``w1`` and
``v1`` viewed as ``[E, ffn, hidden]`` are exactly AutoEP's ``w1``/``w3`` (gate and up,
``deepspeed/moe/ep_experts.py``), and ``w2`` viewed as ``[E, ffn, hidden]`` and transposed to ``[E,
hidden, ffn]`` is exactly its ``w2``: views, no arithmetic. AutoEP reads experts only from 3-D
tensors on a direct child of the block (``auto_ep.py::_has_3d_expert_params``), so for the
conversion the module holding them (``experts.mlp``) is shown to AutoEP as a direct child
(:data:`EXPERTS_ALIAS`, the same module) and its three parameters' data are those views while AutoEP
copies them (:func:`viewed_3d`): the parameters keep their identity, so the optimizer that holds
them hands their place to AutoEP's grouped tensors. The setup-time probe proves each block.

Pure: reads shapes and names (``ds_shape`` for ZeRO-3 partitioned parameters).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from lightning_zeromoe.discovery.expert_list import shape_of

#: Child name under which a nested experts module (DBRX's ``experts.mlp``) is shown to AutoEP.
EXPERTS_ALIAS = "zeromoe_experts"
#: ``BlockLayout.storage`` of such blocks.
FLAT = "flattened_2d"


@dataclass(frozen=True)
class FlatExperts:
    """Where a block keeps its flattened experts, relative to the block."""

    module: str  # e.g. "experts.mlp"
    gate: str    # "w1"
    up: str      # "v1"
    down: str    # "w2"
    ffn: int


def _role(names: list[str], words: tuple[str, ...]) -> str | None:
    found = [n for n in names if n in words or any(w in n for w in words if w.isalpha())]
    return found[0] if len(found) == 1 else None


def find_flat_experts(block: nn.Module, skip: str, num_experts: int, hidden: int) -> FlatExperts | None:
    """A module under ``block`` (a child or grandchild, not ``skip``, the router) holding exactly three
    2-D ``[num_experts * ffn, hidden]`` parameters named as gate, up and down (``w1``/``v1``/``w2``,
    or with ``gate``/``up``/``down`` in the name), or None."""
    for name, module in block.named_modules():
        if not name or name == skip or name.startswith(skip + ".") or name.count(".") > 1:
            continue
        params = {n: shape_of(p) for n, p in module.named_parameters(recurse=False)}
        if len(params) != 3 or any(len(s) != 2 for s in params.values()):
            continue
        rows, cols = next(iter(params.values()))
        if any(s != (rows, cols) for s in params.values()) or cols != hidden or rows % num_experts or rows == num_experts:
            continue
        names = list(params)
        gate, up, down = _role(names, ("w1", "gate")), _role(names, ("v1", "w3", "up")), _role(names, ("w2", "down"))
        if gate and up and down and len({gate, up, down}) == 3:
            return FlatExperts(name, gate, up, down, rows // num_experts)
    return None


def _views(module: nn.Module, gate: str, up: str, down: str, num_experts: int) -> dict[str, torch.Tensor] | None:
    """The 3-D views AutoEP reads, or None when the parameters are ZeRO-3 partitioned (no data to view)."""
    params = {n: getattr(module, n) for n in (gate, up, down)}
    if any(p.data.numel() != p.numel() or p.dim() != 2 or hasattr(p, "ds_id") for p in params.values()):
        return None
    rows, hidden = params[gate].shape
    shape = (num_experts, rows // num_experts, hidden)
    return {gate: params[gate].data.view(shape), up: params[up].data.view(shape),
            down: params[down].data.view(shape).transpose(1, 2)}


def partitioned(module: nn.Module) -> bool:
    """Whether ``module``'s own parameters are ZeRO-3 partitioned (built under ``zero.Init``)."""
    return any(hasattr(p, "ds_id") for p in module.parameters(recurse=False))


def show_3d(module: nn.Module, gate: str, up: str, down: str, num_experts: int) -> bool:
    """Point the three parameters' data at their 3-D views (gate/up ``[E, ffn, hidden]``, down ``[E,
    hidden, ffn]``); False, changing nothing, when they cannot be viewed."""
    views = _views(module, gate, up, down, num_experts)
    if views is None:
        return False
    for name, view in views.items():
        getattr(module, name).data = view
    return True


def show_2d(module: nn.Module, gate: str, up: str, down: str) -> None:
    """The model's own ``[E * ffn, hidden]`` data back (undoes :func:`show_3d`; a no-op when 2-D)."""
    for name in (gate, up, down):
        p = getattr(module, name)
        if p.dim() == 3:
            data = p.data.transpose(1, 2) if name == down else p.data
            p.data = data.reshape(-1, data.shape[-1])


@contextlib.contextmanager
def viewed_3d(module: nn.Module, gate: str, up: str, down: str, num_experts: int) -> Iterator[bool]:
    """:func:`show_3d` for the duration (yields whether it could), then the 2-D data back."""
    done = show_3d(module, gate, up, down, num_experts)
    try:
        yield done
    finally:
        if done:
            show_2d(module, gate, up, down)


__all__ = ["EXPERTS_ALIAS", "FLAT", "FlatExperts", "find_flat_experts", "partitioned", "show_2d", "show_3d",
           "viewed_3d"]
