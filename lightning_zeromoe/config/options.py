"""What ``ZeroMoEStrategy``'s keywords mean, checked in the user's process before any rank or model.

:func:`strategy_settings` turns the constructor's arguments into one typed :class:`StrategySettings`:
the ZeRO options, whether ``stage="auto"`` and ``ep_size`` were asked for, Lightning's own keywords
sorted (:mod:`lightning_zeromoe.config.keywords`), and the user's DeepSpeed config as read (a dict, a
JSON path, or ``PL_DEEPSPEED_CONFIG_PATH``). What can be refused without a model is refused here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from lightning_zeromoe.config.deepspeed import ZeroOptions, load_user_config
from lightning_zeromoe.config.keywords import CONFIG_ENV_VAR, LightningKeywords, config_source, split_keywords
from lightning_zeromoe.config.resolve import effective_ep_size, effective_grouped_experts
from lightning_zeromoe.config.validation import ZeroMoEConfigError
from lightning_zeromoe.discovery.find import MoEPattern
from lightning_zeromoe.knowledge import say

if TYPE_CHECKING:
    from lightning_zeromoe.planner.plan_for import CountedModel, PlanFor


@dataclass(frozen=True)
class StrategySettings:
    """The strategy's arguments, read and checked."""

    options: ZeroOptions
    #: ``stage="auto"``: the planner picks the stage once the model exists.
    auto_stage: bool
    #: Whether ``ep_size`` was passed (unset: a native-MoE model's own size is used, config/native_moe.py).
    ep_size_given: bool
    keywords: LightningKeywords
    user_config: dict[str, Any] | None
    moe_pattern: MoEPattern | None
    #: An info line to log (the config came from ``PL_DEEPSPEED_CONFIG_PATH``), or None.
    note: str | None = None
    #: ``plan_for=``: the model ``configure_model`` will build, counted on the meta device
    #: (:mod:`lightning_zeromoe.planner.plan_for`); ``stage="auto"`` plans from it before it is built.
    plan_for: "CountedModel | None" = None
    #: ``ep_size="auto"``: the planner picks the expert-parallel size once the model exists.
    auto_ep: bool = False


def strategy_settings(*, ep_size: int | str | None, stage: int | str, grouped_experts: bool, offload_optimizer: bool,
                      offload_parameters: bool, config: str | Path | Mapping[str, Any] | None,
                      moe_pattern: MoEPattern | Mapping[str, Any] | None, lightning_keywords: Mapping[str, Any],
                      plan_for: "PlanFor | None" = None, **zero: Any) -> StrategySettings:
    """``zero``: the remaining :class:`ZeroOptions` fields (buckets, thresholds, flags), as passed."""
    if isinstance(stage, str) and stage != "auto":
        raise ValueError(say("strategy-argument-invalid", "stage", "valid-stage", stage=stage))
    auto_stage = stage == "auto"
    auto_ep = ep_size == "auto"
    if auto_ep:
        ep_size = None  # 1 until the planner has seen the model (ZeroMoEStrategy.prepare)
    counted = _count_plan_for(plan_for, stage) if plan_for is not None else None
    ints = {k: int(v) for k, v in zero.items() if k.endswith(("_size", "_threshold"))}
    options = ZeroOptions(stage=3 if auto_stage else int(stage), ep_size=1 if ep_size is None else ep_size,
                          offload_optimizer=offload_optimizer, offload_parameters=offload_parameters,
                          grouped_experts=grouped_experts, **{**zero, **ints})
    keywords = split_keywords(lightning_keywords, offload_optimizer=offload_optimizer,
                              offload_parameters=offload_parameters)
    source, from_env = config_source(config)
    user_config = load_user_config(source)
    # Needs no model: refuse enabled=false with ep_size > 1 (or grouped_experts) now, in the user's process.
    effective_grouped_experts(grouped_experts, effective_ep_size(options.ep_size, user_config), user_config)
    return StrategySettings(
        options=options, auto_stage=auto_stage, ep_size_given=ep_size is not None, keywords=keywords,
        user_config=user_config, moe_pattern=MoEPattern(**moe_pattern) if isinstance(moe_pattern, Mapping) else moe_pattern,
        note=f"ZeroMoEStrategy: loading your DeepSpeed config from {CONFIG_ENV_VAR}={source}" if from_env else None,
        plan_for=counted, auto_ep=auto_ep)


def _count_plan_for(plan_for: "PlanFor", stage: int | str) -> "CountedModel":
    """``plan_for``'s model counted on the meta device; refused without ``stage="auto"`` or when unreadable."""
    if stage != "auto":
        shown = os.fspath(plan_for) if isinstance(plan_for, (str, os.PathLike)) else type(plan_for).__name__
        raise ZeroMoEConfigError(say("plan-for-invalid", "without-auto", "use-auto", plan_for=shown, stage=stage))
    from lightning_zeromoe.planner.model_facts import PlannerInputError
    from lightning_zeromoe.planner.plan_for import count_plan_for

    try:
        return count_plan_for(plan_for)
    except PlannerInputError as err:
        raise ZeroMoEConfigError(str(err)) from None


__all__ = ["StrategySettings", "strategy_settings"]
