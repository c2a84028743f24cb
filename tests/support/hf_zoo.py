"""Tiny configs for the Hugging Face MoE causal-LM families in transformers 5.17 to 5.25 (no downloads).

Every model: hidden 64, 2 decoder layers that are MoE (3 with a dense first layer where the
family has one), 4 experts, top-2, vocab 128. ``build(model_type)`` returns the causal LM in
float32, seeded, with non-zero routing biases (``e_score_correction_bias``, ``expert_bias``) as a
pretrained model has. ``moe_model_types()`` enumerates the MoE causal-LM types transformers itself
registers (its auto-mapping, and the expert-count attributes of each config), so a family added
by a newer transformers shows up as untested instead of silently missing.
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 128

#: The 27 families of issue 9 (measured on transformers 5.22), the other MoE causal-LM types
#: transformers 5.22.2 registers (``moe_model_types()``), then those 5.23, 5.24 and 5.25 added.
ALL_ARCHS = ("mixtral qwen3_moe qwen2_moe olmoe gpt_oss granitemoe granitemoeshared deepseek_v2 deepseek_v3 glm4_moe "
             "glm4_moe_lite dots1 ernie4_5_moe hunyuan_v1_moe phimoe jetmoe dbrx llama4_text flex_olmo lfm2_moe "
             "exaone_moe afmoe cohere2_moe minimax qwen3_next qwen3_5_moe_text longcat_flash "
             "aria_text axk1 axk2 bailing_hybrid beam deepseek_v32 deepseek_v4 doge flint glm_moe_dsa granitemoe_swa "
             "granitemoehybrid hy_v3 hy_v4 inkling_text jamba kimi_linear kolibri1 laguna mellum mimo_v2_flash "
             "minimax_m2 minimax_m3_vl_text nemotron_h qwen4_exp_text solar_open zaya "
             "dots3_note_text inkling2_text "  # 5.23
             "inkling2_loop_text lara_mini sarvam_mla sarvam_moe "  # 5.24
             "ergo kolibri1_1 minicpm5_moe param2moe kolibri1_1+zero_bias").split()  # 5.25

#: ``type+variant`` entries: the family built another way. Kolibri-1.1 converts only while its
#: e_score_correction_bias is zero (hf_semantics.KOLIBRI): as built from its config, before any training.
VARIANTS = {"zero_bias": "its routing biases left at their zero initial values (the model as built from its config)"}


def _registered(model_types: list[str]) -> tuple[str, ...]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return tuple(t for t in model_types if t.partition("+")[0] in CONFIG_MAPPING_NAMES)


#: The families the installed transformers has (older releases lack the newer types).
ARCHS = _registered(ALL_ARCHS)
#: Families whose MoE layer is no router + 3-D experts block at all, so ``ep_size > 1`` is refused
#: at setup with this entry id (the message says to use ``ep_size=1``), and why.
REFUSED = {"doge": ("autoep-no-moe-layers", "its MoE layer keeps product-key experts as rows of two nn.Embedding "
                                            "tables, not a router plus 3-D experts")}

#: Families that train but fail under ZeroMoEStrategy(ep_size=2), with the measured reason and a
#: string the failure's traceback contains (the coverage test checks it, so a fix shows up).
FAILING = {"inkling2_loop_text": (
    "__reduce_and_partition_ipg_grads", "its looped layers run twice in one forward, so ZeRO-3 reduces their "
    "gradients twice in one backward and asserts (deepspeed 0.19.8 stage3.py __reduce_and_partition_ipg_grads)")}

_SMALL: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_experts=4,
    num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2, moe_k=2, moe_topk=2,
    shared_expert_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1,
    tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[], num_dense_layers=0,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, router_aux_loss_coef=0.02, output_router_logits=True,
    use_cache=False, router_jitter_noise=0.0, input_jitter_noise=0.0, attention_dropout=0.0, hidden_dropout=0.0,
    dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, moe_dropout=0.0)

_MLA = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
            num_key_value_heads=4, head_dim=8)

#: Per-family changes on top of _SMALL (None removes a key).
_EXTRA: dict[str, dict[str, Any]] = {
    "deepseek_v2": dict(_MLA, num_hidden_layers=3, first_k_dense_replace=1),
    "deepseek_v3": dict(_MLA, num_hidden_layers=3, first_k_dense_replace=1, n_group=2, topk_group=1),
    "glm4_moe_lite": dict(_MLA, q_lora_rank=16, first_k_dense_replace=0),
    "longcat_flash": dict(_MLA, q_lora_rank=16, num_layers=1, zero_expert_num=2, ffn_hidden_size=64,
                          expert_ffn_hidden_size=32),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                       linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16),
    "qwen3_5_moe_text": dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                             linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16),
    "lfm2_moe": dict(layer_types=["full_attention", "full_attention"], num_dense_layers=0),
    "llama4_text": dict(num_experts_per_tok=1, interleave_moe_layer_step=1, no_rope_layers=[1, 1],
                        intermediate_size_mlp=96),
    "gpt_oss": dict(layer_types=["full_attention", "full_attention"]),
    # Mamba-2 / KDA linear-attention layers at tiny sizes (the defaults made these two families take
    # 16 s and 12 s of the zoo's ~100 s of training).
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=8),
    "kimi_linear": dict(linear_num_heads=2, linear_head_dim=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                        v_head_dim=16),
    # MLA families whose configs derive the dense/sparse layer split from `first_k_dense_replace` in
    # __post_init__ (not a config attribute, so it is given as `mlp_layer_types`); the DSA ones also
    # need a query LoRA (their indexer reads it) and a small indexer.
    "axk1": dict(_MLA, q_lora_rank=16, num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"],
                 n_group=2, topk_group=1),
    "axk2": dict(_MLA, q_lora_rank=16, num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"],
                 index_n_heads=2, index_head_dim=16, gated_norm_rank=4),
    "deepseek_v32": dict(_MLA, q_lora_rank=16, num_hidden_layers=3, first_k_dense_replace=1, n_group=2,
                         topk_group=1, index_n_heads=2, index_head_dim=16),
    "glm_moe_dsa": dict(_MLA, q_lora_rank=16, num_hidden_layers=3, first_k_dense_replace=1, index_n_heads=2,
                        index_head_dim=16),
    # Single shared KV head; the first layer hash-routed (a `tid2eid` table), the others top-k routed
    # (only those record router logits, so at least one is needed for the aux loss).
    "deepseek_v4": dict(num_hidden_layers=3, mlp_layer_types=["hash_moe", "moe", "moe"], intermediate_size=None,
                        num_key_value_heads=1, q_lora_rank=16, o_groups=2, o_lora_rank=16, index_n_heads=2,
                        index_head_dim=16, partial_rotary_factor=0.5, hc_mult=2, hc_sinkhorn_iters=4,
                        layer_types=["heavily_compressed_attention", "compressed_sparse_attention",
                                     "heavily_compressed_attention"],
                        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}),
    # Top-1 only; the router is an MLP over a down-projected state carried from layer to layer.
    "zaya": dict(num_experts_per_tok=1, router_hidden_size=16),
    # Dense for its first three layers by default: one dense, then MoE (sigmoid + bias router, groups).
    "beam": dict(num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"]),
    # Dense unless is_moe: then a product-key MoE whose experts are rows of two nn.Embedding tables
    # (not router [E, H] + 3-D experts, so discovery finds no block; kept MoE so the zoo says so).
    "doge": dict(is_moe=True, keep_window_size=64),
    # transformers 5.23/5.24. Inkling2: grouped sliding / hybrid attention with a padded vocabulary
    # of 200058 rows by default, sigmoid routing with softcapped expert gates; the loop variant runs
    # layers [start, end) `loop_num_passes` times (start > 0, both multiples of the block size).
    "inkling2_text": dict(unpadded_vocab_size=VOCAB, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                          swa_head_dim=16, sliding_window_size=4, rel_extent=8, n_layers_per_attn_res_block=1,
                          layer_types=["hybrid_sliding", "hybrid"]),
    "inkling2_loop_text": dict(unpadded_vocab_size=VOCAB, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                               swa_head_dim=16, sliding_window_size=4, rel_extent=8, n_layers_per_attn_res_block=1,
                               layer_types=["hybrid_sliding", "hybrid"], loop_layer_index_start=1,
                               loop_layer_index_end=2, loop_num_passes=2, loop_gate_rank=8),
    # MLA with a DSA indexer on some layers and sliding-window attention on others; its released
    # config sets heads and ranks per layer (per_layer_config), emptied here so the tiny sizes hold.
    "dots3_note_text": dict(_MLA, head_dim=16, q_lora_rank=16, num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"],
                            per_layer_config={}, layer_types=["indexed_attention", "sliding_attention",
                                                              "indexed_attention"],
                            sliding_window=4, index_topk=4, index_n_heads=2, index_head_dim=16,
                            shared_experts_intermediate_size=32),
    # Built as DeepSeek-V3 (MLA); a head_dim in the config would be read as its legacy format.
    "sarvam_mla": dict(_MLA, head_dim=None),
    # transformers 5.25. Ergo: sliding + global attention, a dense first block, ungated relu2 experts.
    "ergo": dict(num_hidden_layers=3, num_dense_blocks=1, first_dense_intermediate_size=96,
                 shared_intermediate_size=32, sliding_window=4, global_attention_every_n_layers=2),
    # Kolibri-1.1: its validator wants head_dim % 16 == 0 and index_num_heads <= heads / kv_heads; indexed
    # (sparse) attention with a small candidate pool.
    "kolibri1_1": dict(sliding_window=4, index_num_heads=2, index_topk=4, index_pool_size=32, index_compression=4,
                       index_num_local_tokens=4, index_num_sink_tokens=2, mlp_only_intermediate_size=96),
    # Param2-MoE builds Glm4MoeForCausalLM; a dense first layer by default.
    "param2moe": dict(num_hidden_layers=3, first_k_dense_replace=1),
}


def tiny_config(model_type: str) -> Any:
    """The family's tiny config (``type+variant``: the type's; a variant changes the weights, not the config)."""
    from transformers import AutoConfig

    model_type = model_type.partition("+")[0]
    config = AutoConfig.for_model(model_type)
    values = dict(_SMALL, **_EXTRA.get(model_type, {}))
    if model_type == "dbrx":
        return AutoConfig.for_model("dbrx", d_model=64, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=VOCAB,
                                    attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                                    ffn_config=dict(ffn_hidden_size=96, moe_num_experts=4, moe_top_k=2),
                                    tie_word_embeddings=False, output_router_logits=True,
                                    router_aux_loss_coef=0.02, use_cache=False, pad_token_id=0)
    # Through the constructor, so derived fields (DeepSeek's qk_head_dim, ...) follow.
    return AutoConfig.for_model(model_type, **{k: v for k, v in values.items()
                                               if _has(config, k) and v is not None})


def _has(config: Any, key: str) -> bool:
    """``hasattr``, except that a field the config keeps per layer (dots3_note's ``per_layer_config``,
    whose global read raises) counts as present."""
    try:
        getattr(config, key)
    except AttributeError:
        return False
    except Exception:  # noqa: BLE001 - transformers' per-layer-attribute error: the field exists
        return True
    return True


def build(model_type: str, seed: int = 0) -> torch.nn.Module:
    """The family's causal LM from a tiny config, float32, eager attention, seeded (``type+variant``:
    see :data:`VARIANTS`)."""
    from transformers import AutoModelForCausalLM

    model_type, _, variant = model_type.partition("+")
    assert not variant or variant in VARIANTS, variant
    torch.manual_seed(seed)
    config = tiny_config(model_type)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    # A pretrained model's routing biases are learned, not zero: give them values that change
    # which experts are picked, so the conversion and the export are tested on them.
    from lightning_zeromoe.discovery.structure import ROUTING_TENSOR_NAMES

    with torch.no_grad():
        for name, tensor in [] if variant == "zero_bias" else [*model.named_parameters(), *model.named_buffers()]:
            if name.rsplit(".", 1)[-1] in ROUTING_TENSOR_NAMES and tensor.is_floating_point():
                gen = torch.Generator().manual_seed(len(name) + 1000 * seed)
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.5)
    return model.float()


def moe_model_types() -> list[str]:
    """MoE causal-LM model types that the installed transformers registers.

    A type counts when it has a causal-LM class in transformers' auto mapping and its default
    config states an expert count (``num_experts``/``num_local_experts``/``n_routed_experts``/
    ``moe_num_experts`` above 1, or DBRX's ``ffn_config.moe_num_experts``).
    """
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from lightning_zeromoe.discovery.structure import expected_num_experts

    found = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        name = CONFIG_MAPPING_NAMES.get(model_type)
        cls = getattr(transformers, name, None) if name else None
        if cls is None:
            continue
        try:
            config = cls()
        except Exception:  # noqa: BLE001 - a config that needs arguments: judge by its class attributes
            config = cls
        if expected_num_experts(config):
            found.append(model_type)
    return sorted(found)
