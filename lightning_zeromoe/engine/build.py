"""The one ``deepspeed.initialize`` call, for training and evaluation, on CPU and GPU.

AutoEP reads ``root.config`` (``num_experts``, ``top_k``, ``model_type``, routing details), and the
root DeepSpeed gets is the LightningModule: the Hugging Face config is lent to it for the call
(:func:`lend_root_config`). On CPU, ``device_rank`` is the local rank (CPU devices have no index).
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

from torch.nn import Module

from lightning_zeromoe._private.deepspeed import autoep_output_capture_shim, import_muon_compiling_on_first_use
from lightning_zeromoe.config.autoep_wire import config_for_deepspeed
from lightning_zeromoe.config.schema import DeepSpeedConfig

if TYPE_CHECKING:
    import deepspeed


@contextmanager
def lend_root_config(model: Module, config: Any) -> Iterator[None]:
    """Make ``model.config`` the Hugging Face config for the duration of the block.

    Whatever the module had under that name is put back afterwards.
    """
    if config is None:
        yield
        return
    missing = object()
    previous = model.__dict__.get("config", missing)
    model.__dict__["config"] = config
    try:
        yield
    finally:
        if previous is missing:
            del model.__dict__["config"]
        else:
            model.__dict__["config"] = previous


def autoep_converted(model: Module) -> bool:
    """Whether AutoEP has already replaced MoE blocks in ``model`` (``fit`` ran in this process)."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    return any(isinstance(m, AutoEPMoELayer) for m in model.modules())


def initialize(model: Module, config: DeepSpeedConfig, *, device_rank: int, root_config: Any, optimizer: Any,
               params: Any, lr_scheduler: Any) -> tuple["deepspeed.DeepSpeedEngine", Any]:
    """``deepspeed.initialize`` with the root config lent, and what DeepSpeed needs around it.

    DeepSpeed gets no ``preset_model`` next to a re-rooted pattern when AutoEP picks that preset from
    the lent config itself (it warns about the pair: :mod:`lightning_zeromoe.config.autoep_wire`), and
    runs inside the transformers-registry shim (transformers >= 5.23 with deepspeed 0.19.8's AutoEP).
    The typed config becomes the dict DeepSpeed reads here, and only here.

    Around the call: DeepSpeed's Muon module is imported first without compiling its kernels
    (:func:`~lightning_zeromoe._private.deepspeed.import_muon_compiling_on_first_use`), and the heap
    is trimmed before (the conversion probe's copies of the blocks are freed by then) and after
    (AutoEP's conversion frees each replaced block's weights). glibc otherwise keeps both in the
    process: ~160 MB per rank at engine built on a 14M-parameter Mixtral, measured with
    ``benchmarks/start_phases.py``.
    """
    import deepspeed

    from lightning_zeromoe.loading.memory_release import trim_heap

    trim_heap()
    import_muon_compiling_on_first_use()

    wire = config_for_deepspeed(config.to_dict(), root_config)
    with lend_root_config(model, root_config), autoep_output_capture_shim():
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=device_rank), config=wire, model=model,
            model_parameters=params, optimizer=optimizer, lr_scheduler=lr_scheduler, dist_init_required=False)
    trim_heap()
    return engine, ds_optimizer


__all__ = ["autoep_converted", "initialize", "lend_root_config"]
