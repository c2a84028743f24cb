"""PEFT LoRA: the adapter as PEFT saves it, and the base model with the adapter merged in.

Under a ``PeftModel`` the base model's names carry PEFT's wrappers: a LoRA ``Linear`` at ``X``
holds ``X.base_layer.weight`` and ``X.lora_A.<adapter>.weight`` / ``X.lora_B.<adapter>.weight``.

* Adapter: ``base_model.model.X.lora_A.weight`` (the adapter name dropped, as
  ``PeftModel.save_pretrained`` writes it) plus ``adapter_config.json``.
* Merged: ``X.weight = base + scaling * (B @ A)`` with ``scaling = lora_alpha / r`` (``/ sqrt(r)``
  with ``use_rslora``), transposed for ``fan_in_fan_out``: what ``merge_and_unload`` computes.

LoRA on a parameter (PEFT ``target_parameters``, e.g. the fused 3-D ``experts.gate_up_proj``) wraps
the parameter's module ``X`` in a ``ParamWrapper``; two parameters of one module nest two wrappers,
so the base tensors are ``X.base_layer.base_layer.P`` and the adapters sit at ``X`` and
``X.base_layer``. Which parameter each wrapper adapts is not in the names: the save records it
(``LoraAdapter.param_wrappers``, :func:`param_wrappers`). A wrapper over ``[E, d1, d2]`` has
``lora_A [E*r, in]`` and ``lora_B [out, E*r]``; expert ``e``'s delta is
``scaling * B[:, :, e] @ A[e]`` with ``A`` viewed ``[E, r, in]`` and ``B`` viewed ``[out, r, E]``,
transposed to ``[in, out]`` unless PEFT swapped in and out (``[E, out, in]`` layouts, Mixtral's).
An adapter pair that no base tensor takes is refused: the merged model would silently lack it.

LoRA on an embedding holds ``X.lora_embedding_A.<adapter>`` ``[r, num_embeddings]`` and
``X.lora_embedding_B.<adapter>`` ``[dim, r]`` (parameters, no ``.weight``); its delta is
``scaling * (B @ A).T``. ``modules_to_save`` keeps ``X.original_module.P`` (frozen) and
``X.modules_to_save.<adapter>.P`` (trained): the merged model takes the trained copy as ``X.P``,
the adapter saves it as ``X.P`` (PEFT's own key). Any other PEFT tensor (DoRA's magnitude, a LoRA
bias, trainable tokens) left in a merged name is refused, never written as a stray tensor.
"""

from __future__ import annotations

import math
import re
from typing import Any

from lightning_zeromoe.checkpoint.errors import UNSUPPORTED_MODEL, ExportError
from lightning_zeromoe.checkpoint.meta import LoraAdapter
from lightning_zeromoe.checkpoint.plan import OutputTensor
from lightning_zeromoe.knowledge import say

_LORA = re.compile(r"(?P<module>.+)\.lora_(?P<embedding>embedding_)?(?P<ab>[AB])\.(?P<adapter>[^.]+)(?P<leaf>\.weight)?")
_SAVED = re.compile(r"(?P<module>.+)\.(?P<kind>modules_to_save|original_module)\.(?P<rest>.+)")
#: Pieces of a name only PEFT's wrappers have: one left in a merged name would be a stray tensor.
_PEFT_PIECES = (".lora_", ".base_layer.", ".modules_to_save.", ".original_module.", ".token_adapter.")


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
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    fan_in_fan_out = bool(cfg.get("fan_in_fan_out"))
    pairs: dict[str, dict[str, OutputTensor]] = {}
    embeddings: set[str] = set()
    adapter_out: list[OutputTensor] = []
    rest: list[OutputTensor] = []
    for o in outputs:
        m = _LORA.fullmatch(o.name)
        saved = _SAVED.fullmatch(o.name)
        if m and m["adapter"] == adapter.name and bool(m["embedding"]) != bool(m["leaf"]):
            pairs.setdefault(m["module"], {})[m["ab"]] = o
            if m["embedding"]:
                embeddings.add(m["module"])
            kind = "lora_embedding_" if m["embedding"] else "lora_"
            adapter_out.append(OutputTensor(f"{adapter.peft_prefix}{m['module']}.{kind}{m['ab']}{m['leaf'] or ''}",
                                            o.shape, o.build))
        elif saved and saved["kind"] == "original_module":
            continue  # the frozen original beside a modules_to_save copy: merge_and_unload drops it
        elif saved and saved["rest"].startswith(adapter.name + "."):
            # modules_to_save: the trained copy takes the module's own name (merge_and_unload keeps it).
            leaf = saved["rest"][len(adapter.name) + 1:]
            rest.append(OutputTensor(f"{saved['module']}.{leaf}", o.shape, o.build))
            adapter_out.append(OutputTensor(f"{adapter.peft_prefix}{saved['module']}.{leaf}",
                                            o.shape, o.build))
        else:
            rest.append(o)
    wrappers = adapter.param_wrappers
    merged: list[OutputTensor] = []
    used: set[str] = set()
    for o in rest:
        if ".base_layer." not in o.name:
            merged.append(o)
            continue
        module, leaf = o.name.rsplit(".", 1)
        chain = _wrapper_chain(module)
        name = f"{chain[0]}.{leaf}"
        wrapper = next((w for w in chain if wrappers.get(w, {}).get("parameter") == leaf and w in pairs), None)
        if wrapper is not None:
            used.add(wrapper)
            ab = pairs[wrapper]
            merged.append(OutputTensor(name, o.shape, _merge_param(o, ab["A"], ab["B"], scaling, wrappers[wrapper])))
        elif leaf == "weight" and len(chain) == 1 and chain[0] in pairs and chain[0] not in wrappers:
            used.add(chain[0])
            ab = pairs[chain[0]]
            # An embedding's delta is (B @ A).T ([num_embeddings, dim]), whatever fan_in_fan_out says.
            transpose = True if chain[0] in embeddings else fan_in_fan_out
            merged.append(OutputTensor(name, o.shape, _merge(o, ab["A"], ab["B"], scaling, transpose)))
        else:
            merged.append(OutputTensor(name, o.shape, o.build))
    unmerged = sorted(m for m in set(pairs) - used if {"A", "B"} <= set(pairs[m]))
    if unmerged:
        raise ExportError(say(UNSUPPORTED_MODEL, "unmerged-lora", "resave-with-wrappers",
                              modules=_few(unmerged)))
    stray = sorted(o.name for o in merged if any(p in o.name + "." for p in _PEFT_PIECES)) + sorted(
        m for m in pairs if not {"A", "B"} <= set(pairs[m]))
    if stray:
        raise ExportError(say(UNSUPPORTED_MODEL, "peft-leftovers", "merge-yourself", names=_few(stray)))
    return merged, adapter_out


def _few(names: list[str]) -> str:
    return ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")


def _wrapper_chain(module: str) -> list[str]:
    """``X.base_layer.base_layer`` -> ``[X, X.base_layer]``: the PEFT layers around a base tensor, outermost first."""
    chain = [module]
    while chain[-1].endswith(".base_layer"):
        chain.append(chain[-1][: -len(".base_layer")])
    return chain[:0:-1]


def param_wrappers(base_model: Any) -> dict[str, dict[str, Any]]:
    """``{path: {"parameter", "experts", "swapped"}}`` of each PEFT ``ParamWrapper`` under ``base_model``
    (recognised by class name and attributes; no peft import)."""
    out = {}
    for name, m in base_model.named_modules():
        if type(m).__name__ != "ParamWrapper" or not hasattr(m, "parameter_name") or not hasattr(m, "num_experts"):
            continue
        base = m.get_base_layer()
        param = getattr(base, m.parameter_name)
        ndim = len(getattr(param, "ds_shape", param.shape))  # ZeRO-3 partitioned: the full shape is ds_shape
        # PEFT swaps in and out for a 3-D parameter unless its module says it is stored [E, in, out].
        out[name] = {"parameter": str(m.parameter_name), "experts": int(m.num_experts),
                     "swapped": ndim == 3 and not getattr(base, "is_transposed", False)}
    return out


def adapter_config(adapter: LoraAdapter) -> dict[str, Any]:
    return dict(adapter.config)


def _merge(base: OutputTensor, a: OutputTensor, b: OutputTensor, scaling: float, fan_in_fan_out: bool) -> Any:
    def build(reader: Any) -> Any:
        w = base.build(reader).float()
        delta = (b.build(reader).float() @ a.build(reader).float()) * scaling
        return w + (delta.T if fan_in_fan_out else delta)

    return build


def _merge_param(base: OutputTensor, a: OutputTensor, b: OutputTensor, scaling: float,
                 wrapper: dict[str, Any]) -> Any:
    """``base + delta`` for a ``ParamWrapper`` (PEFT's ``get_delta_weight``, in fp32)."""
    import torch

    experts, swapped = int(wrapper["experts"]), bool(wrapper["swapped"])

    def build(reader: Any) -> Any:
        w = base.build(reader).float()
        wa, wb = a.build(reader).float(), b.build(reader).float()
        if experts == 1:
            delta = wb @ wa
        else:
            wa = wa.reshape(experts, -1, wa.shape[-1])  # [E, r, in]
            wb = wb.reshape(wb.shape[0], -1, experts)  # [out, r, E]
            delta = torch.einsum("ore,eri->eoi" if swapped else "ore,eri->eio", wb, wa)
        return w + (delta * scaling).reshape(w.shape)

    return build
