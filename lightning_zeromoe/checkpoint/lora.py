"""PEFT LoRA: the adapter as PEFT saves it, and the base model with the adapter merged in.

Under a ``PeftModel`` the base model's names carry PEFT's wrappers: a LoRA ``Linear`` at ``X``
holds ``X.base_layer.weight`` and ``X.lora_A.<adapter>.weight`` / ``X.lora_B.<adapter>.weight``.

* Adapter: ``base_model.model.X.lora_A.weight`` (the adapter name dropped, as
  ``PeftModel.save_pretrained`` writes it) plus ``adapter_config.json``.
* Merged: ``X.weight = base + scaling * (B @ A)`` with ``scaling = lora_alpha / r`` (``/ sqrt(r)``
  with ``use_rslora``), transposed for ``fan_in_fan_out``: what ``merge_and_unload`` computes.
"""

from __future__ import annotations

import math
import re
from typing import Any

from lightning_zeromoe.checkpoint.errors import UNSUPPORTED_MODEL, ExportError
from lightning_zeromoe.checkpoint.meta import LoraAdapter
from lightning_zeromoe.checkpoint.plan import OutputTensor
from lightning_zeromoe.knowledge import say

_LORA = re.compile(r"(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.weight")


def split_lora(outputs: list[OutputTensor], adapters: list[LoraAdapter]) -> tuple[list[OutputTensor], list[OutputTensor]]:
    """(merged base model, adapter tensors) from the outputs of a PEFT-wrapped model."""
    if len(adapters) != 1:
        raise ExportError(say(UNSUPPORTED_MODEL, "several-adapters", "delete-other-adapters",
                              count=len(adapters), names=[a.name for a in adapters]))
    adapter = adapters[0]
    cfg = adapter.config
    if cfg.get("peft_type") not in ("LORA", None) or cfg.get("use_dora") or cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ExportError(say(UNSUPPORTED_MODEL, "not-plain-lora", "merge-yourself", name=adapter.name,
                              peft_type=cfg.get('peft_type'), use_dora=cfg.get('use_dora'),
                              rank_pattern=cfg.get('rank_pattern'), alpha_pattern=cfg.get('alpha_pattern')))
    by_name = {o.name: o for o in outputs}
    if any(".modules_to_save." in n or ".original_module." in n for n in by_name):
        raise ExportError(say(UNSUPPORTED_MODEL, "modules-to-save", "merge-yourself"))
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    fan_in_fan_out = bool(cfg.get("fan_in_fan_out"))
    pairs: dict[str, dict[str, OutputTensor]] = {}
    adapter_out: list[OutputTensor] = []
    for o in outputs:
        m = _LORA.fullmatch(o.name)
        if m and m["adapter"] == adapter.name:
            pairs.setdefault(m["module"], {})[m["ab"]] = o
            adapter_out.append(OutputTensor(f"{adapter.peft_prefix}{m['module']}.lora_{m['ab']}.weight", o.shape, o.build))
    merged: list[OutputTensor] = []
    for o in outputs:
        if _LORA.fullmatch(o.name):
            continue
        if ".base_layer." not in o.name:
            merged.append(o)
            continue
        module, leaf = o.name.rsplit(".base_layer.", 1)
        name = f"{module}.{leaf}"
        ab = pairs.get(module)
        if leaf != "weight" or ab is None:
            merged.append(OutputTensor(name, o.shape, o.build))
            continue
        merged.append(OutputTensor(name, o.shape, _merge(o, ab["A"], ab["B"], scaling, fan_in_fan_out)))
    return merged, adapter_out


def adapter_config(adapter: LoraAdapter) -> dict[str, Any]:
    return dict(adapter.config)


def _merge(base: OutputTensor, a: OutputTensor, b: OutputTensor, scaling: float, fan_in_fan_out: bool) -> Any:
    def build(reader: Any) -> Any:
        w = base.build(reader).float()
        delta = (b.build(reader).float() @ a.build(reader).float()) * scaling
        return w + (delta.T if fan_in_fan_out else delta)

    return build
