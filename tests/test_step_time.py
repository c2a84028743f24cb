"""The step-time model (``lightning_zeromoe/planner/step_time.py``) and choosing by time: FLOPs per
token counted by hand on the tiny model, communication time = bytes x factor / bandwidth per group
(inside or across nodes), gradient staging per reduction, offload time, and the choice (fastest
that fits, ties to the lower stage, the reason line). No processes and no timing: the ranking on
real CPU ranks is ``benchmarks/rank_setups.py``'s job."""

from __future__ import annotations

import pytest

from lightning_zeromoe.planner import GB, ParamCounts, choose_stage, plan
from lightning_zeromoe.planner.comm import CommShape, predict
from lightning_zeromoe.planner.auto import choose_ep_size, choose_setup
from lightning_zeromoe.planner.setups import LADDER, Setup
from lightning_zeromoe.planner.step_time import (Hardware, Link, ModelShape, bus_factor, expert_loop_of,
                                                 expert_loop_time, flops_per_token, looped_experts, predict_step_time,
                                                 spans_nodes)


def tiny_counts() -> ParamCounts:
    from lightning_zeromoe.planner import count_params
    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoELM

    return count_params(TinyMoELM(TinyMoEConfig()))


def test_flops_per_token_of_the_tiny_model_by_hand():
    # TinyMoEConfig(): vocab 128, hidden 64, 2 layers, 4 experts top-2, expert FFN 96, 64 positions.
    h, v, f, layers, e, k, s = 64, 128, 96, 2, 4, 2, 32
    dense = v * h + 64 * h + layers * (h + 3 * h * h + h * h + h + e * h) + h + v * h
    expert_per_layer = e * (2 * f * h + h * f)
    counts = tiny_counts()
    assert (counts.dense_total, counts.expert_total) == (dense, layers * expert_per_layer)
    shape = CommShape(counts=counts, stage=3, world=2, top_k=k, hidden_size=h, moe_layers=layers, num_experts=e)
    active = dense + layers * expert_per_layer * k / e  # each token runs k of the e experts
    model = ModelShape(attention_layers=layers, seq_len=s)
    assert flops_per_token(shape, model) == 6 * active + 12 * layers * h * s
    ckpt = CommShape(counts=counts, stage=3, world=2, top_k=k, hidden_size=h, moe_layers=layers, num_experts=e,
                     activation_checkpointing=True)
    assert flops_per_token(ckpt, model) == 8 * active + 16 * layers * h * s
    # A wider attention (heads x head_dim != hidden, as Qwen3's 32 x 128 on 2048) counts its own width.
    assert flops_per_token(shape, ModelShape(layers, s, attention_width=2 * h)) == 6 * active + 12 * layers * 2 * h * s
    # Compute time: tokens per rank per step (micro-batch tokens x accumulation) / FLOP rate, + the update.
    hw = Hardware(flops_per_second=1e9, update_params_per_second=1e15)
    step = predict_step_time(CommShape(counts=counts, stage=3, world=2, top_k=k, hidden_size=h, moe_layers=layers,
                                       num_experts=e, tokens_per_micro_batch=4 * s, accumulation=3), hw, model=model)
    assert step.flops_per_rank == flops_per_token(shape, model) * 4 * s * 3
    assert step.compute == pytest.approx(step.flops_per_rank / 1e9 + counts.total / 2 / 1e15)


def test_expert_loop_costs_per_local_expert_and_quadratically_for_sliced_tensors():
    # The tiny model: 2 MoE layers of 4 experts, fp32; 3 micro-batches. Each rank loops over its own
    # experts: 4 at ep_size=1, 2 at ep_size=2.
    counts = tiny_counts()
    per_layer = counts.expert_total / 2 * 4  # one layer's expert gradients, bytes
    hw = Hardware(expert_loop_seconds=1e-3, memory_bandwidth=1e9)

    def loop(ep: int, how: str) -> float:
        shape = CommShape(counts=counts, stage=1, world=2, ep_size=ep, precision="fp32", moe_layers=2, num_experts=4,
                          accumulation=3)
        model = ModelShape(expert_loop=how, autoep_expert_loop=how)
        assert looped_experts(shape, model) == (0 if how == "grouped" else 4 // ep)
        return expert_loop_time(shape, model, hw)

    assert loop(1, "grouped") == loop(2, "grouped") == 0.0  # grouped GEMMs: the default, no loop
    assert loop(1, "modules") == pytest.approx(3 * 2 * 4 * 1e-3)
    assert loop(2, "modules") == pytest.approx(loop(1, "modules") / 2)
    # Sliced fused tensors: every slice's backward writes and sums a gradient of the whole local tensor
    # (4 passes), so the traffic term falls with ep_size squared: 2x fewer slices, each 2x smaller.
    assert loop(1, "slices") == pytest.approx(3 * 2 * 4 * (1e-3 + 4 * per_layer / 1e9))
    assert loop(2, "slices") - loop(2, "modules") == pytest.approx((loop(1, "slices") - loop(1, "modules")) / 4)
    step = predict_step_time(CommShape(counts=counts, stage=1, world=2, precision="fp32", moe_layers=2, num_experts=4,
                                       accumulation=3), hw, model=ModelShape(expert_loop="slices"))
    assert step.expert_loop == pytest.approx(loop(1, "slices"))
    assert step.total == pytest.approx(step.compute + step.comm_total + step.expert_loop + step.gradient_staging)
    # The model's own blocks run at ep_size=1; AutoEP's layer replaces them above (grouped in bf16 on GPUs).
    eager = ModelShape(expert_loop="slices")
    assert (eager.loop_at(1), eager.loop_at(2)) == ("slices", "grouped")
    with pytest.raises(ValueError, match="expert_loop='eager'"):
        ModelShape(expert_loop="eager")


def test_plan_reads_how_the_model_runs_its_experts():
    import torch
    from torch import nn

    class ListMoE(nn.Module):  # the hand-written kind: a router and a ModuleList of expert MLPs
        def __init__(self) -> None:
            super().__init__()
            self.router = nn.Linear(16, 4, bias=False)
            self.experts = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16)) for _ in range(4))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.ModuleDict({"mlp": ListMoE()}) for _ in range(2))

    from transformers import MixtralConfig, MixtralForCausalLM

    def mixtral(**kwargs):
        with torch.device("meta"):
            return MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                                    **kwargs))

    assert expert_loop_of(Net()) == "modules"
    assert expert_loop_of(mixtral()) == "grouped"  # transformers 5's default: grouped GEMMs
    assert expert_loop_of(mixtral(experts_implementation="eager")) == "slices"
    assert expert_loop_of(None) == "grouped"
    # plan() charges the loop at ep_size=1 only, where the model's own blocks run (fp32: AutoEP loops too)
    common = dict(num_gpus=2, gpu_memory_bytes=GB, micro_batch=2, seq_len=8, num_experts=4, top_k=2, hidden_size=16,
                  num_layers=2, num_heads=2, ffn_hidden_size=32, vocab_size=64)
    for ep, loops in ((1, True), (2, False)):
        loop = [t.expert_loop for t in plan(Net(), ep_size=ep, precision="bf16", **common).step_times.values()]
        assert all(t > 0 for t in loop) if loops else not any(loop), (ep, loop)


def test_comm_time_is_bytes_over_bandwidth_per_group():
    # One dense tensor of 10^6 fp32 elements, ZeRO-1 on 2 ranks, no Lightning: an all-reduce of the
    # gradients (4 MB; factor 2(n-1)/n = 1), an all-gather of the parameters (4 MB; factor 1/2)
    # and the gradient-norm all-reduce (4 bytes): 2 all-reduce calls (as the ledger counts on a real
    # engine, tests/test_comm_ledger.py) and 1 all-gather.
    counts = ParamCounts((10**6,), ())
    shape = CommShape(counts=counts, stage=1, world=2, precision="fp32", lightning=False)
    hw = Hardware(intra=Link(bandwidth=1e9, latency=1e-3), inter=Link(bandwidth=1e6, latency=1.0))
    step = predict_step_time(shape, hw, gpus_per_node=2)
    assert step.comm[("all_reduce", "world")] == pytest.approx((4e6 + 4) / 1e9 + 2 * 1e-3)
    assert step.comm[("all_gather", "world")] == pytest.approx(4e6 * 0.5 / 1e9 + 1e-3)
    assert step.total == pytest.approx(step.compute + step.comm_total + step.gradient_staging)
    # The same on 2 nodes of 1 GPU: the world group spans nodes, so the inter-node link.
    across = predict_step_time(shape, hw, gpus_per_node=1)
    assert across.comm[("all_gather", "world")] == pytest.approx(4e6 * 0.5 / 1e6 + 1.0)
    # Measured links per collective replace the intra-node link (gloo on CPU), not the inter-node one.
    gloo = Hardware(intra=Link(1e9, 0.0), collective_links=(("all_gather", Link(1e8, 0.0)),))
    assert predict_step_time(shape, gloo, gpus_per_node=2).comm[("all_gather", "world")] == pytest.approx(2e6 / 1e8)
    by_size = Hardware(intra=Link(1e9, 0.0), collective_links=(("all_gather", Link(1e8, 0.0)),
                                                               ("all_gather/2", Link(1e7, 0.0))))
    assert predict_step_time(shape, by_size, gpus_per_node=2).comm[("all_gather", "world")] == pytest.approx(2e6 / 1e7)
    assert [bus_factor(c, 4) for c in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")] \
        == [1.5, 0.75, 0.75, 0.75, 1.0]


def test_gradient_staging_is_once_per_step_at_stage_1_and_once_per_micro_batch_above():
    # 10^6 dense and 8 x 10^6 expert elements, bf16 gradients (2 bytes), 4 micro-batches, 1 GB/s.
    counts = ParamCounts((10**6,), (8 * 10**6,))
    hw = Hardware(gradient_staging_bandwidth=1e9)

    def step(stage: int, ep: int):
        return predict_step_time(CommShape(counts=counts, stage=stage, world=8, ep_size=ep, precision="bf16",
                                           moe_layers=1, num_experts=8, accumulation=4), hw)

    # A rank stages every dense gradient and the whole gradients of its own experts.
    assert step(1, 1).gradient_staging == pytest.approx(9e6 * 2 / 1e9)
    assert step(2, 1).gradient_staging == step(3, 1).gradient_staging == pytest.approx(4 * 9e6 * 2 / 1e9)
    assert step(2, 8).gradient_staging == pytest.approx(4 * 2e6 * 2 / 1e9)  # one expert per rank
    for stage in (1, 2, 3):
        t = step(stage, 2)
        assert t.total == pytest.approx(t.compute + t.comm_total + t.gradient_staging + t.zero3_host)
    # The GPU default: about 4 bytes of HBM traffic per gradient byte at 4 TB/s.
    assert Hardware().gradient_staging_bandwidth == pytest.approx(Hardware().memory_bandwidth / 4)


def test_groups_span_nodes_as_deepspeed_places_ranks():
    # 16 GPUs, 8 per node: expert-parallel groups are 8 consecutive ranks (one node); the expert-data-
    # parallel groups {j, j+8} and the world group cross nodes. ep_size=16 crosses with its all-to-all.
    assert not spans_nodes("expert_parallel", 16, 8, 8)
    assert spans_nodes("expert_data_parallel", 16, 8, 8) and spans_nodes("world", 16, 8, 8)
    assert spans_nodes("expert_parallel", 16, 16, 8)
    assert not spans_nodes("world", 8, 8, 8)
    counts = ParamCounts((10**6,), (8 * 10**6,))
    shape = CommShape(counts=counts, stage=2, world=16, ep_size=8, hidden_size=64, moe_layers=1, num_experts=8,
                      tokens_per_micro_batch=128, lightning=False)
    hw = Hardware(intra=Link(100e9, 0.0), inter=Link(10e9, 0.0))
    step = predict_step_time(shape, hw, gpus_per_node=8)
    sizes = predict(shape).bytes
    assert step.comm[("all_to_all", "expert_parallel")] == pytest.approx(
        sizes[("all_to_all", "expert_parallel")] * 7 / 8 / 100e9)
    assert step.comm[("all_reduce", "expert_data_parallel")] == pytest.approx(
        sizes[("all_reduce", "expert_data_parallel")] * 1 / 10e9)


def test_offload_adds_pcie_and_cpu_adam_time():
    counts = ParamCounts((8 * 10**6,), ())
    hw = Hardware(intra=Link(1e12, 0.0), pcie_bandwidth=1e9, cpu_adam_params_per_second=1e7,
                  update_params_per_second=1e10)
    shape = CommShape(counts=counts, stage=2, world=8, precision="bf16", lightning=False)
    on_device = predict_step_time(shape, hw)
    offloaded = predict_step_time(shape, hw, offload_optimizer=True)
    # 10^6 elements per rank: fp32 gradients to the host (4 B) and bf16 parameters back (2 B), CPU Adam.
    assert offloaded.offload == pytest.approx(10**6 * 6 / 1e9 + 10**6 / 1e7)
    assert on_device.compute == pytest.approx(10**6 / 1e10) and offloaded.compute == 0
    assert offloaded.comm == on_device.comm


def plan_1b(gb: float, **kw):
    # 10^9 dense bf16 parameters on 8 GPUs; links chosen so that the ladder's comm differs.
    return plan(dense_params=10**9, num_gpus=8, gpu_memory_bytes=gb * GB, headroom=0.0, bucket_elements=0,
                hardware=Hardware(intra=Link(100e9, 1e-5)), **kw)


def test_recommend_picks_the_fastest_setup_that_fits_and_says_why():
    p = plan_1b(6)
    times = {s: p.step_times[s].total for s in LADDER}
    fitting = [s for s in LADDER if p.fits(s)]
    best = min(fitting, key=lambda s: (times[s], s))
    rec = p.recommend()
    assert rec.setup == best
    # ZeRO-1 and ZeRO-2 move the same bytes in the same calls at accumulation 1: a tie, not an order.
    assert times[LADDER[0]] == times[LADDER[1]]
    # The reason line: memory per rank, predicted step time, the runner-up.
    runner = sorted((s for s in fitting if s != best), key=lambda s: (times[s], s))[0]
    assert f"{best.label}: {p.device_bytes(best) / GB:.1f} GB per GPU" in rec.reason
    assert "predicted step" in rec.reason and f"runner-up {runner.label}" in rec.reason
    # When the fastest does not fit, the next fastest that does.
    tight = plan_1b(p.device_bytes(best) / GB * 0.99)
    assert tight.recommend().setup != best and tight.recommend().setup is not None
    assert f"{best.label} needs" in tight.recommend().reason


def test_ties_go_to_the_lower_stage():
    # With all comm free and no compute, every on-device setup takes the same time: ZeRO-1 wins.
    free = Hardware(intra=Link(float("inf"), 0.0), update_params_per_second=float("inf"))
    p = plan(dense_params=10**6, num_gpus=8, gpu_memory_bytes=GB, bucket_elements=0, hardware=free)
    rec = p.recommend()
    assert rec.setup == Setup(0, 1) and "a tie: the less aggressive setup wins" in rec.reason
    assert choose_stage(None, world_size=8, devices_per_node=8, ep_size=1, device_memory_bytes=GB,
                        dense_params=10**6, bucket_elements=0, hardware=free)[0] == 1


def test_choose_stage_never_offloads_and_choose_setup_picks_ep_size_by_time():
    counts = ParamCounts((10**8,), (8 * 10**8,))
    common = dict(counts=counts, num_experts=8, top_k=2, hidden_size=1024, num_layers=4, num_heads=8,
                  ffn_hidden_size=4096, vocab_size=32000, micro_batch=1, seq_len=1024, bucket_elements=0)
    stage, why = choose_stage(None, world_size=8, devices_per_node=8, ep_size=8, device_memory_bytes=80 * GB, **common)
    assert stage in (1, 2, 3) and "predicted step" in why and "runner-up" in why
    stage, ep, why = choose_setup(None, world_size=8, devices_per_node=4, ep_sizes=[1, 2, 4, 8],
                                  device_memory_bytes=80 * GB, **common)
    times = {}
    for e in (1, 2, 4):  # 8 would cross the 4-GPU nodes: not a candidate
        p = plan(num_gpus=8, gpus_per_node=4, ep_size=e, gpu_memory_bytes=80 * GB, **common)
        times[e] = min(p.step_times[s].total for s in LADDER if p.fits(s) and not s.offload_optimizer)
    assert ep == min(times, key=times.get) and f"ep_size={ep}, stage={stage}" in why


def test_ep_size_auto_on_the_strategy(caplog):
    """``ZeroMoEStrategy(ep_size="auto", stage="auto")`` on 2 CPU ranks runs what the planner predicts
    fastest for the tiny model (candidates 1 and 2: both divide its 4 experts and the world), and
    logs why; the stage is the one ``choose_stage`` answers at that ep_size."""
    import logging
    import os

    from support.modules import prepared

    from lightning_zeromoe.reference.models import TinyMoEModule

    module = TinyMoEModule()
    with caplog.at_level(logging.INFO):
        strategy = prepared(module, ep_size="auto", stage="auto")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2
    precision = str(strategy.precision_plugin.precision)
    stage, ep, _ = choose_setup(module, 2, 2, [1, 2], memory, precision)
    assert (strategy.resolved.ep_size, strategy.resolved.stage) == (ep, stage)
    assert choose_ep_size(module, [4, 4], 2, 2, memory, precision)[0] == ep
    assert "ep_size='auto'" in caplog.text and f"ep_size={ep}, stage={stage} chosen by the planner" in caplog.text
    # With a fixed stage, the fastest ep_size where that stage fits.
    fixed = prepared(TinyMoEModule(), ep_size="auto", stage=3)
    assert fixed.resolved.stage == 3
    times = {e: plan(module, num_gpus=2, ep_size=e, gpu_memory_bytes=memory, precision=precision).step_times[LADDER[2]]
             .total for e in (1, 2)}
    assert fixed.resolved.ep_size == min(times, key=lambda e: (times[e], e))


def test_ep_size_auto_keeps_every_expert_group_on_one_node_when_few_divisors_are_shared():
    """160 experts (MiniCPM5-MoE) on 40 GPUs of 8 per node: 5 divides both, but groups of 5
    consecutive ranks (5-9, ...) cross nodes, so it is no candidate; 384 experts (Kolibri-1.1) on 24
    GPUs: neither 3 nor 6 (ranks 6-8, 6-11). Measured before the fix: [1, 2, 4, 5, 8] and
    [1, 2, 3, 4, 6, 8] were the candidates."""
    for experts, world, candidates in ((160, 40, [1, 2, 4, 8]), (384, 24, [1, 2, 4, 8]), (384, 12, [1, 2, 3, 6])):
        per_node = 8 if world != 12 else 6
        counts = ParamCounts((10**8,), (experts * 10**6,))
        common = dict(counts=counts, top_k=6, hidden_size=1024, num_layers=4, num_heads=8,
                      ffn_hidden_size=4096, vocab_size=32000, micro_batch=1, seq_len=1024, bucket_elements=0)
        for stage in (None, 3):
            ep, why = choose_ep_size(None, [experts], world, per_node, 80 * GB, stage=stage, **common)
            assert experts % ep == 0 and world % ep == 0 and ep in candidates, (experts, world, ep)
            assert f"from ep_size in {candidates}" in why or f"from {candidates}" in why, why
