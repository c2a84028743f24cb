"""ZeRO-3 with native MoE: DeepSpeed refuses it; stage 2 with native MoE, or AutoEP under stage 3.

"Try it" runs DeepSpeed's real refusal and the stage-2 fix (:mod:`troubleshooter.repro.zero3`).
"""

from __future__ import annotations

from typing import Mapping

from troubleshooter import knowledge
from troubleshooter.walkthroughs.base import Step, TryResult, Walkthrough
from troubleshooter.walkthroughs.checks import lint_check
from troubleshooter.walkthroughs.context import UserContext
from troubleshooter.walkthroughs.diffs import config_diff, merge_patch, text_diff

__all__ = ["NATIVE_MOE_CONFIG", "native_moe_walkthrough"]

#: The example config when the notebook holds none: a "moe" block (ignored by DeepSpeed), ZeRO-3.
NATIVE_MOE_CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                     "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
                     "moe": {"enabled": True, "ep_size": 2, "num_experts": 4, "top_k": 2}}


def _run_try() -> TryResult:
    from troubleshooter.repro import native_moe_zero3

    r = native_moe_zero3()
    return TryResult({"ZeRO stage": 3, "outcome": r.error_type, "message": r.error_message[:120]},
                     {"ZeRO stage": r.fix_stage, "outcome": f"trained {len(r.fix_losses)} steps",
                      "loss first -> last": f"{r.fix_losses[0]:.3f} -> {r.fix_losses[-1]:.3f}"},
                     r.fix_description)


def native_moe_walkthrough(config: Mapping | None = None, world_size: int = 2,
                           context: UserContext | None = None) -> Walkthrough:
    if context is None:
        context = UserContext(config=config, config_label="config" if config is not None else "",
                              world_size=world_size)
    world_size = context.world_size or world_size
    config, label, example = context.config_or(NATIVE_MOE_CONFIG)
    stage2 = {"zero_optimization": {"stage": 2}, "moe": None}
    autoep = knowledge.get("native-moe-zero3").patch_json()
    steps = [
        Step("Lint the config", "native-moe-zero3", ("native-moe-stage2",), "Lint the config",
             lambda: lint_check(config, world_size, label), lambda: config_diff(config, stage2, label), _run_try),
        Step("Or keep ZeRO-3 and use AutoEP", "native-moe-zero3",
             ("stage3-use-autoep", "use-zeromoe-strategy"), "Lint the AutoEP config",
             lambda: lint_check(merge_patch(config, autoep), world_size, f"{label}, AutoEP"),
             lambda: config_diff(config, autoep, label) + text_diff(
                 "strategy = DeepSpeedStrategy(config=ds_config)\n",
                 "from lightning_zeromoe import ZeroMoEStrategy\n\nstrategy = ZeroMoEStrategy(ep_size=2)\n"),
             try_unavailable="lightning_zeromoe's demo and notebook 04 run AutoEP under ZeRO-3 on 2 CPU processes."),
        Step("Native MoE under ZeRO 1/2: MoE parameter groups", "moe-param-groups",
             ("split-moe-groups", "config-optimizer"), "Lint the stage-2 config",
             lambda: lint_check(merge_patch(config, stage2), world_size, f"{label}, stage 2"),
             lambda: knowledge.get("moe-param-groups").patch or "", _run_try),
    ]
    note = ("No DeepSpeed config was found in the failing cell or the notebook: the steps lint and patch an "
            "example config with a 'moe' block under ZeRO-3.") if example else ""
    return Walkthrough("native-moe-zero3", "ZeRO-3 with native MoE", ("native-moe-zero3", "moe-param-groups"), steps,
                       context, example_note=note)
