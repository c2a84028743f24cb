"""``ZeroMoEStrategy``: DeepSpeed ZeRO (stage 3 by default) plus expert parallelism via AutoEP.

A subclass of Lightning's ``DeepSpeedStrategy``. What it adds, hook by hook:

* ``setup_environment`` (the LightningModule is connected, no process group yet): find the MoE
  blocks, validate the layout, build and merge the DeepSpeed config. On CPU, select DeepSpeed's
  CPU accelerator instead of refusing (Lightning's parent refuses anything but CUDA).
* ``setup_distributed``: on CPU, skip the CUDA device-index check and join a gloo group.
* ``_setup_model_and_optimizer``: lend the Hugging Face config to the root while
  ``deepspeed.initialize`` runs (AutoEP reads ``root.config``), and pass a device rank DeepSpeed
  accepts on CPU.
"""

from __future__ import annotations

import argparse
import logging
import os
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn import Module

from lightning_zeromoe.config import DEFAULT_BUCKET_SIZE, ZeroOptions, build_config, load_user_config, merge_config
from lightning_zeromoe.discovery import Discovery, MoEPattern, discover
from lightning_zeromoe.validation import (Layout, ZeroMoEConfigError, check_batch_arithmetic, check_ep_divides_world,
                                          check_layout)

if TYPE_CHECKING:
    import deepspeed

log = logging.getLogger(__name__)

#: Lightning's own default collective timeout; DeepSpeed's would be 10 min (DEEPSPEED_TIMEOUT).
DEFAULT_TIMEOUT = timedelta(minutes=30)


class ZeroMoEStrategy(DeepSpeedStrategy):
    """Train Mixture-of-Experts models with DeepSpeed ZeRO-3 and expert parallelism.

    Example::

        trainer = L.Trainer(accelerator="gpu", devices=8, precision="bf16-true",
                            strategy=ZeroMoEStrategy(ep_size=8))

    The same code runs on CPU processes (``accelerator="cpu", devices=2``) with gloo.

    Args:
        ep_size: Expert-parallel group size. Experts of every MoE layer are split over groups of
            ``ep_size`` ranks (``num_experts / ep_size`` each); the groups are replicated
            ``world_size / ep_size`` times. Must divide the world size and every layer's expert
            count. 1 disables expert parallelism (AutoEP is not applied).
        stage: ZeRO stage, 3 by default (parameters, gradients and optimizer states sharded).
        offload_optimizer: Keep optimizer states in CPU memory. A last resort: it trades GPU
            memory for PCIe traffic and CPU Adam time.
        offload_parameters: Keep parameters in CPU memory (stage 3 only). Slower still.
        pin_memory: Pin offloaded buffers (needs a large enough ``ulimit -l``).
        overlap_comm: Overlap gradient reduction with backward.
        contiguous_gradients: Copy gradients into one buffer as they are produced (less
            fragmentation).
        reduce_bucket_size, allgather_bucket_size, prefetch_bucket_size: In elements; 5e7 by default.
        param_persistence_threshold: Stage 3 keeps parameters smaller than this unpartitioned
            (DeepSpeed's default 1e5). Set 0 to shard everything.
        gather_16bit_weights_on_save: Gather a consolidated 16-bit state dict when saving
            (``stage3_gather_16bit_weights_on_model_save``). Costly for large models.
        timeout: Collective timeout for the process groups training uses.
        config: A DeepSpeed config dict or JSON path merged over the generated one. Your values win;
            each override is logged.
        moe_pattern: Where your custom MoE blocks are, as :class:`MoEPattern` (or its fields as a
            dict). Hugging Face MoE models with an AutoEP preset, and modules that define
            ``autoep_pattern``, are found without it.
        **kwargs: Passed to Lightning's ``DeepSpeedStrategy`` (accelerator, parallel_devices,
            cluster_environment, precision_plugin, process_group_backend, logging_level, ...).
    """

    strategy_name = "zero_moe"

    def __init__(
        self,
        ep_size: int = 1,
        stage: int = 3,
        *,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        pin_memory: bool = False,
        overlap_comm: bool = True,
        contiguous_gradients: bool = True,
        reduce_bucket_size: int = DEFAULT_BUCKET_SIZE,
        allgather_bucket_size: int = DEFAULT_BUCKET_SIZE,
        prefetch_bucket_size: int = DEFAULT_BUCKET_SIZE,
        param_persistence_threshold: int = 100_000,
        gather_16bit_weights_on_save: bool = False,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        config: str | Path | Mapping[str, Any] | None = None,
        moe_pattern: MoEPattern | Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.options = ZeroOptions(
            stage=stage, ep_size=ep_size, offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters, pin_memory=pin_memory, overlap_comm=overlap_comm,
            contiguous_gradients=contiguous_gradients, reduce_bucket_size=int(reduce_bucket_size),
            allgather_bucket_size=int(allgather_bucket_size), prefetch_bucket_size=int(prefetch_bucket_size),
            param_persistence_threshold=int(param_persistence_threshold),
            gather_16bit_weights_on_save=gather_16bit_weights_on_save)
        self.user_config = load_user_config(config)
        self.moe_pattern = MoEPattern(**moe_pattern) if isinstance(moe_pattern, Mapping) else moe_pattern
        self.discovery: Discovery | None = None
        # The real config is built in setup_environment, once the model is known.
        super().__init__(config={}, timeout=timeout, **kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="DeepSpeed ZeRO-3 + expert parallelism (AutoEP)")

    # ------------------------------------------------------------------ hooks

    def _configure_launcher(self) -> None:
        # The Trainer calls this once devices and nodes are known and before any rank is launched:
        # the earliest point where an impossible ep_size can be refused, in the user's own process.
        check_ep_divides_world(self.options.ep_size, self.num_nodes * self.num_processes)
        super()._configure_launcher()

    def setup_environment(self) -> None:
        self.prepare()
        if self._on_cpu:
            _use_deepspeed_cpu_accelerator()
        # Skip DeepSpeedStrategy.setup_environment: it refuses every accelerator but CUDA.
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        if not self._on_cpu:
            return super().setup_distributed()
        # The parent validates CUDA device indices, which CPU devices do not have.
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def setup(self, trainer: Any) -> None:
        # configure_model() may have built (or replaced) the MoE blocks since setup_environment.
        self.prepare()
        super().setup(trainer)

    # ------------------------------------------------------------------ config

    def prepare(self) -> None:
        """Discover MoE blocks, validate, and build the DeepSpeed config. Idempotent, no communication."""
        module = self.lightning_module
        if module is None:
            raise RuntimeError("ZeroMoEStrategy needs a LightningModule: use it through Trainer.fit/validate/test.")
        self.discovery = discover(module, self.moe_pattern)
        layout = Layout(world_size=self.num_nodes * self.num_processes, devices_per_node=self.num_processes,
                        ep_size=self.options.ep_size, stage=self.options.stage,
                        precision=str(self.precision_plugin.precision))
        for warning in check_layout(layout, self.discovery):
            rank_zero_warn(warning)
        self.config = self._merged_config()
        check_batch_arithmetic(self.config, layout.world_size, self._accumulate_grad_batches())
        # Lightning sets gradient_accumulation_steps itself and refuses a config that has it.
        self.config.pop("gradient_accumulation_steps", None)
        self._config_initialized = False

    def _merged_config(self) -> dict[str, Any]:
        found = self.discovery
        locate = found.autoep if (found and found.blocks and self.options.ep_size > 1) else None
        base = build_config(self.options, locate, use_grouped_mm=not self._on_cpu)
        merged, overrides = merge_config(base, self.user_config)
        for line in overrides:
            rank_zero_info(f"ZeroMoEStrategy config override: {line}")
        return merged

    def _accumulate_grad_batches(self) -> int:
        trainer = getattr(self.lightning_module, "_trainer", None)
        return int(getattr(trainer, "accumulate_grad_batches", 1) or 1)

    @property
    def _on_cpu(self) -> bool:
        devices = self.parallel_devices or [self.root_device]
        return devices[0].type == "cpu"

    def _device_rank(self) -> int:
        # DeepSpeed compares device_rank with 0; CPU devices have no index.
        index = self.root_device.index
        return self.local_rank if index is None else index

    # ------------------------------------------------------------------ engine

    def _setup_model_and_optimizer(
        self, model: Module, optimizer: torch.optim.Optimizer | None, lr_scheduler: Any = None,
    ) -> tuple["deepspeed.DeepSpeedEngine", torch.optim.Optimizer]:
        import deepspeed

        params = [p for p in model.parameters() if p.requires_grad]
        with lend_root_config(model, self.discovery.root_config if self.discovery else None):
            engine, ds_optimizer, _, _ = deepspeed.initialize(
                args=argparse.Namespace(device_rank=self._device_rank()), config=self.config, model=model,
                model_parameters=params, optimizer=optimizer, lr_scheduler=lr_scheduler, dist_init_required=False)
        return engine, ds_optimizer

    def _initialize_deepspeed_inference(self, model: Module) -> None:
        if not self._on_cpu:
            return super()._initialize_deepspeed_inference(model)
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": 1, **{k: self.config[k] for k in ("fp16", "bf16") if k in self.config}}
        if self.zero_stage_3:
            config.update({k: self.config[k] for k in ("zero_allow_untested_optimizer", "zero_optimization")})
        if "expert_parallel" in self.config:
            config["expert_parallel"] = self.config["expert_parallel"]
        with lend_root_config(model, self.discovery.root_config if self.discovery else None):
            self.model, _, _, _ = deepspeed.initialize(
                args=argparse.Namespace(device_rank=self._device_rank()), config=config, model=model,
                optimizer=None, lr_scheduler=None, model_parameters=[], dist_init_required=False)


@contextmanager
def lend_root_config(model: Module, config: Any) -> Iterator[None]:
    """Make ``model.config`` the Hugging Face config for the duration of the block.

    AutoEP reads ``num_experts``, ``top_k``, ``model_type`` and routing details from
    ``root.config``; the root here is the LightningModule. Whatever the module had under that
    name is put back afterwards.
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


def _use_deepspeed_cpu_accelerator() -> None:
    """Point DeepSpeed at its CPU accelerator (gloo), even on a machine that has GPUs."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())


__all__ = ["ZeroMoEStrategy", "ZeroMoEConfigError", "MoEPattern", "lend_root_config"]
