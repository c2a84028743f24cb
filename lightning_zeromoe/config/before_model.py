"""The ZeRO stage ``configure_model`` builds under, decided before the model exists (``stage="auto"``).

Lightning calls the strategy's ``setup_environment`` on every rank, then ``configure_model`` inside
``model_sharded_context`` (``zero.Init`` at stage 3), then ``setup``, where :func:`.resolve.resolve`
reads the built model. :func:`options_before_model` decides what ``zero.Init`` sees:

* a fixed ``stage=``, or a ``zero_optimization.stage`` in the user's config: that stage;
* ``stage="auto"`` with ``plan_for``: the memory planner's stage for the model ``plan_for`` names,
  counted on the meta device at construction (:mod:`lightning_zeromoe.planner.plan_for`); the model
  is built under ``zero.Init`` only if it is 3. Every rank computes it from the same inputs (the
  planner is deterministic), so no collective is needed;
* ``stage="auto"`` without it: stage 3, and, when the module builds its model in ``configure_model``,
  the ``[stage-auto-kept-3]`` line saying so and how to plan instead.

With ``plan_for`` its choice is the one decision: the strategy keeps it, and ``setup`` does not plan
again. Without it, ``setup`` plans from the model itself (trainable parameters only) when the model
is not partitioned; a partitioned one keeps stage 3.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Mapping

from lightning_zeromoe.config.deepspeed import ZeroOptions
from lightning_zeromoe.config.resolve import World, effective_ep_size, user_section
from lightning_zeromoe.config.validation import ZeroMoEConfigError
from lightning_zeromoe.knowledge import say

if TYPE_CHECKING:
    from lightning_zeromoe.planner.plan_for import CountedModel


def builds_in_configure_model(module: Any) -> bool:
    """Whether a LightningModule overrides ``configure_model`` (its model is built there)."""
    from lightning.pytorch import LightningModule

    return module is not None and type(module).configure_model is not LightningModule.configure_model


def options_before_model(options: ZeroOptions, *, auto_stage: bool, user: Mapping[str, Any] | None,
                         plan_for: "CountedModel | None", builds_later: bool, world: World,
                         device_memory_bytes: Callable[[], float]) -> tuple[ZeroOptions, str | None]:
    """The options ``zero.Init`` is configured from, and an info line to log (or None).

    Pass them to :func:`.resolve.zero_init_config` with ``auto_stage=False``: the stage in them is
    already the one to build under (a user's ``zero_optimization.stage`` still wins there)."""
    if not auto_stage or user_section(user, "zero_optimization").get("stage") is not None:
        return options, None
    if plan_for is None:
        return dataclasses.replace(options, stage=3), (say("stage-auto-kept-3", "kept", "pass-plan-for")
                                                       if builds_later else None)
    from lightning_zeromoe.planner.model_facts import PlannerInputError
    from lightning_zeromoe.planner.plan_for import choose_before_model

    try:
        chosen = choose_before_model(plan_for, world_size=world.world_size, devices_per_node=world.devices_per_node,
                                     ep_size=effective_ep_size(options.ep_size, user),
                                     device_memory_bytes=device_memory_bytes(), precision=world.precision)
    except PlannerInputError as err:
        raise ZeroMoEConfigError(str(err)) from None
    return dataclasses.replace(options, stage=chosen.stage), chosen.line


__all__ = ["builds_in_configure_model", "options_before_model"]
