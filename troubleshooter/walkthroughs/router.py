"""Router collapse / load imbalance: measure the shares; aux loss; bias balancing; z-loss; bf16 and
warm-up; router init.

"Try it" trains the tiny one-layer MoE (:mod:`troubleshooter.repro.router`) from the collapse-prone
init without a remedy and with the step's remedy, and shows each expert's load before and after,
the busiest expert per step and the task loss beside it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from troubleshooter import knowledge
from troubleshooter.walkthroughs.base import Outcome, Step, TryResult, Walkthrough
from troubleshooter.walkthroughs.checks import lint_check
from troubleshooter.walkthroughs.context import UserContext
from troubleshooter.walkthroughs.diffs import config_diff, text_diff

__all__ = ["FP16_CONFIG", "router_walkthrough"]

#: The example config of the precision step when the notebook holds none.
FP16_CONFIG = {"fp16": {"enabled": True}, "zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 8}

def router_walkthrough(steps_: int | None = None, context: UserContext | None = None,
                       config: Mapping | None = None) -> Walkthrough:
    """Router collapse: measure; the aux loss; bias balancing; the z-loss; precision; the router init
    (``steps_``: training steps of the reproduction)."""
    from troubleshooter.repro import router as rr

    n = steps_ or rr.STEPS
    context = context or UserContext(config=config, config_label="config" if config is not None else "")
    precision_config, label, example = context.config_or(FP16_CONFIG)

    def measure() -> Outcome:
        run = rr.train_shares(aux_loss_weight=0.0, steps=n)
        worst = max(run.max_share)
        return Outcome(f"example tiny MoE, no aux loss: the busiest expert takes {worst:.0%} of tokens",
                       worst <= rr.COLLAPSE,
                       {"max share (any step)": worst, "final shares": ", ".join(f"{s:.2f}" for s in run.shares[-1]),
                        "aux loss at the end": run.aux[-1]},
                       [f"share = fraction of tokens that pick the expert among their top-{rr.TOP_K} "
                        f"(uniform: {rr.TOP_K / rr.NUM_EXPERTS:.2f})"])

    def pair_try(which: str) -> Callable[[], TryResult]:
        """Before: no remedy, extreme init. After: the run of
        :class:`~troubleshooter.repro.router.RouterCollapseResult` named ``which``."""
        def run() -> TryResult:
            result = rr.router_collapse(steps=n)
            after = getattr(result, which)

            def nums(r: Any) -> dict:
                return {"max share of one expert (any step)": r.worst,
                        "max share of one expert (last step)": r.max_share[-1],
                        f"max share of one expert (last {n // 2} steps)": max(r.max_share[n // 2:]),
                        "task loss (last step)": r.task[-1], "aux loss (last step)": r.aux[-1],
                        "router z-loss (last step)": r.z[-1]}

            return TryResult(nums(result.without_fix), nums(after),
                             f"{n} steps of the example tiny MoE, same seed and data; {after.label}. Collapse: one "
                             f"expert above {rr.COLLAPSE:.0%} of tokens.",
                             rr.load_figure([result.without_fix, after], rr.COLLAPSE))
        return run

    fp16_fix = knowledge.get("fp16-moe").patch_json()
    steps = [
        Step("Measure the expert shares", "router-collapse", ("log-expert-load",), "Measure routing (example)",
             measure,
             lambda: text_diff("trainer.fit(module)\n",
                               "from lightning_zeromoe.observe.telemetry import expert_shares, global_counts\n\n"
                               "trainer.fit(module)\nfor layer, counts in global_counts(module).items():\n"
                               "    print(layer, [f\"{s:.0%}\" for s in expert_shares(counts)])\n"),
             try_unavailable="This step measures; the next ones rerun the example with each fix."),
        Step("Add the load-balancing loss (0.01)", "router-collapse", ("add-aux-loss",),
             "Measure routing (example)", measure,
             lambda: text_diff(rr.config_source(aux_loss_weight=0.0), rr.config_source(aux_loss_weight=0.01),
                               "train.py"),
             pair_try("aux_only")),
        Step("Aux-loss-free bias balancing", "router-collapse", ("bias-balancing",),
             "Measure routing (example)", measure,
             lambda: text_diff(rr.balancer_source(), rr.balancer_source(rr.BIAS_RATE), "train.py"),
             pair_try("bias_balanced")),
        Step("Router z-loss", "router-collapse", ("router-z-loss",),
             "Measure routing (example)", measure,
             lambda: text_diff(rr.config_source(0.0), rr.config_source(0.0, z_loss_weight=rr.Z_WEIGHT), "train.py"),
             pair_try("z_loss")),
        Step("bf16 rather than fp16, longer warm-up", "fp16-moe",
             ("use-bf16", "stabilise-fp16", "watch-skipped-steps"),
             f"Lint {'the example fp16 config' if example else label}",
             lambda: lint_check(precision_config, context.world_size or 2, label),
             lambda: config_diff(precision_config, fp16_fix, label),
             try_unavailable="The CPU reproduction trains in fp32; precision effects need a GPU."),
        Step("Router initialisation (and noise)", "router-collapse", ("check-router-init",),
             "Measure routing (example)", measure,
             lambda: text_diff(rr.config_source(aux_loss_weight=0.01), rr.config_source(aux_loss_weight=0.01,
                                                                                      extreme_init=False), "train.py"),
             pair_try("with_fix")),
    ]
    note = ("The measurements train an example tiny MoE (8 experts, top-2) on this CPU, not your model; "
            "the diffs show the same change for your training code.")
    return Walkthrough("router-collapse", "Router collapse / load imbalance", ("router-collapse",), steps, context,
                       example_note=note)
