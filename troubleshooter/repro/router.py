"""``router_collapse()``: an extreme router init collapses routing; the knowledge base's fix keeps it balanced.

Single process, in this interpreter (no process group is needed to show routing dynamics). The
model is the tiny MoE with one MoE layer of 8 experts, top-2; a token's *share* for an expert is the
fraction of the step's tokens that pick that expert among their top 2 (uniform: 2/8 = 25%), read
from the layer's own ``tokens_per_expert`` counter. Collapse means one expert above 50% of tokens.

Three runs, same seed, data, optimizer and steps:

* **without the fix**: ``TinyMoEConfig(router_bias_expert=0)`` (a large gate row for expert 0)
  and no aux loss: the busiest expert passes 50% of tokens and keeps growing;
* **with the fix** (entry ``router-collapse``: aux loss 0.01, a small-std router init without a
  per-expert offset): stays under 50% at every step;
* **aux loss only** (extreme init kept, aux 0.01): reported, not hidden. On this tiny model, within
  this many steps, the aux loss alone does not undo the extreme init; the init is what matters.

Measured on the development machine (torch 2.13 CPU, seed 0, 40 steps): without the fix the
busiest expert passes 50% at step 4 and ends at 85%; with the fix it peaks at 45%; with the aux loss
alone it peaks at 61% (step 4) and is back to 41% by the last step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from troubleshooter.repro._common import html_table, new_figure

NUM_EXPERTS, TOP_K = 8, 2
STEPS = 40
BATCH, SEQ = 32, 33
LR, WARMUP = 1e-2, 5
#: One expert above this share of tokens is collapse (the seeds' threshold).
COLLAPSE = 0.5
#: With the fix, the busiest expert must stay below this at every step.
BOUND = 0.5


@dataclass
class RunShares:
    """Per-step routing of one run: shares[step][expert], the busiest share, and both losses."""

    label: str
    aux_loss_weight: float
    extreme_init: bool
    shares: list[list[float]] = field(default_factory=list)
    task: list[float] = field(default_factory=list)
    aux: list[float] = field(default_factory=list)

    @property
    def max_share(self) -> list[float]:
        return [max(s) for s in self.shares]

    @property
    def worst(self) -> float:
        return max(self.max_share)

    def first_step_above(self, threshold: float) -> int | None:
        return next((i for i, m in enumerate(self.max_share) if m > threshold), None)


def config_source(aux_loss_weight: float, extreme_init: bool = True) -> str:
    """The model-config line a user would write for these settings (used for the walkthrough's diff)."""
    init = "router_bias_expert=0" if extreme_init else "router_init_std=0.02"
    return (f"config = TinyMoEConfig(num_experts={NUM_EXPERTS}, top_k={TOP_K}, {init},\n"
            f"                       aux_loss_weight={aux_loss_weight})\n"
            "loss = task_loss + config.aux_loss_weight * aux_loss\n")


_RUNS: dict[tuple, RunShares] = {}


def train_shares(aux_loss_weight: float, *, extreme_init: bool = True, steps: int = STEPS, seed: int = 0,
                 label: str = "") -> RunShares:
    """Train the one-layer tiny MoE for ``steps`` steps and record the routing of every step.

    Deterministic for a seed (one thread, seeded init and data); results are kept per setting for
    the life of the process, so the walkthrough's "try it" after the notebook's run is instant.
    """
    key = (aux_loss_weight, extreme_init, steps, seed)
    if key in _RUNS:
        return _RUNS[key]
    import torch

    from lightning_zeromoe.models import SyntheticLMData, TinyMoEConfig, TinyMoELM, lm_losses

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        config = TinyMoEConfig(num_experts=NUM_EXPERTS, top_k=TOP_K, num_layers=1, ffn_hidden_size=64,
                               router_bias_expert=0 if extreme_init else None, router_init_std=0.02,
                               aux_loss_weight=aux_loss_weight)
        model = TinyMoELM(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / WARMUP))
        data = SyntheticLMData(steps * BATCH, SEQ, config.vocab_size, seed=seed)
        counter = model.layers[0].mlp.tokens_per_expert
        run = RunShares(label or f"aux {aux_loss_weight:g}, {'extreme' if extreme_init else 'small-std'} init",
                        aux_loss_weight, extreme_init)
        for step in range(steps):
            counter.zero_()
            task, aux = lm_losses(model, data.tokens[step * BATCH:(step + 1) * BATCH])
            loss = task.mean() + aux_loss_weight * aux.mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            tokens = float(counter.sum()) / TOP_K
            run.shares.append([float(c) / tokens for c in counter.tolist()])
            run.task.append(float(task.detach().mean()))
            run.aux.append(float(aux.detach().mean()))
    finally:
        torch.set_num_threads(threads)
    _RUNS[key] = run
    return run


@dataclass
class RouterCollapseResult:
    without_fix: RunShares
    with_fix: RunShares
    aux_only: RunShares | None
    collapse_threshold: float = COLLAPSE
    bound: float = BOUND

    @property
    def collapsed(self) -> bool:
        """Without the fix, one expert took more than ``collapse_threshold`` of the tokens."""
        return self.without_fix.worst > self.collapse_threshold

    @property
    def collapse_step(self) -> int | None:
        return self.without_fix.first_step_above(self.collapse_threshold)

    @property
    def balanced(self) -> bool:
        """With the fix, the busiest expert stayed below ``bound`` at every step."""
        return self.with_fix.worst < self.bound

    def summary(self) -> str:
        lines = [f"router collapse, {NUM_EXPERTS} experts top-{TOP_K}, {len(self.without_fix.shares)} steps "
                 f"(uniform share {TOP_K / NUM_EXPERTS:.0%}, collapse above {self.collapse_threshold:.0%}):"]
        for run in filter(None, (self.without_fix, self.with_fix, self.aux_only)):
            above = run.first_step_above(self.collapse_threshold)
            first = "never" if above is None else f"step {above}"
            lines.append(f"  {run.label:<40} max share {run.worst:.2f}, last {run.max_share[-1]:.2f}, "
                         f"first above {self.collapse_threshold:.0%}: {first}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        rows = []
        for run in filter(None, (self.without_fix, self.with_fix, self.aux_only)):
            above = run.first_step_above(self.collapse_threshold)
            rows.append([run.label, f"{run.worst:.2f}", f"{run.max_share[-1]:.2f}",
                         "never" if above is None else f"step {above}", f"{run.aux[-1]:.3f}"])
        return ("<b>Router collapse</b>" + html_table(
            ["run", "max share (any step)", "max share (last step)", f"first step above {self.collapse_threshold:.0%}",
             "aux loss (last)"], rows))

    def figure(self):
        """Each expert's load before and after the fix (left: shares of the last step, one bar per
        expert and run), and the busiest expert's share over the steps (right)."""
        return load_figure([r for r in (self.without_fix, self.with_fix, self.aux_only) if r is not None],
                           self.collapse_threshold)


#: Colours of the runs in the figures: without the fix, with it, the aux loss alone.
COLOURS = ("#c62828", "#2e7d32", "#1565c0")


def load_figure(runs: list[RunShares], threshold: float = COLLAPSE):
    """Per-expert load bars of each run (last step) and the busiest share per step, side by side."""
    fig = new_figure(9.0, 3.4)
    bars, lines = fig.subplots(1, 2, width_ratios=[1.2, 1])
    width = 0.8 / len(runs)
    for i, (run, colour) in enumerate(zip(runs, COLOURS)):
        shares = run.shares[-1]
        bars.bar([e + (i - (len(runs) - 1) / 2) * width for e in range(len(shares))], shares, width=width,
                 color=colour, label=run.label)
        lines.plot(run.max_share, color=colour, label=run.label)
    for ax in (bars, lines):
        ax.axhline(TOP_K / NUM_EXPERTS, color="grey", linestyle=":", label="uniform")
        ax.axhline(threshold, color="black", linestyle="--", label="collapse threshold")
        ax.set_ylim(0, 1)
    bars.set_xticks(range(NUM_EXPERTS), [f"e{e}" for e in range(NUM_EXPERTS)])
    bars.set_xlabel("expert")
    bars.set_ylabel("share of tokens (last step)")
    bars.set_title("Each expert's load, before and after", fontsize=10)
    bars.legend(fontsize=6, loc="upper right")
    lines.set_xlabel("step")
    lines.set_ylabel("busiest expert's share")
    lines.set_title("Busiest expert per step", fontsize=10)
    return fig


def router_collapse(*, steps: int = STEPS, seed: int = 0, aux_loss_weight: float = 0.01,
                    include_aux_only: bool = True, **_ignored: Any) -> RouterCollapseResult:
    """Run without the fix, with the fix, and (optionally) with the aux loss alone."""
    without = train_shares(0.0, extreme_init=True, steps=steps, seed=seed, label="no aux loss, extreme init")
    fixed = train_shares(aux_loss_weight, extreme_init=False, steps=steps, seed=seed,
                         label=f"aux loss {aux_loss_weight:g}, small-std init (fix)")
    aux_only = (train_shares(aux_loss_weight, extreme_init=True, steps=steps, seed=seed,
                             label=f"aux loss {aux_loss_weight:g} only, extreme init")
                if include_aux_only else None)
    return RouterCollapseResult(without, fixed, aux_only)
