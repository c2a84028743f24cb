"""ZeRO stage 1 and 2 with MoE: the user's optimizer, split into MoE and non-MoE param groups.

DeepSpeed's ZeRO-1/2 optimizer reduces expert gradients over the expert-data-parallel group, so
it needs every expert parameter in a param group marked ``moe: True`` and named after its
expert group (``stage_1_and_2.py::_configure_moe_settings`` asserts it). It splits the groups
itself only for optimizers it builds from the config. An optimizer from ``configure_optimizers``
reaches it unsplit, and under AutoEP the expert parameters do not even exist yet: AutoEP creates
them inside ``deepspeed.initialize`` (``GroupedExperts``, each parameter tagged
``allreduce=False``, ``group_name="ep_size_<N>"`` in ``auto_ep_layer.py``).

So the strategy hands DeepSpeed a *callable* instead of the optimizer, with the optimizer's own
param groups as ``model_parameters``. DeepSpeed remaps those groups after AutoEP's replacement
(``engine.py::_remap_model_parameters_after_module_replacement``: a replacement joins the group its
sources were in) and then calls :class:`MoEOptimizerSplit` with them. It splits the groups with
DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer`` and installs them **in the
user's optimizer object**, so the LR scheduler from ``configure_optimizers`` still drives it.
Schedulers keep one value per param group (``base_lrs``, ``lr_lambdas``, ...); a group split off
another one inherits its values, so every MoE group follows the schedule of the group it came from.
Native ``deepspeed.moe.layer.MoE`` experts are tagged the same way at construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_zeromoe._private import torch as torch_private
from lightning_zeromoe.knowledge import say

#: Per-param-group lists torch's LR schedulers keep (torch 2.13 ``optim/lr_scheduler.py``).
SCHEDULER_PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas", "min_lrs", "max_lrs", "_initial_lrs")


def groups_with_names(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Copies of the optimizer's param groups, each with a unique ``name`` (DeepSpeed's helper keys on it)."""
    groups, seen = [], set()
    for index, group in enumerate(optimizer.param_groups):
        name = group.get("name") or f"group{index}"
        while name in seen:
            name = f"{name}_{index}"
        seen.add(name)
        groups.append({**group, "name": name, "params": list(group["params"])})
    return groups


@dataclass
class MoEOptimizerSplit:
    """The callable DeepSpeed builds the basic optimizer with: split, then reuse the user's optimizer."""

    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    #: After the call: for each installed group, the index of the user's group it came from.
    origins: list[int] = field(default_factory=list)
    #: After the call: one line for the log (ZeRO flattens the groups afterwards, so count now).
    summary: str = ""

    def __call__(self, model_parameters: Any) -> torch.optim.Optimizer:
        from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

        groups = [dict(g, params=list(g["params"])) for g in model_parameters]
        if any(state for state in self.optimizer.state.values()):
            raise RuntimeError(say("moe-param-groups", "optimizer-has-state", "fresh-optimizer"))
        origin_of = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
        split = split_params_into_different_moe_groups_for_optimizer([dict(g) for g in groups])
        installed, origins = [], []
        for group in split:
            if not group["params"]:
                continue
            origins.append(origin_of[id(group["params"][0])])
            installed.append(group)
        if not any(is_moe_param(p) for g in installed for p in g["params"]):
            raise RuntimeError(say("moe-param-groups", "no-expert-parameter", "include-experts"))
        self.optimizer.state.clear()
        self.optimizer.param_groups = installed
        self.origins = origins
        self.summary = split_summary(self.optimizer)
        if self.scheduler is not None:
            remap_scheduler(self.scheduler, origins, len(groups))
        return self.optimizer


def remap_scheduler(scheduler: Any, origins: list[int], before: int) -> None:
    """Give each new param group its origin's per-group scheduler values (recursing into chains)."""
    for child in torch_private.chained_schedulers(scheduler):
        remap_scheduler(child, origins, before)
    for name in SCHEDULER_PER_GROUP:
        values = getattr(scheduler, name, None)
        if isinstance(values, list) and len(values) == before:
            setattr(scheduler, name, [values[i] for i in origins])


def split_summary(optimizer: torch.optim.Optimizer) -> str:
    """One line for the log: how many groups, how many of them MoE."""
    moe = [g for g in optimizer.param_groups if g.get("moe")]
    return (f"{len(optimizer.param_groups)} param groups, {len(moe)} of them MoE "
            f"({sum(len(g['params']) for g in moe)} expert tensors in {sorted({g['name'] for g in moe})})")
