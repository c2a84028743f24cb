"""Export's LoRA merge against PEFT's own ``merge_and_unload`` on a tiny Mixtral, in-process.

The export reads the state of ``PeftModel.base_model.model`` (names under PEFT's wrappers) and the
adapter record the save writes; here those come straight from a live ``PeftModel`` whose adapter
weights were moved off their initial values, and :func:`split_lora` must give exactly the
tensors ``merge_and_unload()`` gives: the same names, the same values, nothing more.
"""

from __future__ import annotations

import json

import pytest
import torch

from lightning_zeromoe.checkpoint.errors import ExportError
from lightning_zeromoe.checkpoint.lora import param_wrappers, split_lora
from lightning_zeromoe.checkpoint.meta import LoraAdapter
from lightning_zeromoe.checkpoint.plan import OutputTensor
from lightning_zeromoe.checkpoint.save import _jsonable

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

# case -> (LoraConfig arguments, a tensor of the merged model the adapter must have changed)
CASES = {
    "embedding": (dict(target_modules=["embed_tokens", "q_proj"]), "model.embed_tokens.weight"),
    "lm_head": (dict(target_modules=["lm_head", "v_proj"]), "lm_head.weight"),
    "modules_to_save_lm_head": (dict(target_modules=["q_proj"], modules_to_save=["lm_head"]), "lm_head.weight"),
    "modules_to_save_router": (dict(target_modules=["q_proj"], modules_to_save=["gate"]),
                               "model.layers.0.mlp.gate.weight"),
    "rslora_embedding": (dict(target_modules=["embed_tokens", "o_proj"], use_rslora=True), "model.embed_tokens.weight"),
    "fused_experts": (dict(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj",
                                                                          "mlp.experts.down_proj"]),
                      "model.layers.0.mlp.experts.down_proj"),
}


def _base():
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=32)
    return transformers.MixtralForCausalLM(cfg)


def _peft_model(**lora):
    model = peft.get_peft_model(_base(), peft.LoraConfig(r=4, lora_alpha=8, **lora))
    with torch.no_grad():  # as after training: B (zero at init) and the saved copies away from the base
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _split(model):
    """What export computes from the state it reads: (merged name -> tensor, adapter name -> tensor)."""
    inner = model.base_model.model
    state = {n: t.detach().clone() for n, t in inner.state_dict().items()}
    outputs = [OutputTensor(n, tuple(t.shape), (lambda t: lambda reader: t)(t)) for n, t in state.items()]
    config = json.loads(json.dumps(model.peft_config["default"].to_dict(), default=_jsonable))
    merged, adapter = split_lora(outputs, [LoraAdapter("default", config, param_wrappers=param_wrappers(inner))])
    return {o.name: o.build(None) for o in merged}, {o.name: o.build(None) for o in adapter}


@pytest.mark.parametrize("case", list(CASES))
def test_merged_export_is_merge_and_unload(case):
    lora, adapted = CASES[case]
    model = _peft_model(**lora)
    merged, adapter = _split(model)
    saved = peft.get_peft_model_state_dict(model)
    # PEFT also saves a targeted embedding's base layer; the export's adapter holds the trained tensors.
    assert set(adapter) == {k for k in saved if not k.endswith(".base_layer.weight")}
    for name, t in adapter.items():
        assert torch.equal(t, saved[name]), name
    want = model.merge_and_unload().state_dict()
    assert sorted(merged) == sorted(want)
    for name, t in want.items():
        torch.testing.assert_close(merged[name], t, rtol=1e-5, atol=1e-6, msg=name)
    base = _base().state_dict()
    assert (merged[adapted] - base[adapted]).abs().max() > 1e-3  # the case does adapt that tensor


def test_dora_and_lora_bias_are_refused():
    with pytest.raises(ExportError, match=r"^\[export-unsupported-model\] .*use_dora=True"):
        _split(_peft_model(target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ExportError, match=r"^\[export-unsupported-model\] .*does not know how to merge: "
                                          r"model\.layers\.0\.self_attn\.q_proj\.lora_B\.default\.bias"):
        _split(_peft_model(target_modules=["q_proj"], lora_bias=True))
