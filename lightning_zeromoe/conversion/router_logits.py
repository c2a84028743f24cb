"""Router logits across the AutoEP conversion: what Hugging Face's aux-loss recorder sees.

Hugging Face MoE models record each block's router logits (``_can_record_outputs``) and compute
their load-balancing loss from them. After AutoEP replaces a block, :func:`restore_router_logits`
makes the converted layer hand the recorder the same raw logits the original did;
:mod:`lightning_zeromoe.conversion.check` compares exactly those before converting.

Uses transformers' ``install_output_capuring_hook`` (``transformers.utils.output_capturing``, 5.22).
"""

from __future__ import annotations

from torch import nn

from lightning_zeromoe.discovery.find import Discovery
from lightning_zeromoe._private import transformers as hf_private

#: AutoEP presets whose adapter already hands HF's recorder the raw router logits.
_RETARGETING_PRESETS = ("mixtral", "qwen3_moe", "minimax_m3")


def router_logit_recorders(root: nn.Module) -> list[tuple[type, int, str | None]]:
    """``(target class, output index, layer_name)`` of every HF recorder of ``router_logits`` under root."""
    found: list[tuple[type, int, str | None]] = []
    for module in root.modules():
        spec = hf_private.recorded_outputs(type(module)).get("router_logits")
        for item in (spec if isinstance(spec, list) else [spec] if spec is not None else []):
            target = getattr(item, "target_class", item)
            if isinstance(target, type):
                entry = (target, int(getattr(item, "index", 1)), getattr(item, "layer_name", None))
                if entry not in found:
                    found.append(entry)
    return found


def match_output_contract(layer: nn.Module, returns_tuple: bool) -> None:
    """A block that returns ``(hidden, router_logits)`` (Llama-4) gets a layer that does the same,
    with the raw logits of its router (AutoEP detects this contract only from HF recorders)."""
    if returns_tuple and not getattr(layer, "return_router_logits", False):
        layer.return_router_logits = True
        layer.router_logits_capture_target = "router"
        layer.router_logits_capture_mode = "raw"


def raw_router_logits(layer: nn.Module) -> None:
    """Qwen3.5's preset hands HF softmax probabilities, which HF's aux loss softmaxes again: hand raw logits."""
    if getattr(layer, "return_router_logits", False) and getattr(layer, "router_logits_capture_target", "") == "router":
        layer.router_logits_capture_mode = "raw"


def restore_router_logits(root: nn.Module, found: Discovery) -> int:
    """After ``deepspeed.initialize``: make every converted block hand HF's recorder raw router logits.

    AutoEP's Mixtral/Qwen3-MoE/MiniMax-M3 adapters retarget HF's recorder to the new router; the
    Qwen3.5 adapter hands softmax probabilities (switched to raw logits here); a block that returns
    ``(hidden, router_logits)`` itself (Llama-4) gets a layer that does; DeepSeek-V2/V3 and
    custom sections retarget nothing, so a hook on the new router's projection is installed. The
    logits recorded are exactly what :func:`check_block` compared. Returns the hooks installed.
    """
    recorders = router_logit_recorders(root)
    if not recorders or not found.blocks:
        return 0
    from transformers.utils.output_capturing import install_output_capuring_hook

    preset = found.autoep.get("preset_model")
    installed = 0
    for block in found.blocks:
        layer = root.get_submodule(block.path)
        if not hasattr(layer, "router"):
            continue
        raw_router_logits(layer)
        match_output_contract(layer, block.returns_tuple)
        if preset in _RETARGETING_PRESETS or preset == "qwen3_5_moe":  # AutoEP's adapter feeds the recorder
            continue
        # A layer that returns (hidden, logits) computes its logits with a second call of its router
        # projection: record its output then, or each layer's logits would be recorded twice.
        target, index = (layer, 1) if getattr(layer, "return_router_logits", False) else (layer.router.gate, 0)
        if getattr(target, "_zeromoe_logits_hook", False):
            continue
        install_output_capuring_hook(target, "router_logits", index)
        target._zeromoe_logits_hook = True
        installed += 1
    return installed
