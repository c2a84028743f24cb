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
from troubleshooter.widgets import (BUILDERS, WALKTHROUGH_FOR, DiagnosisPanel, config_diff, merge_patch,
                                    walkthrough)

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
        entry = knowledge.get(step.entry)
        shown = html.unescape(walk.what.value)
        for n in step.fixes:
            assert entry.fix[n] in shown, f"{family} step {i + 1} must show fix {n} of {step.entry}"
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
    walk.next_button.click()
    assert '"train_micro_batch_size_per_gpu": 8' in html.unescape(walk.patch_view.value)
    walk.check_button.click()  # lints the patched config for real
    assert walk.outcomes[1].ok and walk.outcomes[1].numbers["errors"] == 0
    walk.next_button.click()
    assert walk.step.title == "Activation checkpointing"
    walk.try_button.click()
    tried = walk.tries[2]
    assert tried.before["outcome"] == "OUT OF MEMORY" and tried.after["outcome"] == "fits"
    assert tried.after["peak MiB"] < tried.after["limit MiB"] <= tried.before["peak MiB"] + 1
    shown = html.unescape(walk.try_output.value)
    assert "OUT OF MEMORY" in shown and "fits" in shown and f"{tried.after['peak MiB']:.3f}" in shown
    walk.next_button.click()  # ZeRO stage up: no reproduction on 1 process, says so
    assert walk.try_button.disabled and "data-parallel ranks" in walk.try_output.value


def test_router_walkthrough_try_it_shows_collapse_then_balance():
    from troubleshooter.repro.router import COLLAPSE

    walk = walkthrough("router-collapse")
    walk.next_button.click()  # step 2: the aux loss alone
    assert "aux_loss_weight=0.01" in html.unescape(walk.patch_view.value)
    walk.try_button.click()
    before, after = walk.tries[1].before, walk.tries[1].after
    assert before["max share of one expert (last step)"] > COLLAPSE > after["max share of one expert (last step)"]
    assert f"{before['max share of one expert (any step)']:.3f}" in walk.try_output.value
    assert walk.tries[1].figure is not None
    walk.next_button.click()
    walk.next_button.click()  # step 4: router init as well
    assert "router_init_std=0.02" in html.unescape(walk.patch_view.value)
    walk.try_button.click()
    assert walk.tries[3].after["max share of one expert (any step)"] < COLLAPSE


def test_native_moe_walkthrough_lints_and_tries_the_fix():
    walk = walkthrough("native-moe-zero3")
    walk.check_button.click()
    outcome = walk.outcomes[0]
    assert outcome.ok is False and any("native-moe-zero3" in d for d in outcome.details)
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
    walk = walkthrough("native-moe-zero3", config={"zero_optimization": "not a dict"})
    walk.check_button.click()
    assert 0 in walk.errors and "the check failed" in walk.check_output.value


def test_diagnosis_panel_opens_the_family_walkthrough_or_says_there_is_none():
    [known] = explain_text("AssertionError: Native DeepSpeed MoE is not supported with ZeRO Stage 3.")[:1]
    panel = DiagnosisPanel([known], full=True)
    assert "Native DeepSpeed MoE refuses ZeRO stage 3" in panel.summary.value
    assert json.loads(known.patch)["expert_parallel"]["enabled"] is True
    assert "expert_parallel" in html.unescape(panel.summary.value)  # the entry's patch, shown
    panel.button.click()
    assert panel.walkthrough.family == "native-moe-zero3"
    config_error = explain_text("AssertionError: Check batch related parameters. train_batch_size is not equal to "
                                "micro_batch_per_gpu * gradient_acc_step * world_size 32 != 2 * 4 * 1")[0]
    assert WALKTHROUGH_FOR.get(config_error.family) is None
    lonely = DiagnosisPanel([config_error])
    assert lonely.button.disabled and lonely.open_walkthrough() is None
    assert "(no walkthrough for this family)" in repr(lonely)


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
