"""``router_collapse()``: an extreme router init collapses routing; each remedy of the knowledge base, tried.

Single process, in this interpreter (no process group is needed to show routing dynamics). The
model is the tiny MoE with one MoE layer of 8 experts, top-2; a token's *share* for an expert is the
fraction of the step's tokens that pick that expert among their top 2 (uniform: 2/8 = 25%), read
from the layer's own ``tokens_per_expert`` counter. Collapse means one expert above 50% of tokens.

Runs, same seed, data, optimizer and steps, each from the collapse-prone set-up
(``TinyMoEConfig(router_bias_expert=0)``: a large gate row for expert 0) unless said otherwise;
the remedies are the knowledge base's fixes of entry ``router-collapse``:

* **no remedy** (no aux loss): the busiest expert passes 50% of tokens and stays there;
* **aux loss** (``add-aux-loss``, 0.01);
* **bias balancing** (``bias-balancing``): ``TinyMoEConfig(score_bias=True)``, no aux loss, and
  after each step the sign rule of :func:`lightning_zeromoe.balance.rules.bias_update` (what
  ``ExpertBiasBalancer`` applies) with rate :data:`BIAS_RATE`;
* **z-loss** (``router-z-loss``, 1e-3), no aux loss;
* **the fix** of the router-init step (``check-router-init`` with ``add-aux-loss``): aux loss 0.01 and
  a small-std router init without the per-expert offset.

Measured on the development machine (torch 2.13 CPU, seed 0, 40 steps; busiest expert's share at
any step / at the last step, task loss at the last step): no remedy 0.72 / 0.72 (above 50% from
step 4), task 1.587; aux loss 0.61 / 0.47, 1.613; bias balancing 0.59 / 0.37 (at most 0.40 over
the last 20 steps), 1.607; z-loss 1.00 / 1.00, 1.577 (the z-loss keeps logits small, it does not
balance: here routing collapses further); the fix 0.45 / 0.45, 1.576. Rates 3e-3 to 1e-2 fix all
three seeds 0-2 by the last step; 2e-2 overshoots (0.52 at the end for seed 0). The early peak
(~0.6 at step 4) is there in every run from the extreme init: a bias moves by the rate per step.
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
#: The bias update rate of the bias-balancing run (scores are softmax probabilities, ~1/8 each).
BIAS_RATE = 5e-3
#: The router z-loss weight of the z-loss run (ST-MoE's).
Z_WEIGHT = 1e-3


@dataclass
class RunShares:
    """Per-step routing of one run: shares[step][expert], the busiest share, and the losses."""

    label: str
    aux_loss_weight: float
    extreme_init: bool
    bias_rate: float = 0.0
    z_loss_weight: float = 0.0
    shares: list[list[float]] = field(default_factory=list)
    task: list[float] = field(default_factory=list)
    aux: list[float] = field(default_factory=list)
    z: list[float] = field(default_factory=list)
    #: The choice-only bias after the last step (bias balancing only).
    bias: list[float] = field(default_factory=list)

    @property
    def max_share(self) -> list[float]:
        return [max(s) for s in self.shares]

    @property
    def worst(self) -> float:
        return max(self.max_share)

    def first_step_above(self, threshold: float) -> int | None:
        return next((i for i, m in enumerate(self.max_share) if m > threshold), None)


def config_source(aux_loss_weight: float, extreme_init: bool = True, *, score_bias: bool = False,
                  z_loss_weight: float = 0.0) -> str:
    """The model-config line a user would write for these settings (used for the walkthrough's diff)."""
    init = "router_bias_expert=0" if extreme_init else "router_init_std=0.02"
    extra = (", score_bias=True" if score_bias else "") + (f", z_loss_weight={z_loss_weight:g}" if z_loss_weight else "")
    return (f"config = TinyMoEConfig(num_experts={NUM_EXPERTS}, top_k={TOP_K}, {init},\n"
            f"                       aux_loss_weight={aux_loss_weight}{extra})\n"
            "loss = task_loss + config.aux_loss_weight * aux_loss"
            + (" + config.z_loss_weight * z_loss" if z_loss_weight else "") + "\n")


def balancer_source(rate: float | None = None) -> str:
    """A training script's model config and Trainer, with bias balancing at ``rate`` (None: without);
    the walkthrough diffs the two."""
    if rate is None:
        return config_source(0.0) + "trainer = L.Trainer(strategy=ZeroMoEStrategy(ep_size=2), callbacks=[])\n"
    return ("from lightning_zeromoe.balance.balancer import ExpertBiasBalancer\n\n" + config_source(0.0, score_bias=True)
            + f"trainer = L.Trainer(strategy=ZeroMoEStrategy(ep_size=2), callbacks=[ExpertBiasBalancer(update_rate={rate:g})])\n")


_RUNS: dict[tuple, RunShares] = {}


def train_shares(aux_loss_weight: float, *, extreme_init: bool = True, steps: int = STEPS, seed: int = 0,
                 label: str = "", bias_rate: float = 0.0, z_loss_weight: float = 0.0) -> RunShares:
    """Train the one-layer tiny MoE for ``steps`` steps and record the routing of every step.

    ``bias_rate`` > 0 gives the router a choice-only bias moved by the sign rule after every step;
    ``z_loss_weight`` adds the router z-loss. Deterministic for a seed (one thread, seeded init and
    data); results are kept per setting for the life of the process, so the walkthrough's "try it"
    after the notebook's run is instant.
    """
    key = (aux_loss_weight, extreme_init, steps, seed, bias_rate, z_loss_weight)
    if key in _RUNS:
        return _RUNS[key]
    import torch

    from lightning_zeromoe.balance.rules import bias_update
    from lightning_zeromoe.reference.models import SyntheticLMData, TinyMoEConfig, TinyMoELM, lm_loss_terms

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        config = TinyMoEConfig(num_experts=NUM_EXPERTS, top_k=TOP_K, num_layers=1, ffn_hidden_size=64,
                               router_bias_expert=0 if extreme_init else None, router_init_std=0.02,
                               aux_loss_weight=aux_loss_weight, score_bias=bias_rate > 0, z_loss_weight=z_loss_weight)
        model = TinyMoELM(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / WARMUP))
        data = SyntheticLMData(steps * BATCH, SEQ, config.vocab_size, seed=seed)
        block = model.layers[0].mlp
        counter = block.tokens_per_expert
        run = RunShares(label or f"aux {aux_loss_weight:g}, {'extreme' if extreme_init else 'small-std'} init",
                        aux_loss_weight, extreme_init, bias_rate, z_loss_weight)
        for step in range(steps):
            counter.zero_()
            task, aux, z = lm_loss_terms(model, data.tokens[step * BATCH:(step + 1) * BATCH])
            loss = task.mean() + aux_loss_weight * aux.mean() + z_loss_weight * z.mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            if bias_rate:
                with torch.no_grad():
                    block.gate.e_score_correction_bias += bias_update(counter, bias_rate)
            tokens = float(counter.sum()) / TOP_K
            run.shares.append([float(c) / tokens for c in counter.tolist()])
            run.task.append(float(task.detach().mean()))
            run.aux.append(float(aux.detach().mean()))
            run.z.append(float(z.detach().mean()))
        if bias_rate:
            run.bias = block.gate.e_score_correction_bias.tolist()
    finally:
        torch.set_num_threads(threads)
    _RUNS[key] = run
    return run


@dataclass
class RouterCollapseResult:
    without_fix: RunShares
    with_fix: RunShares
    aux_only: RunShares | None
    bias_balanced: RunShares | None = None
    z_loss: RunShares | None = None
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

    @property
    def runs(self) -> list[RunShares]:
        """Every run, no remedy first."""
        return [r for r in (self.without_fix, self.aux_only, self.bias_balanced, self.z_loss, self.with_fix)
                if r is not None]

    def summary(self) -> str:
        lines = [f"router collapse, {NUM_EXPERTS} experts top-{TOP_K}, {len(self.without_fix.shares)} steps "
                 f"(uniform share {TOP_K / NUM_EXPERTS:.0%}, collapse above {self.collapse_threshold:.0%}):"]
        for run in self.runs:
            above = run.first_step_above(self.collapse_threshold)
            first = "never" if above is None else f"step {above}"
            lines.append(f"  {run.label:<44} max share {run.worst:.2f}, last {run.max_share[-1]:.2f}, "
                         f"first above {self.collapse_threshold:.0%}: {first}, task loss {run.task[-1]:.3f}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        rows = []
        for run in self.runs:
            above = run.first_step_above(self.collapse_threshold)
            rows.append([run.label, f"{run.worst:.2f}", f"{run.max_share[-1]:.2f}",
                         "never" if above is None else f"step {above}", f"{run.task[-1]:.3f}", f"{run.aux[-1]:.3f}"])
        return ("<b>Router collapse</b>" + html_table(
            ["run", "max share (any step)", "max share (last step)", f"first step above {self.collapse_threshold:.0%}",
             "task loss (last)", "aux loss (last)"], rows))

    def figure(self):
        """Each expert's load on the last step, one bar per expert and run (left), the busiest
        expert's share over the steps (middle) and the task loss beside it (right)."""
        return load_figure(self.runs, self.collapse_threshold)


#: Colours of the runs in the figures, in the order of :attr:`RouterCollapseResult.runs` (a pair of
#: runs in the walkthrough takes the first colour for "before" and its remedy's colour for "after").
COLOURS = {"no remedy": "#c62828", "aux loss": "#1565c0", "bias balancing": "#2e7d32", "z-loss": "#ef6c00",
           "fix": "#6a1b9a"}


def _colour(run: RunShares) -> str:
    if run.bias_rate:
        return COLOURS["bias balancing"]
    if run.z_loss_weight:
        return COLOURS["z-loss"]
    if not run.extreme_init:
        return COLOURS["fix"]
    return COLOURS["aux loss"] if run.aux_loss_weight else COLOURS["no remedy"]


def load_figure(runs: list[RunShares], threshold: float = COLLAPSE):
    """Per-expert load bars of each run (last step), the busiest share per step, the task loss per step."""
    fig = new_figure(11.0, 3.4)
    bars, lines, losses = fig.subplots(1, 3, width_ratios=[1.3, 1, 1])
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        shares = run.shares[-1]
        colour = _colour(run)
        bars.bar([e + (i - (len(runs) - 1) / 2) * width for e in range(len(shares))], shares, width=width,
                 color=colour, label=run.label)
        lines.plot(run.max_share, color=colour, label=run.label)
        losses.plot(run.task, color=colour, label=run.label)
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
    losses.set_xlabel("step")
    losses.set_ylabel("task loss")
    losses.set_title("Task loss per step", fontsize=10)
    return fig


def router_collapse(*, steps: int = STEPS, seed: int = 0, aux_loss_weight: float = 0.01,
                    include_aux_only: bool = True, include_remedies: bool = True, **_ignored: Any) -> RouterCollapseResult:
    """Run without a remedy, with the fix, with the aux loss alone and (``include_remedies``) with
    bias balancing alone and the z-loss alone."""
    without = train_shares(0.0, extreme_init=True, steps=steps, seed=seed, label="no remedy, extreme init")
    fixed = train_shares(aux_loss_weight, extreme_init=False, steps=steps, seed=seed,
                         label=f"aux loss {aux_loss_weight:g}, small-std init (fix)")
    aux_only = (train_shares(aux_loss_weight, extreme_init=True, steps=steps, seed=seed,
                             label=f"aux loss {aux_loss_weight:g} only, extreme init")
                if include_aux_only else None)
    bias = z = None
    if include_remedies:
        bias = train_shares(0.0, extreme_init=True, steps=steps, seed=seed, bias_rate=BIAS_RATE,
                            label=f"bias balancing (rate {BIAS_RATE:g}), extreme init")
        z = train_shares(0.0, extreme_init=True, steps=steps, seed=seed, z_loss_weight=Z_WEIGHT,
                         label=f"z-loss {Z_WEIGHT:g}, extreme init")
    return RouterCollapseResult(without, fixed, aux_only, bias, z)
