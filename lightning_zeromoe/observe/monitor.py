"""``ExpertUtilizationMonitor``: watch expert load per MoE layer, and raise the alarm on collapse.

Why: router collapse does not raise an error. One expert takes most tokens, others starve, and
the first visible symptom is a loss spike or NaN many steps later (the seeds' "路由塌缩"). The
only early signal is the routing statistics, and the aux loss read *separately* from the task
loss (an aux loss that is flat from step 1 is a signal of its own).

What it reads: the ``tokens_per_expert`` counter that both AutoEP's ``AutoEPMoELayer`` and our
``MoEBlock`` keep (top-k assignments per global expert, counted by the rank that routed the
tokens). Every ``every_n_steps`` optimizer steps it sums the counters over all ranks, logs the
window's statistics, and zeroes the counters, so each log covers the steps since the previous one
(``<prefix>/<layer>/tokens`` is the window's token count: constant for a constant batch, which
shows the numbers are windowed, not cumulative).

Shares. ``share_e`` is the fraction of the layer's *tokens* that were sent to expert ``e``
(``count_e * top_k / sum(counts)``, between 0 and 1; the shares sum to ``top_k``). Under perfectly
uniform top-k routing every expert sees ``top_k / num_experts`` of the tokens, which for the tiny
model (top-2 of 4) is already 50%. So the collapse test cannot be "share > 0.5" literally; it is
the *collapse score*: how far the busiest expert has moved from uniform towards receiving every
token, ``(max_share - k/E) / (1 - k/E)``. For top-1 routing over many experts the score is the
busiest expert's share, i.e. the seeds' "one expert takes more than 50% of the tokens".

Remedies. An alarm names the remedies that apply to *this* model by their knowledge-base fix ids
(entry ``router-collapse``, ``lightning_zeromoe/knowledge/entries/router-collapse.toml``) followed by
the knowledge base's own text: ``add-aux-loss``, ``bias-balancing`` (only when the model routes
with a choice-only bias and no :class:`~lightning_zeromoe.balance.balancer.ExpertBiasBalancer` runs
already), ``router-z-loss``, ``larger-batch``, ``bf16-and-warmup``, ``check-router-init``. The
advice itself, and every message the monitor warns with, lives only in the knowledge base.

The load picture. With ``heatmap=True`` each window's per-layer x per-expert load is also drawn
as a heatmap and logged as an image (:mod:`lightning_zeromoe.observe.load_heatmap`: TensorBoard, loggers
with ``log_image``; a PNG next to the logs for CSV and other loggers, said once).
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from lightning_zeromoe import knowledge
from lightning_zeromoe.observe.telemetry import expert_counters, global_counts

log = logging.getLogger(__name__)


class ExpertCollapseWarning(UserWarning):
    """Routing collapse or a dead expert, found by :class:`ExpertUtilizationMonitor`."""


#: The knowledge-base entry whose fixes an alarm cites, and those fixes in the order it names them.
ENTRY = "router-collapse"
REMEDIES = ("add-aux-loss", "bias-balancing", "router-z-loss", "larger-batch", "bf16-and-warmup", "check-router-init")


def applicable_remedies(trainer: L.Trainer, pl_module: L.LightningModule) -> tuple[tuple[str, ...], dict[str, str]]:
    """The fix ids of :data:`REMEDIES` that apply to this model, and those that do not with why."""
    from lightning_zeromoe.balance.balancer import ExpertBiasBalancer, find_score_biases

    skipped: dict[str, str] = {}
    if any(isinstance(c, ExpertBiasBalancer) for c in trainer.callbacks):
        skipped["bias-balancing"] = "ExpertBiasBalancer already runs"
    elif not find_score_biases(pl_module)[0]:
        skipped["bias-balancing"] = "the model has no choice-only routing bias"
    return tuple(f for f in REMEDIES if f not in skipped), skipped


def remedies_text(fix_ids: tuple[str, ...], skipped: dict[str, str]) -> str:
    """``Remedies for this model (knowledge base entry router-collapse): [add-aux-loss] <its text> ...``."""
    cited = " ".join(f"[{f}] {knowledge.fix(ENTRY, f).render()}" for f in REMEDIES if f in fix_ids)
    text = knowledge.message(ENTRY, "remedies").render(entry=ENTRY, cited=cited)
    if skipped:
        text += " " + knowledge.message(ENTRY, "not-applicable").render(
            skipped="; ".join(f"[{f}] {why}" for f, why in skipped.items()))
    return text


@dataclass(frozen=True)
class LayerStats:
    """One layer's routing over one window."""

    layer: str
    counts: tuple[float, ...]  # top-k assignments per expert, summed over ranks
    shares: tuple[float, ...]
    max_share: float
    collapse_score: float
    cv: float
    entropy: float
    dead: tuple[int, ...]


@dataclass(frozen=True)
class Alarm:
    """One alarm: where, what, the message, and the knowledge-base fix ids it names."""

    step: int
    layer: str
    kind: str  # "collapse" | "dead"
    message: str
    fix_ids: tuple[str, ...] = ()


def layer_stats(layer: str, counts: torch.Tensor, top_k: int) -> LayerStats | None:
    """Statistics of one window's counts; None when the layer routed nothing."""
    c = counts.double()
    total = float(c.sum())
    if total <= 0:
        return None
    num_experts = c.numel()
    assign = c / total  # sums to 1
    shares = (assign * top_k).clamp(max=1.0)
    uniform = top_k / num_experts
    max_share = float(shares.max())
    score = (max_share - uniform) / (1 - uniform) if uniform < 1 else 0.0
    mean = float(c.mean())
    cv = float(c.std(unbiased=False)) / mean if mean else 0.0
    nz = assign[assign > 0]
    entropy = float(-(nz * nz.log()).sum()) / math.log(num_experts) if num_experts > 1 else 1.0
    dead = tuple(int(i) for i in torch.nonzero(c == 0).flatten().tolist())
    return LayerStats(layer, tuple(c.tolist()), tuple(shares.tolist()), max_share, max(score, 0.0), cv, entropy, dead)


class ExpertUtilizationMonitor(L.Callback):
    """Logs per-layer expert load every ``every_n_steps`` steps and warns on routing collapse.

    Args:
        every_n_steps: Optimizer steps per window (log and reset).
        collapse_share: Collapse-score threshold (see module docstring); 0.5 means the busiest
            expert is halfway from uniform to taking every token (top-1: > 50% of the tokens).
        patience: Consecutive windows the collapse condition must hold before the alarm. Early
            routing fluctuates (the seeds: the first few hundred steps are noisy); 1 alarms at once.
        dead_steps: An expert that receives no token for this many steps is reported dead.
        stop_on_collapse: Also stop training (``trainer.should_stop``) when an alarm fires.
        aux_loss_key: ``trainer.callback_metrics`` name of the aux loss (``TinyMoEModule`` logs
            ``train/aux_loss``). Its mean over the window is logged as ``<prefix>/aux_loss``.
        task_loss_key: The same for the task loss (``train/task_loss``; logged as ``<prefix>/task_loss``).
        top_k: Experts per token; read from the MoE layers or the model's config when None.
        prefix: Metric name prefix.
        heatmap: Also log each window's per-layer x per-expert load as an image
            (:mod:`lightning_zeromoe.observe.load_heatmap`); needs matplotlib.

    Every rank must run the callback (the counters are summed with an all-reduce); only rank 0 logs
    and warns. All ranks take the same stop decision, since they see the same global counts.
    """

    def __init__(self, every_n_steps: int = 50, *, collapse_share: float = 0.5, patience: int = 2,
                 dead_steps: int = 200, stop_on_collapse: bool = False, aux_loss_key: str | None = "train/aux_loss",
                 task_loss_key: str | None = "train/task_loss", top_k: int | None = None,
                 prefix: str = "experts", heatmap: bool = False) -> None:
        if every_n_steps < 1 or patience < 1 or dead_steps < 1:
            raise ValueError("every_n_steps, patience and dead_steps must be >= 1")
        if not 0 < collapse_share < 1:
            raise ValueError(f"collapse_share={collapse_share} must be between 0 and 1")
        self.every_n_steps = every_n_steps
        self.collapse_share = collapse_share
        self.patience = patience
        self.dead_steps = dead_steps
        self.stop_on_collapse = stop_on_collapse
        self.aux_loss_key = aux_loss_key
        self.task_loss_key = task_loss_key
        self.top_k = top_k
        self.prefix = prefix
        self.heatmap = heatmap
        if heatmap:
            from lightning_zeromoe.observe.load_heatmap import require_matplotlib

            require_matplotlib()
        self.alarms: list[Alarm] = []
        self.remedies: tuple[str, ...] = REMEDIES
        self._skipped: dict[str, str] = {}
        #: Where heatmaps went that a logger could not take as images (said once each, on rank 0).
        self.heatmap_notes: list[str] = []
        self.history: list[tuple[int, dict[str, LayerStats]]] = []
        self._warned: set[tuple[str, str]] = set()
        self._streak: dict[str, int] = {}
        self._last_alive: dict[str, list[int]] = {}
        self._last_step = -1
        self._losses: dict[str, tuple[Any, int]] = {}
        self._saved: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ hooks

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.remedies, self._skipped = applicable_remedies(trainer, pl_module)
        counters = expert_counters(pl_module)
        if not counters:
            self._warn_once("<model>", "none", knowledge.message(ENTRY, "no-counter").render(), trainer)
        for counter in counters.values():
            counter.zero_()
        start = trainer.global_step
        self._last_alive = {name: [start] * c.numel() for name, c in counters.items()}
        self._last_step = start
        if self.top_k is None:
            self.top_k = _find_top_k(pl_module)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        for key in (self.aux_loss_key, self.task_loss_key):
            value = trainer.callback_metrics.get(key) if key else None
            if value is not None:
                # Summed as tensors on the device; converted once per window, not once per step
                # (on a GPU each float()/.item() waits for the device).
                total, n = self._losses.get(key, (0.0, 0))
                value = value.detach() if isinstance(value, torch.Tensor) else value
                self._losses[key] = (total + value, n + 1)
        step = trainer.global_step
        if step == self._last_step or step % self.every_n_steps:
            return
        self._last_step = step
        self._window(trainer, pl_module, step)

    # Validation forwards also count tokens; keep them out of the training windows.
    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._saved = {name: c.clone() for name, c in expert_counters(pl_module).items()}

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for name, counter in expert_counters(pl_module).items():
            if name in self._saved:
                counter.copy_(self._saved[name])
        self._saved = {}

    # ------------------------------------------------------------------ one window

    def _window(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        comm = self._comm_window(trainer)  # first: the counters' all-reduce below belongs to the next step
        counts = global_counts(pl_module, reset=True)  # collective: every rank gets here at the same step
        top_k = self.top_k or 1
        metrics: dict[str, float] = {}
        stats: dict[str, LayerStats] = {}
        for layer, c in counts.items():
            s = layer_stats(layer, c, top_k)
            if s is None:
                continue
            stats[layer] = s
            base = f"{self.prefix}/{layer}"
            for e, share in enumerate(s.shares):
                metrics[f"{base}/share_{e}"] = share
            metrics.update({f"{base}/tokens": sum(s.counts) / top_k, f"{base}/max_share": s.max_share,
                            f"{base}/collapse_score": s.collapse_score,
                            f"{base}/cv": s.cv, f"{base}/entropy": s.entropy, f"{base}/dead": float(len(s.dead))})
            self._check(trainer, step, s, top_k)
        if self.aux_loss_key and self.aux_loss_key not in self._losses and stats:
            self._warn_once("<model>", "no-aux", knowledge.compose(ENTRY, "no-aux-loss", "log-aux-loss-key",
                                                                  key=self.aux_loss_key), trainer)
        for key, name in ((self.aux_loss_key, "aux_loss"), (self.task_loss_key, "task_loss")):
            total, n = self._losses.pop(key, (0.0, 0)) if key else (0.0, 0)
            if n:
                metrics[f"{self.prefix}/{name}"] = float(total) / n
        self._losses = {}
        metrics.update(comm)
        self.history.append((step, stats))
        if trainer.is_global_zero and metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
        if self.heatmap and trainer.is_global_zero and stats and trainer.loggers:
            self._log_heatmap(trainer, stats, step, top_k)
        if self.stop_on_collapse and self.alarms and not trainer.should_stop:
            trainer.should_stop = True
            if trainer.is_global_zero:
                log.warning("ExpertUtilizationMonitor: stopping training (stop_on_collapse=True).")

    def _comm_window(self, trainer: L.Trainer) -> dict[str, float]:
        """With a CommLedger running: its mean bytes per step over this window (``<prefix>/comm/...``)."""
        from lightning_zeromoe.observe.comm_ledger import find_ledger

        ledger = find_ledger(trainer)
        if ledger is None:
            return {}
        ledger.sync(trainer)
        return ledger.window_metrics(self.history[-1][0] if self.history else -1, prefix=f"{self.prefix}/comm")

    def _log_heatmap(self, trainer: L.Trainer, stats: dict[str, LayerStats], step: int, top_k: int) -> None:
        from lightning.pytorch.utilities import rank_zero_info

        from lightning_zeromoe.observe.load_heatmap import load_heatmap, log_heatmap

        fig = load_heatmap(stats, top_k, step, self.every_n_steps)
        for note in log_heatmap(trainer, fig, step, f"{self.prefix}/load_heatmap"):
            if note not in self.heatmap_notes:
                self.heatmap_notes.append(note)
                rank_zero_info(f"ExpertUtilizationMonitor: {note}")

    def history_figure(self) -> Any:
        """The load over every window so far, one panel per layer (:func:`load_heatmap.history_figure`)."""
        from lightning_zeromoe.observe.load_heatmap import history_figure

        return history_figure(self.history, self.top_k or 1)

    def _check(self, trainer: L.Trainer, step: int, s: LayerStats, top_k: int) -> None:
        collapsed = s.collapse_score > self.collapse_share
        self._streak[s.layer] = self._streak.get(s.layer, 0) + 1 if collapsed else 0
        if self._streak[s.layer] >= self.patience:
            busiest = max(range(len(s.shares)), key=lambda e: s.shares[e])
            found = knowledge.message(ENTRY, "collapse").render(
                layer=s.layer, step=step, busiest=busiest, share=s.shares[busiest], top_k=top_k,
                num_experts=len(s.shares), uniform=top_k / len(s.shares), score=s.collapse_score,
                threshold=self.collapse_share, windows=self._streak[s.layer], every=self.every_n_steps,
                shares=", ".join(f"{x:.2f}" for x in s.shares))
            self._alarm(trainer, step, s.layer, "collapse", found + " " + remedies_text(self.remedies, self._skipped))
        alive = self._last_alive.setdefault(s.layer, [self._last_step] * len(s.counts))
        for e, count in enumerate(s.counts):
            if count > 0:
                alive[e] = step
        dead_for = [e for e in range(len(alive)) if step - alive[e] >= self.dead_steps]
        if dead_for:
            found = knowledge.message(ENTRY, "dead").render(dead=dead_for, layer=s.layer, dead_steps=self.dead_steps,
                                                            step=step)
            self._alarm(trainer, step, s.layer, "dead", found + " " + remedies_text(self.remedies, self._skipped))

    def _alarm(self, trainer: L.Trainer, step: int, layer: str, kind: str, message: str) -> None:
        if (layer, kind) in self._warned:
            return
        self.alarms.append(Alarm(step, layer, kind, message, self.remedies))
        self._warn_once(layer, kind, message, trainer)

    def _warn_once(self, layer: str, kind: str, message: str, trainer: L.Trainer) -> None:
        if (layer, kind) in self._warned:
            return
        self._warned.add((layer, kind))
        if trainer.is_global_zero:
            warnings.warn(message, ExpertCollapseWarning, stacklevel=2)
            log.warning(message)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"alarms": [a.__dict__ for a in self.alarms], "warned": sorted(self._warned)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.alarms = [Alarm(**{**a, "fix_ids": tuple(a.get("fix_ids", ()))}) for a in state_dict.get("alarms", [])]
        self._warned = {tuple(w) for w in state_dict.get("warned", [])}


def _find_top_k(module: torch.nn.Module) -> int | None:
    """top_k from a MoE layer (ours: ``top_k``; AutoEP: its router's ``top_k``) or a config."""
    for m in module.modules():
        for holder in (m, getattr(m, "router", None)):
            k = getattr(holder, "top_k", None)
            if isinstance(k, int) and hasattr(m, "tokens_per_expert"):
                return k
    for m in module.modules():
        cfg = getattr(m, "config", None)
        k = getattr(cfg, "num_experts_per_tok", None) or getattr(cfg, "top_k", None)
        if isinstance(k, int):
            return k
    return None


__all__ = ["ENTRY", "REMEDIES", "Alarm", "ExpertCollapseWarning", "ExpertUtilizationMonitor", "LayerStats",
           "applicable_remedies", "layer_stats", "remedies_text"]
