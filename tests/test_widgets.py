"""Walkthroughs driven the way a user drives them: ``button.click()`` on Next, the check and Try it,
then assertions on the state and on the numbers the widgets show.

The content must come from the knowledge base, so the tests compare what a step shows with the
entry's own fix text; the checks are real calls (lint, doctor, explain, the reproductions).
"""

from __future__ import annotations

import html
import json

import pytest

from troubleshooter import knowledge
from troubleshooter.explain import explain_text
from troubleshooter.walkthroughs import (BUILDERS, WALKTHROUGH_FOR, DiagnosisPanel, UserContext, config_diff,
                                         merge_patch, walkthrough)

OOM_LADDER_TITLES = ["Measure before changing anything", "Micro-batch down, gradient accumulation up",
                     "Activation checkpointing", "ZeRO stage up", "Offload, last"]


def test_merge_patch_follows_rfc_7386():
    target = {"a": "b", "c": {"d": "e", "f": "g"}}
    assert merge_patch(target, {"a": "z", "c": {"f": None}}) == {"a": "z", "c": {"d": "e"}}
    assert merge_patch({"a": [1, 2]}, {"a": [3]}) == {"a": [3]}
    assert merge_patch({"a": {"b": 1}}, {"a": 5}) == {"a": 5}
    assert target == {"a": "b", "c": {"d": "e", "f": "g"}}, "the input must not change"


def test_config_diff_shows_only_what_the_patch_changes():
    diff = config_diff({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}},
                       {"zero_optimization": {"stage": 3}})
    changed = [line for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert changed == ['-    "stage": 2', '+    "stage": 3']


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_every_walkthrough_shows_knowledge_base_text_and_a_diff_and_navigates(family):
    walk = walkthrough(family)
    assert walk.index == 0 and walk.back_button.disabled
    for i, step in enumerate(walk.steps):
        assert walk.index == i
        shown = html.unescape(walk.what.value)
        assert step.fixes, f"{family} step {i + 1} cites no fix"
        for fix_id in step.fixes:  # cited by id; a renamed or removed fix id fails here
            assert knowledge.fix(step.entry, fix_id).text in shown, f"{family} step {i + 1}: {step.entry}/{fix_id}"
        assert "troubleshooter-diff" in walk.patch_view.value
        assert "color:#1b5e20" in walk.patch_view.value, f"{family} step {i + 1}: the fix adds no line"
        assert walk.try_button.disabled == (step.try_it is None)
        if i < len(walk.steps) - 1:
            walk.next_button.click()
    assert walk.next_button.disabled
    walk.back_button.click()
    assert walk.index == len(walk.steps) - 2


def test_oom_walkthrough_follows_the_ladder_and_try_it_shows_before_and_after():
    walk = walkthrough("oom")
    assert [s.title for s in walk.steps] == OOM_LADDER_TITLES
    assert "example" in walk.header.value and "No DeepSpeed config was found" in walk.header.value
    walk.next_button.click()
    assert '"train_micro_batch_size_per_gpu": 8' in html.unescape(walk.patch_view.value)
    walk.check_button.click()  # lints the patched config for real
    assert walk.outcomes[1].ok and walk.outcomes[1].numbers["errors"] == 0
    walk.try_button.click()  # micro-batch halved: measured both ways, still does not fit, says what is next
    tried = walk.tries[1]
    assert tried.before["under the limit"].startswith("out of memory; next: micro-batch")
    assert tried.after["under the limit"] == "out of memory; next: activation checkpointing"
    assert tried.after["needs MiB (no limit)"] < tried.before["needs MiB (no limit)"]
    shown = html.unescape(walk.try_output.value)
    assert "- vs -" not in shown and "(-" not in shown
    assert tried.before["loss of the step (no limit)"] in shown and "the same within 1e-3" in shown
    walk.next_button.click()
    assert walk.step.title == "Activation checkpointing"
    walk.try_button.click()
    tried = walk.tries[2]
    assert tried.before["under the limit"].startswith("out of memory") and tried.after["under the limit"] == "fits"
    assert tried.after["needs MiB (no limit)"] < tried.after["limit MiB"] < tried.before["needs MiB (no limit)"]
    assert "<img" in walk.try_output.value  # the ladder's picture, inline
    walk.next_button.click()  # ZeRO stage up: no reproduction on 1 process, says so
    assert walk.try_button.disabled and "data-parallel ranks" in walk.try_output.value


def test_host_ram_oom_gets_the_host_walkthrough():
    walk = walkthrough("oom", context=UserContext(entry_id="cpu-oom"))
    assert walk.title == "Out of memory (host RAM)"
    assert "Host RAM ran out." in html.unescape(walk.header.value)
    assert "A GPU allocation failed" not in html.unescape(walk.header.value)
    assert walk.steps[0].fixes == ("confirm-with-dmesg",)


def test_oom_walkthrough_reads_the_numbers_of_the_users_gpu_error_and_patches_their_config():
    error = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
             "of 79.15 GiB of which 1.50 GiB is free. Of the allocated memory 75.10 GiB is allocated by PyTorch, "
             "and 1.90 GiB is reserved by PyTorch but unallocated.")
    mine = {"train_micro_batch_size_per_gpu": 6, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2}}
    walk = walkthrough("oom", context=UserContext(config=mine, config_label="trainer.strategy.config",
                                                  error_text=error, entry_id="cuda-oom"))
    assert walk.step.title == "Read the numbers of your error"
    assert "Your config: <code>trainer.strategy.config</code>" in walk.header.value
    walk.check_button.click()
    outcome = walk.outcomes[0]
    assert outcome.numbers["allocated GiB"] == 75.1 and outcome.numbers["reserved but unused GiB"] == 1.9
    assert outcome.numbers["fragmentation"] is False and "your error" in outcome.headline
    walk.next_button.click()
    diff = html.unescape(walk.patch_view.value)
    assert "a/trainer.strategy.config" in diff
    assert '+  "train_micro_batch_size_per_gpu": 3' in diff and '+  "gradient_accumulation_steps": 4' in diff


def test_router_walkthrough_try_it_shows_collapse_then_balance():
    from troubleshooter.repro.router import COLLAPSE

    walk = walkthrough("router-collapse")
    walk.next_button.click()  # step 2: the aux loss alone
    assert "aux_loss_weight=0.01" in html.unescape(walk.patch_view.value)
    walk.try_button.click()
    before, after = walk.tries[1].before, walk.tries[1].after
    assert before["max share of one expert (last step)"] > COLLAPSE > after["max share of one expert (last step)"]
    assert f"{before['max share of one expert (any step)']:.3f}" in walk.try_output.value
    bars = walk.tries[1].figure.axes[0]  # each expert's load, before and after
    assert len(bars.patches) == 2 * 8 and "<img" in walk.try_output.value
    walk.next_button.click()  # step 3: bias balancing alone fixes it, the task loss shown beside
    diff = html.unescape(walk.patch_view.value)
    assert "+from lightning_zeromoe.balance.balancer import ExpertBiasBalancer" in diff and "score_bias=True" in diff
    assert "[bias-balancing]" not in walk.what.value and "ExpertBiasBalancer(update_rate=1e-3)" in walk.what.value
    walk.try_button.click()
    before, after = walk.tries[2].before, walk.tries[2].after
    assert before["max share of one expert (last step)"] > COLLAPSE > after["max share of one expert (last 20 steps)"]
    assert after["task loss (last step)"] > 0 and "task loss" in walk.try_output.value
    bars, _, losses = walk.tries[2].figure.axes
    assert len(bars.patches) == 2 * 8 and len(losses.lines) == 2
    walk.next_button.click()  # step 4: the z-loss, measured (it steadies logits; it does not balance)
    assert "z_loss_weight=0.001" in html.unescape(walk.patch_view.value)
    walk.try_button.click()
    assert walk.tries[3].after["router z-loss (last step)"] > 0
    walk.next_button.click()
    walk.next_button.click()  # step 6: router init as well
    assert "router_init_std=0.02" in html.unescape(walk.patch_view.value)
    walk.try_button.click()
    assert walk.tries[5].after["max share of one expert (any step)"] < COLLAPSE


def test_native_moe_walkthrough_lints_and_tries_the_fix():
    walk = walkthrough("native-moe-zero3")
    walk.check_button.click()
    outcome = walk.outcomes[0]
    # The seeds' "moe" block is not live config: lint reports it once (where each key really goes)
    # and derives no error from its keys.
    assert outcome.numbers["errors"] == 0 and any("moe-config-block-ignored" in d for d in outcome.details)
    assert '-  "moe": {' in html.unescape(walk.patch_view.value)
    walk.try_button.click()
    tried = walk.tries[0]
    assert tried.before["outcome"] == "AssertionError" and tried.after["ZeRO stage"] == 2
    assert "trained" in tried.after["outcome"]


def test_install_walkthrough_runs_the_doctor():
    walk = walkthrough("install")
    walk.check_button.click()
    outcome = walk.outcomes[0]
    assert outcome.headline.startswith("doctor (versions)")
    assert any("deepspeed version" in d for d in outcome.details)


def test_timeout_walkthrough_finds_the_first_failure_in_a_log():
    log = ("[rank1]: RuntimeError: [enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory\n"
           "[rank0]: Timed out waiting 1800000ms for recv operation to complete\n")
    walk = walkthrough("timeout", log=log)
    walk.check_button.click()
    outcome = walk.outcomes[0]
    assert "Host (CPU) memory exhausted" in outcome.headline  # the cause ranks above the timeout echo
    assert any(d.startswith("nccl-watchdog-timeout") for d in outcome.details)


def test_pitfalls_walkthrough_check_finds_the_tie():
    walk = walkthrough("zero3-pitfalls")
    walk.check_button.click()
    outcome = walk.outcomes[0]
    assert outcome.numbers["tied groups"] == 1
    assert "tied: embed.weight = lm_head.weight" in outcome.details


def test_a_failing_check_is_shown_not_raised():
    # A notebook dict holding a value no JSON config can hold: lint itself raises on it.
    walk = walkthrough("native-moe-zero3", config={"zero_optimization": {"stage": object()}})
    walk.check_button.click()
    assert 0 in walk.errors and "the check failed" in walk.check_output.value


def test_diagnosis_panel_opens_the_family_walkthrough_or_says_there_is_none():
    [known] = explain_text("AssertionError: Native DeepSpeed MoE is not supported with ZeRO Stage 3.")[:1]
    panel = DiagnosisPanel([known], full=True)
    assert "Native DeepSpeed MoE refuses ZeRO stage 3" in panel.summary.value
    assert panel.button.description == "Open the walkthrough: ZeRO-3 with native MoE"  # words, not a slug
    assert "matched" not in panel.summary.value.lower()
    assert json.loads(known.patch)["expert_parallel"]["enabled"] is True
    assert "expert_parallel" in html.unescape(panel.summary.value)  # the entry's patch, shown
    panel.button.click()
    assert panel.walkthrough.family == "native-moe-zero3"
    config_error = explain_text("AssertionError: Check batch related parameters. train_batch_size is not equal to "
                                "micro_batch_per_gpu * gradient_acc_step * world_size 32 != 2 * 4 * 1")[0]
    assert WALKTHROUGH_FOR.get(config_error.family) is None
    lonely = DiagnosisPanel([config_error])
    assert lonely.button.disabled and lonely.open_walkthrough() is None
    assert "(no walkthrough for this problem)" in repr(lonely)


def test_timeout_walkthrough_try_it_shows_the_expert_group_wait():
    """Step 2's "try it" runs the two-rank reproduction: the wait before and after the fix."""
    walk = walkthrough("timeout")
    walk.next_button.click()
    assert not walk.try_button.disabled
    walk.try_button.click()
    tried = walk.tries[1]
    assert tried.before["expert group timeout (s)"] == 1800.0 and not tried.before["timed out"]
    assert tried.after["expert group timeout (s)"] == 4.0 and tried.after["timed out"]
    assert tried.after["rank 0 waited (s)"] < tried.before["rank 0 waited (s)"]
