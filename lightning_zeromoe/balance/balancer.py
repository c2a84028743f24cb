"""``ExpertBiasBalancer``: aux-loss-free load balancing of a model's own choice-only routing bias.

Usage::

    from lightning_zeromoe.balance.balancer import ExpertBiasBalancer

    trainer = L.Trainer(strategy=ZeroMoEStrategy(ep_size=8), callbacks=[ExpertBiasBalancer(update_rate=1e-3)])

After each optimizer step it sums, over every rank, how many top-k assignments each expert of each
MoE layer received during the step, and moves the layer's choice-only bias by
``update_rate * sign(mean_load - load)`` (:func:`lightning_zeromoe.balance.rules.bias_update`;
the module docstring there compares the DeepSeek-V3 paper's rule, used here, with torchtitan's
centred variant, ``centered=True``).

**Which bias.** Only one the model already has and routes with for the choice only:
DeepSeek-V3-style ``e_score_correction_bias`` (on the router, or on the block) and AFMoE /
LFM2-MoE's ``expert_bias``, found by :func:`find_score_biases` in the model's own blocks
(ZeRO-3 without EP, the fallback blocks) and in AutoEP's layers (AutoEP's router holds the bias as
``router.e_score_correction_bias``). A model without one is refused
(``[bias-balancing-refused]``): adding a bias would change the model, which would then route
differently from the one its config describes and from what export writes. A bias the optimizer
trains (``requires_grad``) is refused too: each optimizer step would overwrite the update.

**Where the loads come from.** Each rank counts the choices of the tokens it routed: AutoEP's
router returns them (``num_tokens_per_expert``), the model's own blocks hand them to their experts
module (the integer top-k indices). The counts of a step are all-reduced once (one tensor for
every layer) over the default process group: every rank holds identical counts, so every rank
applies the identical update. Forwards in eval mode (validation) are not counted. An
activation-checkpointing recomputation is not told apart: it counts its micro-batch again, with the
same choices, which scales every expert's count of that layer alike and so changes no sign (only the
logged loads).

**State.** The bias is model state: a persistent buffer or a (frozen) parameter, saved in every
checkpoint, put back on resume on any shape (:mod:`lightning_zeromoe.checkpoint.resume.module_state`) and exported
under the model's own name. Under ZeRO-3 a bias that is a parameter is partitioned; the update
gathers it, changes it on every rank and hands rank 0's copy back (``GatheredParameters``). The
callback keeps an fp32 copy of each bias, so that a bf16 model's bias still moves by steps
smaller than bf16's spacing; the copy is also in the callback's checkpoint state, and is used
again on resume when the model's restored bias equals it in the model's dtype.

**Checked identical.** Every ``check_every_n_steps`` steps (and when training starts) each
layer's bias is compared across ranks with one all-reduce (max of ``b`` and of ``-b``); a spread
above ``tolerance`` raises ``[bias-balancing-diverged]``, naming the layer and the spread.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Any, Iterator

import lightning as L
import torch
from torch import nn
from typing_extensions import override

from lightning_zeromoe.engine import collectives
from lightning_zeromoe.balance.rules import bias_update, router_z_loss
from lightning_zeromoe._private import deepspeed as ds_private
from lightning_zeromoe.knowledge import entry_of, say

log = logging.getLogger(__name__)

#: Knowledge-base entries (``lightning_zeromoe/knowledge/entries/<id>.toml``) of the errors raised here.
REFUSED = "bias-balancing-refused"
DIVERGED = "bias-balancing-diverged"

__all__ = ["BiasBalancingError", "BiasSite", "DIVERGED", "ExpertBiasBalancer", "REFUSED", "find_score_biases",
           "router_z_loss"]


class BiasBalancingError(RuntimeError):
    """The balancer cannot run on this model, or the ranks' biases differ; the message starts with
    ``[<entry_id>] ``, its knowledge-base entry."""

    def __init__(self, message: str) -> None:  # message: knowledge.say(entry_id, ...)
        self.entry_id = entry_of(message)
        super().__init__(message)


@dataclass(eq=False)
class BiasSite:
    """One MoE layer's choice-only bias, and the module whose calls say which experts were chosen."""

    layer: str          # the MoE layer's path in the module the balancer was given
    owner: nn.Module    # the module holding the bias ...
    attr: str           # ... as this attribute
    name: str           # the bias's path in that module (AutoEP's while AutoEP holds it)
    counter: nn.Module  # hooked to count the layer's top-k choices
    kind: str           # "autoep-router" (its output's 3rd item) | "expert-indices" (experts' int input)
    num_experts: int

    @property
    def tensor(self) -> torch.Tensor:
        return getattr(self.owner, self.attr)


def _autoep_layers(root: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in root.named_modules() if ds_private.is_autoep_layer(m)}


def find_score_biases(root: nn.Module) -> tuple[list[BiasSite], list[str]]:
    """The choice-only biases of every MoE layer under ``root``, and the MoE layers without one.

    AutoEP layers: their router's ``e_score_correction_bias`` (AutoEP copies it there from the
    block, see :mod:`lightning_zeromoe.checkpoint.autoep_names`). Other MoE blocks (found by structure,
    :func:`lightning_zeromoe.discovery.structure.find_blocks`): the block's
    :attr:`~lightning_zeromoe.discovery.structure.BlockLayout.score_bias`.
    """
    sites: list[BiasSite] = []
    without: list[str] = []
    autoep = _autoep_layers(root)
    for path, layer in autoep.items():
        bias = getattr(layer.router, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            sites.append(BiasSite(path, layer.router, "e_score_correction_bias", f"{path}.router.e_score_correction_bias",
                                  layer.router, "autoep-router", _size(bias)))
        else:
            without.append(path)
    for layout in _blocks(root):
        if any(layout.path == p or layout.path.startswith(p + ".") for p in autoep):
            continue
        if layout.score_bias is None:
            without.append(layout.path)
            continue
        block = root.get_submodule(layout.path)
        owner_path, _, attr = layout.score_bias.rpartition(".")
        owner = block.get_submodule(owner_path) if owner_path else block
        sites.append(BiasSite(layout.path, owner, attr, f"{layout.path}.{layout.score_bias}",
                              block.get_submodule(layout.experts), "expert-indices", _size(getattr(owner, attr))))
    return sites, without


def _size(tensor: torch.Tensor) -> int:
    """Elements of a tensor, also of a ZeRO-3 partitioned parameter (one bias per expert)."""
    from lightning_zeromoe.discovery.structure import shape_of

    return math.prod(shape_of(tensor))


def _blocks(root: nn.Module) -> list[Any]:
    """MoE blocks by structure; under a module with a Hugging Face config, also those whose experts are
    not 3-D (found with the config's expert count, e.g. Inkling's)."""
    from lightning_zeromoe.discovery.structure import expected_num_experts, find_blocks

    layouts = {b.path: b for b in find_blocks(root)}
    for name, module in root.named_modules():
        config = getattr(module, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        num_experts = expected_num_experts(text) if text is not None else None
        if num_experts:
            for layout in find_blocks(module, num_experts, prefix=name):
                layouts.setdefault(layout.path, layout)
    return list(layouts.values())


def _first_index_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dtype != torch.bool:
            return value
    return None


@contextlib.contextmanager
def _gathered(tensors: list[torch.Tensor], modifier_rank: int | None) -> Iterator[None]:
    """ZeRO-3 partitioned parameters among ``tensors`` gathered whole for the block (no-op otherwise);
    with ``modifier_rank``, that rank's values are handed back to every partition on exit."""
    partitioned = [t for t in tensors if hasattr(t, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank):
        yield


class ExpertBiasBalancer(L.Callback):
    """Aux-loss-free load balancing: after each optimizer step, ``b_i += rate * sign(mean - load_i)``.

    Args:
        update_rate: The step of each bias per optimizer step (DeepSeek-V3's bias update speed,
            ``gamma``; they used 1e-3). Biases sit beside scores in [0, 1] (sigmoid or softmax), so
            a rate r moves an expert's choice by at most r per step.
        centered: Subtract the step's mean from the update (torchtitan's variant; the same
            routing, biases with a zero sum).
        check_every_n_steps: How often the biases are compared across ranks (one all-reduce).
        tolerance: The largest spread across ranks that is accepted (the update is identical on
            every rank, so 0).
        log_every_n_steps: How often rank 0 logs each layer's bias range and busiest expert's load
            relative to the mean (``balancing/<layer>/...``) to the Trainer's loggers.

    Every rank must run the callback (the counts are all-reduced every step).
    """

    def __init__(self, update_rate: float = 1e-3, *, centered: bool = False, check_every_n_steps: int = 50,
                 tolerance: float = 0.0, log_every_n_steps: int = 50) -> None:
        if not update_rate > 0:
            raise ValueError(f"update_rate={update_rate} must be > 0")
        if check_every_n_steps < 1 or log_every_n_steps < 1:
            raise ValueError("check_every_n_steps and log_every_n_steps must be >= 1")
        self.update_rate = update_rate
        self.centered = centered
        self.check_every_n_steps = check_every_n_steps
        self.tolerance = tolerance
        self.log_every_n_steps = log_every_n_steps
        self.sites: list[BiasSite] = []
        self.updates = 0
        #: The counts (summed over ranks) of the last step the biases were updated from, by layer.
        self.last_counts: dict[str, torch.Tensor] = {}
        #: This rank's counts since the last update, per site, on the device they were counted on.
        self._counts: list[torch.Tensor | None] = []
        self._master: list[torch.Tensor] = []
        self._saved_master: dict[str, torch.Tensor] = {}
        self._hooks: list[Any] = []
        self._last_step = -1

    # ------------------------------------------------------------------ set-up

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        sites, without = find_score_biases(pl_module)
        if not sites:
            layers = ", ".join(without[:4]) + (f" and {len(without) - 4} more" if len(without) > 4 else "")
            found = f"its MoE layers ({layers}) have" if without else "no MoE layer was found, so it has"
            raise BiasBalancingError(say(REFUSED, "no-bias", "use-aux-loss",
                                         module_type=type(pl_module).__name__, found=found))
        trained = [s.name for s in sites if s.tensor.requires_grad]
        if trained:
            raise BiasBalancingError(say(REFUSED, "bias-trained", "freeze-the-bias",
                                         names=', '.join(trained[:4])))
        if without:
            log.warning("ExpertBiasBalancer: %d MoE layer(s) have no choice-only bias and are not balanced: %s",
                        len(without), ", ".join(without))
        self.sites = sites
        self._counts = [None] * len(sites)
        for i, site in enumerate(sites):
            if site.kind == "autoep-router":
                self._hooks.append(site.counter.register_forward_hook(self._router_hook(i)))
            else:
                self._hooks.append(site.counter.register_forward_pre_hook(self._experts_hook(i), with_kwargs=True))
        if trainer.is_global_zero:
            log.info("ExpertBiasBalancer: balancing %d MoE layer(s) by their choice-only bias (%s), rate %g",
                     len(sites), ", ".join(s.name for s in sites[:2]) + (", ..." if len(sites) > 2 else ""),
                     self.update_rate)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After the checkpoint is restored (DeepSpeed restores after setup): read the biases now.
        tensors = [s.tensor for s in self.sites]
        with _gathered(tensors, modifier_rank=None), torch.no_grad():
            current = [t.detach().float().clone().cpu() for t in tensors]
        self._master = []
        for site, value in zip(self.sites, current):
            saved = self._saved_master.get(site.layer)
            same = saved is not None and saved.shape == value.shape and torch.equal(
                saved.to(site.tensor.dtype).float(), value)
            self._master.append(saved.clone() if same else value)
        self._last_step = trainer.global_step
        self._check(trainer)

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._remove_hooks()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # ------------------------------------------------------------------ counting

    def _add(self, i: int, counts: torch.Tensor) -> None:
        """Add to site ``i``'s counts where they are (no copy to the host, so no device sync per call)."""
        counts = counts.detach().long()
        current = self._counts[i]
        self._counts[i] = counts.clone() if current is None else current + counts.to(current.device)

    def _add_choices(self, i: int, chosen: torch.Tensor) -> None:
        n = self.sites[i].num_experts
        ids = chosen.detach().reshape(-1).long()
        # padding (-1) and zero-computation experts (>= n) are no experts: counted in a bin n, dropped
        ids = torch.where((ids >= 0) & (ids < n), ids, torch.full_like(ids, n))
        self._add(i, torch.zeros(n + 1, dtype=torch.long, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))[:n])

    def _router_hook(self, i: int) -> Any:
        def hook(module: nn.Module, _args: Any, out: Any) -> None:
            if module.training:
                self._add(i, out[2])
        return hook

    def _experts_hook(self, i: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            chosen = _first_index_tensor(args, kwargs)
            if module.training and chosen is not None:
                self._add_choices(i, chosen)
        return hook

    # ------------------------------------------------------------------ after each optimizer step

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step or not self.sites:
            return  # a micro-batch inside gradient accumulation: keep counting
        self._last_step = step
        self.update()
        if step % self.check_every_n_steps == 0:
            self._check(trainer)
        if step % self.log_every_n_steps == 0 and trainer.is_global_zero:
            self._log(trainer, step)

    def update(self) -> None:
        """All-reduce this step's counts and move every bias by the rule (a collective: every rank)."""
        device = next((c.device for c in self._counts if c is not None), torch.device("cpu"))
        counts = torch.cat([torch.zeros(s.num_experts, dtype=torch.long, device=device) if c is None else c.to(device)
                            for s, c in zip(self.sites, self._counts)])
        if collectives.is_initialized():
            collectives.all_reduce(counts)
        self._counts = [None] * len(self.sites)
        per_layer = counts.cpu().split([s.num_experts for s in self.sites])
        self.last_counts = {s.layer: c.clone() for s, c in zip(self.sites, per_layer)}
        for master, c in zip(self._master, per_layer):
            master += bias_update(c, self.update_rate, centered=self.centered)
        self._write()
        self.updates += 1

    def _write(self) -> None:
        tensors = [s.tensor for s in self.sites]
        with _gathered(tensors, modifier_rank=0), torch.no_grad():
            for tensor, master in zip(tensors, self._master):
                tensor.copy_(master.to(device=tensor.device, dtype=tensor.dtype))

    def biases(self) -> dict[str, torch.Tensor]:
        """Each balanced layer's bias as the model holds it (fp32 copies on the CPU; a collective under
        ZeRO-3 when a bias is a partitioned parameter: call it on every rank)."""
        tensors = [s.tensor for s in self.sites]
        with _gathered(tensors, modifier_rank=None), torch.no_grad():
            return {s.layer: t.detach().float().cpu().clone() for s, t in zip(self.sites, tensors)}

    # ------------------------------------------------------------------ checks and logs

    def _check(self, trainer: L.Trainer) -> None:
        values = self.biases()
        flat = torch.cat([v.reshape(-1) for v in values.values()])
        both = torch.cat([flat, -flat])
        if collectives.is_initialized():
            import torch.distributed as dist

            collectives.all_reduce(both, op=dist.ReduceOp.MAX)
        spread = (both[: flat.numel()] + both[flat.numel():]).split([s.num_experts for s in self.sites])
        for site, s in zip(self.sites, spread):
            worst = float(s.max())
            if worst > self.tolerance:
                raise BiasBalancingError(say(DIVERGED, "ranks-differ", layer=site.layer,
                                             name=site.name, worst=worst, step=trainer.global_step,
                                             tolerance=self.tolerance))

    def _log(self, trainer: L.Trainer, step: int) -> None:
        metrics: dict[str, float] = {}
        for site, master in zip(self.sites, self._master):
            base = f"balancing/{site.layer}"
            metrics[f"{base}/bias_min"] = float(master.min())
            metrics[f"{base}/bias_max"] = float(master.max())
            counts = self.last_counts.get(site.layer)
            if counts is not None and counts.sum() > 0:
                metrics[f"{base}/max_load_over_mean"] = float(counts.max()) / float(counts.float().mean())
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    # ------------------------------------------------------------------ checkpoint state

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"update_rate": self.update_rate, "centered": self.centered, "updates": self.updates,
                "master": {s.layer: m.clone() for s, m in zip(self.sites, self._master)}}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.updates = int(state_dict.get("updates", 0))
        self._saved_master = {k: v.float().cpu() for k, v in (state_dict.get("master") or {}).items()}
