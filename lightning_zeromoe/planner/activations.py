"""Activation memory per GPU: what autograd keeps for backward in one micro-batch, term by term.

Each term is a tensor the forward saves, read from the code that saves it and checked by counting
the saved tensors of real forwards (``tests/test_activations.py``: Hugging Face Mixtral, Qwen3-MoE
and OLMoE in fp32 and bf16, with transformers' eager and grouped-GEMM experts, DeepSpeed AutoEP's
layer, and the reference model). ``a`` is the activation dtype's bytes (2 in bf16/fp16, 4 in fp32),
``T = micro_batch * seq_len`` tokens, ``h`` the hidden size, ``f`` one expert's FFN width, ``k``
experts per token, ``E`` routed experts, ``V`` the vocabulary. Per decoder layer:

* **attention** (SDPA / flash, no score matrix kept): the projections' input ``h``, the rotated
  ``q`` (``heads * head_dim``) and ``k``, ``v`` (``kv_heads * head_dim`` each, as SDPA takes grouped
  heads), and the attention output that ``o_proj`` saves: ``a*T*(h + 2*h_q + 2*h_kv)``. Without
  flash attention, Korthikanti et al.'s ``5*heads*s^2*b`` score bytes (16-bit) are added. Models with
  per-head q/k norms (Qwen3, OLMoE) save each norm's fp32 input and normalised output as well.
  Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash; :class:`LatentAttention`)
  saves instead, per token: the input ``h``; with a query low-rank ``r_q``, its norm's fp32 input
  and normalised value and the up projection's input, ``(4 + 2a)/a * r_q``; the same for the
  compressed key/value's ``r_kv``; the query and the key SDPA takes (``H*(d_n + d_r)`` each); the
  key/value up projection's output, which holds the values (``H*(d_n + d_v)``); and the attention
  output twice (SDPA's, and ``o_proj``'s contiguous input: ``2*H*d_v``). The rotation saves
  nothing per token (its cos/sin need no gradient). Measured with equal query and value head
  widths, which keep CPU's SDPA on its flash kernel; DeepSeek-V3's 192/128 widths on a GPU take the
  memory-efficient kernel, which saves the same tensors (transformers' ``flash_attention_2`` pads
  the values to 192 first: not counted).
* **norms**: transformers' RMSNorm upcasts its input to fp32 and saves it, and saves the normalised
  value in the model's dtype for the weight's product: ``(4 + a)*T*h`` per norm, two per layer.
  (Korthikanti et al. count a fused LayerNorm's 16-bit input only: ``2*T*h``.)
* **router**: its input (the block's input, ``a*T*h``) and the fp32 softmax probabilities (``4*T*E``).
* **experts**, for ``k*T`` routed token copies of a SwiGLU expert: the gathered input ``h``, the
  gate and up outputs ``2f``, ``silu(gate)`` ``f``, their product ``f`` (the down projection's
  input), and the down projection's output ``h``, which the routing weight multiplies:
  ``a*k*T*(2h + 4f)`` for grouped GEMMs over fused tensors (transformers' ``grouped_mm``). A loop
  over experts (transformers' ``eager``, a ``ModuleList``) also keeps each expert's weighted output
  for the index-add: ``a*k*T*(3h + 4f)``. AutoEP's layer (``ep_size > 1``) pads each local expert's
  rows to a multiple of 8 (``TOKEN_GROUP_ALIGN_SIZE_M`` in ``deepspeed/moe/ep_kernels``): its permuted
  tokens fill ``R = k*T + 8*E/ep_size`` rows of ``h``, its grouped GEMM computes all ``R`` rows
  (``4f`` each) and its loop (fp32, CPU) each expert's rows rounded up, ``k*T + 3.5*E/ep_size`` on
  average; it keeps the combined ``[T, k, h]`` output for the routing weights: ``a*(R*h + R'*4f +
  k*T*h)``. Balanced routing is assumed: a rank whose experts draw more tokens than ``k*T`` keeps
  proportionally more.

* **dense MLPs** (``mlp``): shared experts beside the routed ones (DeepSeek, GLM-4 MoE, Qwen2-MoE)
  keep ``4f_s`` per token, their input being the router's; Qwen2-MoE's sigmoid gate on their output
  adds the output and the gate, ``h + 1``. A dense layer (no experts: DeepSeek's first layers) keeps
  its SwiGLU MLP's input and ``4f_d`` per token, and has no router.

Once per micro-batch (``logits``): the loss's fp32 log-softmax ``4*T*V``, the final norm and the
LM head's input, ``(4 + 2a)*T*h``. With activation checkpointing a layer keeps its input (``a*T*h``)
and one layer's activations are live at a time, during its recompute.

Not included: all-to-all buffers in flight, temporaries of a single op, and the allocator's caching:
that is what the plan's headroom is for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_zeromoe.planner.setups import normalize_precision

#: Rows per local expert that AutoEP's permutation aligns to (``deepspeed.moe.ep_kernels.
#: TOKEN_GROUP_ALIGN_SIZE_M``, 8 in DeepSpeed 0.19.8; ``tests/test_activations.py`` checks it).
AUTOEP_ROW_ALIGNMENT = 8

#: How a layer runs its experts: the planner's ``expert_loop`` kinds (``"grouped"`` GEMMs, or a loop
#: over ``"modules"`` or fused ``"slices"``), or AutoEP's layer, which replaces the blocks when
#: ``ep_size > 1``: ``"autoep"`` (grouped GEMM, bf16 on GPUs) or ``"autoep-loop"`` (a loop over its
#: local experts: fp32, or CPU).
EXPERT_IMPLS = ("grouped", "modules", "slices", "autoep", "autoep-loop")


@dataclass(frozen=True)
class LayerActivations:
    """Bytes one decoder layer keeps for backward, by part (module docstring)."""

    attention: float
    norms: float
    router: float
    experts: float
    #: Shared experts in a MoE layer; a dense layer's whole MLP.
    mlp: float = 0.0

    @property
    def total(self) -> float:
        return self.attention + self.norms + self.router + self.experts + self.mlp


@dataclass(frozen=True)
class ActivationEstimate:
    """Activation bytes one GPU keeps for backward, for one micro-batch. An *estimate*: each term is
    what the code saves (module docstring), with balanced routing."""

    #: The mean over the decoder layers (MoE and dense).
    per_layer: float
    logits: float
    total: float
    formula: str
    #: What each layer keeps between its forward and its backward: ``per_layer``, or with
    #: activation checkpointing its input only (the rest is recomputed during its backward).
    kept_per_layer: float | None = None
    #: A MoE layer by part.
    layer: LayerActivations | None = None
    #: A dense layer by part (None: every layer holds experts).
    dense_layer: LayerActivations | None = None

    @property
    def largest_layer(self) -> float:
        """The largest layer's bytes: what one layer's recompute holds under activation checkpointing."""
        return max(self.layer.total if self.layer else self.per_layer,
                   self.dense_layer.total if self.dense_layer else 0.0)


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention's widths (DeepSeek-V2's config names): ``q_lora_rank`` None
    projects the query directly."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    @classmethod
    def of(cls, config: Any) -> "LatentAttention | None":
        """The widths from a model config that has ``kv_lora_rank``, else None."""
        values = {name: getattr(config, name, None) for name in ("kv_lora_rank", "qk_nope_head_dim",
                                                                 "qk_rope_head_dim", "v_head_dim")}
        if not all(isinstance(v, int) and v > 0 for v in values.values()):
            return None
        q_rank = getattr(config, "q_lora_rank", None)
        return cls(**values, q_lora_rank=q_rank if isinstance(q_rank, int) and q_rank > 0 else None)

    def saved_bytes(self, tokens: int, hidden_size: int, num_heads: int, act_bytes: int) -> float:
        """Bytes one layer's attention saves (module docstring)."""
        a, heads = act_bytes, num_heads
        qk = heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        # the compressed key/value's norm reads an fp32 copy, or in fp32 the projection's output itself
        kv_norm_input = 4 * self.kv_lora_rank if a < 4 else a * (self.kv_lora_rank + self.qk_rope_head_dim)
        per_token = (a * hidden_size
                     + ((4 + 2 * a) * self.q_lora_rank if self.q_lora_rank else 0)
                     + kv_norm_input + 2 * a * self.kv_lora_rank  # normalised, and the up projection's input
                     + a * 2 * qk  # the query and the key SDPA takes
                     + a * heads * (self.qk_nope_head_dim + self.v_head_dim)  # the up projection's output: values
                     + a * 2 * heads * self.v_head_dim)  # the attention output, and o_proj's contiguous input
        return float(tokens * per_token)


def expert_bytes(*, tokens: int, hidden_size: int, ffn_hidden_size: int, top_k: int, act_bytes: int,
                 impl: str = "grouped", local_experts: int = 0) -> float:
    """The routed experts' saved tensors in one MoE layer (module docstring, "experts"), for one of
    :data:`EXPERT_IMPLS`; ``local_experts``: the experts AutoEP's layer holds (its row padding)."""
    if impl not in EXPERT_IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {', '.join(EXPERT_IMPLS)}")
    t, h, f, k = tokens, hidden_size, ffn_hidden_size, top_k
    if impl.startswith("autoep"):
        # the permuted tokens fill the padded buffer; the grouped GEMM runs over all of it, the
        # loop over each expert's rows rounded up to the alignment (on average half of it, less one)
        padded = k * t + AUTOEP_ROW_ALIGNMENT * local_experts
        computed = padded if impl == "autoep" else k * t + (AUTOEP_ROW_ALIGNMENT - 1) / 2 * local_experts
        return act_bytes * (padded * h + computed * 4 * f + k * t * h)
    return act_bytes * k * t * ((2 if impl == "grouped" else 3) * h + 4 * f)


def estimate_activations(*, micro_batch: int, seq_len: int, hidden_size: int, num_layers: int,
                         num_heads: int, ffn_hidden_size: int, top_k: int, vocab_size: int,
                         precision: str = "bf16", flash_attention: bool = True,
                         activation_checkpointing: bool = False, num_kv_heads: int | None = None,
                         head_dim: int | None = None, qk_norm: bool = False, num_experts: int = 0,
                         ep_size: int = 1, expert_loop: str = "grouped", dense_layers: int = 0,
                         dense_ffn: int = 0, shared_ffn: int = 0, shared_gate: bool = False,
                         latent_attention: LatentAttention | None = None) -> ActivationEstimate:
    """Per-GPU activation bytes for one micro-batch (module docstring for each term).

    ``num_kv_heads`` / ``head_dim``: grouped-query attention (default: ``num_heads`` and
    ``hidden_size / num_heads``). ``qk_norm``: per-head q/k norms. ``num_experts``: the router's
    width and AutoEP's padding. ``expert_loop``: how the experts run (``"grouped"``, ``"modules"``,
    ``"slices"``): the model's own blocks at ``ep_size=1``; at ``ep_size > 1`` AutoEP's layers, with
    grouped GEMMs (``"grouped"``) or a loop (anything else). ``dense_layers`` of the ``num_layers``
    run a dense MLP of width ``dense_ffn``; ``shared_ffn`` / ``shared_gate``: the shared experts of
    each MoE layer (:class:`~lightning_zeromoe.planner.layers.LayerMix` reads all four from a model).
    ``latent_attention``: multi-head latent attention's widths, in place of grouped-query attention's."""
    a = 4 if normalize_precision(precision) == "fp32" else 2
    impl = ("autoep" if expert_loop == "grouped" else "autoep-loop") if ep_size > 1 else expert_loop
    s, b, h, f, k = seq_len, micro_batch, hidden_size, ffn_hidden_size, top_k
    t = s * b
    d = head_dim or h // num_heads
    h_q, h_kv = num_heads * d, (num_kv_heads or num_heads) * d
    attention = (latent_attention.saved_bytes(t, h, num_heads, a) if latent_attention else
                 a * t * (h + 2 * h_q + 2 * h_kv))
    if qk_norm:
        attention += (4 + a) * t * (h_q + h_kv)
    if not flash_attention:
        attention += a / 2 * 5 * num_heads * s * s * b
    norms = 2 * (4 + a) * t * h
    shared = a * t * 4 * shared_ffn + (a * t * (h + 1) if shared_gate and shared_ffn else 0)
    layer = LayerActivations(
        attention=attention, norms=norms, router=a * t * h + 4 * t * num_experts,
        experts=expert_bytes(tokens=t, hidden_size=h, ffn_hidden_size=f, top_k=k, act_bytes=a, impl=impl,
                             local_experts=num_experts // ep_size), mlp=shared)
    dense = (LayerActivations(attention=attention, norms=norms, router=0.0, experts=0.0,
                              mlp=a * t * (h + 4 * dense_ffn)) if dense_layers else None)
    moe_layers = num_layers - dense_layers
    layers_total = moe_layers * layer.total + (dense_layers * dense.total if dense else 0.0)
    per_layer = layers_total / num_layers if num_layers else layer.total
    logits = 4.0 * t * vocab_size + (4 + 2 * a) * t * h
    routed = ("(kT+8E/ep)(h+4f) + kTh" if impl.startswith("autoep") else
              f"kT({2 if impl == 'grouped' else 3}h+4f)")
    if shared_ffn:
        routed += " + 4Tf_s" + (" + T(h+1)" if shared_gate else "")
    attn = "latent attention" if latent_attention else "T(h+2h_q+2h_kv)"
    body = f"{attn}{' + qk norms' if qk_norm else ''} + 2T(4+a)h/a + Th + 4TE/a + {routed}"
    if dense:
        body = f"{moe_layers} MoE layers' [{body}], {dense_layers} dense layers' [attention + norms + T(h+4f_d)]"
        layers_term = f"a*({body})"
    else:
        layers_term = f"L*a*[{body}]"
    if activation_checkpointing:
        kept = float(a * t * h)
        total = kept * num_layers + max(layer.total, dense.total if dense else 0.0) + logits
        formula = f"L*aTh (checkpointed inputs) + the largest layer of {layers_term} + 4TV + (4+2a)Th"
    else:
        kept = per_layer
        total = layers_total + logits
        formula = f"{layers_term} + 4TV + (4+2a)Th"
    return ActivationEstimate(per_layer=per_layer, logits=logits, total=total, formula=formula,
                              kept_per_layer=kept, layer=layer, dense_layer=dense)
