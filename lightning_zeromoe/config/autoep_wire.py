"""The ``expert_parallel`` section as DeepSpeed receives it: nothing in it that DeepSpeed warns about.

Discovery records a Hugging Face model's AutoEP preset as ``preset_model`` and, when the model sits
under the LightningModule (``self.net.model.layers.N.mlp``), re-roots the preset's block pattern as
``moe_layer_pattern``. deepspeed 0.19.8 warns on every rank, at each ``deepspeed.initialize``, when
any "custom preset field" is set next to ``preset_model``
(``module_inject/auto_ep_config.py::validate_autoep_config``: ``Custom preset fields [...] are set
alongside preset_model=...``), although a re-rooted pattern is exactly what the override is for.

AutoEP picks the same preset by itself when ``preset_model`` is absent: it reads ``model_type``
from the root's ``config`` (the strategy lends the model's config to the LightningModule while
``deepspeed.initialize`` runs) and takes ``preset_name_for_hf_model_type(model_type)``, then applies
the same overrides (``auto_ep_presets/registry.py::resolve_preset_candidates``); with
``moe_layer_pattern`` set an empty detection is still an error. So ``preset_model`` is left out of
what is sent exactly when that look-up names the same preset. The layers AutoEP converts, and
how, do not change (``tests/test_autoep_wire.py`` compares DeepSpeed's parsed layer specs for
several model types). The strategy's own config keeps ``preset_model``: checkpoints, export and
resume read the preset's names from it.

Pure apart from one look-up in DeepSpeed's preset registry (a public function).
"""

from __future__ import annotations

from typing import Any, Mapping

#: What ``validate_autoep_config`` counts as a custom preset field (deepspeed 0.19.8): set when its
#: value is not None, ``expert_w3`` whenever the key is present (None there means "fused gate+up").
CUSTOM_PRESET_FIELDS = ("moe_layer_pattern", "router_pattern", "expert_pattern", "expert_w1", "expert_w2",
                        "expert_w3", "num_experts_attr", "top_k_attr", "has_shared_experts",
                        "shared_experts_pattern", "shared_experts_gate_pattern", "expert_activation")


def custom_fields(section: Mapping[str, Any]) -> list[str]:
    """The custom preset fields ``section`` sets, as DeepSpeed counts them."""
    return [k for k in CUSTOM_PRESET_FIELDS if k in section and (section[k] is not None or k == "expert_w3")]


def preset_from_model_type(model_config: Any) -> str | None:
    """The preset AutoEP selects itself from ``model_config.model_type`` (None: none, or no config)."""
    model_type = getattr(model_config, "model_type", None)
    if not isinstance(model_type, str):
        return None
    from deepspeed.module_inject.auto_ep_presets.registry import preset_name_for_hf_model_type

    return preset_name_for_hf_model_type(model_type)


def section_for_deepspeed(section: Mapping[str, Any], model_config: Any) -> dict[str, Any]:
    """``section`` without ``preset_model`` when AutoEP would select that preset from ``model_config``
    anyway and a custom field is set next to it (what DeepSpeed warns about); otherwise unchanged."""
    out = dict(section)
    preset = out.get("preset_model")
    if preset is not None and custom_fields(out) and preset_from_model_type(model_config) == preset:
        del out["preset_model"]
    return out


def config_for_deepspeed(config: Mapping[str, Any], model_config: Any) -> dict[str, Any]:
    """The DeepSpeed config with its AutoEP section as :func:`section_for_deepspeed` sends it.

    Left as it is when ``tensor_parallel.preset_model`` is set: DeepSpeed checks that one against
    ``expert_parallel.preset_model`` (``auto_ep_folding.py::validate_folding_global``).
    """
    section = config.get("expert_parallel")
    tensor_parallel = config.get("tensor_parallel")
    if not isinstance(section, Mapping) or (isinstance(tensor_parallel, Mapping) and tensor_parallel.get("preset_model")):
        return dict(config)
    return {**config, "expert_parallel": section_for_deepspeed(section, model_config)}
