"""Guided walkthroughs (ipywidgets), one per problem family, and the diagnosis panel.

A walkthrough is a list of :class:`Step`. Each step

* says what to check and what to do, in the knowledge base's own words (``Step.entry`` and
  ``Step.fixes`` index an entry's ordered ``fix`` list, so a fact is corrected in one TOML file
  and every face of the troubleshooter shows the correction);
* runs the check for the user: a real call (doctor checks, lint, the memory planner, a
  measurement on the tiny model), never canned text;
* proposes the fix as a concrete config or code patch, shown as a unified diff (difflib);
* and, where a tiny reproduction exists, has a "try it" button that reruns it with the fix and
  shows the numbers before and after.

The order of the steps is the knowledge base's order of fixes; for out-of-memory that is measure,
micro-batch down with accumulation up, activation checkpointing, ZeRO stage up, offload last.

Everything is driven through methods (``next()``, ``back()``, ``run_check()``, ``try_it()``) that
the buttons call, so tests and notebooks can drive a walkthrough with ``button.click()`` and read
its state (``index``, ``outcomes``, ``tries``) as well as the HTML it shows.
"""

from __future__ import annotations

import difflib
import html
import json
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import ipywidgets as W

from troubleshooter import knowledge
from troubleshooter.lint import merge_patch

__all__ = ["DiagnosisPanel", "Outcome", "Step", "TryResult", "WALKTHROUGH_FOR", "Walkthrough", "config_diff",
           "diff_html", "merge_patch", "text_diff", "walkthrough"]


# ---------------------------------------------------------------------------------------------
# Patches and diffs
# ---------------------------------------------------------------------------------------------


def text_diff(before: str, after: str, name: str = "train.py") -> str:
    """A unified diff of two texts, as ``git diff`` would show it."""
    lines = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                 fromfile=f"a/{name}", tofile=f"b/{name}")
    return "".join(line if line.endswith("\n") else line + "\n" for line in lines)


def config_diff(config: Mapping, patch: Mapping, name: str = "ds_config.json") -> str:
    """The diff a JSON merge patch makes to a config, both pretty-printed."""
    before = json.dumps(config, indent=2) + "\n"
    after = json.dumps(merge_patch(config, patch), indent=2) + "\n"
    return text_diff(before, after, name)


def diff_html(diff: str) -> str:
    """A diff as coloured HTML (added lines green, removed red)."""
    out = []
    for line in diff.splitlines():
        colour = ("#1b5e20" if line.startswith("+") and not line.startswith("+++") else
                  "#b71c1c" if line.startswith("-") and not line.startswith("---") else
                  "#6a1b9a" if line.startswith("@@") else "#333")
        out.append(f"<span style='color:{colour}'>{html.escape(line)}</span>")
    return ("<pre class='troubleshooter-diff' style='background:#f7f7f7;padding:4px;font-size:90%'>"
            + "\n".join(out) + "</pre>")


def _esc(text: Any) -> str:
    return html.escape(str(text))


# ---------------------------------------------------------------------------------------------
# Steps, outcomes and the walkthrough widget
# ---------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What a check found: a headline, whether it looks fine, the numbers, and detail lines."""

    headline: str
    ok: bool | None = None
    numbers: dict[str, Any] = field(default_factory=dict)
    details: list[str] = field(default_factory=list)

    def html(self) -> str:
        icon = {True: "✔", False: "✖", None: "ℹ"}[self.ok]
        rows = "".join(f"<tr><td>{_esc(k)}</td><td>{_esc(_fmt(v))}</td></tr>" for k, v in self.numbers.items())
        details = "".join(f"<li>{_esc(d)}</li>" for d in self.details)
        return (f"<div class='troubleshooter-outcome'><b>{icon} {_esc(self.headline)}</b>"
                + (f"<table>{rows}</table>" if rows else "") + (f"<ul>{details}</ul>" if details else "") + "</div>")


@dataclass
class TryResult:
    """Numbers from the reproduction without the fix (``before``) and with it (``after``)."""

    before: dict[str, Any]
    after: dict[str, Any]
    note: str = ""
    figure: Any = None

    def html(self) -> str:
        keys = list(dict.fromkeys([*self.before, *self.after]))
        rows = "".join(f"<tr><td>{_esc(k)}</td><td>{_esc(_fmt(self.before.get(k, '-')))}</td>"
                       f"<td>{_esc(_fmt(self.after.get(k, '-')))}</td></tr>" for k in keys)
        return ("<div class='troubleshooter-try'><table><thead><tr><th></th><th>before</th><th>after the fix</th>"
                f"</tr></thead><tbody>{rows}</tbody></table>"
                + (f"<div>{_esc(self.note)}</div>" if self.note else "") + "</div>")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:,.1f}"
    return str(value)


@dataclass
class Step:
    """One step of a walkthrough (see the module docstring)."""

    title: str
    entry: str  # knowledge-base entry the advice comes from
    fixes: tuple[int, ...]  # indices into that entry's ordered fix steps
    check_label: str
    check: Callable[[], Outcome]
    patch: Callable[[], str]  # the unified diff of the proposed fix
    try_it: Callable[[], TryResult] | None = None
    try_unavailable: str = ""  # why there is no try-it, shown instead of the button

    def advice(self) -> list[str]:
        entry = knowledge.get(self.entry)
        return [entry.fix[i] for i in self.fixes]


class Walkthrough(W.VBox):
    """A step-by-step guide. State: ``index``, ``outcomes`` (check results), ``tries``, ``errors``."""

    def __init__(self, family: str, title: str, entries: tuple[str, ...], steps: list[Step]) -> None:
        self.family, self.title, self.entries, self.steps = family, title, entries, steps
        self.index = 0
        self.outcomes: dict[int, Outcome] = {}
        self.tries: dict[int, TryResult] = {}
        self.errors: dict[int, str] = {}
        self.header = W.HTML()
        self.position = W.HTML()
        self.what = W.HTML()
        self.check_button = W.Button(description="Run the check", icon="search")
        self.check_output = W.HTML()
        self.patch_view = W.HTML()
        self.try_button = W.Button(description="Try it", icon="play", button_style="success")
        self.try_output = W.HTML()
        self.back_button = W.Button(description="Back", icon="arrow-left")
        self.next_button = W.Button(description="Next", icon="arrow-right")
        self.check_button.on_click(lambda _b: self.run_check())
        self.try_button.on_click(lambda _b: self.try_it())
        self.back_button.on_click(lambda _b: self.back())
        self.next_button.on_click(lambda _b: self.next())
        causes = " ".join(knowledge.get(entries[0]).cause.split()[:60])
        self.header.value = (f"<h3 style='margin:4px 0'>Walkthrough: {_esc(title)}</h3>"
                             f"<div style='color:#444'>{_esc(causes)}…</div>")
        super().__init__([self.header, self.position, self.what,
                          W.HBox([self.check_button]), self.check_output, self.patch_view,
                          W.HBox([self.try_button]), self.try_output,
                          W.HBox([self.back_button, self.next_button])])
        self.go(0)

    @property
    def step(self) -> Step:
        return self.steps[self.index]

    def go(self, index: int) -> None:
        """Show step ``index`` (with whatever its check and try-it already produced)."""
        self.index = max(0, min(index, len(self.steps) - 1))
        step = self.step
        self.position.value = f"<b>Step {self.index + 1} of {len(self.steps)}: {_esc(step.title)}</b>"
        advice = "".join(f"<li>{_esc(a)}</li>" for a in step.advice())
        self.what.value = (f"<div><b>What to check and do</b> (knowledge entry <code>{_esc(step.entry)}</code>)"
                           f"<ol>{advice}</ol></div>")
        self.check_button.description = step.check_label
        self.check_output.value = self._check_html()
        try:
            diff = step.patch()
        except Exception as err:  # noqa: BLE001 - a broken patch must not break navigation
            diff = f"(could not build the patch: {type(err).__name__}: {err})"
        self.patch_view.value = "<b>Proposed fix</b>" + diff_html(diff)
        self.try_button.disabled = step.try_it is None
        self.try_button.tooltip = step.try_unavailable or "Rerun the tiny reproduction with this fix"
        self.try_output.value = (self.tries[self.index].html() if self.index in self.tries else
                                 f"<i>{_esc(step.try_unavailable)}</i>" if step.try_it is None else "")
        self.back_button.disabled = self.index == 0
        self.next_button.disabled = self.index == len(self.steps) - 1

    def _check_html(self) -> str:
        if self.index in self.errors:
            return f"<div style='color:#c62828'>{_esc(self.errors[self.index])}</div>"
        if self.index in self.outcomes:
            return self.outcomes[self.index].html()
        return ""

    def next(self) -> None:
        self.go(self.index + 1)

    def back(self) -> None:
        self.go(self.index - 1)

    def run_check(self) -> Outcome | None:
        """Run the current step's check; its outcome is stored and shown (errors too, not raised)."""
        i = self.index
        self.check_output.value = "<i>running…</i>"
        try:
            self.outcomes[i] = self.steps[i].check()
            self.errors.pop(i, None)
        except Exception as err:  # noqa: BLE001 - a button callback must not raise into the frontend
            self.errors[i] = f"the check failed: {type(err).__name__}: {err}"
        if self.index == i:
            self.check_output.value = self._check_html()
        return self.outcomes.get(i)

    def try_it(self) -> TryResult | None:
        """Rerun the reproduction with this step's fix; show before/after numbers."""
        i = self.index
        step = self.steps[i]
        if step.try_it is None:
            return None
        self.try_output.value = "<i>running the reproduction…</i>"
        try:
            self.tries[i] = step.try_it()
            self.errors.pop(i, None)
            self.try_output.value = self.tries[i].html()
        except Exception as err:  # noqa: BLE001
            self.errors[i] = f"the reproduction failed: {type(err).__name__}: {err}"
            self.try_output.value = f"<div style='color:#c62828'>{_esc(self.errors[i])}</div>"
        return self.tries.get(i)

    def __repr__(self) -> str:
        return f"<Walkthrough {self.title!r}: step {self.index + 1}/{len(self.steps)} {self.step.title!r}>"


# ---------------------------------------------------------------------------------------------
# Checks shared by several walkthroughs (real calls into the doctor, lint and the planner)
# ---------------------------------------------------------------------------------------------


def doctor_check(*families: str, timeout: float = 60.0) -> Outcome:
    """Run the doctor's check families and summarise: which did not pass, with their fixes."""
    from troubleshooter.doctor import DoctorOptions, run_checks

    results = run_checks(DoctorOptions(only=families, timeout=timeout))
    bad = [r for r in results if r.status in ("warn", "fail", "error")]
    details = [f"[{r.status}] {r.title}: {r.found}" + (f" -> {r.fix}" if r.fix and r.status != "ok" else "")
               for r in results]
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "warn", "fail", "error", "skip")}
    return Outcome(f"doctor ({', '.join(families)}): {len(bad)} need attention", not any(
        r.status in ("fail", "error") for r in results), counts, details)


def lint_check(config: Mapping, world_size: int | None = None, label: str = "config") -> Outcome:
    """Lint a config dict; the headline counts the errors."""
    from troubleshooter.lint import lint_config

    findings = lint_config(dict(config), world_size=world_size, source=label)
    errors = [f for f in findings if f.severity == "error"]
    return Outcome(f"lint of {label}: {len(errors)} error(s), {len(findings) - len(errors)} other finding(s)",
                   not errors, {"errors": len(errors), "findings": len(findings)},
                   [f"[{f.severity}] {f.path}: {f.message} ({f.rule})" for f in findings])


# ---------------------------------------------------------------------------------------------
# The walkthroughs
# ---------------------------------------------------------------------------------------------

#: The tiny reproduction's DeepSpeed settings (1 data-parallel rank): the OOM walkthrough's default.
OOM_CONFIG = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}


def _oom_try(rung: dict) -> Callable[[], TryResult]:
    def run() -> TryResult:
        from troubleshooter.repro import memory as memory

        base = {"name": "measure", "micro_batch": memory.MICRO_BATCH, "accumulation": 1, "checkpointing": False,
                "budget_mb": memory.BUDGET_MB}
        before, after = memory.run_rungs([base, {**rung, "budget_mb": memory.BUDGET_MB}], stop_when_fits=False)

        def nums(r: dict) -> dict:
            return {"micro-batch x accumulation": f"{r['micro_batch']} x {r['accumulation']}",
                    "activation checkpointing": "yes" if r["checkpointing"] else "no",
                    "limit MiB": r["budget_mb"], "peak MiB": round(r["peak_vm_mb"], 1),
                    "outcome": "fits" if r["ok"] else ("OUT OF MEMORY" if r["oom"] else r["error"])}

        return TryResult(nums(before), nums(after), "Same global batch: the loss of the step is the same "
                         f"({before.get('loss') or '-'} vs {after['loss'] if after['loss'] is not None else '-'}).")
    return run


def oom_walkthrough(config: Mapping | None = None, world_size: int = 1, num_gpus: int = 16) -> Walkthrough:
    """Out of memory: measure; micro-batch down with accumulation up; checkpointing; ZeRO up; offload.

    ``num_gpus`` sizes the memory planner's example (Mixtral-8x7B, 8 GPUs per node) in the ZeRO step.
    """
    config = dict(config or OOM_CONFIG)
    micro = int(config.get("train_micro_batch_size_per_gpu", 16))
    acc = int(config.get("gradient_accumulation_steps", 1))
    half = {"train_micro_batch_size_per_gpu": max(1, micro // 2), "gradient_accumulation_steps": acc * 2}
    stage = int(config.get("zero_optimization", {}).get("stage", 0))
    stage_up = {"zero_optimization": {"stage": min(3, stage + 1)}}
    if stage + 1 >= 3:
        stage_up["zero_optimization"].update({k: v for k, v in knowledge.get("cuda-oom").patch_json()[
            "zero_optimization"].items() if k != "stage"})
    offload = {"zero_optimization": {"stage": max(stage, 2),
                                     "offload_optimizer": {"device": "cpu", "pin_memory": True}}}

    def measure() -> Outcome:
        from troubleshooter.repro import memory as memory

        base = {"name": "measure", "micro_batch": memory.MICRO_BATCH, "accumulation": 1, "checkpointing": False}
        free, limited = memory.run_rungs([{**base, "budget_mb": None}, {**base, "budget_mb": memory.BUDGET_MB}],
                                            stop_when_fits=False)
        return Outcome(f"the step needs {free['peak_vm_mb']:.1f} MiB; under a {memory.BUDGET_MB} MiB limit it "
                       + ("fails: " + str(limited["error"]) if not limited["ok"] else "fits"), limited["ok"],
                       {"peak without limit (MiB)": round(free["peak_vm_mb"], 1), "limit (MiB)": memory.BUDGET_MB,
                        "OOM under the limit": limited["oom"]},
                       ["Measured in a child process on the tiny MoE (VmPeak growth during one optimizer step)."])

    def plan_check() -> Outcome:
        from lightning_zeromoe.planner import MIXTRAL_8X7B, moe_transformer_counts, plan

        m = MIXTRAL_8X7B
        p = plan(counts=moe_transformer_counts(**m), num_gpus=num_gpus, gpus_per_node=8, gpu_memory_bytes=80e9,
                 ep_size=8, micro_batch=1, seq_len=4096, hidden_size=m["hidden_size"], num_layers=m["num_layers"],
                 num_heads=m["num_heads"], ffn_hidden_size=m["ffn_hidden_size"], top_k=2,
                 vocab_size=m["vocab_size"], activation_checkpointing=True)
        rec = p.recommend()
        return Outcome(f"memory planner, Mixtral-8x7B, 4k tokens per GPU, {num_gpus} x 80 GB (ep_size 8): "
                       + (rec.setup.label if rec.setup else "nothing fits"), rec.fits, {},
                       [rec.reason, *p.table().splitlines()])

    steps = [
        Step("Measure before changing anything", "cuda-oom", (0,), "Measure the step", measure,
             lambda: text_diff("loss.backward()\noptimizer.step()\n",
                               "torch.cuda.reset_peak_memory_stats()\nloss.backward()\noptimizer.step()\n"
                               "print(f\"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB\")\n"),
             try_unavailable="Nothing to try yet: this step measures."),
        Step("Micro-batch down, gradient accumulation up", "cuda-oom", (2,), "Lint the patched config",
             lambda: lint_check(merge_patch(config, half), world_size, "patched config"),
             lambda: config_diff(config, half),
             _oom_try({"name": "micro-batch down, accumulation up", "micro_batch": 8, "accumulation": 2,
                       "checkpointing": False})),
        Step("Activation checkpointing", "cuda-oom", (3,), "Measure with checkpointing",
             lambda: measure_checkpointing(),
             lambda: text_diff("for layer in model.layers:\n    x = layer(x)\n",
                               "from torch.utils.checkpoint import checkpoint\n\nfor layer in model.layers:\n"
                               "    x = checkpoint(layer, x, use_reentrant=False)\n", "model.py"),
             _oom_try({"name": "activation checkpointing", "micro_batch": 8, "accumulation": 2,
                       "checkpointing": True})),
        Step("ZeRO stage up", "cuda-oom", (4,), "Ask the memory planner", plan_check,
             lambda: config_diff(config, stage_up),
             try_unavailable="ZeRO partitions over data-parallel ranks: a 1-process reproduction cannot show it. "
                             "The planner's per-GPU numbers are the check."),
        Step("Offload, last", "offload-last-resort", (0, 1, 2), "Lint the offload config",
             lambda: lint_check(merge_patch(config, offload), world_size, "config with offload"),
             lambda: config_diff(config, offload),
             try_unavailable="Offload moves GPU memory to the host; on a CPU-only machine there is nothing to move."),
    ]
    return Walkthrough("oom", "Out of memory", ("cuda-oom", "cpu-oom", "offload-last-resort"), steps)


def measure_checkpointing() -> Outcome:
    """Peak of the halved micro-batch with and without activation checkpointing, no limit."""
    from troubleshooter.repro import memory as memory

    rung = {"name": "activation checkpointing", "micro_batch": 8, "accumulation": 2, "budget_mb": None}
    plain, ckpt = memory.run_rungs([{**rung, "checkpointing": False}, {**rung, "checkpointing": True}],
                                      stop_when_fits=False)
    return Outcome(f"checkpointing: {plain['peak_vm_mb']:.1f} -> {ckpt['peak_vm_mb']:.1f} MiB peak", True,
                   {"peak without (MiB)": round(plain["peak_vm_mb"], 1),
                    "peak with (MiB)": round(ckpt["peak_vm_mb"], 1),
                    "seconds without": round(plain["seconds"], 2), "seconds with": round(ckpt["seconds"], 2)},
                   ["Checkpointing trades compute (a second forward per layer) for activation memory."])


def router_walkthrough(steps_: int | None = None) -> Walkthrough:
    """Router collapse / load imbalance: measure shares; aux loss; bf16 and warm-up; router init."""
    from troubleshooter.repro import router as rr

    n = steps_ or rr.STEPS

    def measure() -> Outcome:
        run = rr.train_shares(aux_loss_weight=0.0, steps=n)
        worst = max(run.max_share)
        return Outcome(f"without aux loss the busiest expert takes {worst:.0%} of tokens", worst <= rr.COLLAPSE,
                       {"max share (any step)": worst, "final shares": ", ".join(f"{s:.2f}" for s in run.shares[-1]),
                        "aux loss at the end": run.aux[-1]},
                       [f"share = fraction of tokens that pick the expert among their top-{rr.TOP_K} "
                        f"(uniform: {rr.TOP_K / rr.NUM_EXPERTS:.2f})"])

    def pair_try(which: str) -> Callable[[], TryResult]:
        """Before: no aux loss, extreme init. After: ``aux_only`` (this step's fix alone) or
        ``with_fix`` (aux loss and a small-std router init, the next step's fix as well)."""
        def run() -> TryResult:
            result = rr.router_collapse(steps=n)
            after = result.aux_only if which == "aux_only" else result.with_fix

            def nums(r: Any) -> dict:
                return {"max share of one expert (any step)": r.worst,
                        "max share of one expert (last step)": r.max_share[-1],
                        "aux loss (last step)": r.aux[-1], "task loss (last step)": r.task[-1]}

            return TryResult(nums(result.without_fix), nums(after),
                             f"{n} steps, same seed and data; {after.label}. Collapse: one expert above "
                             f"{rr.COLLAPSE:.0%} of tokens.", result.figure())
        return run

    fp16 = {"fp16": {"enabled": True}, "zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 8}
    steps = [
        Step("Measure the expert shares", "router-collapse", (0,), "Measure routing", measure,
             lambda: text_diff("trainer.fit(module)\n",
                               "from lightning_zeromoe.telemetry import expert_shares, global_counts\n\n"
                               "trainer.fit(module)\nfor layer, counts in global_counts(module).items():\n"
                               "    print(layer, [f\"{s:.0%}\" for s in expert_shares(counts)])\n"),
             try_unavailable="Nothing to try yet: this step measures."),
        Step("Add the load-balancing loss (0.01)", "router-collapse", (1,), "Measure routing", measure,
             lambda: text_diff(rr.config_source(aux_loss_weight=0.0), rr.config_source(aux_loss_weight=0.01),
                               "train.py"),
             pair_try("aux_only")),
        Step("bf16 rather than fp16, longer warm-up", "fp16-moe", tuple(range(len(knowledge.get("fp16-moe").fix))),
             "Lint an fp16 MoE config", lambda: lint_check(fp16, 2, "fp16 config"),
             lambda: config_diff(fp16, knowledge.get("fp16-moe").patch_json()),
             try_unavailable="The CPU reproduction trains in fp32; precision effects need a GPU."),
        Step("Router initialisation (and noise)", "router-collapse", (3,), "Measure routing", measure,
             lambda: text_diff(rr.config_source(aux_loss_weight=0.01), rr.config_source(aux_loss_weight=0.01,
                                                                                      extreme_init=False), "train.py"),
             pair_try("with_fix")),
    ]
    return Walkthrough("router-collapse", "Router collapse / load imbalance", ("router-collapse",), steps)


def timeout_walkthrough(log: str | None = None) -> Walkthrough:
    """Collective timeout: find the first failure; raise the timeout where it is read; same order."""

    def first_failure() -> Outcome:
        if log is None:
            return doctor_check("timeouts")
        from troubleshooter.explain import explain_text

        found = explain_text(log)
        return Outcome(f"{len(found)} known problem(s) in the log; the first cause: "
                       f"{found[0].title if found else 'none'}", not found, {},
                       [f"{d.entry_id} (line {d.line_no}): {d.snippet}" for d in found])

    def try_group_timeouts() -> TryResult:
        from troubleshooter.repro import collective_timeout

        result = collective_timeout()

        def nums(run: Any) -> dict:
            return {"world group timeout (s)": run.world_timeout, "expert group timeout (s)": run.expert_group_timeout,
                    "rank 0 waited (s)": run.waited, "timed out": run.timed_out}

        return TryResult(nums(result.before), nums(result.after),
                         f"2 gloo ranks; rank 1 stays away for {result.stuck_for:g} s while rank 0 all-reduces on a "
                         "group made with new_group(ranks), as DeepSpeed makes its expert groups. The fix is "
                         "what ZeroMoEStrategy runs after deepspeed.initialize.")

    steps = [
        Step("Find the first failure", "nccl-watchdog-timeout", (0,), "Read the log / check timeouts", first_failure,
             lambda: text_diff("export NCCL_TIMEOUT=3600\n", "# NCCL_TIMEOUT is read by nothing\n"
                               "grep -n -m1 -E 'Traceback|Error|out of memory' logs/rank*.log\n", "launch.sh"),
             try_unavailable="No reproduction: a timeout is the echo of another failure; find that one first."),
        Step("Raise the timeout where it is read", "nccl-watchdog-timeout", (1,), "Check timeout settings",
             lambda: doctor_check("timeouts"),
             lambda: text_diff("strategy = ZeroMoEStrategy(ep_size=8)\n",
                               "from datetime import timedelta\n\n"
                               "strategy = ZeroMoEStrategy(ep_size=8, timeout=timedelta(minutes=60))\n"),
             try_group_timeouts),
        Step("Same collectives, same order, on every rank", "nccl-watchdog-timeout", (2, 3), "Check NCCL settings",
             lambda: doctor_check("nccl"),
             lambda: text_diff("if trainer.global_rank == 0:\n    trainer.save_checkpoint(path)\n",
                               "trainer.save_checkpoint(path)  # collective under ZeRO-3: every rank calls it\n"),
             try_unavailable="A collective issued by some ranks only hangs the others until the timeout; "
                             "the previous step's reproduction shows that wait."),
    ]
    return Walkthrough("timeout", "Collective timeout", ("nccl-watchdog-timeout", "subgroup-timeout"), steps)


def install_walkthrough() -> Walkthrough:
    """Install or CUDA mismatch: versions, CUDA toolkit vs torch, compiler/ninja, stale JIT locks."""

    def recheck(*families: str) -> Callable[[], TryResult]:
        first: dict[str, Outcome] = {}

        def run() -> TryResult:
            before = first.setdefault("before", doctor_check(*families))
            now = doctor_check(*families)
            first["before"] = now
            return TryResult(before.numbers, now.numbers, "Re-runs the doctor's checks after you applied the fix.")
        return run

    steps = [
        Step("Versions and known-bad combinations", "autoep-transformers-5.23", (0,), "Check versions",
             lambda: doctor_check("versions"),
             lambda: text_diff("deepspeed==0.19.8\ntransformers\n", "deepspeed==0.19.8\ntransformers>=5.17,<5.23\n",
                               "requirements.txt"), recheck("versions")),
        Step("torch's CUDA vs the system CUDA", "cuda-version-mismatch", (0, 1), "Check CUDA",
             lambda: doctor_check("cuda"),
             lambda: text_diff("pip install torch\n",
                               "pip install torch --index-url https://download.pytorch.org/whl/cu124\n", "setup.sh"),
             recheck("cuda")),
        Step("Compiler, ninja and CUDA_HOME for JIT-built ops", "missing-compiler", (0,), "Check the build tools",
             lambda: doctor_check("build"),
             lambda: text_diff("pip install deepspeed\n", "apt-get install -y build-essential ninja-build\n"
                               "pip install deepspeed\n", "setup.sh"), recheck("build")),
        Step("Stale JIT build locks", "stale-extension-lock", (0, 1), "Look for stale locks",
             lambda: doctor_check("env"),
             lambda: text_diff("python train.py\n", "find ${TORCH_EXTENSIONS_DIR:-~/.cache/torch_extensions} "
                               "-name lock -delete\npython train.py\n", "launch.sh"), recheck("env")),
    ]
    return Walkthrough("install", "Install or CUDA mismatch",
                       ("cuda-version-mismatch", "cuda-home-missing", "missing-compiler", "stale-extension-lock"),
                       steps)


#: The seeds' style of config: a "moe" block (ignored by DeepSpeed) and ZeRO stage 3.
NATIVE_MOE_CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                     "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
                     "moe": {"enabled": True, "ep_size": 2, "num_experts": 4, "top_k": 2}}


def native_moe_walkthrough(config: Mapping | None = None, world_size: int = 2) -> Walkthrough:
    """ZeRO-3 with native MoE: DeepSpeed refuses it; stage 2 with native MoE, or AutoEP under stage 3."""
    config = dict(config or NATIVE_MOE_CONFIG)
    stage2 = {"zero_optimization": {"stage": 2}, "moe": None}
    autoep = knowledge.get("native-moe-zero3").patch_json()

    def run_try() -> TryResult:
        from troubleshooter.repro import native_moe_zero3

        r = native_moe_zero3()
        return TryResult({"ZeRO stage": 3, "outcome": r.error_type, "message": r.error_message[:120]},
                         {"ZeRO stage": r.fix_stage, "outcome": f"trained {len(r.fix_losses)} steps",
                          "loss first -> last": f"{r.fix_losses[0]:.3f} -> {r.fix_losses[-1]:.3f}"},
                         r.fix_description)

    steps = [
        Step("Lint the config", "native-moe-zero3", (0,), "Lint the config",
             lambda: lint_check(config, world_size), lambda: config_diff(config, stage2), run_try),
        Step("Or keep ZeRO-3 and use AutoEP", "native-moe-zero3", (1, 2), "Lint the AutoEP config",
             lambda: lint_check(merge_patch(config, autoep), world_size, "AutoEP config"),
             lambda: config_diff(config, autoep) + text_diff(
                 "strategy = DeepSpeedStrategy(config=ds_config)\n",
                 "from lightning_zeromoe import ZeroMoEStrategy\n\nstrategy = ZeroMoEStrategy(ep_size=2)\n"),
             try_unavailable="lightning_zeromoe's demo and notebook 04 run AutoEP under ZeRO-3 on 2 CPU processes."),
        Step("Native MoE under ZeRO 1/2: MoE parameter groups", "moe-param-groups", (0, 1), "Lint the stage-2 config",
             lambda: lint_check(merge_patch(config, stage2), world_size, "stage-2 config"),
             lambda: knowledge.get("moe-param-groups").patch or "", run_try),
    ]
    return Walkthrough("native-moe-zero3", "ZeRO-3 with native MoE", ("native-moe-zero3", "moe-param-groups"), steps)


def scan_forward_sources(model: Any = None) -> Outcome:
    """Read the source of every module class's ``forward`` and flag what breaks ZeRO-3: device or
    dtype moves (``.to(``, ``.cuda(``, ``.half(``...) and cached ``.data``. A static look, so it
    also finds code paths a short run would not take. Default model: the tiny MoE."""
    import inspect
    import re

    if model is None:
        from lightning_zeromoe.models import TinyMoEConfig, TinyMoELM

        model = TinyMoELM(TinyMoEConfig())
    pattern = re.compile(r"\.(to|cuda|cpu|half|float|bfloat16|double)\(|\.data\b")
    found, seen = [], set()
    for name, module in model.named_modules():
        cls = type(module)
        if cls in seen or cls.__module__.startswith("torch."):
            continue
        seen.add(cls)
        try:
            lines, start = inspect.getsourcelines(cls.forward)
        except (OSError, TypeError):
            continue
        for offset, line in enumerate(lines):
            if pattern.search(line) and not line.strip().startswith("#"):
                found.append(f"{cls.__name__}.forward line {start + offset}: {line.strip()}")
    tied = []
    try:
        from lightning_zeromoe.pitfalls import find_tied_parameters

        tied = [" = ".join(t.paths) for t in find_tied_parameters(model)]
    except ImportError:
        pass
    return Outcome(f"{len(found)} suspicious line(s) in forward, {len(tied)} tied parameter group(s)", not found,
                   {"module classes read": len(seen), "tied groups": len(tied)},
                   [*found, *(f"tied: {t}" for t in tied)])


def pitfalls_walkthrough(model: Any = None) -> Walkthrough:
    """Tied weights, device moves, stale parameter copies under ZeRO-3."""

    def pit_try(name: str) -> Callable[[], TryResult]:
        def run() -> TryResult:
            import troubleshooter.repro as repro

            r = getattr(repro, name)()
            return TryResult(r.before, r.after, r.summary_line)
        return run

    def tied_check() -> Outcome:
        from lightning_zeromoe.models import TinyMoEConfig, TinyMoELM

        return scan_forward_sources(model if model is not None else TinyMoELM(TinyMoEConfig(tie_embeddings=True)))

    steps = [
        Step("Tied or shared weights", "zero3-param-not-available", (2, 0), "Find tied parameters", tied_check,
             lambda: text_diff("strategy = ZeroMoEStrategy(ep_size=2)\n",
                               "strategy = ZeroMoEStrategy(\n    ep_size=2, shared_parameters={\"head\": "
                               "[\"embed.weight\"]})\n"),
             pit_try("tied_weights")),
        Step("Device and dtype moves in forward", "device-mismatch", (1, 2), "Scan forward for moves",
             lambda: scan_forward_sources(model),
             lambda: text_diff("    def forward(self, x):\n        self.proj.to(\"cuda\")\n"
                               "        mask = torch.ones(x.shape[1]).cuda()\n",
                               "    def forward(self, x):\n        mask = torch.ones(x.shape[1], device=x.device)\n",
                               "model.py"),
             pit_try("device_move")),
        Step("Stale parameter copies (cached .data)", "zero3-param-not-available", (0, 1), "Scan forward for .data",
             lambda: scan_forward_sources(model),
             lambda: text_diff("    def forward(self, x):\n        if self._w is None:\n"
                               "            self._w = self.proj.weight.data\n        return x @ self._w.t()\n",
                               "    def forward(self, x):\n        return self.proj(x)\n", "model.py"),
             pit_try("stale_param_copy")),
    ]
    return Walkthrough("zero3-pitfalls", "Tied weights, device moves, stale parameter copies (ZeRO-3)",
                       ("zero3-param-not-available", "device-mismatch"), steps)


BUILDERS: dict[str, Callable[..., Walkthrough]] = {
    "oom": oom_walkthrough,
    "router-collapse": router_walkthrough,
    "timeout": timeout_walkthrough,
    "install": install_walkthrough,
    "native-moe-zero3": native_moe_walkthrough,
    "zero3-pitfalls": pitfalls_walkthrough,
}

#: Knowledge-base family -> walkthrough. Families without one (config, host) get a panel only.
WALKTHROUGH_FOR = {**{f: f for f in BUILDERS}, "autoep": "native-moe-zero3"}


def walkthrough(family: str, **context: Any) -> Walkthrough:
    """The walkthrough for a knowledge-base family (``oom``, ``router-collapse``, ...)."""
    try:
        return BUILDERS[WALKTHROUGH_FOR[family]](**context)
    except KeyError:
        raise KeyError(f"no walkthrough for family {family!r}; there are: {', '.join(BUILDERS)}") from None


# ---------------------------------------------------------------------------------------------
# The diagnosis panel (automatic after a failed cell, and from %%troubleshoot)
# ---------------------------------------------------------------------------------------------


class DiagnosisPanel(W.VBox):
    """What the knowledge base knows about an error, and a button that opens the walkthrough.

    ``full=False`` is the short panel appended after any failed cell: the problem, the line that
    matched and the first fix. ``full=True`` (``%%troubleshoot``) adds the cause, every fix step
    and the entry's patch.
    """

    def __init__(self, diagnoses: list, *, full: bool = False) -> None:
        self.diagnoses = diagnoses
        self.diagnosis = diagnoses[0]
        self.full = full
        self.walkthrough: Walkthrough | None = None
        self.summary = W.HTML(self._html())
        family = WALKTHROUGH_FOR.get(self.diagnosis.family)
        self.button = W.Button(description=f"Open walkthrough: {family}" if family else "No walkthrough",
                               icon="life-ring", disabled=family is None, layout=W.Layout(width="auto"))
        self.button.on_click(lambda _b: self.open_walkthrough())
        super().__init__([self.summary, self.button])

    def _html(self) -> str:
        d = self.diagnosis
        colour = {"error": "#c62828", "warning": "#b26a00"}.get(d.severity, "#1565c0")
        parts = [f"<div class='troubleshooter-diagnosis' style='border-left:4px solid {colour};padding-left:8px'>"
                 f"<b>troubleshooter: {_esc(d.title)}</b> <code>{_esc(d.entry_id)}</code>",
                 f"<div style='color:#555'>matched: <code>{_esc(d.snippet)}</code></div>"]
        if self.full:
            parts.append(f"<div>{_esc(d.cause)}</div><ol>" + "".join(f"<li>{_esc(f)}</li>" for f in d.fix) + "</ol>")
            if d.patch:
                parts.append(diff_html(d.patch) if d.patch_kind == "diff" else
                             "<b>config patch</b>" + diff_html(json.dumps(json.loads(d.patch), indent=2)))
        else:
            parts.append(f"<div><b>first fix</b> {_esc(d.fix[0])}</div>")
        others = [o.entry_id for o in self.diagnoses[1:4]]
        if others:
            parts.append(f"<div style='color:#777'>also matched: {_esc(', '.join(others))}</div>")
        return "".join(parts) + "</div>"

    def open_walkthrough(self) -> Walkthrough | None:
        """Build the walkthrough for this family and show it under the panel (once)."""
        family = WALKTHROUGH_FOR.get(self.diagnosis.family)
        if family is None:
            return None
        if self.walkthrough is None:
            self.walkthrough = walkthrough(family)
            self.children = (*self.children, self.walkthrough)
            self.button.disabled = True
        return self.walkthrough

    def plain(self) -> str:
        d = self.diagnosis
        text = f"troubleshooter: {d.title} [{d.entry_id}]\n  matched: {d.snippet}\n"
        if self.full:
            text += textwrap.indent(d.cause, "  ") + "\n" + "".join(f"  {i}. {f}\n" for i, f in enumerate(d.fix, 1))
        else:
            text += f"  first fix: {d.fix[0]}\n"
        family = WALKTHROUGH_FOR.get(d.family)
        return text + (f"  walkthrough: {family}" if family else "  (no walkthrough for this family)")

    def __repr__(self) -> str:
        return self.plain()

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        """The widget view, plus the whole plain text (ipywidgets cuts ``text/plain`` at 110 chars)."""
        data = super()._repr_mimebundle_(**kwargs)
        data["text/plain"] = self.plain()
        return data
