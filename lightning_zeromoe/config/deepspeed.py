"""Building the DeepSpeed config for ZeRO + AutoEP, and merging the user's config into it.

Pure functions: no torch, no DeepSpeed, no process group. The strategy calls them; the tests
call them in milliseconds; the troubleshooter's lint can compare a user's config with them.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from lightning_zeromoe.knowledge import compose, say

#: ZeroOptions' refusals (rendered without prefix: resolve wraps them as [merged-config-invalid]).
ARGUMENTS = "strategy-argument-invalid"

#: Bucket size the field notes recommend for MoE under stage 3 (elements, not bytes).
DEFAULT_BUCKET_SIZE = 50_000_000


@dataclass(frozen=True)
class ZeroOptions:
    """The ZeRO and AutoEP knobs the strategy exposes as constructor arguments."""

    stage: int = 3
    ep_size: int = 1
    offload_optimizer: bool = False
    offload_parameters: bool = False
    pin_memory: bool = False
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    reduce_bucket_size: int = DEFAULT_BUCKET_SIZE
    allgather_bucket_size: int = DEFAULT_BUCKET_SIZE
    prefetch_bucket_size: int = DEFAULT_BUCKET_SIZE
    param_persistence_threshold: int = 100_000
    gather_16bit_weights_on_save: bool = False
    #: AutoEP's layer (grouped-GEMM experts) also at ``ep_size=1``: ``autoep_size=1``, every rank
    #: holds every expert, no all-to-all. At ``ep_size > 1`` the blocks get that layer anyway.
    grouped_experts: bool = False

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(compose(ARGUMENTS, "zero-stage", stage=self.stage))
        if not isinstance(self.ep_size, int) or self.ep_size < 1:
            raise ValueError(compose(ARGUMENTS, "ep-size", ep_size=self.ep_size))
        if not isinstance(self.grouped_experts, bool):
            raise ValueError(compose(ARGUMENTS, "grouped-experts", value=self.grouped_experts))
        if self.offload_parameters and self.stage != 3:
            raise ValueError(compose(ARGUMENTS, "offload-parameters-stage"))
        for name in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size"):
            if getattr(self, name) <= 0:
                raise ValueError(compose(ARGUMENTS, "bucket-size", name=name, value=getattr(self, name)))


def zero_section(opts: ZeroOptions) -> dict[str, Any]:
    """The ``zero_optimization`` section: overlap and contiguous gradients on, ~5e7 buckets."""
    zero: dict[str, Any] = {
        "stage": opts.stage,
        "overlap_comm": opts.overlap_comm,
        "contiguous_gradients": opts.contiguous_gradients,
        "reduce_bucket_size": opts.reduce_bucket_size,
        "allgather_bucket_size": opts.allgather_bucket_size,
    }
    if opts.stage == 3:
        zero.update({
            "stage3_prefetch_bucket_size": opts.prefetch_bucket_size,
            "stage3_param_persistence_threshold": opts.param_persistence_threshold,
            "stage3_gather_16bit_weights_on_model_save": opts.gather_16bit_weights_on_save,
        })
    if opts.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": opts.pin_memory}
    if opts.offload_parameters:
        zero["offload_param"] = {"device": "cpu", "pin_memory": opts.pin_memory}
    return zero


def converts_blocks(opts: ZeroOptions) -> bool:
    """Whether AutoEP replaces the MoE blocks: expert parallelism, or ``grouped_experts`` at ep_size=1."""
    return opts.ep_size > 1 or opts.grouped_experts


def expert_parallel_section(opts: ZeroOptions, locate: Mapping[str, Any], use_grouped_mm: bool) -> dict[str, Any]:
    """The AutoEP section: ``autoep_size`` plus the keys that locate the blocks (``autoep_size=1``
    with ``grouped_experts``: AutoEP's layer, every expert local, no all-to-all)."""
    return {"enabled": True, "autoep_size": opts.ep_size, "use_grouped_mm": use_grouped_mm, **locate}


def build_config(opts: ZeroOptions, locate: Mapping[str, Any] | None, *, use_grouped_mm: bool) -> dict[str, Any]:
    """The strategy's own DeepSpeed config, before the user's config is merged over it.

    ``locate``: discovery's AutoEP keys, or None when AutoEP converts nothing (no block found, or
    ``ep_size=1`` without ``grouped_experts``: see :func:`converts_blocks`).
    """
    config: dict[str, Any] = {
        "zero_allow_untested_optimizer": True,
        "zero_optimization": zero_section(opts),
    }
    if locate is not None:
        config["expert_parallel"] = expert_parallel_section(opts, locate, use_grouped_mm)
    return config


def load_user_config(config: str | Path | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A user config from a dict or a JSON file, with clear errors for the usual mistakes."""
    if config is None:
        return None
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(say("config-file-format", "not-found", "dict-or-existing-path", path=path))
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(say("config-file-format", "invalid-json-file", path=path, line=err.lineno, col=err.colno,
                             error=err.msg)) from None
    if not isinstance(loaded, dict):
        raise ValueError(say("config-file-format", "not-an-object", path=path, type_name=type(loaded).__name__))
    return loaded


def merge_config(base: Mapping[str, Any], user: Mapping[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """Deep-merge ``user`` over ``base``; the user wins. Returns the result and one line per override."""
    merged = copy.deepcopy(dict(base))
    notes: list[str] = []
    _merge_into(merged, user or {}, "", notes)
    return merged, notes


def _merge_into(target: dict[str, Any], source: Mapping[str, Any], prefix: str, notes: list[str]) -> None:
    for key, value in source.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and isinstance(target.get(key), dict):
            _merge_into(target[key], value, path + ".", notes)
            continue
        if key in target and target[key] != value:
            notes.append(f"{path}: {target[key]!r} -> {value!r} (from your config)")
        target[key] = copy.deepcopy(value)

