"""The reproductions fail for real, and their fixes work for real: each test asserts the outcome.

* ``oom``: the unchanged step raises the allocator's own error under an OS-enforced limit, and a
  later rung of the ladder fits under the same limit;
* ``router_collapse``: without the fix one expert passes 50% of tokens, with it no expert does;
* ``native_moe_zero3``: DeepSpeed's own AssertionError, then ZeRO-2 trains (the loss falls);
* the ZeRO-3 pitfalls on 2 CPU ranks: what plain DeepSpeed shows, then what the handling reports.

The measured numbers are printed (``pytest -s``) so a run documents them.

Why a module fixture starts them all at once: the OOM ladder, the native-MoE run and the two
pitfall ranks are child processes that spend most of their wall time importing torch and
DeepSpeed; run side by side (threads waiting on children, the router runs in this process
meanwhile) the module takes about as long as its slowest reproduction. Every reproduction keeps
its result for the process, so the tests below, and the widget tests after them, read it back.
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest


@pytest.fixture(scope="module", autouse=True)
def run_all_reproductions_side_by_side():
    from troubleshooter.repro import collective_timeout, native_moe_zero3, oom, pitfalls, router_collapse

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=4) as pool:
        jobs = [pool.submit(oom), pool.submit(native_moe_zero3), pool.submit(pitfalls.run_all),
                pool.submit(collective_timeout)]
        router_collapse()
        for job in jobs:
            job.exception()  # failures are reported by the test that reads that reproduction
    print(f"\nall reproductions: {time.perf_counter() - start:.1f} s wall")



def test_importing_repro_is_light():
    code = ("import sys, troubleshooter.repro as r; r.OOM_LADDER; "
            "print([m for m in ('torch', 'deepspeed', 'lightning', 'lightning_zeromoe.reference.models') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_oom_really_raises_then_the_ladder_fits():
    """Every rung is measured the same way: without the limit (what it needs, its loss) and under it."""
    from troubleshooter.repro import oom

    result = oom()
    print("\n" + result.summary())
    names = [r.name for r in result.rungs]
    assert names == ["measure", "micro-batch down, accumulation up", "activation checkpointing",
                     "ZeRO stage up", "offload"]
    base, half, ckpt = result.rungs[:3]
    assert base.needs_mb > 2 * result.budget_mb, "the baseline must really need more than the limit"
    assert result.raised and "can't allocate memory" in base.error
    assert half.needs_mb < base.needs_mb and not half.fits and half.oom, "halving alone is not enough here"
    assert result.outcome(half) == "out of memory; next: activation checkpointing"
    fitted = result.fitted
    assert fitted is ckpt and ckpt.fits and ckpt.needs_mb < result.budget_mb
    assert result.outcome(ckpt) == "fits"
    # same global batch: each rung's unlimited step computes the same loss, rounded for people
    assert half.loss == pytest.approx(base.loss, abs=1e-3) and ckpt.loss == pytest.approx(base.loss, abs=1e-3)
    assert all(r.loss == round(r.loss, 4) and r.needs_mb == round(r.needs_mb, 1) for r in result.rungs[:3])
    assert [r.ran for r in result.rungs[3:]] == [False, False]
    assert [result.outcome(r) for r in result.rungs[3:]] == ["not needed", "not needed"]
    assert len(result.figure().axes[0].patches) == 3
    assert result.figure()._repr_png_().startswith(b"\x89PNG"), "a notebook must show the figure as an image"


def test_oom_rejects_an_unknown_device():
    from troubleshooter.repro import oom

    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        oom(device="tpu")


def test_router_collapses_without_the_fix_and_stays_balanced_with_it():
    from troubleshooter.repro import router_collapse
    from troubleshooter.repro.router import COLLAPSE, TOP_K

    result = router_collapse()
    print("\n" + result.summary())
    assert result.collapsed and result.without_fix.worst > COLLAPSE
    assert result.collapse_step is not None and result.collapse_step < len(result.without_fix.shares)
    assert result.balanced and result.with_fix.worst < result.bound == 0.5
    # bias balancing alone (no aux loss) undoes the collapse: below 50% over the whole second half
    bias = result.bias_balanced
    assert max(bias.max_share[len(bias.max_share) // 2:]) < COLLAPSE < result.without_fix.max_share[-1]
    assert bias.bias and any(b != 0 for b in bias.bias) and result.z_loss.z[-1] > 0
    for run in result.runs:
        assert len(run.shares) == len(run.task) == len(run.aux) == len(run.z)
        assert all(sum(step) == pytest.approx(TOP_K) for step in run.shares)  # every token picks 2 experts
    bars, lines, losses = result.figure().axes
    assert len(bars.patches) == 5 * len(result.with_fix.shares[-1])  # each expert's load, per run
    assert len(lines.lines) >= 5 and len(losses.lines) == 5  # the busiest expert, and the task loss beside it


def test_router_runs_are_deterministic():
    from troubleshooter.repro import router

    first = router.train_shares(0.0, steps=4, seed=3)
    router._RUNS.clear()
    second = router.train_shares(0.0, steps=4, seed=3)
    assert first is not second and first.shares == second.shares and first.task == second.task


def test_native_moe_is_refused_under_zero3_and_trains_under_zero2():
    from troubleshooter.repro import native_moe_zero3

    result = native_moe_zero3()
    print("\n" + result.summary())
    assert result.refused and result.error_type == "AssertionError"
    assert "Native DeepSpeed MoE is not supported with ZeRO Stage 3" in result.error_message
    assert "_validate_zero3_moe_compatibility" in result.error_traceback
    assert result.diagnosis()[0].entry_id == "native-moe-zero3"  # the knowledge base recognises it
    assert result.fix_stage == 2 and result.trained


@pytest.fixture(scope="module")
def pitfalls():
    from troubleshooter.repro import pitfalls as module

    return module


def test_tied_weights_plain_deepspeed_then_handled(pitfalls):
    result = pitfalls.tied_weights()
    print("\n" + repr(result))
    raw = result.raw
    assert raw["tie_kept"] and raw["shape_outside"] == [0]
    assert "must be 2-D" in raw["outside_forward"]  # knowledge entry zero3-param-not-available
    assert ["embed.weight", "lm_head.weight"] in raw["tied"] and raw["broken"] == []
    assert raw["shape_gathered"] == [128, 64] and raw["embedding_inside_gather"] == [2, 8, 64]


def test_stale_param_copy_is_silent_then_reported(pitfalls):
    result = pitfalls.stale_param_copy()
    print("\n" + repr(result))
    plain = result.raw["plain"]
    assert plain["cached_weight_change"] == 0.0 and plain["other_weight_change"] > 0
    assert plain["cache_numel"] == plain["full_numel"] > plain["partition_numel"]
    assert result.raw["stale"] == ["cached.weight"] and result.raw["aliases"] == ["cached.cache"]
    assert not result.raw["hooks_left"]


def test_device_move_is_stopped_by_the_guard(pitfalls):
    result = pitfalls.device_move()
    print("\n" + repr(result))
    handled = result.raw["handled"]
    assert handled["outcome"].startswith("ZeroDeviceMoveError")
    assert ".double()" in handled["message"] and "proj" in handled["message"]
    assert result.raw["plain"]["outcome"] != handled["outcome"]


def test_expert_group_ignores_the_world_timeout_until_the_strategy_applies_it():
    """Without the fix rank 0 waits until the stuck rank leaves (15 s, and would wait the 30-min
    gloo default), far past the 4 s world timeout; with it, gloo times out after ~4 s."""
    from troubleshooter.repro import collective_timeout

    result = collective_timeout()
    print(f"\ncollective timeout: before {result.before}; after {result.after}")
    assert result.before.world_timeout == 4.0 and result.before.expert_group_timeout == 1800.0
    assert result.before.waited >= 0.9 * result.stuck_for and not result.before.timed_out
    assert result.after.expert_group_timeout == 4.0 and result.after.timed_out
    assert result.after.waited < 4.0 + 6.0
