"""The memory planner: the ZeRO paper's formulas, Mixtral-8x7B's real counts, the recommendation
ladder, and a measured check against what DeepSpeed engines actually hold on 1, 2 and 4 CPU ranks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support.jobs import REPO, read_ranks, run_job
from lightning_zeromoe import planner
from lightning_zeromoe.planner import GB, MIXTRAL_8X7B, choose_stage, moe_transformer_counts, plan

# --------------------------------------------------------------------------------- pure formulas


def test_zero_paper_figure_1_numbers():
    """ZeRO paper (Rajbhandari et al. 2020), Fig. 1: Psi = 7.5B, N = 64, mixed-precision Adam:
    120 GB baseline, 31.4 GB (P_os), 16.6 GB (P_os+g), 1.9 GB (P_os+g+p)."""
    p = plan(dense_params=7_500_000_000, num_gpus=64, gpu_memory_bytes=80 * GB, precision="bf16")
    got = [p.estimate(s).device_total / GB for s in (1, 2, 3)]
    assert got == pytest.approx([31.40625, 16.640625, 1.875])
    psi, n = 7.5e9, 64
    assert got == pytest.approx([(4 * psi + 12 * psi / n) / GB, (2 * psi + 14 * psi / n) / GB, 16 * psi / n / GB])


@pytest.mark.parametrize("world,ep", [(8, 1), (8, 2), (8, 8), (16, 8), (4, 4)])
def test_experts_divide_by_their_own_groups(world, ep):
    """Experts: Psi_e / ep per rank, ZeRO-partitioned over world / ep replicas; dense over world."""
    dense, expert = 1_000_000_000, 8_000_000_000
    p = plan(dense_params=dense, expert_params=expert, num_gpus=world, gpu_memory_bytes=80 * GB, ep_size=ep)
    local, edp = expert / ep, world // ep
    want = {
        1: 4 * dense + 12 * dense / world + 4 * local + 12 * local / edp,
        2: 2 * dense + 14 * dense / world + 2 * local + 14 * local / edp,
        3: 16 * dense / world + 16 * local / edp,
    }
    for stage, bytes_ in want.items():
        est = p.estimate(stage)
        assert est.device_total == pytest.approx(bytes_)
        assert est.dense + est.expert == pytest.approx(bytes_)
    # ZeRO-3 sees through EP: 16 Psi / N whatever the ep_size.
    assert p.estimate(3).device_total == pytest.approx(16 * (dense + expert) / world)


def test_fp32_costs_20_bytes_per_param_and_offload_moves_states_to_host():
    p = plan(dense_params=10**9, num_gpus=4, gpu_memory_bytes=80 * GB, precision="32-true")
    assert p.estimate(3).device_total == pytest.approx(20 * 10**9 / 4)
    off = p.estimate(3, offload_optimizer=True)
    assert off.device_total == pytest.approx(4 * 10**9 / 4)  # only the fp32 parameter partition stays
    assert off.host == pytest.approx(16 * 10**9 / 4)  # master, Adam m and v, gradient partition
    both = p.estimate(3, offload_optimizer=True, offload_parameters=True)
    assert both.device_total == 0 and both.host == pytest.approx(20 * 10**9 / 4)


def test_mixtral_8x7b_counts_match_transformers_model():
    """The hand-written count equals the real Hugging Face Mixtral built on the meta device."""
    counts = moe_transformer_counts(**MIXTRAL_8X7B)
    assert counts.total == 46_702_792_704
    assert counts.expert_total == 8 * 32 * 3 * 4096 * 14336 == 45_097_156_608
    assert counts.dense_total == 1_605_636_096
    import torch
    import transformers
    config = transformers.MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                        num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(config)
    real = planner.count_params(model)
    assert (real.dense_total, real.expert_total) == (counts.dense_total, counts.expert_total)
    assert sorted(real.expert) == sorted(counts.expert)


def test_mixtral_8x7b_on_8x80gb():
    """ZeRO-3 model states are 16 * 46.7B / 8 = 93.4 GB per GPU whatever ep_size is: over 80 GB.
    So the plan reaches for offload. With EP=8, ZeRO-2 + offload fits too, but by predicted step
    time ZeRO-3 + offload wins: both are dominated by CPU Adam over the same partition, and stage 3
    moves 16-bit gradient partitions over PCIe where stages 1/2 copy fp32 ones."""
    counts = moe_transformer_counts(**MIXTRAL_8X7B)
    common = dict(counts=counts, num_gpus=8, gpus_per_node=8, gpu_memory_bytes=80 * GB, precision="bf16-mixed")
    for ep in (1, 2, 8):
        p = plan(ep_size=ep, **common)
        assert p.estimate(3).device_total / GB == pytest.approx(16 * counts.total / 8 / GB)
        assert not any(p.fits(s) for s in planner.LADDER if not s.offload_optimizer)
    assert plan(ep_size=1, **common).recommend().setup.label == "ZeRO-3 + offload optimizer"
    p8 = plan(ep_size=8, **common)
    rec = p8.recommend()
    z2, z3 = (next(s for s in planner.LADDER if s.label == f"ZeRO-{k} + offload optimizer") for k in (2, 3))
    assert p8.fits(z2) and rec.setup == z3, rec.reason
    assert p8.step_times[z3].offload < p8.step_times[z2].offload
    assert "ZeRO-3 needs 93.6 GB" in rec.reason and "host memory" in rec.reason and "predicted step" in rec.reason
    # Host memory bounds offload: 12 bytes/param of master + Adam for all 46.7B params, per node.
    tight = plan(ep_size=1, host_memory_bytes=256 * GB, **common).recommend()
    assert tight.setup is None and "Nothing fits" in tight.reason


def test_recommend_takes_the_fastest_setup_that_fits():
    """One dense tensor of 10^9 bf16 parameters on 8 GPUs (no ZeRO-3 regathering, one module): ZeRO-3's
    gather + reduce-scatter move fewer bytes than ZeRO-1/2's all-reduce + gather, so it is predicted
    fastest wherever it fits; ZeRO-1 and ZeRO-2 tie (the lower stage is named first)."""
    psi = 10**9  # 16 GB of model states at ZeRO-0, bf16
    def rec(gb, **kw):
        return plan(dense_params=psi, num_gpus=8, gpu_memory_bytes=gb * GB, headroom=0.0,
                    bucket_elements=0, **kw).recommend()
    assert rec(6).setup.label == "ZeRO-3" and "runner-up ZeRO-1" in rec(6).reason
    assert rec(3).setup.label == "ZeRO-3"  # 2 GB
    assert rec(1.5).setup.label == "ZeRO-3 + offload optimizer"  # 0.25 GB of parameter partitions
    assert rec(0.1).setup.label == "ZeRO-3 + offload optimizer + offload params"
    # What the user asked for, against the choice.
    assert "You asked for ZeRO-3 + offload optimizer: it fits, predicted" in rec(6, stage=3, offload_optimizer=True).reason
    assert "You asked for ZeRO-1, which does not fit (5.5 GB)" in rec(3, stage=1).reason
    with pytest.raises(ValueError, match="offload_parameters needs stage 3"):
        rec(6, stage=2, offload_parameters=True)


def test_activation_estimate_keeps_korthikantis_score_term_without_flash_attention():
    """Without flash attention the score matrices are kept: Korthikanti et al.'s 5as^2b bytes
    (16-bit) per layer on top of the flash estimate; checkpointing keeps far less."""
    s, b, h, a = 2048, 1, 4096, 32
    common = dict(micro_batch=b, seq_len=s, hidden_size=h, num_layers=1, num_heads=a, ffn_hidden_size=14336,
                  top_k=2, vocab_size=1)
    flash = planner.estimate_activations(**common)
    eager = planner.estimate_activations(**common, flash_attention=False)
    assert eager.per_layer - flash.per_layer == pytest.approx(5 * a * s * s * b)
    full = planner.estimate_activations(micro_batch=1, seq_len=4096, hidden_size=4096, num_layers=32,
                                        num_heads=32, ffn_hidden_size=14336, top_k=2, vocab_size=32000)
    ckpt = planner.estimate_activations(micro_batch=1, seq_len=4096, hidden_size=4096, num_layers=32,
                                        num_heads=32, ffn_hidden_size=14336, top_k=2, vocab_size=32000,
                                        activation_checkpointing=True)
    assert ckpt.total < full.total / 10


def test_choose_stage_on_a_real_module():
    import torch
    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoELM

    torch.manual_seed(0)
    model = TinyMoELM(TinyMoEConfig())  # ~200k params: 4 MB of fp32 weights
    stage, reason = choose_stage(model, world_size=2, devices_per_node=2, ep_size=2, device_memory_bytes=16 * GB,
                                 precision="32-true", bucket_elements=0)
    # ZeRO-3's host work per module outweighs the few bytes it saves on this tiny model; ZeRO-1 and
    # ZeRO-2 tie, and the lower stage wins.
    assert stage == 1 and "runner-up ZeRO-2" in reason and "a tie" in reason, reason
    stage, reason = choose_stage(model, world_size=2, devices_per_node=2, ep_size=1, device_memory_bytes=2.2e6,
                                 precision="32-true", bucket_elements=0, headroom=0.0)
    assert stage == 3 and "ZeRO-1 needs" in reason and "ZeRO-2 needs" in reason
    with pytest.raises(ValueError, match="must divide"):
        plan(model, num_gpus=3, ep_size=3, gpu_memory_bytes=GB)


def test_planner_is_a_pure_module():
    code = ("import sys, lightning_zeromoe.planner as p, lightning_zeromoe as z; assert z.plan is p.plan; "
            "print(sorted(m for m in ('torch', 'deepspeed', 'lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"


def test_cli_prints_the_mixtral_table():
    out = subprocess.run([sys.executable, "-m", "lightning_zeromoe.planner", "--mixtral-8x7b"], capture_output=True,
                         text=True, cwd=REPO, check=True).stdout
    assert "46,702,792,704 parameters" in out and "| ZeRO-3 | 11.7 | 11.7 | 23.4 | 46.7 | 93.4 |" in out


# --------------------------------------------------------------------------------- measured

#: (world size, "stage:ep" pairs). EP=2 needs 2 ranks; world 1 has no partitioning, so stages 1 and
#: 2 coincide there. Stage 3 is the strategy's default; stages 1/2 check the non-partitioned params.
RUNS = {1: "1:1,3:1", 2: "1:1,2:1,3:1,1:2,2:2,3:2", 4: "1:1,2:1,3:1,1:2,2:2,3:2"}
TOLERANCE = 0.02


@pytest.fixture(scope="module", params=sorted(RUNS), ids=lambda w: f"world{w}")
def measured(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"states{world}")
    run_job("planner_states.py", "--out", str(out), "--world", str(world), "--configs", RUNS[world], timeout=600)
    return world, read_ranks(out, world)


def _tiny_model():
    import torch

    from jobs.planner_states import MODEL
    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoELM

    torch.manual_seed(0)
    return TinyMoELM(TinyMoEConfig(**MODEL))


def test_planner_matches_what_each_rank_holds(measured):
    world, ranks = measured
    model = _tiny_model()
    report = []
    for rank in ranks:
        for run in rank["runs"]:
            stage, ep = run["stage"], run["ep_size"]
            est = plan(model, num_gpus=world, ep_size=ep, precision="32-true", gpu_memory_bytes=GB).estimate(stage)
            held = run["after_step"]
            pairs = {"params": (held["params"], est.params), "master": (held["master_params"], est.master),
                     "optimizer": (held["optimizer_states"], est.optimizer)}
            if stage == 3:  # persistent gradient partitions
                pairs["grads"] = (held["grads"], est.grads)
            for what, (actual, planned) in pairs.items():
                report.append(f"rank{rank['rank']} stage{stage} ep{ep} {what}: held {actual} planned {planned:.0f}")
                assert actual == pytest.approx(planned, rel=TOLERANCE), report[-1]
            if stage < 3:
                # Stages 1/2 hold gradients only between backward and step: at least this rank's
                # reduced partition (the stage-2 figure), at most the full gradients (stage 1).
                grads = run["after_backward"]["grads"]
                low = plan(model, num_gpus=world, ep_size=ep, precision="32-true", gpu_memory_bytes=GB).estimate(2)
                assert low.grads * (1 - TOLERANCE) <= grads <= est.params * (1 + TOLERANCE), (stage, ep, grads)
    print("\n".join(report))


def test_the_measured_check_can_tell_precisions_apart(measured):
    """The 16-bytes-per-parameter rule of thumb (bf16) would fail the 2% check on fp32 engines."""
    world, ranks = measured
    model = _tiny_model()
    run = next(r for r in ranks[0]["runs"] if r["stage"] == 3)
    held = sum(run["after_step"].values())
    bf16 = plan(model, num_gpus=world, ep_size=run["ep_size"], precision="bf16", gpu_memory_bytes=GB).estimate(3)
    assert abs(held - bf16.device_total) / held > 0.15


# ------------------------------------------------------------------------------ measured, bf16

#: Hidden and expert sizes x8 of the fp32 runs' model (5.8 M elements per rank): large enough for
#: the optimizer step's transient memory to stand out from the allocator's noise.
BF16_SCALE = 8


@pytest.fixture(scope="module", params=("bf16-true", "bf16-mixed"))
def measured_bf16(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"states_{request.param}")
    run_job("planner_states.py", "--out", str(out), "--world", "2", "--configs", "3:1,3:2",
            "--precision", request.param, "--scale", str(BF16_SCALE), timeout=600)
    return request.param, read_ranks(out, 2)


def test_planner_bf16_matches_what_each_rank_holds_and_the_step_peak(measured_bf16):
    """bf16-true and bf16-mixed engines hold 2 (bf16 weights) + 2 (bf16 gradient partitions) + 4
    (fp32 master) + 8 (Adam) = 16 bytes per partitioned element, as planned; the first step's
    growth is the Adam states plus the step transient the planner models (a flattened bf16 gradient
    and its fp32 copy) at least; torch's Adam scratch and allocator slack come on top."""
    import torch

    from jobs.planner_states import model_dims
    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoELM

    precision, ranks = measured_bf16
    torch.manual_seed(0)
    model = TinyMoELM(TinyMoEConfig(**model_dims(BF16_SCALE)))
    report = []
    for rank in ranks:
        for index, run in enumerate(rank["runs"]):
            assert run["param_dtypes"] == ["torch.bfloat16"], (precision, run["param_dtypes"])
            est = plan(model, num_gpus=2, ep_size=run["ep_size"], precision=precision,
                       gpu_memory_bytes=GB).estimate(3)
            held = run["after_step"]
            pairs = {"params": (held["params"], est.params), "grads": (held["grads"], est.grads),
                     "master": (held["master_params"], est.master),
                     "optimizer": (held["optimizer_states"], est.optimizer)}
            for what, (actual, planned) in pairs.items():
                report.append(f"{precision} rank{rank['rank']} ep{run['ep_size']} {what}: held {actual} "
                              f"planned {planned:.0f}")
                assert actual == pytest.approx(planned, rel=TOLERANCE), report[-1]
            if index > 0:
                # A later engine in the same process reuses the heap the first one freed: its
                # growth says nothing about what a step needs. Only the first run is a measurement.
                continue
            grown, planned = run["step_peak_bytes"], est.optimizer + est.step_transient
            report.append(f"{precision} rank{rank['rank']} ep{run['ep_size']} first step grew {grown} "
                          f"planned {planned:.0f} ({grown / planned:.2f}x)")
            # A loose lower bound only: the resident set grows past what the step needs (allocator
            # slack), and can also grow less when the step reuses heap that engine setup freed
            # (measured 0.91x-1.46x across runs on a shared machine; a fresh CI run gave 0.91x).
            assert grown >= 0.8 * planned, report[-1]
    print("\n".join(report))
