"""The activation estimate (``lightning_zeromoe.planner.activations``): its terms by hand, and the
whole estimate against what autograd really saves for backward in one forward of real models
(Hugging Face Mixtral, Qwen3-MoE and OLMoE with transformers' eager and grouped-GEMM experts, in fp32
and bf16; the reference model; DeepSpeed AutoEP's layer in the blocks' place). No processes."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_zeromoe.planner.activations import (AUTOEP_ROW_ALIGNMENT, LatentAttention, estimate_activations,
                                                   expert_bytes)
from lightning_zeromoe.planner.layers import LayerMix, layer_mix

TOLERANCE = 0.05
BATCH, SEQ, VOCAB = 2, 64, 512


def saved_bytes(model: torch.nn.Module, run) -> int:
    """Bytes of the tensors autograd saves during ``run()``, each storage once, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def test_terms_by_hand():
    t, h, f, k, e = 8 * 16, 64, 96, 2, 8
    est = estimate_activations(micro_batch=8, seq_len=16, hidden_size=h, num_layers=3, num_heads=4, num_kv_heads=2,
                               head_dim=32, ffn_hidden_size=f, top_k=k, vocab_size=100, precision="bf16",
                               num_experts=e, qk_norm=True)
    h_q, h_kv = 4 * 32, 2 * 32
    assert est.layer.attention == 2 * t * (h + 2 * h_q + 2 * h_kv) + 6 * t * (h_q + h_kv)
    assert est.layer.norms == 2 * 6 * t * h  # fp32 input + bf16 normalised, two norms
    assert est.layer.router == 2 * t * h + 4 * t * e
    assert est.layer.experts == 2 * k * t * (2 * h + 4 * f)  # grouped GEMMs
    assert est.total == 3 * est.per_layer + 4 * t * 100 + 8 * t * h
    fp32_loop = estimate_activations(micro_batch=8, seq_len=16, hidden_size=h, num_layers=3, num_heads=4,
                                     ffn_hidden_size=f, top_k=k, vocab_size=100, precision="fp32",
                                     expert_loop="slices")
    assert fp32_loop.layer.experts == 4 * k * t * (3 * h + 4 * f)
    autoep = estimate_activations(micro_batch=8, seq_len=16, hidden_size=h, num_layers=3, num_heads=4,
                                  ffn_hidden_size=f, top_k=k, vocab_size=100, num_experts=e, ep_size=2)
    assert autoep.layer.experts == 2 * ((k * t + 8 * e // 2) * (h + 4 * f) + k * t * h)
    ckpt = estimate_activations(micro_batch=8, seq_len=16, hidden_size=h, num_layers=3, num_heads=4,
                                ffn_hidden_size=f, top_k=k, vocab_size=100, activation_checkpointing=True)
    assert ckpt.kept_per_layer == 2 * t * h and ckpt.total == 3 * 2 * t * h + ckpt.per_layer + ckpt.logits
    mixed = estimate_activations(micro_batch=8, seq_len=16, hidden_size=h, num_layers=3, num_heads=4,
                                 ffn_hidden_size=f, top_k=k, vocab_size=100, num_experts=e, dense_layers=1,
                                 dense_ffn=3 * f, shared_ffn=f // 2, shared_gate=True)
    assert mixed.layer.mlp == 2 * t * 4 * (f // 2) + 2 * t * (h + 1)  # shared expert, its gate and output
    assert mixed.dense_layer.mlp == 2 * t * (h + 4 * 3 * f) and not mixed.dense_layer.router + mixed.dense_layer.experts
    assert mixed.total == 2 * mixed.layer.total + mixed.dense_layer.total + mixed.logits
    assert mixed.per_layer * 3 == mixed.total - mixed.logits
    mixed_ckpt = estimate_activations(micro_batch=8, seq_len=16, hidden_size=h, num_layers=3, num_heads=4,
                                      ffn_hidden_size=f, top_k=k, vocab_size=100, num_experts=e, dense_layers=1,
                                      dense_ffn=3 * f, activation_checkpointing=True)
    assert mixed_ckpt.largest_layer == max(mixed_ckpt.layer.total, mixed_ckpt.dense_layer.total)
    assert mixed_ckpt.total == 3 * 2 * t * h + mixed_ckpt.largest_layer + mixed_ckpt.logits
    mla = LatentAttention(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=48)
    latent = estimate_activations(micro_batch=8, seq_len=16, hidden_size=h, num_layers=3, num_heads=4,
                                  ffn_hidden_size=f, top_k=k, vocab_size=100, latent_attention=mla)
    assert latent.layer.attention == t * (2 * h + 8 * 48 + (4 * 32 + 4 * 32) + 2 * 2 * 4 * 24 + 2 * 4 * 32
                                          + 2 * 2 * 4 * 16)
    assert LatentAttention.of(_hf_model("mixtral", "eager", torch.float32, 64, 96, 4, 2, 4, 2).config) is None
    with pytest.raises(ValueError, match="expected one of"):
        expert_bytes(tokens=1, hidden_size=1, ffn_hidden_size=1, top_k=1, act_bytes=2, impl="fused")


def test_autoep_row_alignment_is_deepspeeds():
    from deepspeed.moe.ep_kernels import TOKEN_GROUP_ALIGN_SIZE_M

    assert AUTOEP_ROW_ALIGNMENT == TOKEN_GROUP_ALIGN_SIZE_M


#: (model_type, experts_implementation, dtype, hidden, expert ffn, experts, top_k, heads, kv heads)
HF_CASES = [("mixtral", "eager", torch.float32, 128, 256, 8, 2, 4, 2),
            ("mixtral", "grouped_mm", torch.bfloat16, 256, 128, 16, 4, 8, 8),
            ("qwen3_moe", "grouped_mm", torch.bfloat16, 128, 256, 8, 2, 4, 2),
            ("olmoe", "eager", torch.float32, 128, 512, 4, 1, 4, 4)]


def _hf_model(model_type, impl, dtype, h, f, e, k, heads, kv, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(hidden_size=h, intermediate_size=f, moe_intermediate_size=f, num_local_experts=e, num_experts=e,
                  n_routed_experts=e, num_experts_per_tok=k, num_hidden_layers=2, num_attention_heads=heads,
                  num_key_value_heads=kv, head_dim=h // heads, vocab_size=VOCAB, decoder_sparse_step=1,
                  mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=256)
    base = AutoConfig.for_model(model_type)
    if hasattr(base, "moe_intermediate_size"):  # a dense MLP width beside the experts': not theirs
        values["intermediate_size"] = 3 * f
    values.update(extra)
    config = AutoConfig.for_model(model_type, **{key: v for key, v in values.items() if hasattr(base, key)})
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                experts_implementation=impl).to(dtype)


def _estimate(model, dtype, num_gpus=1, **kw):
    from lightning_zeromoe.planner import GB, plan

    return plan(model, num_gpus=num_gpus, gpu_memory_bytes=GB, precision="fp32" if dtype == torch.float32 else "bf16",
                micro_batch=BATCH, seq_len=SEQ, **kw).activations


@pytest.mark.parametrize("case", HF_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{str(c[2])[6:]}")
def test_estimate_matches_what_hugging_face_models_save(case):
    """``plan(model, micro_batch, seq_len)`` reads the shapes, GQA, q/k norms, the experts' own FFN
    width (``moe_intermediate_size`` over a dense ``intermediate_size``) and how the experts run
    (transformers' ``experts_implementation``) from the model itself."""
    model = _hf_model(*case)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    actual = saved_bytes(model, lambda: model(input_ids=ids, labels=ids).loss)
    est = _estimate(model, case[2])
    assert abs(est.total / actual - 1) < TOLERANCE, (case, est.total, actual, est.layer)


#: Shared experts beside the routed ones and a dense first layer: Qwen2-MoE's gated shared expert
#: (``mlp_only_layers``), GLM-4 MoE's two shared experts (``first_k_dense_replace``). GLM-4 MoE's
#: router upcasts its input to fp32, which bf16 runs keep too (not modelled): fp32 only.
MIX_CASES = [("qwen2_moe", torch.bfloat16, dict(shared_expert_intermediate_size=192, mlp_only_layers=[0]),
              LayerMix(moe_layers=1, dense_layers=1, dense_ffn=768, shared_ffn=192, shared_gate=True)),
             ("qwen2_moe", torch.float32, dict(shared_expert_intermediate_size=192),
              LayerMix(moe_layers=2, shared_ffn=192, shared_gate=True)),
             ("glm4_moe", torch.float32, dict(n_shared_experts=2, first_k_dense_replace=1),
              LayerMix(moe_layers=1, dense_layers=1, dense_ffn=768, shared_ffn=512))]


@pytest.mark.parametrize("case", MIX_CASES, ids=lambda c: f"{c[0]}-{str(c[1])[6:]}-{c[3].dense_layers}dense")
def test_dense_layers_and_shared_experts_are_read_from_the_model_and_counted(case):
    """``plan(model)`` reads the :class:`LayerMix` off the modules (not config keys, which differ by
    family); without it the same estimate misses what the shared experts and the dense MLP keep."""
    model_type, dtype, extra, mix = case
    model = _hf_model(model_type, "grouped_mm", dtype, 128, 256, 8, 2, 4, 2, **extra)
    assert layer_mix(model, 128, 2) == mix
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    actual = saved_bytes(model, lambda: model(input_ids=ids, labels=ids).loss)
    est = _estimate(model, dtype)
    assert abs(est.total / actual - 1) < TOLERANCE, (case, est.total, actual, est.layer, est.dense_layer)
    blind = _estimate(model, dtype, mix=LayerMix(moe_layers=2))  # every layer a MoE layer, nothing shared
    assert abs(blind.total / actual - 1) > TOLERANCE, (case, blind.total, actual)


#: Multi-head latent attention (with and without a query low-rank, interleaved rotary or not), with a
#: shared expert and a dense first layer; value heads as wide as query heads keep CPU's SDPA on its
#: flash kernel (``activations.py``). DeepSeek-V3's router computes in fp32: in bf16 its input's copy
#: is the 2-3% left.
MLA = dict(n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
           v_head_dim=48, head_dim=16, n_group=1, topk_group=1)
MLA_CASES = [("deepseek_v3", torch.bfloat16, dict(MLA, q_lora_rank=96)),
             ("deepseek_v3", torch.float32, dict(MLA, q_lora_rank=None, rope_interleave=False)),
             ("deepseek_v2", torch.float32, dict(MLA, q_lora_rank=96)),
             ("glm4_moe_lite", torch.bfloat16, dict(MLA, q_lora_rank=96))]


@pytest.mark.parametrize("case", MLA_CASES, ids=lambda c: f"{c[0]}-{str(c[1])[6:]}-q{c[2]['q_lora_rank']}")
def test_latent_attention_is_read_from_the_config_and_counted(case):
    model_type, dtype, extra = case
    model = _hf_model(model_type, "grouped_mm", dtype, 128, 256, 8, 2, 4, 4, **extra)
    assert LatentAttention.of(model.config) == LatentAttention(64, 32, 16, 48, extra["q_lora_rank"])
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    actual = saved_bytes(model, lambda: model(input_ids=ids, labels=ids).loss)
    est = _estimate(model, dtype)
    assert abs(est.total / actual - 1) < TOLERANCE, (case, est.total, actual, est.layer, est.dense_layer)


def test_layer_mix_of_models_without_dense_layers_or_shared_experts():
    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoELM

    model = _hf_model("mixtral", "eager", torch.float32, 128, 256, 8, 2, 4, 2)
    assert layer_mix(model, 128, 2) == LayerMix(moe_layers=2)
    tiny = TinyMoELM(TinyMoEConfig(vocab_size=VOCAB, hidden_size=64, ffn_hidden_size=96, num_layers=3))
    assert layer_mix(tiny, 64, 3) == LayerMix(moe_layers=3)
    assert layer_mix(torch.nn.Linear(4, 4), 4, 1) is None  # no MoE block: plan() assumes every layer is one


def test_layer_mix_under_peft_lora_is_the_base_models():
    peft = pytest.importorskip("peft")
    model_type, dtype, extra, mix = MIX_CASES[0]
    model = _hf_model(model_type, "grouped_mm", dtype, 128, 256, 8, 2, 4, 2, **extra)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["shared_expert_gate", "gate_proj", "up_proj",
                                                                          "down_proj", "q_proj"]))
    assert layer_mix(lora, 128, 2) == mix


def test_estimate_matches_what_the_reference_model_saves():
    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoELM, lm_losses

    for h, f, k, e in [(256, 512, 2, 8), (64, 96, 1, 4)]:
        torch.manual_seed(0)
        model = TinyMoELM(TinyMoEConfig(vocab_size=VOCAB, hidden_size=h, ffn_hidden_size=f, top_k=k, num_experts=e,
                                        max_seq_len=SEQ + 1, num_layers=2))
        actual = saved_bytes(model, lambda: lm_losses(model, torch.randint(0, VOCAB, (BATCH, SEQ + 1))))
        # the reference block loops over slices of its fused experts (expert_loop_of cannot tell)
        est = _estimate(model, torch.float32, expert_loop="slices")
        assert abs(est.total / actual - 1) < TOLERANCE, (h, f, k, e, est.total, actual, est.layer)


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
def test_estimate_matches_what_autoeps_layer_saves(grouped):
    """Each Mixtral block replaced by the ``AutoEPMoELayer`` the strategy's section builds, all
    experts local (the layer AutoEP builds on one rank of an ``ep_size`` group holds ``E / ep_size``):
    the estimate at ``ep_size=2`` with twice the experts pads the same rows."""
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    from lightning_zeromoe.conversion.check import _Holder, _section_for_probe
    from lightning_zeromoe.discovery.find import discover

    model = _hf_model("mixtral", "eager", torch.float32, 128, 256, 8, 2, 4, 2)
    found = discover(model, None)
    for block in found.blocks:
        section = dict(_section_for_probe(found), use_grouped_mm=grouped)
        config = parse_autoep_config(section)
        source = model.get_submodule(block.path)
        spec = AutoEP(_Holder(source, found.root_config), config).ep_parser()[0]
        layer = AutoEPMoELayer(spec=spec, source_module=source, ep_size=1, ep_rank=0, config=config)
        for key in ("use_grouped_mm", "use_triton_grouped_mm"):
            if hasattr(layer.experts, key) and not grouped:
                setattr(layer.experts, key, False)
        parent, _, child = block.path.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    actual = saved_bytes(model, lambda: model(input_ids=ids, labels=ids).loss)
    est = estimate_activations(micro_batch=BATCH, seq_len=SEQ, hidden_size=128, num_layers=2, num_heads=4,
                               num_kv_heads=2, ffn_hidden_size=256, top_k=2, vocab_size=VOCAB, precision="fp32",
                               num_experts=16, ep_size=2,  # 8 local experts, as built
                               expert_loop="grouped" if grouped else "slices")
    assert abs(est.total / actual - 1) < TOLERANCE, (grouped, est.total, actual, est.layer)
