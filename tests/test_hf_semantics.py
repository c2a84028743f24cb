"""Routing semantics from the HF config, structural discovery, and the setup-time conversion probe.

All in-process and single-rank: the probe builds AutoEP's real ``AutoEPMoELayer`` with
``ep_size=1`` (no communication) from the very section the strategy hands DeepSpeed, and runs it
against the original Hugging Face block. The negative controls flip one routing field against
the model's config and must be caught; the positive ones must pass with a small measured error.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import nn

from support.hf_zoo import build
from lightning_zeromoe.conversion.check import (
    ENTRY_ID, check_block, check_conversion, narrowed_config, register_fallback_leaves, tolerance_for)
from lightning_zeromoe.config.schema import DeepSpeedConfig
from lightning_zeromoe.discovery.find import Discovery, MoEPattern, discover, exact_pattern
from lightning_zeromoe.discovery.hf_semantics import routing_from_config
from lightning_zeromoe.discovery.structure import find_blocks


class _Holder(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net


def test_olmoe_routing_comes_from_its_config_not_autoep_defaults() -> None:
    """OLMoE has norm_topk_prob=False; AutoEP's custom default is route_norm=True."""
    model = build("olmoe")
    assert model.config.norm_topk_prob is False
    routing = routing_from_config(model.config)
    assert not isinstance(routing, str)
    assert (routing.score_func, routing.route_norm, routing.route_scale, routing.top_k) == ("softmax", False, 1.0, 2)
    assert ("route_norm", "False (config.norm_topk_prob)") in routing.origin
    flipped = dataclasses.replace(model.config)
    flipped.norm_topk_prob = True
    assert routing_from_config(flipped).route_norm is True  # type: ignore[union-attr]


def test_custom_pattern_on_olmoe_gets_the_config_semantics_and_the_lent_config() -> None:
    """The trap of issue 9: a MoEPattern on an HF model used to get route_norm=True silently."""
    root = _Holder(build("olmoe"))
    found = discover(root, MoEPattern(block=r"net\.model\.layers\.\d+\.mlp", top_k=2))
    assert found.autoep["route_norm"] is False and found.autoep["score_func"] == "softmax"
    assert found.root_config is root.net.config
    checked, checks = check_conversion(root, found)
    assert [c.passed for c in checks] == [True, True], [c.detail for c in checks]
    assert len(checked.blocks) == 2 and not checked.fallback


@pytest.mark.parametrize("arch", ["olmoe", "glm4_moe"])
def test_probe_catches_route_norm_opposite_to_the_config(arch: str) -> None:
    """Force route_norm against the model's config: the probe refuses the block and says why."""
    root = _Holder(build(arch))
    found = discover(root)
    assert found.blocks and "route_norm" in found.autoep
    good = check_block(root, found.blocks[0], found)
    assert good.passed and good.output_error is not None and good.output_error < good.tolerance, good
    wrong = dataclasses.replace(found, autoep={**found.autoep, "route_norm": not found.autoep["route_norm"]})
    bad = check_block(root, wrong.blocks[0], wrong)
    assert not bad.passed and bad.output_error is not None and bad.output_error > 100 * bad.tolerance, bad
    message = bad.message(wrong.autoep)
    assert message.startswith(f"[{ENTRY_ID}] net.model.layers.") and "output differs by" in message
    # norm_topk_prob flipped: the same experts, other weights, and the message says which part
    assert "first difference: the combine weights (same experts" in message
    assert "without expert parallelism" in message and f"route_norm={not found.autoep['route_norm']}" in message
    narrowed, checks = check_conversion(root, wrong)
    assert not narrowed.blocks and {b.path for b in narrowed.fallback} == {b.path for b in found.blocks}
    assert all("conversion probe failed" in b.reason for b in narrowed.fallback)
    assert narrowed_config(DeepSpeedConfig.from_dict({"expert_parallel": {"enabled": True, **wrong.autoep}}),
                           narrowed).to_dict() == {}


def test_probe_catches_llama4_score_apply() -> None:
    """Llama-4 weights the expert *input*; applying the weight after the experts is caught."""
    root = _Holder(build("llama4_text"))
    found = discover(root)
    assert found.autoep["score_apply"] == "pre" and check_block(root, found.blocks[0], found).passed
    wrong = dataclasses.replace(found, autoep={**found.autoep, "score_apply": "post"})
    bad = check_block(root, wrong.blocks[0], wrong)
    # its router returns dense [T, E] scores: read as the choice and weights, which agree
    assert not bad.passed and "first difference: the expert outputs" in bad.detail, bad.detail


def test_one_failing_block_narrows_the_pattern_to_the_others() -> None:
    root = _Holder(build("olmoe"))
    found = discover(root)
    first, second = (b.path for b in found.blocks)
    narrowed = found.without({first: "probe failed"})
    assert [b.path for b in narrowed.blocks] == [second]
    assert re.fullmatch(narrowed.autoep["moe_layer_pattern"], second)
    assert not re.fullmatch(narrowed.autoep["moe_layer_pattern"], first)
    assert narrowed.autoep["moe_layer_pattern"] == exact_pattern([second])
    cfg = narrowed_config(DeepSpeedConfig.from_dict({"expert_parallel": {"enabled": True, "moe_layer_pattern": "x"}}),
                          narrowed).to_dict()
    assert cfg["expert_parallel"]["moe_layer_pattern"] == exact_pattern([second])
    assert "1 without EP" in narrowed.summary() and first in narrowed.summary()


def test_structure_finds_blocks_under_any_name_with_the_models_own_names() -> None:
    """Blocks at block_sparse_moe (Granite) and feed_forward (Llama-4), router named router, and
    Llama-4's hidden-first fused layout; DeepSeek-V3's score-correction bias is named for export."""
    granite = find_blocks(build("granitemoe"), 4)
    assert [b.path for b in granite] == [f"model.layers.{i}.block_sparse_moe" for i in (0, 1)]
    assert (granite[0].router, granite[0].router_weight, granite[0].w1, granite[0].w2, granite[0].layout) == \
        ("router", "router.weight", "gate_up_proj", "down_proj", "gate_up_first")
    llama = find_blocks(build("llama4_text"), 4)
    assert llama[0].path == "model.layers.0.feed_forward" and llama[0].layout == "hidden_first"
    assert llama[0].shared_experts == "shared_expert"
    ds3 = find_blocks(build("deepseek_v3"), 4)
    assert [b.path for b in ds3] == ["model.layers.1.mlp", "model.layers.2.mlp"]  # layer 0 is dense
    assert ds3[0].extra_tensors == ("gate.e_score_correction_bias",) and ds3[0].shared_experts == "shared_experts"


@pytest.mark.parametrize("arch, reason", [
    ("gpt_oss", "experts add biases"), ("phimoe", "SparseMixer"), ("deepseek_v4", "sqrtsoftplus"),
    ("inkling2_text", "softcapped by tanh"), ("inkling_text", "also scores its shared experts")])
def test_what_autoep_cannot_express_falls_back_with_a_reason(arch: str, reason: str) -> None:
    root = _Holder(build(arch))
    found = discover(root)
    assert not found.blocks and found.fallback and all(reason in b.reason for b in found.fallback)
    leaves = register_fallback_leaves(root, found, ep_converts=True)
    assert leaves == [b.path for b in found.fallback]
    assert all(getattr(root.get_submodule(p), "_z3_leaf", False) for p in leaves)


@pytest.mark.parametrize("arch, attr", [("mixtral", "router_jitter_noise"), ("minimax", "router_jitter_noise")])
def test_jitter_noise_in_training_falls_back_although_the_probe_would_agree(arch: str, attr: str) -> None:
    """Jitter multiplies the block's input by noise in training only: the eval-mode probe cannot see
    it, AutoEP's layer does not do it. A preset family (Mixtral) and a custom one both fall back."""
    net = build(arch)
    assert discover(_Holder(net)).blocks  # jitter off (the zoo's configs): EP
    setattr(net.config, attr, 0.1)
    found = discover(_Holder(net))
    assert not found.blocks and len(found.fallback) == 2
    assert all(f"config.{attr}=0.1" in b.reason for b in found.fallback), found.fallback


def test_tolerance_is_dtype_aware() -> None:
    assert tolerance_for(torch.float32) < tolerance_for(torch.float16) < tolerance_for(torch.bfloat16)


def test_empty_discovery_summary() -> None:
    assert Discovery(source="none").summary(ep_enabled=False).startswith("0 MoE block(s)")


def test_nested_router_is_shown_to_autoep_by_an_alias_that_leaves_with_a_failed_block() -> None:
    """HunYuan's router projection is ``gate.wg``: AutoEP reads ``<router>.weight`` of a direct child,
    so the block gets a ``zeromoe_router`` alias of the same module while it is to be converted; a
    block that fails the probe loses the alias again (its state dict must not name the weight twice)."""
    root = _Holder(build("hunyuan_v1_moe"))
    found = discover(root)
    assert found.autoep["router_pattern"] == "zeromoe_router"
    assert found.blocks[0].layout.router_weight == "gate.wg.weight"  # the model's own name, for export
    checked, checks = check_conversion(root, found)
    assert all(c.passed for c in checks) and len(checked.blocks) == 2
    block = root.get_submodule(found.blocks[0].path)
    assert block.zeromoe_router is block.gate.wg
    wrong = dataclasses.replace(found, autoep={**found.autoep, "route_norm": False})
    failed, _ = check_conversion(root, wrong)
    assert not failed.blocks and "zeromoe_router" not in dict(block.named_children())
    assert not any("zeromoe_router" in k for k in root.state_dict())


def test_dbrx_flattened_experts_convert_through_exact_views_and_come_back_when_refused() -> None:
    """DBRX keeps w1/v1/w2 as [E * ffn, hidden]: shown to AutoEP as 3-D views of the same parameters
    (no copy, so the optimizer's parameters are AutoEP's sources), the probe passes; a block refused
    gets its own 2-D tensors back (same storage) and no alias."""
    from lightning_zeromoe.checkpoint.autoep_names import fuse_experts, names_of_block, split_experts
    from lightning_zeromoe.checkpoint.autoep_names import BlockNames

    root = _Holder(build("dbrx"))
    found = discover(root)
    layout = found.blocks[0].layout
    assert (layout.experts, layout.w1, layout.w3, layout.w2, layout.storage) == ("experts.mlp", "w1", "v1", "w2",
                                                                                  "flattened_2d")
    assert found.autoep["expert_pattern"] == "zeromoe_experts" and found.autoep["route_norm"] is True
    mlp = root.get_submodule(f"{found.blocks[0].path}.experts.mlp")
    before = {n: (getattr(mlp, n), getattr(mlp, n).detach().clone()) for n in ("w1", "v1", "w2")}
    checked, checks = check_conversion(root, found, expert_grads=True)  # per-expert gradient norms compared too
    assert all(c.passed for c in checks) and len(checked.blocks) == 2, [c.detail for c in checks]
    assert all("expert_grads" in c.report.errors for c in checks)
    assert mlp.w1.shape == (4, 96, 64) and mlp.w2.shape == (4, 64, 96)  # left as AutoEP's views for initialize
    assert all(getattr(mlp, n) is p for n, (p, _) in before.items())
    wrong = dataclasses.replace(found, autoep={**found.autoep, "route_norm": False})
    failed, _ = check_conversion(root, wrong)
    assert not failed.blocks and "zeromoe_experts" not in dict(root.get_submodule(found.blocks[0].path).named_children())
    for n, (p, value) in before.items():
        assert getattr(mlp, n) is p and torch.equal(p, value)  # shape [E * ffn, hidden] and values as they were
    names = names_of_block(layout, BlockNames())
    own = {n: v for n, (_, v) in before.items()}
    split = split_experts(own, names)
    assert split["w2"].shape == (4, 64, 96) and torch.equal(split["w2"][1], own["w2"].view(4, 96, 64)[1].T)
    back = fuse_experts(split["w1"], split["w2"], split["w3"], names, {})
    assert all(torch.equal(back[n], own[n]) for n in own)


def test_ernie_bias_of_shape_1_by_e_is_shown_to_autoep_as_e_and_comes_back_when_refused() -> None:
    """ERNIE-4.5's e_score_correction_bias is [1, E]; AutoEP's router needs [E] (else 'Index tensor must
    have the same number of dimensions'). Reshaped for the probe, it passes; a refused block gets its
    own [1, E] parameter back."""
    root = _Holder(build("ernie4_5_moe"))
    found = discover(root)
    statics = root.get_submodule(f"{found.blocks[0].path}.gate.moe_statics")
    own = statics.e_score_correction_bias
    assert own.shape == (1, 4) and bool(own.abs().sum() > 0)
    checked, checks = check_conversion(root, found)
    assert all(c.passed for c in checks) and checked.blocks, [c.detail for c in checks]
    assert statics.e_score_correction_bias.shape == (4,) and torch.equal(statics.e_score_correction_bias, own[0])
    statics.e_score_correction_bias = own  # as before the probe
    wrong = dataclasses.replace(found, autoep={**found.autoep, "route_norm": False})
    failed, _ = check_conversion(root, wrong)
    assert not failed.blocks and statics.e_score_correction_bias is own


def test_dots3_routes_with_sigmoid_as_deepseek_v3() -> None:
    """dots3.note's config states no scoring_func; its router is DeepSeek-V3's (sigmoid). The softmax
    default made the probe fail by 0.06."""
    routing = routing_from_config(build("dots3_note_text").config)
    assert not isinstance(routing, str) and routing.score_func == "sigmoid"


def _needs(arch: str) -> pytest.MarkDecorator:
    from support.hf_zoo import ARCHS

    return pytest.mark.skipif(arch not in ARCHS, reason=f"the installed transformers has no {arch} (5.25 added it)")


@_needs("ergo")
def test_ergo_falls_back_for_its_ungated_normed_experts_which_its_block_really_has() -> None:
    """Ergo's reason names what its block computes; the block is checked for exactly that: the
    router is found (``gate.linear``, not the experts' ``[E, H]`` norm weight), the experts hold
    only ``up_proj``/``down_proj`` (no gate), and one route through expert e computes
    ``rms_norm(relu(x @ up[e])^2 @ down[e]) * post_expert_norm.weight[e]``."""
    root = _Holder(build("ergo"))
    net = root.net
    found = discover(root)
    assert not found.blocks and found.fallback
    for block in found.fallback:
        assert "ungated (up_proj -> relu2 -> down_proj" in block.reason and "post_expert_norm" in block.reason
        assert "3-D" not in block.reason
        assert block.layout.router_weight == "gate.linear.weight"
    experts = root.get_submodule(found.fallback[0].path).experts
    three_d = sorted(n for n, p in experts.named_parameters(recurse=False) if p.dim() == 3)
    assert three_d == ["down_proj", "up_proj"]  # ungated: no gate_proj / gate_up_proj
    e, hidden = 3, net.config.hidden_size
    assert tuple(experts.post_expert_norm.weight.shape) == (net.config.num_experts, hidden)
    with torch.no_grad():
        experts.post_expert_norm.weight.uniform_(0.5, 2.0)
        x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(0))
        got = experts(x, torch.full((5, 1), e), torch.ones(5, 1))
        mlp = torch.relu(x @ experts.up_proj[e]).square() @ experts.down_proj[e]
        want = nn.functional.rms_norm(mlp, (hidden,), eps=experts.post_expert_norm.eps) * \
            experts.post_expert_norm.weight[e]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@_needs("kolibri1_1")
def test_kolibri1_1_converts_with_a_zero_bias_and_falls_back_with_a_non_zero_one() -> None:
    """Its router takes the top-k of ``logits + e_score_correction_bias`` (AutoEP: of ``sigmoid +
    bias``): with the tiny model's non-zero bias the two choices differ on real tokens, and the
    block falls back naming the bias; at zero (a model from its config) they are one rule, and the
    probe proves the conversion."""
    net = build("kolibri1_1")
    found = discover(net)
    assert not found.blocks and len(found.fallback) == 2
    assert all("e_score_correction_bias is non-zero" in b.reason for b in found.fallback), found.fallback
    gate = net.get_submodule(found.fallback[0].path).gate
    x = torch.randn(64, net.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gate.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))  # trained, not its zero init
        logits, _, chosen = gate(x)
        k = net.config.num_experts_per_tok
        own = (logits + gate.e_score_correction_bias).topk(k).indices.sort(-1).values
        assert torch.equal(chosen.sort(-1).values, own)
        autoep = (logits.sigmoid() + gate.e_score_correction_bias).topk(k).indices.sort(-1).values
        assert not torch.equal(chosen.sort(-1).values, autoep)
        for name, buf in net.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.zero_()
    root = _Holder(net)
    found = discover(root)
    assert len(found.blocks) == 2 and found.autoep["score_func"] == "sigmoid"
    assert found.autoep["route_norm"] is net.config.norm_topk_prob
    assert check_block(root, found.blocks[0], found).passed


@_needs("minicpm5_moe")
def test_minicpm5_moe_routes_as_deepseek_v3_scaled_and_the_probe_agrees() -> None:
    net = build("minicpm5_moe")
    root = _Holder(net)
    found = discover(root)
    assert found.blocks and not found.fallback
    assert (found.autoep["score_func"], found.autoep["route_norm"], found.autoep["routed_scaling_factor"]) == \
        ("sigmoid", True, net.config.routed_scaling_factor)
    assert found.autoep["shared_experts_pattern"] == "shared_experts"
    assert all(check_block(root, b, found).passed for b in found.blocks)


@pytest.mark.parametrize("arch, key, value, part", [
    ("deepseek_v3", "routed_scaling_factor", 1.0, "the combine weights (same experts"),  # config says 2.5
    ("glm4_moe", "top_k", 1, "the top-k choice (the original picks 2 experts, AutoEP 1)"),
    ("mixtral", "expert_activation", "geglu_tanh", "the expert outputs (router scores, top-k choice and combine")])
def test_a_failed_probe_names_the_first_differing_part(arch: str, key: str, value: object, part: str) -> None:
    """One routing field set wrong in the section: the probe's message names the part that differs."""
    root = _Holder(build(arch))
    found = discover(root)
    wrong = dataclasses.replace(found, autoep={**found.autoep, key: value})
    bad = check_block(root, wrong.blocks[0], wrong)
    assert not bad.passed and f"first difference: {part}" in bad.message(wrong.autoep), bad.detail


@_needs("kolibri1_1")
def test_a_failed_probe_names_the_top_k_choice_with_the_tokens_that_differ() -> None:
    """Kolibri-1.1 converted for its zero bias, then given a non-zero one (as training with
    aux-loss-free balancing elsewhere would): its choice top-k(logits + bias) is not AutoEP's."""
    net = build("kolibri1_1")
    with torch.no_grad():
        for name, buf in net.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.zero_()
    root = _Holder(net)
    found = discover(root)
    block = root.get_submodule(found.blocks[0].path)
    with torch.no_grad():
        block.gate.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
        block.gate.e_score_correction_bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    bad = check_block(root, found.blocks[0], found)
    assert not bad.passed
    assert re.search(r"first difference: the top-k choice \(which experts\): \d+ of \d+ tokens go to other experts",
                     bad.detail), bad.detail
