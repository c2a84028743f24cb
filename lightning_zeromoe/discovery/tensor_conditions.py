"""Routing conditions read from a block's tensors rather than its config.

Some families compute what AutoEP computes only while a tensor of the block has a certain value:
Kolibri-1 / 1.1 add their ``e_score_correction_bias`` to the raw logits before the top-k, which is
AutoEP's sigmoid router exactly while that bias is zero (:data:`FamilyFacts.unsupported_unless_zero
<lightning_zeromoe.discovery.hf_semantics.FamilyFacts>`). Pure: reads attributes, imports nothing heavy.
"""

from __future__ import annotations

from typing import Any

from lightning_zeromoe.discovery.hf_semantics import FAMILY_FACTS


def weights_difference(config: Any, block: Any) -> str | None:
    """The family's reason AutoEP cannot compute ``block`` with its current tensors, or None.

    For :attr:`FamilyFacts.unsupported_unless_zero`: the reason, with the tensor's largest
    magnitude, when that tensor of the block is not all zeros. Reads the tensor (a buffer: never
    partitioned by ZeRO-3); imports nothing.
    """
    facts = FAMILY_FACTS.get(str(getattr(config, "model_type", "")))
    if facts is None or facts.unsupported_unless_zero is None:
        return None
    name, reason = facts.unsupported_unless_zero
    try:
        tensor = block.get_submodule(name.rsplit(".", 1)[0]) if "." in name else block
        tensor = getattr(tensor, name.rsplit(".", 1)[-1])
    except AttributeError:
        return None
    if tensor is None or tensor.numel() == 0 or getattr(tensor, "is_meta", False) or not bool(tensor.detach().any()):
        return None  # zero, or not readable (meta device): the conversion probe decides on the real values
    return f"{reason}; here {name} is non-zero (max |value| {float(tensor.detach().abs().max()):.3g})"
