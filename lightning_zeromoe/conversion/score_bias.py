"""A choice-only score bias stored with singleton dimensions, shown to AutoEP as the ``[E]`` vector it is.

ERNIE-4.5-MoE keeps its ``e_score_correction_bias`` as ``[1, E]`` (``Ernie4_5_MoeStatics``, one
row per expert group, one group) and adds ``bias.squeeze()`` to the scores. AutoEP's router adds
``bias.unsqueeze(0)`` to its ``[T, E]`` scores (``deepspeed/moe/ep_router.py``): a ``[1, E]`` bias
makes them ``[1, T, E]`` and the layer fails ("Index tensor must have the same number of
dimensions as input tensor"). The ``[E]`` vector holds the same numbers in the same order (an
exact reshape), so for each block to convert the bias is swapped, before the probe, for an ``[E]``
tensor of the same kind (parameter or buffer, same ``requires_grad``); the block's own forward
squeezes it to the same vector, so the probe compares the original computation with AutoEP's.
Blocks that are not converted get their own tensor back. Export and resume write the bias under
the model's own name and shape (``checkpoint/save.py`` records the model's shape; the values are
reshaped, nothing else).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_zeromoe.discovery.block_probe import gathered
from lightning_zeromoe.discovery.expert_list import shape_of
from lightning_zeromoe._private import torch as torch_private


@dataclass(frozen=True)
class Swapped:
    """One block's own bias tensor, set aside while its ``[E]`` reshape stands in for it."""

    owner: nn.Module
    attribute: str
    tensor: torch.Tensor


def _flat_bias(block: nn.Module, layout: Any) -> tuple[nn.Module, str, torch.Tensor] | None:
    """The block's score bias when it has singleton dimensions around its ``[E]`` values, else None."""
    name = layout.score_bias if layout is not None else None
    if not name:
        return None
    owner_path, _, leaf = name.rpartition(".")
    owner = block.get_submodule(owner_path) if owner_path else block
    tensor = getattr(owner, leaf, None)
    if not isinstance(tensor, torch.Tensor):
        return None
    shape = tuple(shape_of(tensor))
    if len(shape) < 2 or math.prod(shape) != layout.num_experts or max(shape) != layout.num_experts:
        return None
    return owner, leaf, tensor


def flatten_score_biases(root: nn.Module, blocks: list[Any]) -> dict[str, Swapped]:
    """Swap each block's singleton-dimension score bias for its ``[E]`` reshape; return what was set aside."""
    swapped: dict[str, Swapped] = {}
    for block in blocks:
        hit = _flat_bias(root.get_submodule(block.path), block.layout)
        if hit is None:
            continue
        owner, leaf, tensor = hit
        with gathered(owner), torch.no_grad():
            value = tensor.detach().reshape(-1).clone()
        if isinstance(tensor, nn.Parameter):
            torch_private.own_parameters(owner)[leaf] = nn.Parameter(value, requires_grad=tensor.requires_grad)
        else:
            torch_private.own_buffers(owner)[leaf] = value
        swapped[block.path] = Swapped(owner, leaf, tensor)
    return swapped


def restore_score_biases(swapped: dict[str, Swapped], converted: set[str]) -> list[str]:
    """Give every block not in ``converted`` its own bias tensor back; return their paths."""
    done = []
    for path, kept in swapped.items():
        if path in converted:
            continue
        own = isinstance(kept.tensor, nn.Parameter)
        table = torch_private.own_parameters(kept.owner) if own else torch_private.own_buffers(kept.owner)
        table[kept.attribute] = kept.tensor
        done.append(path)
    return done


__all__ = ["Swapped", "flatten_score_biases", "restore_score_biases"]
