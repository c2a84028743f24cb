"""The setup-time conversion probe proves what the README says it proves (issue 16, item 3).

In-process and single-rank, with AutoEP's real ``AutoEPMoELayer`` (``ep_size=1``) built from the
section the strategy hands DeepSpeed, against real blocks: tiny Hugging Face models from
``tests/support/hf_zoo.py`` and variants of the repository's tiny MoE block (subclasses that differ from
what AutoEP computes in one deliberate way each). Every negative control is a block that truly
differs from its conversion, and every one of them passed the probe as it was before (eval mode,
no gradients, bf16 tolerance 4e-2, 16 tokens); the positive controls must keep passing.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from support.hf_zoo import build
from lightning_zeromoe.conversion.check import (ENTRY_ID, _Holder, _section_for_probe, check_block, check_conversion,
                                                probe_summary, tolerance_for)
from lightning_zeromoe.conversion.probe import GROWTH, MAX_TOKENS, probe_tokens
from lightning_zeromoe.discovery.find import discover
from lightning_zeromoe.reference.models import MoEBlock, TinyMoEConfig, TinyMoELM
from lightning_zeromoe.conversion.report import COMPARE_TOLERANCE


class _Root(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net


def _old_probe_error(root: nn.Module, found, block_index: int = 0) -> float:
    """What the probe measured before issue 16: both blocks in the model's dtype and mode, no
    gradients, 16 tokens, the output's relative max-abs error (accepted below ``tolerance_for(dtype)``)."""
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    block = root.get_submodule(found.blocks[block_index].path)
    dtype = next(block.parameters()).dtype
    config = parse_autoep_config(_section_for_probe(found))
    spec = AutoEP(_Holder(block, found.root_config), config).ep_parser()[0]
    layer = AutoEPMoELayer(spec=spec, source_module=block, ep_size=1, ep_rank=0, config=config).to(dtype)
    x = torch.randn(2, 8, spec.hidden_size, generator=torch.Generator().manual_seed(1234)).to(dtype)
    with torch.no_grad():
        want, got = block(x), layer(x)
    want = want[0] if isinstance(want, tuple) else want
    return float((want.double() - got.double()).abs().max() / want.double().abs().max())


def _peaked_olmoe(scale: float = 80.0) -> nn.Module:
    """OLMoE (``norm_topk_prob=False``) with routers scaled so the top-2 hold ~all of the softmax
    mass: renormalising them then changes the output by a few percent, not by half."""
    net = build("olmoe")
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(scale)
    return net


def _tiny(variant: type[MoEBlock] | None = None, **config) -> _Root:
    """The repository's tiny MoE LM (self-described blocks), with every block's class swapped for a variant."""
    torch.manual_seed(0)
    net = TinyMoELM(TinyMoEConfig(**config))
    if variant is not None:
        for layer in net.layers:
            layer.mlp.__class__ = variant
    return _Root(net)


class DetachedRouter(MoEBlock):
    """The same forward as ``MoEBlock``, but the routing weights carry no gradient to the router:
    AutoEP's layer trains the router through them, so the two train differently."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        scores = torch.softmax(self.gate(x).detach().float(), dim=-1)
        top_scores, chosen = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        return self.experts(x, top_scores, chosen).reshape(shape)


class ExpertDropout(MoEBlock):
    """``MoEBlock`` plus dropout on its output in training mode (which AutoEP's layer does not do)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.dropout(super().forward(hidden_states), p=0.1, training=self.training)


def test_probe_tokens_scale_with_experts_over_top_k():
    assert probe_tokens(4, 2) == 64  # the floor
    assert probe_tokens(64, 2) == 512 and probe_tokens(64, 6) == 172 and probe_tokens(256, 8) == 512
    assert probe_tokens(128, 1) == 2048 and probe_tokens(100_000, 1) == MAX_TOKENS
    assert all(probe_tokens(e, k) % 2 == 0 for e in (3, 5, 63) for k in (1, 2, 3))


def test_wrong_renormalisation_passed_the_old_bf16_check_and_fails_the_fp32_probe():
    """The converted block renormalises its top-k weights, the original (OLMoE) does not: a
    systematic few-percent error. In bf16 the old check saw ~2 % and accepted it (below 4e-2);
    the fp32 probe measures it against 1e-4 and refuses the block, naming the output."""
    root = _Root(_peaked_olmoe().to(torch.bfloat16).eval())
    found = discover(root)
    assert found.autoep["route_norm"] is False
    wrong = dataclasses.replace(found, autoep={**found.autoep, "route_norm": True})
    old = _old_probe_error(root, wrong)
    assert 1e-3 < old < tolerance_for(torch.bfloat16), f"the old check measured {old:.3g}"
    bad = check_block(root, wrong.blocks[0], wrong)
    assert not bad.passed and bad.tolerance == COMPARE_TOLERANCE
    assert bad.report is not None and bad.report.compute_dtype == "torch.float32"
    assert 0.01 < bad.output_error < 0.2, bad.output_error  # a few percent, measured in fp32
    message = bad.message(wrong.autoep)
    assert message.startswith(f"[{ENTRY_ID}] net.model.layers.0.mlp: ") and "output differs by" in message
    assert "compared in float32, training mode" in message and "route_norm=True" in message
    # The right mapping on the same bf16 model passes with fp32-sized errors, every quantity compared.
    good = check_block(root, found.blocks[0], found, expert_grads=True)
    assert good.passed, good.detail
    assert set(good.report.errors) == {"output", "logits", "input_grad", "router_grad", "expert_grads"}
    assert max(good.report.errors.values()) < 1e-5, good.report.errors
    # Beside it, both blocks in bf16 against the fp32 reference: bf16 rounding, reported, not judged.
    own, converted = good.report.dtype_gap["output"]
    assert 1e-4 < own < 5e-2 and 1e-4 < converted < 5e-2, good.report.dtype_gap


def test_router_weight_gradient_is_compared():
    """Outputs equal to ~1e-7, gradients not: a block whose routing weights are detached from its
    router. A forward-only probe passes it; this one refuses it for the router weight's gradient."""
    root = _tiny(DetachedRouter)
    found = discover(root)
    assert _old_probe_error(root, found) < 1e-6
    check = check_block(root, found.blocks[0], found)
    assert not check.passed
    assert check.report.errors["output"] < 1e-6 and check.report.errors["router_grad"] > 1.0, check.report.errors
    assert "the router weight's gradient differs by" in check.detail
    assert check.report.errors["input_grad"] > COMPARE_TOLERANCE  # the routing path feeds the input's gradient too
    assert check_block(_tiny(), found.blocks[0], found).passed  # the unmodified block


def test_probe_runs_in_training_mode_and_restores_each_modules_mode():
    """A block with dropout in training: the model is in eval mode (as from_pretrained leaves it), where
    the old probe saw no difference; the probe runs in training mode, refuses it and says why."""
    root = _tiny(ExpertDropout).eval()
    found = discover(root)
    assert _old_probe_error(root, found) < 1e-6
    rng = torch.get_rng_state()
    check = check_block(root, found.blocks[0], found)
    assert not check.passed and check.report.random_in_training
    assert "random in training mode" in check.detail
    assert not any(m.training for m in root.modules()), "the probe must put every module's mode back"
    assert torch.equal(torch.get_rng_state(), rng), "the probe must not consume the model's random stream"
    plain = _tiny().train()
    plain.net.layers[0].attn.training = False  # a mixed tree comes back exactly as it was
    assert check_block(plain, found.blocks[0], found).passed
    assert [m.training for m in plain.modules()].count(False) == 1 and not plain.net.layers[0].attn.training


def test_every_expert_receives_tokens():
    """64 experts, top-2: the old 16 tokens reached at most 32 of them; the probe sizes its batch from
    num_experts / top_k and counts the experts hit, from AutoEP's router (proven equal to the original's)
    or, when expert gradients are compared, from the original block's own expert-weight gradients."""
    root = _tiny(num_experts=64, top_k=2)
    found = discover(root)
    for expert_grads, source in ((None, "AutoEP's router counts"),
                                 (True, "the original block's expert-weight gradients")):
        check = check_block(root, found.blocks[0], found, expert_grads=expert_grads)
        assert check.passed, check.detail
        report = check.report
        assert report.tokens == probe_tokens(64, 2) == 512 and report.experts_hit == 64 and not report.uncovered
        assert report.hit_source == source and ("expert_grads" in report.errors) == bool(expert_grads)


def test_an_expert_no_token_can_reach_is_reported_after_the_batch_grew():
    """A choice bias of -100 on expert 0: no input picks it. The batch grows once (x8), the block still
    passes (everything that was compared matches), and the report and the log line name the gap."""
    root = _tiny(score_bias=True)
    with torch.no_grad():
        for layer in root.net.layers:
            layer.mlp.gate.e_score_correction_bias[0] = -100.0
    found = discover(root)
    checked, checks = check_conversion(root, found)
    assert all(c.passed for c in checks) and len(checked.blocks) == 2
    for check in checks:
        assert check.report.uncovered == [0] and check.report.experts_hit == 3
        assert check.report.tokens == probe_tokens(4, 2) * GROWTH
    line = probe_summary(checks, grouped_configured=False, on_cpu=True)
    assert "2 expert(s) got no probe token and were not compared" in line


def test_grouped_gemm_path_is_compared_when_the_section_turns_it_on():
    """torch 2.13's CPU build has a ``_grouped_mm`` too, so the comparison itself runs here (the CUDA
    kernel training uses on a GPU is only compared there). Off, as the strategy configures CPU runs,
    the log line says the path was not compared."""
    root = _tiny()
    found = discover(root)
    section = {"enabled": True, "autoep_size": 2, **found.autoep}
    on = check_block(root, found.blocks[0], found, section={**section, "use_grouped_mm": True})
    assert on.passed and on.report.grouped == "compared", on.detail
    assert "expert_grads" in on.report.grouped_errors  # a kernel's weight gradient is compared too
    assert all(err <= bound == COMPARE_TOLERANCE for err, bound in on.report.grouped_errors.values())
    off = check_block(root, found.blocks[0], found, section={**section, "use_grouped_mm": False})
    assert off.passed and off.report.grouped == "not used" and not off.report.grouped_errors
    line = probe_summary([off], grouped_configured=False, on_cpu=True)
    assert "grouped-GEMM expert path not compared (training runs AutoEP's per-expert loop on CPU)" in line
    assert "compared (0 block(s) outside its bound)" in probe_summary([on], grouped_configured=True, on_cpu=True)
    # In bf16 the grouped path must stay within twice the original block's own bf16 error (+ eps).
    low = _tiny().to(torch.bfloat16)
    bf16 = check_block(low, found.blocks[0], found, section={**section, "use_grouped_mm": True})
    assert bf16.passed and bf16.report.grouped == "compared", bf16.detail
    assert all(0 < err <= bound for err, bound in bf16.report.grouped_errors.values()), bf16.report.grouped_errors


def test_probe_leaves_the_model_as_it_was():
    """fp32 copies only: the bf16 model keeps its dtype, values, counters and grads (none)."""
    root = _tiny().to(torch.bfloat16)
    found = discover(root)
    before = {k: v.clone() for k, v in root.state_dict(keep_vars=False).items()}
    counts = root.net.layers[0].mlp.tokens_per_expert.clone()
    _, checks = check_conversion(root, found)
    assert all(c.passed for c in checks), [c.detail for c in checks]
    after = root.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.dtype == torch.bfloat16 and p.grad is None for p in root.parameters())
    assert torch.equal(root.net.layers[0].mlp.tokens_per_expert, counts)


@pytest.mark.parametrize("arch", ["hunyuan_v1_moe", "afmoe"])
def test_probe_puts_back_the_very_same_parameter_objects(arch):
    """Blocks reachable under two names (HunYuan's router alias, AFMoE's score-bias alias too): after
    the probe every name holds the model's own parameter object again, not the probe's copy (ZeRO-3
    keeps its partitioning state on those objects). torch.func.functional_call got this wrong."""
    root = _Root(build(arch).to(torch.bfloat16))
    found = discover(root)
    before = {n: p for n, p in root.named_parameters(remove_duplicate=False)}
    _, checks = check_conversion(root, found)
    assert all(c.passed for c in checks), [c.detail for c in checks]
    after = dict(root.named_parameters(remove_duplicate=False))
    assert all(after[n] is p for n, p in before.items()), [n for n, p in before.items() if after[n] is not p]
    block = root.get_submodule(found.blocks[0].path)
    assert block.zeromoe_router.weight is before[f"{found.blocks[0].path}.{found.blocks[0].layout.router_weight}"]


def test_log_line_reports_errors_gap_and_blind_spots():
    root = _Root(build("qwen3_moe").to(torch.bfloat16))
    found = discover(root)
    _, checks = check_conversion(root, found)
    line = probe_summary(checks, grouped_configured=False, on_cpu=True)
    assert line.startswith("ZeroMoEStrategy conversion probe: 2/2 block(s) match their AutoEP layer in float32 "
                           "(training mode, forward and backward, 64 tokens; worst relative error: output ")
    for words in ("router_grad", "tolerance 0.0001", "every expert received tokens",
                  "in bfloat16 against that reference (informational): original output",
                  "not seen by the probe: the all-to-all of expert parallelism", "router jitter", "dropout"):
        assert words in line, (words, line)
