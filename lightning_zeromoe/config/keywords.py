"""Lightning's ``DeepSpeedStrategy`` keywords: each one is passed on, mapped into the config, or refused.

``ZeroMoEStrategy`` builds its own DeepSpeed config, so Lightning's ``_create_default_config``
never runs and a keyword that only feeds it would otherwise be accepted and silently ignored.
Every parameter of ``DeepSpeedStrategy.__init__`` (lightning 2.6.6) is in exactly one table below;
``tests/test_keywords.py`` enumerates the signature, so a keyword a new Lightning adds fails there.

Pure: no torch, no DeepSpeed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from lightning_zeromoe.config.validation import ZeroMoEConfigError
from lightning_zeromoe.knowledge import say

#: Handed to ``DeepSpeedStrategy.__init__`` unchanged; the parent uses them itself (devices, the
#: process group, DeepSpeed's log level, zero.Init's remote device, fp16 loss scaling in
#: ``_format_precision_config``, full-weight loading, frozen-parameter exclusion on save).
PASSED_TO_LIGHTNING = frozenset({
    "accelerator", "parallel_devices", "cluster_environment", "precision_plugin", "process_group_backend",
    "timeout", "logging_level", "remote_device", "load_full_weights", "exclude_frozen_parameters",
    "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale",
})

#: Named parameters of ``ZeroMoEStrategy`` itself (its defaults differ from Lightning's).
OWN_PARAMETERS = frozenset({
    "stage", "offload_optimizer", "offload_parameters", "pin_memory", "overlap_comm", "contiguous_gradients",
    "reduce_bucket_size", "allgather_bucket_size", "config",
})

#: keyword -> (config section, key). Written into the built config when the keyword is given.
MAPPED: dict[str, tuple[str, str]] = {
    "partition_activations": ("activation_checkpointing", "partition_activations"),
    "cpu_checkpointing": ("activation_checkpointing", "cpu_checkpointing"),
    "contiguous_memory_optimization": ("activation_checkpointing", "contiguous_memory_optimization"),
    "synchronize_checkpoint_boundary": ("activation_checkpointing", "synchronize_checkpoint_boundary"),
    "block_size": ("aio", "block_size"),
    "queue_depth": ("aio", "queue_depth"),
    "single_submit": ("aio", "single_submit"),
    "overlap_events": ("aio", "overlap_events"),
    "thread_count": ("aio", "thread_count"),
    "sub_group_size": ("zero_optimization", "sub_group_size"),
    "allgather_partitions": ("zero_optimization", "allgather_partitions"),
    "reduce_scatter": ("zero_optimization", "reduce_scatter"),
    "zero_allow_untested_optimizer": ("", "zero_allow_untested_optimizer"),
    "logging_batch_size_per_gpu": ("", "train_micro_batch_size_per_gpu"),
    "offload_optimizer_device": ("zero_optimization.offload_optimizer", "device"),
    "optimizer_buffer_count": ("zero_optimization.offload_optimizer", "buffer_count"),
    "offload_params_device": ("zero_optimization.offload_param", "device"),
    "params_buffer_count": ("zero_optimization.offload_param", "buffer_count"),
    "params_buffer_size": ("zero_optimization.offload_param", "buffer_size"),
    "max_in_cpu": ("zero_optimization.offload_param", "max_in_cpu"),
    "nvme_path": ("zero_optimization.offload_*", "nvme_path"),
}

#: keyword -> the fix (entry ``strategy-keyword-refused``) that says what to use instead.
REFUSED: dict[str, str] = {
    "zero_optimization": "zero-optimization-stage",
}

#: Lightning's environment variable for a DeepSpeed config path (read as Lightning reads it).
CONFIG_ENV_VAR = "PL_DEEPSPEED_CONFIG_PATH"


@dataclass(frozen=True)
class LightningKeywords:
    """The Lightning keywords a user passed: those for the parent, and those mapped into the config."""

    passed: dict[str, Any] = field(default_factory=dict)
    mapped: dict[str, Any] = field(default_factory=dict)

    def config_sections(self, *, offload_optimizer: bool, offload_parameters: bool) -> dict[str, Any]:
        """The mapped keywords as a partial DeepSpeed config, merged under the user's config."""
        out: dict[str, Any] = {}
        for name, value in self.mapped.items():
            section, key = MAPPED[name]
            if name == "logging_batch_size_per_gpu" and value == "auto":
                continue  # Lightning's default: derive it from the train dataloader
            if section == "zero_optimization.offload_*":
                targets = [s for s, on in (("offload_optimizer", offload_optimizer),
                                           ("offload_param", offload_parameters)) if on]
                for target in targets:
                    out.setdefault("zero_optimization", {}).setdefault(target, {})[key] = value
                continue
            if section.startswith("zero_optimization.offload_"):
                sub = section.split(".", 1)[1]
                out.setdefault("zero_optimization", {}).setdefault(sub, {})[key] = value
            elif section:
                _nested(out, section)[key] = value
            else:
                out[key] = value
        return out


def _nested(config: dict[str, Any], dotted: str) -> dict[str, Any]:
    for part in dotted.split("."):
        config = config.setdefault(part, {})
    return config


def split_keywords(kwargs: Mapping[str, Any], *, offload_optimizer: bool, offload_parameters: bool) -> LightningKeywords:
    """Sort ``**kwargs`` given to ``ZeroMoEStrategy`` into passed-on and mapped keywords, or refuse.

    A mapped offload keyword without the offload it configures is refused: it would change nothing.
    Unknown names are left in ``passed``, so Python's own ``unexpected keyword`` error names them.
    """
    passed: dict[str, Any] = {}
    mapped: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name in REFUSED:
            raise ZeroMoEConfigError(say("strategy-keyword-refused", "deepspeed-keyword", REFUSED[name], name=name,
                                         value=value))
        if name in MAPPED:
            section = MAPPED[name][0]
            needs = {"zero_optimization.offload_optimizer": ("offload_optimizer", offload_optimizer),
                     "zero_optimization.offload_param": ("offload_parameters", offload_parameters),
                     "zero_optimization.offload_*": ("offload_optimizer or offload_parameters",
                                                     offload_optimizer or offload_parameters)}.get(section)
            if needs is not None and not needs[1]:
                raise ZeroMoEConfigError(
                    say("strategy-keyword-refused", "offload-off", "offload-on-or-drop", name=name, value=value,
                        needs=needs[0], switch=needs[0].split(' or ')[0]))
            mapped[name] = value
        else:
            passed[name] = value
    return LightningKeywords(passed=passed, mapped=mapped)


def config_source(config: str | Path | Mapping[str, Any] | None) -> tuple[str | Path | Mapping[str, Any] | None, bool]:
    """The user config to load: ``config``, or, when it is None, the path in ``PL_DEEPSPEED_CONFIG_PATH``.

    Lightning reads the variable the same way (``DeepSpeedStrategy._load_config``: only when no
    config is passed). Returns the source and whether it came from the environment.
    """
    if config is None and os.environ.get(CONFIG_ENV_VAR):
        return os.environ[CONFIG_ENV_VAR], True
    return config, False
