"""``load_checkpoint`` under ZeroMoEStrategy: the same shape as Lightning loads it, another shape
through DeepSpeed's universal checkpoint (:mod:`lightning_zeromoe.checkpoint.resume.reshape`).

The engine's own AutoEP layers say which ``ep_size`` runs (a config's ``autoep_size``, or none
when every block fell back), not the ``ep_size`` asked for. Frozen AutoEP experts (LoRA under
ZeRO-3) come back from the strategy's own files on either path
(:mod:`lightning_zeromoe.checkpoint.frozen_experts`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch.nn import Module

from lightning_zeromoe.checkpoint import frozen_experts
from lightning_zeromoe.checkpoint.frozen_experts import FrozenExpertSave
from lightning_zeromoe.checkpoint.resume import reshape


@dataclass(frozen=True)
class ResumeContext:
    """The run that loads: its shape, its blocks and how it reports."""

    world_size: int
    stage: int
    is_global_zero: bool
    #: The ``expert_parallel`` section the engine was built with (None: no AutoEP).
    ep_section: Mapping[str, Any] | None
    #: Discovery's ``BlockLayout`` of every block kept for EP, and each such block's expert count, by path.
    layouts: Mapping[str, Any]
    experts: Mapping[str, int]
    fitting: bool
    strict: bool


def load(engine: Any, checkpoint_path: str | os.PathLike, ctx: ResumeContext, *,
         load_same_shape: Callable[[], dict[str, Any]], broadcast: Callable[[Any], Any],
         agree: Callable[[bool], bool], info: Callable[[str], None], warn: Callable[[str], None]) -> dict[str, Any]:
    """Load on every rank (collective); returns the client state. ``load_same_shape`` is Lightning's
    own load, used when the saved shape is this run's."""
    saved = reshape.read_saved(checkpoint_path)
    frozen_experts.check_saved(saved)
    target = reshape.Shape(world_size=ctx.world_size, ep_size=reshape.engine_ep_size(engine.module), stage=ctx.stage)
    trainable = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    if not reshape.plan_resume(saved, target, dict(ctx.experts), trainable):
        frozen = FrozenExpertSave.of(engine.module, checkpoint_path, stage_3=ctx.stage == 3, excluded=False)
        with frozen.presented(saving=False):
            client_state = load_same_shape()
        frozen_experts.restore(engine.module, saved, ctx.ep_section, ctx.layouts)
        return client_state
    return reshape.load_on_new_shape(
        engine, saved, target, ep_section=ctx.ep_section, layouts=ctx.layouts, is_global_zero=ctx.is_global_zero,
        broadcast=broadcast, agree=agree, fitting=ctx.fitting, strict=ctx.strict, info=info, warn=warn)


def evaluation_parameters(module: Module, checkpoint_path: str | os.PathLike) -> list[torch.nn.Parameter]:
    """The trainable parameters in the order the checkpoint's flat optimizer groups hold them.

    Under ZeRO-3 the trained weights live in the ZeRO partition files, which DeepSpeed restores
    through its ZeRO-3 optimizer (``engine._load_zero_checkpoint`` copies each saved flat fp32 group
    into the optimizer's); an engine built without an optimizer has none (and for a model without
    MoE layers DeepSpeed would consolidate with ``zero_to_fp32``, which refuses AutoEP checkpoints).
    So ``validate/test/predict(ckpt_path=...)`` builds its engine once with a do-nothing optimizer
    (SGD, lr=0, never stepped) over these parameters, and loads the shards through it.
    """
    trainable = {n: p for n, p in module.named_parameters() if p.requires_grad}
    order = [n for n in reshape.saved_parameter_order(checkpoint_path) if n in trainable]
    return [trainable[n] for n in order] + [p for n, p in trainable.items() if n not in set(order)]


__all__ = ["ResumeContext", "evaluation_parameters", "load"]
