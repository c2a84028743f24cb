"""``trainer.save_checkpoint`` under ZeroMoEStrategy: DeepSpeed's sharded files, made safe and complete.

Around DeepSpeed's own ``engine.save_checkpoint``:

* an engine built by validate/test/predict (no optimizer, no checkpoint engine) is refused first;
* ``latest`` is removed before any rank writes and written after every rank finished
  (:mod:`lightning_zeromoe.checkpoint.commit`): a save killed half-way never looks complete;
* frozen AutoEP experts under ZeRO-3 (LoRA), which DeepSpeed refuses, are saved beside its files
  (:mod:`lightning_zeromoe.checkpoint.frozen_experts`);
* ``zeromoe_meta.json`` records how AutoEP's names map back to the model's own, for ``zeromoe-export``;
* a full disk is one ``[checkpoint-disk-full]`` error naming the incomplete directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from torch.nn import Module

from lightning_zeromoe.checkpoint.commit import DISK_FULL, begin_save, commit_save, is_disk_full
from lightning_zeromoe.checkpoint.frozen_experts import FrozenExpertSave
from lightning_zeromoe.checkpoint.meta import META_FILE
from lightning_zeromoe.checkpoint.save import build_meta, write_meta
from lightning_zeromoe.knowledge import say

if TYPE_CHECKING:
    from lightning_zeromoe.config.schema import DeepSpeedConfig

TAG = "checkpoint"


@dataclass(frozen=True)
class SaveContext:
    """Who saves, and what the model looks like while it is in memory."""

    global_rank: int
    is_global_zero: bool
    world_size: int
    zero_stage_3: bool
    exclude_frozen_parameters: bool
    #: The LightningModule and the DeepSpeed config it was built with (for the export metadata).
    module: Module
    config: DeepSpeedConfig
    #: Discovery's ``BlockLayout`` of every block kept for EP, by path.
    layouts: Mapping[str, Any]


def refuse_engine_without_optimizer(engine: Any, filepath: Any) -> None:
    """validate/test/predict built an engine without an optimizer: DeepSpeed gives it no checkpoint
    engine, and its save would fail deep inside with an AttributeError."""
    if engine is not None and hasattr(engine, "checkpoint_engine") and engine.checkpoint_engine is None:
        raise RuntimeError(
            say("save-after-evaluation", "no-optimizer-engine", "save-before-evaluating", filepath=str(filepath)))


def save(engine: Any, filepath: Any, client_state: dict[str, Any], ctx: SaveContext,
         barrier: Callable[[str], None], warn: Callable[[str], None]) -> str | None:
    """Save on every rank (collective). Returns the frozen-experts file this rank wrote, if any."""
    frozen = FrozenExpertSave.of(engine.module, filepath, stage_3=ctx.zero_stage_3,
                                 excluded=ctx.exclude_frozen_parameters)
    if ctx.is_global_zero:
        begin_save(filepath)  # the other ranks wait in DeepSpeed's first barrier
        frozen.begin()
    try:
        with frozen.presented():
            engine.save_checkpoint(filepath, client_state=client_state, tag=TAG, save_latest=False,
                                   exclude_frozen_parameters=ctx.exclude_frozen_parameters)
        written = frozen.write()
    except Exception as err:
        if is_disk_full(err):
            raise OSError(say(DISK_FULL, "save-failed", "free-space", rank=ctx.global_rank, filepath=filepath,
                              error_type=type(err).__name__, err=err)) from err
        refusal = frozen.refusal(err)
        if refusal is not None:
            raise refusal from err
        raise
    if frozen.active:
        barrier("zeromoe_frozen_experts_written")
    if ctx.is_global_zero:
        frozen.commit()
        write_export_meta(filepath, ctx, warn)
        commit_save(filepath, TAG)
    barrier("zeromoe_checkpoint_committed")
    return written


def write_export_meta(filepath: Any, ctx: SaveContext, warn: Callable[[str], None]) -> None:
    """Record, while the model is in memory, how AutoEP's names map back to the model's own.

    A failure here must not cost the user the checkpoint DeepSpeed has just written: it is reported
    as a warning, and the export of this checkpoint will then say what is missing.
    """
    try:
        write_meta(build_meta(ctx.module, ctx.config, world_size=ctx.world_size, blocks=dict(ctx.layouts)), filepath)
    except Exception as err:  # noqa: BLE001 - the DeepSpeed checkpoint is already safe on disk
        warn(f"ZeroMoEStrategy: could not write {META_FILE} into {filepath} ({type(err).__name__}: "
             f"{err}); the checkpoint resumes normally but `zeromoe-export` cannot convert it.")


__all__ = ["SaveContext", "TAG", "refuse_engine_without_optimizer", "save", "write_export_meta"]
