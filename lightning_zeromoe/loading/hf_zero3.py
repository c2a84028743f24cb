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
file into ``param.ds_tensor`` (its partition), with no gather and no collective, and gives the file
pages it read back to the kernel (:mod:`lightning_zeromoe.loading.memory_release`). Peak memory per rank is
its partitions plus one expert's weight conversion. Transformers' own key handling is kept: its weight conversions
(``load_config.weight_mapping``, e.g. legacy per-expert Mixtral checkpoints fused into
``gate_up_proj``) and ``base_model_prefix`` renaming run first. The original loader is used instead
for NVMe parameter offload (partitions live on disk).

Measured in ``benchmarks/load_memory.py`` (docs/benchmarks.md). The DeepSpeed internals read here
(``ds_tensor``, ``ds_numel``, ``ds_shape``, ``ds_status``, ``ds_process_group``) and the transformers
function replaced are all named in :data:`PRIVATE_NAMES`; ``tests/test_hf_loading.py`` fails when
an upgrade removes one.
"""

from __future__ import annotations

import importlib.abc
import sys
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch
from torch import nn

from lightning_zeromoe._private import transformers as hf_private
from lightning_zeromoe.loading.expert_fusion import convert_row, copy_range_into_partition, load_expert_rows, split_expert_rows
from lightning_zeromoe.loading.import_hooks import spec_without
from lightning_zeromoe.loading.memory_release import FilePages, trim_heap

if TYPE_CHECKING:
    from lightning_zeromoe.config.schema import DeepSpeedConfig

#: Private names this module relies on, by owner (checked by tests/test_hf_loading.py).
PRIVATE_NAMES = {
    "transformers.modeling_utils": ("_load_state_dict_into_zero3_model",),
    "transformers.core_model_loading": ("Concatenate", "MergeModulelist", "WeightConverter", "WeightRenaming",
                                        "dot_natural_key", "rename_source_key"),
    "transformers.integrations.deepspeed": ("_apply_weight_conversions_to_state_dict", "_hf_deepspeed_config_weak_ref",
                                            "set_hf_deepspeed_config",
                                            "unset_hf_deepspeed_config", "is_deepspeed_zero3_enabled"),
    "deepspeed.runtime.zero.partition_parameters": ("ZeroParamStatus", "shutdown_init_context",
                                                    "restore_init_context"),
}

class _Zero3Flag:
    """What transformers asks of the object behind its DeepSpeed weakref: ``is_zero3()`` and ``config``.

    transformers' ``HfDeepSpeedConfig`` would do the same but needs ``accelerate``, which this
    project does not depend on; ``is_deepspeed_zero3_enabled`` and ``deepspeed_config`` read only
    these two members.
    """

    def __init__(self, config: DeepSpeedConfig) -> None:
        self.config = config.to_dict()  # transformers reads the dict
        self.stage = config.stage

    def is_zero3(self) -> bool:
        return self.stage == 3


@contextmanager
def transformers_zero3(ds_config: DeepSpeedConfig | None) -> Iterator[None]:
    """Tell transformers that ZeRO-3 is on, and load ``from_pretrained`` weights partition by partition.

    A no-op when ``ds_config`` is ``None`` or not stage 3, or when transformers is not installed.
    Whatever transformers had registered before is put back afterwards.
    """
    if ds_config is None or ds_config.stage != 3:
        yield
        return
    try:
        from transformers.integrations import deepspeed as hf_ds
    except ImportError:
        yield
        return
    previous_ref = hf_private.deepspeed_config_ref()
    flag = _Zero3Flag(ds_config)
    original = hf_private.zero3_loader()
    hf_ds.set_hf_deepspeed_config(flag)
    hf_private.set_zero3_loader(_partition_loader(original))
    finder = ImportOutsideZeroInit()
    sys.meta_path.insert(0, finder)
    try:
        with hf_private.checkpoint_read_on_every_rank():  # transformers >= 5.23 reads "meta" on ranks != 0
            yield
    finally:
        sys.meta_path.remove(finder)
        hf_private.set_zero3_loader(original)
        if previous_ref is None:
            hf_ds.unset_hf_deepspeed_config()
        else:
            hf_private.set_deepspeed_config_ref(previous_ref)


class ImportOutsideZeroInit(importlib.abc.MetaPathFinder):
    """Import ``transformers.models.*`` modules with ``zero.Init``'s class patching lifted.

    ``AutoModelForCausalLM.from_pretrained`` imports the model's module on first use, here inside
    ``zero.Init``. ``zero.Init`` wraps the ``__init__`` of every ``nn.Module`` subclass created
    while it is active and, on exit, puts back the ``__init__`` it saw at class creation. Decorators
    applied after the class statement are then lost: transformers 5.22's ``@use_experts_implementation``
    sets ``self.config`` in a wrapped ``__init__``, so every Mixtral built later in the process (a
    plain reference model, the exported model reloaded) fails with "'MixtralExperts' object has
    no attribute 'config'" (measured on the rank that had not imported Mixtral before fit).
    DeepSpeed's own ``shutdown_init_context`` / ``restore_init_context`` lift and restore the
    patching around the module's execution; classes created there are patched on restore like
    any existing class, with their finished ``__init__``.
    """

    _depth = 0

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if not name.startswith("transformers.models."):
            return None
        spec = spec_without(self, name, path, target)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _OutsideZeroInitLoader(spec.loader)
        return spec


class _OutsideZeroInitLoader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... of the real loader
        return getattr(self.inner, name)

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        from deepspeed.runtime.zero.partition_parameters import restore_init_context, shutdown_init_context

        outermost = ImportOutsideZeroInit._depth == 0
        ImportOutsideZeroInit._depth += 1
        if outermost:
            shutdown_init_context()
        try:
            self.inner.exec_module(module)
        finally:
            ImportOutsideZeroInit._depth -= 1
            if outermost:
                restore_init_context()


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
    (no ``ds_tensor``) are copied whole; buffers too (ZeRO-3 never partitions them).

    Weight conversions run one layer at a time (:func:`layer_groups`): transformers' own
    ``_apply_weight_conversions_to_state_dict`` fuses *every* layer's experts before loading any,
    which materialises all expert weights on every rank at once (measured: 2.6x the fp32 model per
    rank for a legacy-format Mixtral, the format ``save_pretrained`` writes in transformers 5.22).
    Within a layer, fused experts are converted one expert at a time, and only the experts this
    rank's partition holds (:mod:`lightning_zeromoe.loading.expert_fusion`).
    """
    weight_mapping = getattr(load_config, "weight_mapping", None)
    if weight_mapping:
        hf_private.keep_weight_conversions(model, weight_mapping)
    targets: dict[str, tuple[torch.Tensor, bool]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        targets[name] = (param, True)
    for name, buf in model.named_buffers(remove_duplicate=False):
        if buf is not None:
            targets[name] = (buf, False)
    model_keys = set(model.state_dict().keys())
    prefix = getattr(model, "base_model_prefix", None)
    missing = set(model_keys)
    errors: list[str] = []
    pages = FilePages()
    pages.release_mappings(state_dict.values())  # what handing the tensors out touched (memory_release)
    params = {name: t for name, (t, is_param) in targets.items() if is_param}
    for keys in layer_groups(state_dict.keys()):
        if weight_mapping:  # fused experts: one expert at a time, this rank's only (expert_fusion)
            keys, per_expert = split_expert_rows(keys, weight_mapping, params, prefix)
            for item in per_expert:
                if load_expert_rows(item, state_dict, partial(convert_row, item, model=model), pages.release):
                    missing.discard(item.target)
                    hf_private.mark_loaded(item.param)
                else:
                    keys = keys + item.keys
        group = {k: state_dict[k] for k in keys}
        if weight_mapping:
            group = hf_private.apply_weight_conversions(model, group, weight_mapping)
            for k in keys:  # consumed by a conversion (fused into a new tensor): its file pages are done
                if k not in group:
                    pages.release(state_dict[k])
        while group:  # popped, so each converted tensor is freed as soon as its slice is copied
            key, tensor = group.popitem()
            if prefix and key not in targets and f"{prefix}.{key}" in targets:
                key = f"{prefix}.{key}"
            target = targets.get(key)
            if target is None:
                continue
            missing.discard(key)
            tensor_, is_param = target
            if is_param:
                error = copy_into_partition(tensor_, tensor, key)
                if error:
                    errors.append(error)
                else:
                    hf_private.mark_loaded(tensor_)
            else:
                with torch.no_grad():
                    tensor_.copy_(tensor)
                hf_private.mark_loaded(tensor_)
            pages.release(tensor)
            del tensor
        for k in keys:
            pages.release(state_dict[k])
        del group
        trim_heap()
    return errors, missing


def layer_groups(keys: Any) -> list[list[str]]:
    """Checkpoint keys grouped by the first numbered module in their path (``model.layers.3``);
    keys without one (embeddings, final norm, head) each on their own. Weight conversions combine
    tensors within one layer (the experts of a block), never across layers."""
    import re

    groups: dict[str, list[str]] = {}
    for key in keys:
        match = re.match(r"^(.*?\.\d+)\.", key)
        groups.setdefault(match.group(1) if match else key, []).append(key)
    return list(groups.values())


def copy_into_partition(param: torch.Tensor, source: torch.Tensor, key: str = "") -> str | None:
    """Copy this rank's part of ``source`` into ``param``; return an error message on a shape mismatch.

    Only the slice of ``source`` that this rank's partition holds is read
    (:func:`lightning_zeromoe.loading.expert_fusion.partition_range`).
    """
    shape = tuple(getattr(param, "ds_shape", param.shape))
    if tuple(source.shape) != shape:
        return (f"size mismatch for {key}: copying a param with shape {tuple(source.shape)} from checkpoint, "
                f"the shape in current model is {shape}.")
    with torch.no_grad():
        if getattr(param, "ds_tensor", None) is None:
            param.data.copy_(source)
            return None
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        copy_range_into_partition(param, source.reshape(-1), 0)
        if param.ds_status == ZeroParamStatus.AVAILABLE:  # gathered right now: the full view too
            param.data.copy_(source)
    return None


__all__ = ["PRIVATE_NAMES", "copy_into_partition", "load_into_partitions", "transformers_zero3"]
