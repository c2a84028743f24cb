"""Loading pretrained weights under ZeRO-3 without any rank holding the whole model."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from lightning_zeromoe.config.schema import DeepSpeedConfig


@contextmanager
def while_building(ds_config: "DeepSpeedConfig | None") -> Iterator[None]:
    """What ``configure_model`` runs inside, next to DeepSpeed's ``zero.Init`` (``ds_config``: the
    ZeRO-3 config, None at stages 0-2, where all three are no-ops).

    :func:`.hf_zero3.transformers_zero3` makes ``from_pretrained`` build the model partitioned and
    copy each rank's slice of the checkpoint into its partition; :func:`.memory_release.trim_after_each_partition`
    trims the heap after each partitioned module; :func:`.peft_zero3.peft_init_gathered` runs PEFT's
    LoRA initialisation on gathered parameters. Imported lazily: transformers and peft are optional.
    """
    from lightning_zeromoe.loading.hf_zero3 import transformers_zero3
    from lightning_zeromoe.loading.memory_release import trim_after_each_partition
    from lightning_zeromoe.loading.peft_zero3 import peft_init_gathered

    stage_3 = ds_config is not None
    with trim_after_each_partition(stage_3), transformers_zero3(ds_config), peft_init_gathered(stage_3):
        yield


__all__ = ["while_building"]
