"""What the planner reads from a Hugging Face model: its config (a ``config.json`` or transformers'
default for a ``model_type``) and the model built from it on the meta device, as :class:`ModelFacts`.

Nothing is downloaded and no weights are allocated. Input the planner cannot plan from raises
:class:`PlannerInputError`, whose message starts with its knowledge-base entry id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_zeromoe.knowledge import say
from lightning_zeromoe.planner.activations import LatentAttention
from lightning_zeromoe.planner.counts import (EXPERT_FFN_KEYS, EXPERT_KEYS, TOP_K_KEYS, GatherUnit, ParamCounts,
                                             count_params, gather_units, has_qk_norm, is_expert_param)
from lightning_zeromoe.planner.layers import LayerMix, layer_mix
from lightning_zeromoe.planner.native_ep import NativeTensor, NativeUnit, fsdp_units


ENTRY = "planner-hf-config"


class PlannerInputError(ValueError):
    """Input the planner cannot plan from; the message starts with its knowledge-base entry id."""


@dataclass(frozen=True)
class ModelFacts:
    """What the planner needs from a Hugging Face model, read off its config and meta-device build."""

    model_type: str
    counts: ParamCounts
    num_experts: int
    top_k: int
    hidden_size: int
    num_layers: int
    num_heads: int
    expert_ffn: int
    vocab_size: int
    #: Layers that hold routed experts (those with an ``experts`` module), from the built model.
    moe_layers: int
    #: (elements, is_expert, module) per trainable parameter tensor, in the model's order (ZeRO-3's reuse distance).
    param_order: tuple[tuple[int, bool, str], ...] = ()
    #: Size of one attention head (``head_dim``, or hidden / heads): attention FLOPs use heads x head_dim.
    head_dim: int = 0
    #: ZeRO-3's gather units (:func:`~lightning_zeromoe.planner.counts.gather_units`) at ``ep_size`` 1,
    #: where each MoE block is one leaf module, and with expert parallelism: for the modelled peak.
    units_leaf: tuple[GatherUnit, ...] = ()
    units_ep: tuple[GatherUnit, ...] = ()
    #: For the activations: key/value heads (grouped-query attention), per-head q/k norms, multi-head
    #: latent attention's widths, and the dense layers and shared experts beside the MoE blocks.
    num_kv_heads: int = 0
    qk_norm: bool = False
    latent_attention: LatentAttention | None = None
    mix: LayerMix | None = None
    #: For the peer's layout (:mod:`~lightning_zeromoe.planner.native_ep`): every trainable tensor with its
    #: shape, and the model's own ``fsdp_plan`` and ``ep_plan`` (transformers' plans, as (key, style) pairs).
    native_tensors: tuple[NativeTensor, ...] = ()
    fsdp_plan: tuple[tuple[str, str], ...] = ()
    ep_plan: tuple[tuple[str, str], ...] = ()

    def units(self, ep_size: int) -> tuple[GatherUnit, ...]:
        return self.units_leaf if ep_size == 1 else self.units_ep

    def native_units(self, ep_size: int) -> tuple[NativeUnit, ...]:
        """The ``fully_shard`` units transformers' FSDP2 + EP builds for this model at ``ep_size``."""
        return fsdp_units(self.native_tensors, dict(self.fsdp_plan), dict(self.ep_plan), ep_size)


def load_config(config_path: str | None = None, model_type: str | None = None) -> Any:
    """A ``PretrainedConfig`` from a ``config.json`` (file or directory) or transformers' default
    config for ``model_type``. Nothing is downloaded."""
    if config_path:
        path = Path(config_path)
        path = path / "config.json" if path.is_dir() else path
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise PlannerInputError(say(ENTRY, "unreadable", "readable-config", path=path, error=err)) from None
        model_type = (raw.pop("model_type", None) if isinstance(raw, dict) else None) or model_type
        if not model_type:
            raise PlannerInputError(say(ENTRY, "no-model-type", "add-model-type", path=path))
    else:
        raw = {}
    if not isinstance(raw, dict):
        raise PlannerInputError(say(ENTRY, "not-an-object", "readable-config", path=config_path))
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError):
        raise PlannerInputError(say(ENTRY, "unknown-model-type", "known-model-type", model_type=model_type,
                                    version=_transformers_version())) from None


def model_facts(config: Any) -> ModelFacts:
    """Build the model on the meta device and read its counts and shapes."""
    import torch
    from transformers import AutoModelForCausalLM

    model_type = getattr(config, "model_type", "?")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except ValueError as err:
        raise PlannerInputError(say(ENTRY, "no-causal-lm", "plan-a-decoder", model_type=model_type,
                                    error=str(err).splitlines()[0][:120])) from None
    counts = count_params(model)
    if not counts.expert_total:
        raise PlannerInputError(say(ENTRY, "no-experts", "moe-config", model_type=model_type))
    moe_layers = len({name.split(".experts.")[0] for name, _ in model.named_parameters() if ".experts." in name})
    text = getattr(config, "get_text_config", lambda: config)()

    def first(keys: tuple[str, ...]) -> int:
        for key in keys:
            value = getattr(text, key, None)
            if isinstance(value, int) and value > 0:
                return value
        raise PlannerInputError(say(ENTRY, "missing-key", "add-config-key", model_type=model_type,
                                    keys=", ".join(keys)))

    return ModelFacts(model_type=model_type, counts=counts, num_experts=first(EXPERT_KEYS), top_k=first(TOP_K_KEYS),
                      hidden_size=first(("hidden_size", "d_model")), num_layers=first(("num_hidden_layers",)),
                      num_heads=first(("num_attention_heads",)), expert_ffn=first(EXPERT_FFN_KEYS),
                      vocab_size=first(("vocab_size",)), moe_layers=moe_layers,
                      param_order=tuple((p.numel(), is_expert_param(n), n.rpartition(".")[0])
                                        for n, p in model.named_parameters() if p.requires_grad),
                      head_dim=getattr(text, "head_dim", None) or first(("hidden_size", "d_model"))
                      // first(("num_attention_heads",)),
                      units_leaf=gather_units(model, lambda name, module: hasattr(module, "experts")),
                      units_ep=gather_units(model),
                      num_kv_heads=getattr(text, "num_key_value_heads", None) or first(("num_attention_heads",)),
                      qk_norm=has_qk_norm(model), latent_attention=LatentAttention.of(text),
                      mix=layer_mix(model, first(("hidden_size", "d_model")), first(("num_hidden_layers",))),
                      native_tensors=native_tensors(model), fsdp_plan=tuple(getattr(model, "fsdp_plan", {}).items()),
                      ep_plan=tuple((getattr(model, "ep_plan", None) or {}).items()))


def native_tensors(model: Any) -> tuple[NativeTensor, ...]:
    """``model``'s trainable tensors with their shapes, for the peer's layout."""
    return tuple(NativeTensor(name, tuple(int(d) for d in p.shape), is_expert_param(name))
                 for name, p in model.named_parameters() if p.requires_grad)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


__all__ = ["ENTRY", "ModelFacts", "PlannerInputError", "load_config", "model_facts", "native_tensors"]
