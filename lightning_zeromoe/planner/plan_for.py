"""``ZeroMoEStrategy(stage="auto", plan_for=...)``: plan the ZeRO stage before ``configure_model`` builds the model.

A model loaded in ``configure_model`` does not exist when ``zero.Init`` must be entered or not, so
``stage="auto"`` alone builds it under ZeRO-3. ``plan_for`` names the model ``configure_model``
will build; :func:`count_plan_for` builds that model from its config on the meta device (no
weights read or allocated) and counts it exactly as the CLI does (:func:`.cli.load_config`,
:func:`.cli.model_facts`), and :func:`choose_before_model` asks :func:`.plan.choose_stage` for the
stage, from those counts. The strategy then builds under ``zero.Init`` only if that stage is 3.

``plan_for`` is one of:

* a local directory holding ``config.json`` (the one ``from_pretrained`` reads), or a ``config.json``:
  read from disk, nothing is downloaded;
* a Hugging Face hub id (``"org/name"``, not an existing path): its ``config.json`` alone is read
  with ``AutoConfig.from_pretrained`` (from the local hub cache, else downloaded: a few KB, never
  weights; ``HF_HUB_OFFLINE=1`` keeps it to the cache);
* a ``transformers.PretrainedConfig``.

Deterministic: the same config, world, precision and device memory give every rank the same stage,
so no collective is needed (ranks whose devices differ in memory size would each plan for their own;
mixed devices are outside what the strategy supports). Bad input raises :class:`.cli.PlannerInputError`
with a ``[plan-for-invalid]`` (or ``[planner-hf-config]``) message, in the user's process, when the
strategy is constructed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Union

from lightning_zeromoe.knowledge import say
from lightning_zeromoe.planner.model_facts import ModelFacts, PlannerInputError, load_config, model_facts
from lightning_zeromoe.planner.plan import choose_stage, plan
from lightning_zeromoe.planner.setups import GB, LADDER

if TYPE_CHECKING:
    from transformers import PretrainedConfig

#: What ``plan_for=`` accepts.
PlanFor = Union[str, "os.PathLike[str]", "PretrainedConfig"]

ENTRY = "plan-for-invalid"
#: A hub repository id: ``name`` or ``org/name`` (huggingface_hub's rule, without its length limits).
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


@dataclass(frozen=True)
class CountedModel:
    """The model ``plan_for`` names, counted on the meta device."""

    #: What was named: the path or hub id, or the config's class name.
    source: str
    facts: ModelFacts


@dataclass(frozen=True)
class StageBeforeModel:
    """The stage chosen before the model exists, and the info line that says why."""

    stage: int
    line: str


def count_plan_for(plan_for: PlanFor) -> CountedModel:
    """Read ``plan_for``'s config and count its model on the meta device (:func:`.cli.model_facts`)."""
    if isinstance(plan_for, (str, os.PathLike)):
        name = os.fspath(plan_for)
        path = Path(name).expanduser()
        if path.exists():
            if path.is_dir() and not (path / "config.json").is_file():
                raise PlannerInputError(say(ENTRY, "no-config-json", "local-config", path=path))
            return CountedModel(str(path), model_facts(load_config(str(path))))
        if not _HUB_ID.match(name) or name.count("/") != 1:
            raise PlannerInputError(say(ENTRY, "missing", "local-config", plan_for=name))
        return CountedModel(name, model_facts(_hub_config(name)))
    if _is_pretrained_config(plan_for):
        return CountedModel(type(plan_for).__name__, model_facts(plan_for))
    raise PlannerInputError(say(ENTRY, "wrong-type", "local-config", type_name=type(plan_for).__qualname__))


def _is_pretrained_config(value: object) -> bool:
    try:
        from transformers import PretrainedConfig
    except ImportError:
        return False
    return isinstance(value, PretrainedConfig)


def _hub_config(repo_id: str) -> "PretrainedConfig":
    """``config.json`` of a hub model (the hub cache first); never its weights."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(repo_id)
    except (OSError, ValueError) as err:
        raise PlannerInputError(say(ENTRY, "hub-unreadable", "local-config", plan_for=repo_id,
                                    error=str(err).splitlines()[0][:160])) from None


def choose_before_model(counted: CountedModel, *, world_size: int, devices_per_node: int, ep_size: int,
                        device_memory_bytes: float, precision: str) -> StageBeforeModel:
    """The stage ``stage="auto"`` builds and trains ``plan_for``'s model at, and the line that says why:
    the memory per rank of every on-device stage (model states + buckets), the chosen one first."""
    facts = counted.facts
    if facts.num_experts % ep_size:
        raise PlannerInputError(say("ep-size-divisibility", "planner", ep_size=ep_size, num_experts=facts.num_experts,
                                    gpus=world_size, valid=[e for e in range(1, world_size + 1)
                                                            if world_size % e == 0 and facts.num_experts % e == 0]))
    kwargs = dict(world_size=world_size, devices_per_node=devices_per_node, ep_size=ep_size,
                  device_memory_bytes=device_memory_bytes, precision=precision)
    stage, reason = choose_stage(None, counts=facts.counts, num_experts=facts.num_experts, **kwargs)
    memory = plan(counts=facts.counts, num_gpus=world_size, gpus_per_node=devices_per_node, ep_size=ep_size,
                  gpu_memory_bytes=device_memory_bytes, precision=precision, num_experts=facts.num_experts)
    on_device = sorted((s for s in LADDER if not s.offload_optimizer), key=lambda s: s.stage != stage)
    per_rank = ", ".join(f"ZeRO-{s.stage} {memory.device_bytes(s) / GB:.2f} GB"
                         + (" (chosen)" if s.stage == stage else "") for s in on_device)
    build = ("partitioned under zero.Init" if stage == 3 else "whole on every rank (no zero.Init)")
    line = (f"ZeroMoEStrategy(stage='auto', plan_for={counted.source!r}): {facts.counts.total:,} parameters "
            f"({facts.counts.expert_total:,} in {facts.num_experts} experts per MoE layer) counted on the meta "
            f"device before configure_model; stage {stage}, so configure_model builds the model {build}. "
            f"Memory per rank (model states + buckets) of {memory.usable_bytes / GB:.2f} GB usable: {per_rank}. "
            f"{reason}")
    return StageBeforeModel(stage, line)


__all__ = ["CountedModel", "PlanFor", "StageBeforeModel", "choose_before_model", "count_plan_for"]
