"""MoE blocks that carry PEFT adapters stay out of expert parallelism.

AutoEP replaces a block with its own layer, repacked from the block's *base* tensors (router
``Linear``, 3-D experts). An adapter inside the block (LoRA on the router, or on the fused expert
tensors through PEFT's ``target_parameters``, which wraps the experts module in a
``peft.tuners.lora.layer.ParamWrapper``) is not carried over: after the conversion its parameters
would sit in no module's forward, never get a gradient, and the model would compute without the
adapter (measured with peft 0.21.2: discovery still found both blocks of a tiny Mixtral whose
experts were wrapped, and the setup probe cannot tell: ``lora_B`` starts at zero, so the wrapped
block and AutoEP's layer agree before the first step). Such blocks fall back to ZeRO-3 without
expert parallelism (registered as leaf modules), with this reason in the setup log line.

PEFT's ``ParamWrapper`` itself works under ZeRO-3 as a leaf module: it parametrizes the 3-D tensor
only inside its forward, when the leaf block's parameters are gathered, so the adapter trains at
parity with plain PEFT, the base experts stay frozen, and the run saves, resumes (same and other
``ep_size``) and exports with the adapter merged (``tests/test_lora_ep.py``, runs ``T``/``U``/``V``).
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

__all__ = ["adapted_blocks"]


def adapted_blocks(root: nn.Module, paths: Iterable[str]) -> dict[str, str]:
    """``{block path: reason}`` for each block under ``root`` that holds a PEFT module (checked by the
    class's module, no peft import)."""
    out = {}
    for path in paths:
        try:
            block = root.get_submodule(path)
        except AttributeError:
            continue
        wrapped = [(name, type(m).__name__) for name, m in block.named_modules()
                   if type(m).__module__.split(".")[0] == "peft"]
        if wrapped:
            where = ", ".join(f"{name or '<block>'} ({kind})" for name, kind in wrapped[:2])
            out[path] = (f"it holds PEFT adapters ({where}), which AutoEP's layer would drop (it is rebuilt from the "
                         "base weights, so the adapters would stop training)")
    return out
