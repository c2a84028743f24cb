"""DBRX's flattened experts for AutoEP: the nested module shown as a direct child, its tensors as 3-D views.

See :mod:`lightning_zeromoe.discovery.flat_experts` for why the views are exact. Here, around the
probe and ``deepspeed.initialize``:

- :func:`install` shows each such block's experts module (``experts.mlp``) to AutoEP as the child
  ``zeromoe_experts`` (the same module, no copy), as :func:`lightning_zeromoe.conversion.check.router_aliases`
  does for a nested router.
- :func:`for_autoep` is held while AutoEP builds a layer from the block (the probe's, and the
  engine's): the parameters' data are then the 3-D views. The block's own forward, which the probe
  runs, needs its 2-D data, so the probe builds its layer inside it and runs the block outside.
- :func:`settle` leaves the blocks that passed in the 3-D state for ``deepspeed.initialize`` (which
  replaces them; their parameters then leave the model) and gives the others their own 2-D data and
  no alias.

A block whose parameters are already ZeRO-3 partitioned (built under ``zero.Init``) has no data to
view: :func:`unviewable` names it, with the reason, and it trains without EP.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn

from lightning_zeromoe.discovery.flat_experts import EXPERTS_ALIAS, FLAT, partitioned, show_2d, show_3d, viewed_3d
from lightning_zeromoe._private import torch as torch_private

PARTITIONED = ("its experts are 2-D [E * ffn, hidden] tensors, ZeRO-3 partitioned when the model was built "
               "(zero.Init), and the exact 3-D view AutoEP 0.19.8 reads needs their data whole (the same model "
               "built outside zero.Init converts)")


def _flat(blocks: list[Any]) -> list[Any]:
    return [b for b in blocks if b.layout is not None and b.layout.storage == FLAT]


def _experts(root: nn.Module, block: Any) -> nn.Module:
    return root.get_submodule(f"{block.path}.{block.layout.experts}")


def unviewable(root: nn.Module, blocks: list[Any]) -> dict[str, str]:
    """Flattened-expert blocks that cannot be viewed as 3-D (ZeRO-3 partitioned), with the reason."""
    return {b.path: PARTITIONED for b in _flat(blocks) if partitioned(_experts(root, b))}


def install(root: nn.Module, blocks: list[Any]) -> list[str]:
    """Show each flattened-expert block's experts module to AutoEP as ``zeromoe_experts``, its data 2-D
    (the block's own forward runs in the probe; a block left 3-D by an earlier probe is put back)."""
    done = []
    for block in _flat(blocks):
        experts = _experts(root, block)
        show_2d(experts, block.layout.w1, block.layout.w3, block.layout.w2)
        root.get_submodule(block.path).add_module(EXPERTS_ALIAS, experts)
        done.append(block.path)
    return done


@contextlib.contextmanager
def for_autoep(root: nn.Module, block: Any) -> Iterator[None]:
    """The block's flattened experts as AutoEP's 3-D views for the duration (nothing for other blocks)."""
    if block.layout is None or block.layout.storage != FLAT:
        yield
        return
    layout = block.layout
    with viewed_3d(_experts(root, block), layout.w1, layout.w3, layout.w2, layout.num_experts):
        yield


def settle(root: nn.Module, blocks: list[Any], converted: set[str]) -> None:
    """Blocks in ``converted``: 3-D views kept for ``deepspeed.initialize``; the others: their own 2-D
    data, and no alias (their state dict must not name the experts twice)."""
    for block in _flat(blocks):
        module, layout = root.get_submodule(block.path), block.layout
        experts = _experts(root, block)
        if block.path in converted:
            show_3d(experts, layout.w1, layout.w3, layout.w2, layout.num_experts)
            continue
        show_2d(experts, layout.w1, layout.w3, layout.w2)
        torch_private.child_table(module).pop(EXPERTS_ALIAS, None)


__all__ = ["FLAT", "PARTITIONED", "for_autoep", "install", "settle", "unviewable"]
