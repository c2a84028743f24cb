"""Loading a pretrained Hugging Face model straight into ZeRO-3 partitions.

Inside a LightningModule's ``configure_model``, under ``ZeroMoEStrategy`` at stage 3::

    def configure_model(self):
        if self.model is None:
            self.model = AutoModelForCausalLM.from_pretrained(path)   # nothing else to do

``ZeroMoEStrategy.model_sharded_context`` enters :func:`transformers_zero3` inside DeepSpeed's
``zero.Init``. What transformers 5.22 does then (``modeling_utils.py``, ``integrations/deepspeed.py``):

* ``is_deepspeed_zero3_enabled()`` is true, so ``PreTrainedModel.get_init_context`` builds the model
  under its own (nested, harmless) ``deepspeed.zero.Init`` with ``no_init_weights``: each module's
  parameters are partitioned as soon as the module is constructed, and nothing is initialised
  twice. Without this flag transformers builds on the ``meta`` device and assigns full tensors on
  every rank, which ZeRO-3 never partitions.
* The checkpoint files are opened with ``safe_open``: safetensors 0.8 hands back tensors that are
  memory-mapped views of the file, read only when touched.
* ``_load_state_dict_into_zero3_model`` then, module by module, gathers the full parameters on every
  rank (``GatheredParameters(modifier_rank=0)``), lets rank 0 copy the checkpoint in and broadcasts.
  So rank 0 touches every page of the checkpoint and keeps them mapped until loading ends: its
  peak holds the whole checkpoint on top of its partition.

While :func:`transformers_zero3` is active that last step is replaced by
:func:`load_into_partitions`: each rank copies only *its own* slice of each tensor from the mapped
file into ``param.ds_tensor`` (its partition), with no gather and no collective, and then tells the
kernel it is done with those file pages (``madvise(MADV_PAGEOUT)``: pages of a file mapping are
dropped and re-read if touched again; a hint, never a change of data). Peak memory per rank is its
partition plus one tensor's slice. Transformers' own key handling is kept: its weight conversions
(``load_config.weight_mapping``, e.g. legacy per-expert Mixtral checkpoints fused into
``gate_up_proj``) and ``base_model_prefix`` renaming run first. The original loader is used instead
for NVMe parameter offload (partitions live on disk).

Measured in ``benchmarks/load_memory.py`` (see the README). The DeepSpeed internals read here
(``ds_tensor``, ``ds_numel``, ``ds_shape``, ``ds_status``, ``ds_process_group``) and the transformers
function replaced are all named in :data:`PRIVATE_NAMES`; ``tests/test_hf_loading.py`` fails when
an upgrade removes one.
"""

from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

import torch
from torch import nn

#: Private names this module relies on, by owner (checked by tests/test_hf_loading.py).
PRIVATE_NAMES = {
    "transformers.modeling_utils": ("_load_state_dict_into_zero3_model",),
    "transformers.integrations.deepspeed": ("_apply_weight_conversions_to_state_dict", "_hf_deepspeed_config_weak_ref",
                                            "set_hf_deepspeed_config",
                                            "unset_hf_deepspeed_config", "is_deepspeed_zero3_enabled"),
    "deepspeed.runtime.zero.partition_parameters": ("ZeroParamStatus",),
}

_MADV_PAGEOUT = 21  # Linux >= 5.4; elsewhere madvise fails with EINVAL and nothing happens


class _Zero3Flag:
    """What transformers asks of the object behind its DeepSpeed weakref: ``is_zero3()`` and ``config``.

    transformers' ``HfDeepSpeedConfig`` would do the same but needs ``accelerate``, which this
    project does not depend on; ``is_deepspeed_zero3_enabled`` and ``deepspeed_config`` read only
    these two members.
    """

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = dict(config)

    def is_zero3(self) -> bool:
        return int(self.config.get("zero_optimization", {}).get("stage", 0)) == 3


@contextmanager
def transformers_zero3(ds_config: Mapping[str, Any] | None) -> Iterator[None]:
    """Tell transformers that ZeRO-3 is on, and load ``from_pretrained`` weights partition by partition.

    A no-op when ``ds_config`` is ``None`` or not stage 3, or when transformers is not installed.
    Whatever transformers had registered before is put back afterwards.
    """
    if ds_config is None or int(ds_config.get("zero_optimization", {}).get("stage", 0)) != 3:
        yield
        return
    try:
        from transformers import modeling_utils
        from transformers.integrations import deepspeed as hf_ds
    except ImportError:
        yield
        return
    previous_ref = hf_ds._hf_deepspeed_config_weak_ref
    flag = _Zero3Flag(ds_config)
    original = modeling_utils._load_state_dict_into_zero3_model
    hf_ds.set_hf_deepspeed_config(flag)
    modeling_utils._load_state_dict_into_zero3_model = _partition_loader(original)
    try:
        yield
    finally:
        modeling_utils._load_state_dict_into_zero3_model = original
        if previous_ref is None:
            hf_ds.unset_hf_deepspeed_config()
        else:
            hf_ds._hf_deepspeed_config_weak_ref = previous_ref


def _partition_loader(original: Any) -> Any:
    def load(model: nn.Module, state_dict: dict[str, torch.Tensor], load_config: Any = None) -> tuple[list[str], set[str]]:
        if _any_nvme(model):
            return original(model, state_dict, load_config)
        return load_into_partitions(model, state_dict, load_config)

    load.__wrapped__ = original  # type: ignore[attr-defined]
    return load


def _any_nvme(model: nn.Module) -> bool:
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    return any(getattr(getattr(p, "ds_tensor", None), "final_location", None) == OffloadDeviceEnum.nvme
               for p in model.parameters())


def load_into_partitions(model: nn.Module, state_dict: Mapping[str, torch.Tensor],
                         load_config: Any = None) -> tuple[list[str], set[str]]:
    """Copy each rank's slice of ``state_dict`` into the ZeRO-3 partitions of ``model``; no collective.

    Same contract as transformers' ``_load_state_dict_into_zero3_model``: returns
    ``(error_msgs, missing_keys)`` and marks every loaded parameter ``_is_hf_initialized`` so
    transformers initialises only the missing ones. Parameters that are not ZeRO-3 partitioned
    (no ``ds_tensor``) are copied whole. Buffers are copied whole (ZeRO-3 never partitions them).
    """
    from transformers.integrations.deepspeed import _apply_weight_conversions_to_state_dict

    weight_mapping = getattr(load_config, "weight_mapping", None)
    if weight_mapping:
        state_dict = _apply_weight_conversions_to_state_dict(model, dict(state_dict), weight_mapping)
        model._weight_conversions = weight_mapping  # transformers keeps it for save_pretrained
    model_keys = set(model.state_dict().keys())
    prefix = getattr(model, "base_model_prefix", None)
    state_dict = {(f"{prefix}.{k}" if f"{prefix}.{k}" in model_keys else k): v for k, v in state_dict.items()}
    missing = set(model_keys)
    errors: list[str] = []
    for mod_name, module in model.named_modules():
        dot = f"{mod_name}." if mod_name else ""
        for name, param in module.named_parameters(recurse=False):
            key = dot + name
            if key not in state_dict:
                continue
            missing.discard(key)
            error = copy_into_partition(param, state_dict[key], key)
            if error:
                errors.append(error)
            else:
                param._is_hf_initialized = True
        for name, buf in module.named_buffers(recurse=False):
            key = dot + name
            if key in state_dict and buf is not None:
                missing.discard(key)
                with torch.no_grad():
                    buf.copy_(state_dict[key])
                buf._is_hf_initialized = True
    return errors, missing


def copy_into_partition(param: torch.Tensor, source: torch.Tensor, key: str = "") -> str | None:
    """Copy this rank's part of ``source`` into ``param``; return an error message on a shape mismatch.

    A ZeRO-3 parameter's partition (``param.ds_tensor``, ``ds_tensor.ds_numel`` elements) holds the
    flattened elements ``[r * n, (r + 1) * n)`` of the full tensor, ``r`` being this rank's index in
    ``param.ds_process_group``; the last partition is padded. That is DeepSpeed 0.19's layout
    (``Init._partition_param``). Only that slice of ``source`` is read.
    """
    shape = tuple(getattr(param, "ds_shape", param.shape))
    if tuple(source.shape) != shape:
        return (f"size mismatch for {key}: copying a param with shape {tuple(source.shape)} from checkpoint, "
                f"the shape in current model is {shape}.")
    flat = source.reshape(-1)
    part = getattr(param, "ds_tensor", None)
    with torch.no_grad():
        if part is None:
            param.data.copy_(source)
        else:
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

            group = getattr(param, "ds_process_group", None)
            rank = torch.distributed.get_rank(group) if torch.distributed.is_initialized() else 0
            size = int(part.ds_numel)
            start = rank * size
            count = max(0, min(size, flat.numel() - start))
            if count:
                part.narrow(0, 0, count).copy_(flat.narrow(0, start, count))
            if param.ds_status == ZeroParamStatus.AVAILABLE:  # gathered right now: the full view too
                param.data.copy_(source)
    release_pages(source)
    return None


def release_pages(tensor: torch.Tensor) -> None:
    """Ask the kernel to drop the pages behind ``tensor`` from this process (``MADV_PAGEOUT``).

    For a memory-mapped checkpoint this takes the file pages just read out of the process's
    resident set (they are re-read from the page cache or disk if touched again). Anonymous pages
    are left alone without swap, and kept intact with it: the data never changes. No-op where the
    call is unsupported.
    """
    if tensor.device.type != "cpu" or tensor.numel() == 0 or not hasattr(os, "sysconf"):
        return
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    lo, hi = -(-start // page) * page, end // page * page
    if hi > lo:
        _libc().madvise(lo, hi - lo, _MADV_PAGEOUT)


_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _LIBC.madvise.restype = ctypes.c_int
    return _LIBC


__all__ = ["PRIVATE_NAMES", "copy_into_partition", "load_into_partitions", "release_pages", "transformers_zero3"]
