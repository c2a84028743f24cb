"""Routing semantics of a Hugging Face MoE block, read from the model's own config.

AutoEP's custom section (``deepspeed/module_inject/auto_ep_presets/base.py``, ``AutoEPConfig``)
can express softmax or sigmoid scoring, top-k renormalisation (``route_norm``), a scale
(``route_scale``), group-limited routing, shared experts with or without a sigmoid gate, the
expert activation and whether scores weight the expert input or output (``score_apply``). Its
custom defaults (``route_norm=True``, softmax) are right for Mixtral and silently wrong for
OLMoE (``norm_topk_prob=False``). This module never leaves a field to those defaults: every
field of :class:`Routing` is resolved here, from the config where the config states it, and
otherwise from what the model's router code does for its family (:data:`FAMILY_FACTS`, read
from ``transformers/models/<type>/modeling_<type>.py``, 5.22). Each field records where it came
from, so a refusal can say why. Whatever is decided is then *proven* numerically per block by
:mod:`lightning_zeromoe.conversion.check`; a wrong mapping falls back, it never trains.

Pure: reads attributes, imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_zeromoe.knowledge import compose


@dataclass(frozen=True)
class FamilyFacts:
    """What a family's router code does where its config says nothing (or is not read).

    ``route_norm`` None: the config's ``norm_topk_prob`` decides. ``unsupported``: a reason AutoEP
    cannot express this family's routing at all (the block falls back without a probe).
    ``unsupported_when``: ``(config attribute, reason)`` pairs for options of the family that AutoEP
    cannot express; the reason applies when the config sets that attribute to a true or non-zero
    value. ``expert_activation``: AutoEP's name for the experts' activation, where it is not plain
    SwiGLU (a name in ``deepspeed.moe.ep_experts.EXPERT_ACTIVATIONS``). ``unsupported_unless_zero``:
    ``(block tensor, reason)``: the reason applies unless that tensor of the block is all zeros
    (read from the model by :func:`lightning_zeromoe.discovery.tensor_conditions.weights_difference`).
    """

    score_func: str = "softmax"
    route_norm: bool | None = None
    score_apply: str = "post"
    group_score_func: str = "top2_sum"
    unsupported: str | None = None
    unsupported_when: tuple[tuple[str, str], ...] = ()
    expert_activation: str | None = None
    unsupported_unless_zero: tuple[str, str] | None = None


INKLING2_EXPERTS = ("Inkling2's experts compute c_g*tanh(gate/c_g) * sigmoid(gate) * c_u*tanh(up/c_u) (a SwiGLU "
                    "softcapped by tanh, config.mlp_gate_softcap/mlp_up_softcap); AutoEP 0.19.8's expert "
                    "activations (swiglu, geglu_tanh, swiglu_clamped, swiglu_oai) clamp or do not bound at all; tanh is "
                    "nearly linear near 0, so on the tiny test model the probe measured only a 0.006 relative gap")

KOLIBRI = ("Kolibri-1 and -1.1 add their e_score_correction_bias to the raw router logits before the top-k "
           "(AutoEP 0.19.8 adds it to the sigmoid scores), so with a non-zero bias the experts AutoEP would choose "
           "differ (a zero bias, as in a model built from its config, converts)")

#: Read from each family's router ``forward`` in transformers 5.22 (see the module docstring).
FAMILY_FACTS: dict[str, FamilyFacts] = {
    # softmax over all experts, top-k, renormalised (no norm_topk_prob in the config)
    "mixtral": FamilyFacts(route_norm=True),
    "minimax": FamilyFacts(route_norm=True),
    "hunyuan_v1_moe": FamilyFacts(route_norm=True),
    # softmax over the top-k logits == renormalised softmax over all experts
    "granitemoe": FamilyFacts(route_norm=True),
    "granitemoeshared": FamilyFacts(route_norm=True),
    "gpt_oss": FamilyFacts(route_norm=True, unsupported=(
        "GPT-OSS's experts add biases (gate_up_proj_bias, down_proj_bias) to both projections; AutoEP 0.19.8 has "
        "their activation (expert_activation='swiglu_oai') but its grouped experts (w1, w2, w3) hold no bias")),
    # Qwen3.5's router renormalises whatever norm_topk_prob says
    "qwen3_5_moe_text": FamilyFacts(route_norm=True),
    # the config's norm_topk_prob is read by the router
    "qwen3_moe": FamilyFacts(), "qwen2_moe": FamilyFacts(), "olmoe": FamilyFacts(), "flex_olmo": FamilyFacts(),
    "qwen3_next": FamilyFacts(), "deepseek_v2": FamilyFacts(group_score_func="max"),
    # Ernie: softmax, a correction bias for the choice only, always renormalised (clamped by moe_norm_min)
    "ernie4_5_moe": FamilyFacts(route_norm=True),
    # sigmoid scoring with a score-correction bias for the choice (DeepSeek-V3's noaux_tc)
    "deepseek_v3": FamilyFacts(score_func="sigmoid"), "glm4_moe": FamilyFacts(score_func="sigmoid"),
    "glm4_moe_lite": FamilyFacts(score_func="sigmoid"), "dots1": FamilyFacts(score_func="sigmoid"),
    "exaone_moe": FamilyFacts(score_func="sigmoid"), "lfm2_moe": FamilyFacts(score_func="sigmoid"),
    "afmoe": FamilyFacts(score_func="sigmoid", route_norm=True),
    # Llama-4: sigmoid of the selected logits, not renormalised, applied to the expert *input*
    "llama4_text": FamilyFacts(score_func="sigmoid", route_norm=False, score_apply="pre"),
    "cohere2_moe": FamilyFacts(),
    "phimoe": FamilyFacts(unsupported="Phi-MoE routes with SparseMixer: each chosen expert is weighted by a softmax "
                                      "over only the logits within 2*router_jitter_noise (relative) of its own, and "
                                      "in training the experts are sampled (Gumbel) with a Heun's-method gradient; "
                                      "AutoEP 0.19.8's router takes a deterministic top-k of one softmax"),
    "longcat_flash": FamilyFacts(unsupported="LongCat-Flash's router also scores zero_expert_num identity experts "
                                             "(router rows beyond the routed experts; a token routed there passes "
                                             "through, weighted), which AutoEP 0.19.8's experts do not have"),
    "jetmoe": FamilyFacts(unsupported="JetMoE's MLP MoE adds a learned output bias (mlp.bias) after the experts, "
                                      "which AutoEP 0.19.8's layer does not, and its attention MoE "
                                      "(self_attention.experts) routes attention projections, not an MLP"),
    # DBRX: routing under config.ffn_config, read by dbrx_routing (below)
    # Jamba: softmax over all experts, top-k, never renormalised (no norm_topk_prob in the config)
    "jamba": FamilyFacts(route_norm=False),
    # Flint: sigmoid, top-k without a bias, renormalised per norm_topk_prob, no scale
    "flint": FamilyFacts(score_func="sigmoid"),
    # DeepSeek-V3's noaux_tc router (sigmoid + choice-only e_score_correction_bias, n_group/topk_group
    # top2_sum groups, norm_topk_prob, routed_scaling_factor); shared experts ungated
    "bailing_hybrid": FamilyFacts(score_func="sigmoid"), "kimi_linear": FamilyFacts(score_func="sigmoid"),
    "mimo_v2_flash": FamilyFacts(score_func="sigmoid"), "solar_open": FamilyFacts(score_func="sigmoid"),
    "axk2": FamilyFacts(score_func="sigmoid"), "deepseek_v32": FamilyFacts(score_func="sigmoid"),
    "glm_moe_dsa": FamilyFacts(score_func="sigmoid"), "beam": FamilyFacts(score_func="sigmoid"),
    # dots3.note (5.23): DeepSeek-V3's noaux_tc router (sigmoid, choice-only bias, top2_sum groups,
    # norm_topk_prob, routed_scaling_factor); its config states no scoring_func
    "dots3_note_text": FamilyFacts(score_func="sigmoid"),
    # transformers 5.24: configs that build DeepseekV3ForCausalLM and Glm4MoeForCausalLM (the same router)
    "sarvam_mla": FamilyFacts(score_func="sigmoid"), "sarvam_moe": FamilyFacts(score_func="sigmoid"),
    # HY-V4: the same router; its experts clamp gate (max) and up (+-swiglu_limit) before silu(gate) * up
    "hy_v4": FamilyFacts(score_func="sigmoid", expert_activation="swiglu_clamped"),
    # HY-V3: sigmoid + the block's e_score_correction_bias for the choice, always renormalised, then
    # x config.router_scaling_factor
    "hy_v3": FamilyFacts(score_func="sigmoid", route_norm=True),
    # MiniMax-M2: sigmoid + the block's e_score_correction_bias for the choice, always renormalised
    "minimax_m2": FamilyFacts(score_func="sigmoid", route_norm=True),
    # Laguna: sigmoid + e_score_correction_bias for the choice, always renormalised; the routed output
    # is scaled by config.moe_routed_scaling_factor (== scaling the weights)
    "laguna": FamilyFacts(score_func="sigmoid", route_norm=True, unsupported_when=(
        ("moe_router_logit_softcapping", "Laguna soft-caps its router logits (tanh, "
                                         "moe_router_logit_softcapping > 0) before the sigmoid, which "
                                         "AutoEP's router does not do"),)),
    # Inkling2 (5.23/5.24): sigmoid + choice-only bias, renormalised, x routed_scaling_factor (expressible);
    # its experts are not: a softcapped SwiGLU
    "inkling2_text": FamilyFacts(unsupported=INKLING2_EXPERTS),
    "inkling2_loop_text": FamilyFacts(unsupported=INKLING2_EXPERTS),
    "axk1": FamilyFacts(unsupported="A.X-K1 applies an RMSNorm (mlp.post_mlp_layernorm) to the MoE block's output "
                                    "(experts + shared experts), which AutoEP 0.19.8's layer does not"),
    "deepseek_v4": FamilyFacts(unsupported=(
        "DeepSeek-V4 scores experts with sqrt(softplus(logits)) (config.scoring_func='sqrtsoftplus') and its "
        "hash_moe layers pick experts by token id (gate.tid2eid); AutoEP 0.19.8's router scores with softmax or "
        "sigmoid only and has no token-id routing (its clamped SwiGLU alone would convert: "
        "expert_activation='swiglu_clamped')")),
    "nemotron_h": FamilyFacts(unsupported="Nemotron-H's experts are not gated (down(act(up(x))), up_proj and "
                                          "down_proj only, act = mlp_hidden_act, squared ReLU by default); all of "
                                          "AutoEP 0.19.8's expert activations (swiglu, geglu_tanh, swiglu_clamped, "
                                          "swiglu_oai) are gated, act(gate) * up"),
    "zaya": FamilyFacts(unsupported="ZAYA routes with an MLP (router.router_mlp) over a down-projected state carried "
                                    "from layer to layer, with an extra skip class, not with the single Linear "
                                    "router AutoEP 0.19.8 has"),
    # Kolibri-1 and Kolibri-1.1 (5.25, the same router): the top-k of logits + bias, weights sigmoid(logit) of the
    # chosen, renormalised per norm_topk_prob. With a zero bias that is AutoEP's sigmoid router exactly (sigmoid
    # is monotonic, so the top-k of the logits is the top-k of the scores); nothing in training updates the bias.
    "kolibri1": FamilyFacts(score_func="sigmoid", unsupported_unless_zero=("gate.e_score_correction_bias", KOLIBRI)),
    "kolibri1_1": FamilyFacts(score_func="sigmoid", unsupported_unless_zero=("gate.e_score_correction_bias",
                                                                             KOLIBRI)),
    # MiniCPM5-MoE (5.25): DeepSeek-V3's noaux_tc router (sigmoid, choice-only e_score_correction_bias,
    # n_group/topk_group top2_sum groups, norm_topk_prob, routed_scaling_factor), ungated shared expert
    "minicpm5_moe": FamilyFacts(score_func="sigmoid"),
    # Param2-MoE (5.25): a config only; it builds Glm4MoeForCausalLM (the same router as glm4_moe)
    "param2moe": FamilyFacts(score_func="sigmoid"),
    "ergo": FamilyFacts(unsupported=(
        "Ergo's experts are ungated (up_proj -> relu2 -> down_proj, no gate projection) and each expert's output "
        "goes through its own RMSNorm (experts.post_expert_norm, weight [E, hidden]) before the combine weights; "
        "AutoEP 0.19.8's experts are gated, act(gate) * up (swiglu, geglu_tanh, swiglu_clamped, swiglu_oai), and "
        "end at the down projection")),
    "inkling_text": FamilyFacts(unsupported=(
        "Inkling's router also scores its shared experts (router weight [E + n_shared_experts, hidden]) and "
        "normalises their weights together with the top-k's (a softmax over logsigmoid, times a learned "
        "global_scale), so each shared expert is weighted per token; AutoEP 0.19.8 adds shared experts unweighted "
        "or behind a separate sigmoid gate")),
}


#: Config attributes of blocks that multiply their input by random noise in training only
#: (Mixtral, MiniMax, MiniMax-M2, PhiMoE: ``hidden *= uniform(1 - j, 1 + j)`` when ``j > 0``).
JITTER_ATTRS = ("router_jitter_noise", "input_jitter_noise")


def training_only_difference(config: Any) -> str | None:
    """Why AutoEP's layer would train differently although the (eval-mode) probe agrees, or None.

    A block with jitter noise on, preset or not, whatever a ``MoEPattern`` says: AutoEP's layer
    has no such step, so training would silently lose it.
    """
    for attr in JITTER_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return (f"the block multiplies its input by random jitter noise in training (config.{attr}={value}), "
                    "which AutoEP's layer does not do")
    return None


_TOP_K_ATTRS = ("num_experts_per_tok", "moe_k", "moe_topk", "top_k", "num_selected_experts")


@dataclass(frozen=True)
class Routing:
    """Routing semantics of one MoE block, in AutoEP's vocabulary. Every field is decided."""

    score_func: str
    route_norm: bool
    route_scale: float
    top_k: int
    score_apply: str = "post"
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    group_score_func: str = "top2_sum"
    shared_experts: str | None = None
    shared_experts_gate: str | None = None
    #: None: AutoEP's default form (``swiglu``), checked by AutoEP against the experts' act_fn.
    expert_activation: str | None = None
    #: ``(field, where it came from)``, e.g. ``("route_norm", "config.norm_topk_prob=False")``.
    origin: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    def autoep_keys(self) -> dict[str, Any]:
        """The ``expert_parallel`` keys for these semantics (all explicit: nothing left to defaults)."""
        keys: dict[str, Any] = {
            "score_func": self.score_func, "route_norm": self.route_norm,
            "routed_scaling_factor": self.route_scale, "top_k": self.top_k, "score_apply": self.score_apply,
            "has_shared_experts": self.shared_experts is not None,
        }
        if self.num_expert_groups is not None:
            keys.update(num_expert_groups=self.num_expert_groups, num_limited_groups=self.num_limited_groups)
        if self.shared_experts is not None:
            keys["shared_experts_pattern"] = self.shared_experts
        if self.shared_experts_gate is not None:
            keys["shared_experts_gate_pattern"] = self.shared_experts_gate
        if self.expert_activation is not None:
            keys["expert_activation"] = self.expert_activation
        return keys

    def describe(self) -> str:
        return ", ".join(f"{name}={value}" for name, value in self.origin)


def text_config(config: Any) -> Any:
    """The text backbone's config of a composite (VLM) config, else the config itself."""
    getter = getattr(config, "get_text_config", None)
    if callable(getter):
        try:
            return getter()
        except Exception:  # noqa: BLE001 - an odd config: keep the outer one
            return config
    return config


def top_k_of(config: Any) -> tuple[int | None, str]:
    for attr in _TOP_K_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value, f"config.{attr}"
    return None, "none of " + "/".join(_TOP_K_ATTRS)


def routing_from_config(
    config: Any,
    *,
    shared_experts: str | None = None,
    shared_experts_gate: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> Routing | str:
    """Routing semantics of a block from the model's config, or the reason AutoEP cannot express it.

    ``shared_experts`` / ``shared_experts_gate`` are child names the structural search found on
    the block. ``overrides`` are fields a user's :class:`~lightning_zeromoe.discovery.find.MoEPattern`
    set explicitly; they win and are recorded as such.
    """
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    model_type = str(getattr(config, "model_type", ""))
    if model_type == "dbrx" and not overrides:
        return dbrx_routing(config)
    facts = FAMILY_FACTS.get(model_type, FamilyFacts())
    if facts.unsupported and not overrides:
        return facts.unsupported
    jitter = training_only_difference(config)
    if jitter:
        return jitter
    for attr, reason in facts.unsupported_when:
        value = getattr(config, attr, None)
        if value and not overrides:
            return f"{reason} (config.{attr}={value!r})"
    origin: list[tuple[str, str]] = []

    def pick(name: str, value: Any, source: str) -> Any:
        if name in overrides:
            origin.append((name, f"{overrides[name]!r} (MoEPattern)"))
            return overrides[name]
        origin.append((name, f"{value!r} ({source})"))
        return value

    # score function: the config's own word first, then what the router code does
    for attr in ("scoring_func", "expert_selection_fn", "score_func"):
        stated = getattr(config, attr, None)
        if stated in ("softmax", "sigmoid"):
            score_func = pick("score_func", stated, f"config.{attr}")
            break
    else:
        score_func = pick("score_func", facts.score_func, f"{model_type or 'unknown'} router code")

    # renormalisation of the top-k weights
    if facts.route_norm is not None:
        route_norm = pick("route_norm", facts.route_norm, f"{model_type} router code")
    elif isinstance(getattr(config, "norm_topk_prob", None), bool):
        route_norm = pick("route_norm", config.norm_topk_prob, "config.norm_topk_prob")
    else:
        # Neither the config nor a known family says: the Mixtral convention (renormalise). The
        # setup-time probe proves or refutes it for this model.
        route_norm = pick("route_norm", True, "no norm_topk_prob; Mixtral convention, to be proven")

    scale, scale_src = 1.0, "default"
    for attr in ("routed_scaling_factor", "route_scale", "router_scaling_factor", "moe_routed_scaling_factor"):
        value = getattr(config, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            scale, scale_src = float(value), f"config.{attr}"
            break
    route_scale = pick("route_scale", scale, scale_src)

    top_k, top_k_src = top_k_of(config)
    if "top_k" not in overrides and top_k is None:
        return f"the config states no top-k ({top_k_src})"
    top_k = pick("top_k", top_k, top_k_src)

    score_apply = pick("score_apply", facts.score_apply, f"{model_type or 'default'} block code")

    groups, limited = getattr(config, "n_group", None), getattr(config, "topk_group", None)
    if model_type == "deepseek_v2" and getattr(config, "topk_method", "greedy") == "greedy":
        groups = None  # DeepSeek-V2 reads n_group only for topk_method="group_limited_greedy"
    if isinstance(groups, int) and groups > 1:
        num_groups = pick("num_expert_groups", groups, "config.n_group")
        num_limited = pick("num_limited_groups", limited, "config.topk_group")
        group_score_func = pick("group_score_func", facts.group_score_func, f"{model_type} router code")
    else:
        num_groups = num_limited = None
        group_score_func = facts.group_score_func

    shared = pick("shared_experts", shared_experts, "block structure")
    shared_gate = pick("shared_experts_gate", shared_experts_gate, "block structure")
    activation = overrides.get("expert_activation")
    if activation is not None:
        origin.append(("expert_activation", f"{activation!r} (MoEPattern)"))
    elif facts.expert_activation is not None:
        activation = facts.expert_activation
        origin.append(("expert_activation", f"{activation!r} ({model_type} experts code)"))
    return Routing(score_func=score_func, route_norm=bool(route_norm), route_scale=float(route_scale),
                   top_k=int(top_k), score_apply=score_apply, num_expert_groups=num_groups,
                   num_limited_groups=num_limited, group_score_func=group_score_func, shared_experts=shared,
                   shared_experts_gate=shared_gate, expert_activation=activation, origin=tuple(origin))


#: DBRX ``ffn_config.ffn_act_fn`` names AutoEP computes exactly: its gated form's name (None: ``swiglu``).
_DBRX_ACTIVATIONS = {"silu": None, "swish": None, "gelu_pytorch_tanh": "geglu_tanh"}


def dbrx_routing(config: Any) -> Routing | str:
    """DBRX (``DbrxFFN.route_tokens_to_experts``): softmax over the experts, top ``moe_top_k``, the
    weights divided by their ``moe_normalize_expert_weights``-norm (p=1: their sum, AutoEP's
    ``route_norm``; None: not at all), jitter noise in training when ``moe_jitter_eps`` is set."""
    ffn = getattr(config, "ffn_config", None)
    top_k = getattr(ffn, "moe_top_k", None)
    if not isinstance(top_k, int):
        return "the config states no top-k (ffn_config.moe_top_k)"
    jitter = getattr(ffn, "moe_jitter_eps", None)
    if jitter:
        return (f"the block multiplies its input by random jitter noise in training (config.ffn_config.moe_jitter_eps="
                f"{jitter}), which AutoEP's layer does not do")
    p = getattr(ffn, "moe_normalize_expert_weights", None)
    if p not in (None, 1, 1.0):
        return (f"DBRX divides its top-k weights by their L{p} norm (ffn_config.moe_normalize_expert_weights={p}); "
                "AutoEP 0.19.8 renormalises by their sum (the L1 norm) or not at all")
    act = (getattr(ffn, "ffn_act_fn", None) or {}).get("name", "silu")
    if act not in _DBRX_ACTIVATIONS:
        return (f"DBRX's experts compute {act}(gate) * up (ffn_config.ffn_act_fn), which none of AutoEP 0.19.8's "
                "expert activations (swiglu, geglu_tanh, swiglu_clamped, swiglu_oai) is")
    origin = (("score_func", "'softmax' (dbrx router code)"),
              ("route_norm", f"{p is not None} (config.ffn_config.moe_normalize_expert_weights={p})"),
              ("route_scale", "1.0 (dbrx router code)"), ("top_k", f"{top_k} (config.ffn_config.moe_top_k)"),
              ("expert_activation", f"{_DBRX_ACTIVATIONS[act] or 'swiglu'!r} (config.ffn_config.ffn_act_fn={act!r})"))
    return Routing(score_func="softmax", route_norm=p is not None, route_scale=1.0, top_k=top_k,
                   expert_activation=_DBRX_ACTIVATIONS[act], origin=origin)


def default_routing(overrides: dict[str, Any]) -> Routing | str:
    """Routing for a model without an HF config: softmax, renormalised top-k, scale 1, unless set."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if "top_k" not in overrides:
        return compose("autoep-top-k-undetermined", "pattern-without-config", "moe-pattern-top-k")
    values = dict(score_func="softmax", route_norm=True, route_scale=1.0)
    values.update({k: overrides[k] for k in ("score_func", "route_norm", "route_scale") if k in overrides})
    origin = tuple((k, f"{v!r} ({'MoEPattern' if k in overrides else 'default for models without an HF config'})")
                   for k, v in values.items())
    return Routing(score_func=values["score_func"], route_norm=bool(values["route_norm"]),
                   route_scale=float(values["route_scale"]), top_k=int(overrides["top_k"]),
                   shared_experts=overrides.get("shared_experts"),
                   shared_experts_gate=overrides.get("shared_experts_gate"),
                   expert_activation=overrides.get("expert_activation"), origin=origin)
