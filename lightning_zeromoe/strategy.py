"""``ZeroMoEStrategy``: DeepSpeed ZeRO (stage 3 by default) plus expert parallelism via AutoEP.

A subclass of Lightning's ``DeepSpeedStrategy``; the hooks below run in Lifecycle order. What each adds:

* ``__init__``: sort Lightning's ``DeepSpeedStrategy`` keywords into passed-on, mapped into the
  config, or refused (:mod:`lightning_zeromoe.config.keywords`); read ``PL_DEEPSPEED_CONFIG_PATH``.
* ``_configure_launcher`` (devices and nodes known, no rank launched): refuse an ``ep_size`` that
  does not divide the world, in the user's own process.
* ``setup_environment``: on CPU, select DeepSpeed's CPU accelerator instead of refusing; give
  ``zero.Init`` (``configure_model``) the ZeRO section it needs. No model yet: nothing else.
* ``setup_distributed``: on CPU, skip the CUDA device-index check and join a gloo group.
* ``setup`` (after ``configure_model``: the model exists): discover the MoE blocks, pick the stage
  for ``stage="auto"``, build, merge and validate the config once (:func:`lightning_zeromoe.config.resolve.resolve`).
* ``_setup_model_and_optimizer`` / ``_initialize_deepspeed_inference``: one engine builder for
  training and evaluation, on every device (:meth:`ZeroMoEStrategy._build_engine`): it lends the
  Hugging Face config to the root while ``deepspeed.initialize`` runs (AutoEP reads ``root.config``)
  and passes a device rank DeepSpeed accepts on CPU. Under ZeRO-1/2 with MoE the user's optimizer is
  split into MoE and non-MoE param groups (:mod:`lightning_zeromoe.engine.moe_groups`).
"""

from __future__ import annotations

import argparse
import os
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.utilities.rank_zero import WarningCache, rank_zero_info, rank_zero_warn
from torch.nn import Module
from typing_extensions import override

from lightning_zeromoe._private import lightning as lightning_private
from lightning_zeromoe._private.lightning import PARENT_PRIVATE_API  # noqa: F401 - re-exported (tests)
from lightning_zeromoe._private.torch import remove_hooks_defined_in
from lightning_zeromoe.config.deepspeed import DEFAULT_BUCKET_SIZE, ZeroOptions, load_user_config
from lightning_zeromoe.discovery.find import Discovery, MoEPattern, discover
from lightning_zeromoe.config.keywords import CONFIG_ENV_VAR, config_source, split_keywords
from lightning_zeromoe.engine.processes import (apply_timeout_to_all_groups, group_timeout, stop_launched_ranks,
                                         use_deepspeed_cpu_accelerator)
from lightning_zeromoe.config.resolve import (ResolvedConfig, World, check_offload_optimizer, effective_ep_size,
                                       effective_grouped_experts,
                                       inference_config, resolve, zero_init_config)
from lightning_zeromoe.config.validation import ZeroMoEConfigError, check_ep_divides_world
from lightning_zeromoe.knowledge import say

if TYPE_CHECKING:
    import deepspeed

#: Lightning's own default collective timeout; DeepSpeed's would be 10 min (DEEPSPEED_TIMEOUT).
DEFAULT_TIMEOUT = timedelta(minutes=30)

# PARENT_PRIVATE_API (lightning_zeromoe._private.lightning): the private DeepSpeedStrategy members this
# class overrides or relies on; tests/test_lightning_internals.py checks they still exist.


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
            count. 1 disables expert parallelism (AutoEP is not applied, unless
            ``grouped_experts``). An ``expert_parallel.autoep_size`` in ``config`` wins (and is what
            is validated).
        grouped_experts: At ``ep_size=1``, still replace each MoE block with AutoEP's layer
            (``autoep_size=1``: every rank holds every expert, no all-to-all), for its grouped-GEMM
            experts (``torch._grouped_mm``, bf16 on CUDA; elsewhere its per-expert loop): one GPU
            or one node without expert parallelism. The blocks are probed, checkpointed, exported
            and resumed exactly as expert-parallel ones. Refused with ``expert_parallel.enabled:
            false`` or ``use_grouped_mm: false`` in ``config``. At ``ep_size > 1`` the blocks get
            that layer anyway.
        stage: ZeRO stage, 3 by default (parameters, gradients and optimizer states sharded), or
            ``"auto"``: once the model exists, :func:`lightning_zeromoe.planner.choose_stage` picks
            the lowest stage whose model states fit the device memory and logs why. A model built
            under ``zero.Init`` in ``configure_model`` is already sharded, so ``"auto"`` keeps stage 3
            for it. A ``zero_optimization.stage`` in ``config`` wins over both. Stages 1 and 2 split
            the optimizer from ``configure_optimizers`` into MoE and non-MoE param groups.
        offload_optimizer: Keep optimizer states in CPU memory. A last resort: it trades GPU
            memory for PCIe traffic and CPU Adam time. Needs ``DeepSpeedCPUAdam`` from
            ``configure_optimizers`` (a torch optimizer is refused before any engine exists).
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
            each override is logged. Without it, ``PL_DEEPSPEED_CONFIG_PATH`` is read (as Lightning does).
        moe_pattern: Where your custom MoE blocks are, as :class:`MoEPattern` (or its fields as a
            dict). Hugging Face MoE models with an AutoEP preset, and modules that define
            ``autoep_pattern``, are found without it.
        register_tied_parameters: Register the parameters named in ``shared_parameters`` with
            ``deepspeed.zero.register_external_parameter`` on the modules that use them, so ZeRO-3
            prefetches them instead of gathering them synchronously on first use. (Tied weights a
            module holds itself, like a tied lm_head, need no registration: measured, it changes
            nothing in deepspeed 0.19.8.)
        shared_parameters: ``{module_path: [parameter_path, ...]}``: parameters a module uses
            functionally although another module owns them (``F.linear(h, other.weight)``).
        guard_device_moves: After engine setup, turn ``.to()/.cuda()/.half()``-style calls on the
            model into a no-op with one warning when nothing would change, and an error explaining
            why ZeRO-3 cannot allow it when the device or dtype would.
        grad_audit_steps: For this many optimizer steps, watch which trainable parameters get no
            gradient (a cached ``.data``, a detached copy, an unused branch) and warn; 0 turns it off.
            Nothing stays installed afterwards.
        **kwargs: Lightning's ``DeepSpeedStrategy`` keywords. Those the parent uses itself are passed
            on (accelerator, parallel_devices, cluster_environment, precision_plugin,
            process_group_backend, logging_level, remote_device, loss_scale*, load_full_weights, ...);
            those that only fed Lightning's own config builder (activation checkpointing, aio,
            ``offload_*_device``, ``nvme_path``, ``sub_group_size``, ``logging_batch_size_per_gpu``, ...)
            are written into the built config; ``zero_optimization`` is refused
            (:mod:`lightning_zeromoe.config.keywords`).
    """

    strategy_name = "zero_moe"

    def __init__(
        self,
        ep_size: int = 1,
        stage: int | str = 3,
        *,
        grouped_experts: bool = False,
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
        register_tied_parameters: bool = True,
        shared_parameters: Mapping[str, list[str] | tuple[str, ...]] | None = None,
        guard_device_moves: bool = True,
        grad_audit_steps: int = 3,
        **kwargs: Any,
    ) -> None:
        if isinstance(stage, str) and stage != "auto":
            raise ValueError(say("strategy-argument-invalid", "stage", "valid-stage", stage=stage))
        self.auto_stage = stage == "auto"
        self.options = ZeroOptions(
            stage=3 if self.auto_stage else int(stage), ep_size=ep_size, offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters, pin_memory=pin_memory, overlap_comm=overlap_comm,
            contiguous_gradients=contiguous_gradients, reduce_bucket_size=int(reduce_bucket_size),
            allgather_bucket_size=int(allgather_bucket_size), prefetch_bucket_size=int(prefetch_bucket_size),
            param_persistence_threshold=int(param_persistence_threshold),
            gather_16bit_weights_on_save=gather_16bit_weights_on_save, grouped_experts=grouped_experts)
        self.keywords = split_keywords(kwargs, offload_optimizer=offload_optimizer,
                                       offload_parameters=offload_parameters)
        source, from_env = config_source(config)
        if from_env:
            rank_zero_info(f"ZeroMoEStrategy: loading your DeepSpeed config from {CONFIG_ENV_VAR}={source}")
        self.user_config = load_user_config(source)
        # Needs no model: refuse enabled=false with ep_size > 1 (or grouped_experts) now, in the user's process.
        effective_grouped_experts(grouped_experts, effective_ep_size(ep_size, self.user_config), self.user_config)
        self.moe_pattern = MoEPattern(**moe_pattern) if isinstance(moe_pattern, Mapping) else moe_pattern
        self.discovery: Discovery | None = None
        #: The merged, validated config and the facts read from it; built once, in ``setup``.
        self.resolved: ResolvedConfig | None = None
        self._resolved_for: Module | None = None
        self._once = WarningCache()
        if grad_audit_steps < 0:
            raise ValueError(f"grad_audit_steps={grad_audit_steps} must be >= 0 (0 turns the gradient audit off).")
        # ZeRO-3 pitfalls (lightning_zeromoe.engine.pitfalls): one typed object, called at each hook.
        from lightning_zeromoe.engine.pitfalls import PitfallOptions, ZeroPitfalls

        self.pitfalls = ZeroPitfalls(
            PitfallOptions(register_tied_parameters=register_tied_parameters,
                           shared_parameters={k: list(v) for k, v in (shared_parameters or {}).items()},
                           guard_device_moves=guard_device_moves, grad_audit_steps=int(grad_audit_steps)),
            info=rank_zero_info, warn=rank_zero_warn)
        # Lightning never builds its own config (config={} is not None); ours is built in setup().
        super().__init__(config={}, timeout=timeout, **self.keywords.passed)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="DeepSpeed ZeRO-3 + expert parallelism (AutoEP)")

    # ------------------------------------------------------------------ hooks, in lifecycle order

    @override
    def _configure_launcher(self) -> None:
        # The Trainer calls this once devices and nodes are known and before any rank is launched:
        # the earliest point where an impossible ep_size can be refused, in the user's own process.
        check_ep_divides_world(effective_ep_size(self.options.ep_size, self.user_config),
                               self.num_nodes * self.num_processes)
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        if self._on_cpu:
            use_deepspeed_cpu_accelerator()
        # configure_model() runs next, under zero.Init for stage 3: it needs the ZeRO section now.
        # The full config (discovery, validation, stage="auto") waits for the model, in setup().
        if self.resolved is None:
            self.config = zero_init_config(self.options, auto_stage=self.auto_stage,
                                           keyword_sections=self._keyword_sections(), user=self.user_config)
            lightning_private.rebuild_config(self)
        # Skip DeepSpeedStrategy.setup_environment: it refuses every accelerator but CUDA.
        DDPStrategy.setup_environment(self)

    @override
    def setup_distributed(self) -> None:
        if not self._on_cpu:
            return super().setup_distributed()
        # The parent validates CUDA device indices, which CPU devices do not have.
        reset_seed()
        self.set_world_ranks()
        lightning_private.init_distributed(self)

    @override
    def setup(self, trainer: Any) -> None:
        # configure_model() has run: the model exists, so discovery and validation can see it.
        self.prepare()
        super().setup(trainer)

    @override
    @contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        """``configure_model`` runs here: DeepSpeed's ``zero.Init`` (stage 3), and transformers told so.

        Under ``zero.Init`` every module's parameters are partitioned as it is constructed. Inside,
        :func:`lightning_zeromoe.loading.hf_zero3.transformers_zero3` makes ``from_pretrained`` build the
        model partitioned (not on the meta device) and copy each rank's slice of the checkpoint
        straight into its partition: no rank ever holds the whole model. AutoEP converts the MoE
        blocks later, inside ``deepspeed.initialize``. The heap is trimmed after each partitioned
        module (:func:`lightning_zeromoe.loading.memory_release.trim_after_each_partition`).
        """
        from lightning_zeromoe.loading.hf_zero3 import transformers_zero3
        from lightning_zeromoe.loading.memory_release import trim_after_each_partition

        stage_3 = self.zero_stage_3
        with super().model_sharded_context(), trim_after_each_partition(stage_3), \
                transformers_zero3(self.config if stage_3 else None):
            yield

    @override
    def init_deepspeed(self) -> None:
        super().init_deepspeed()
        # deepspeed.initialize has created the expert-parallel groups by now.
        apply_timeout_to_all_groups(lightning_private.collective_timeout(self))

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        timeout = lightning_private.collective_timeout(self)
        stop_launched_ranks(self.launcher, grace=min(10.0, timeout.total_seconds() if timeout else 10.0))

    # ------------------------------------------------------------------ config

    def prepare(self) -> None:
        """Discover MoE blocks, pick the stage, build, merge and validate the config. No communication.

        Runs once per model: a second ``setup`` for the same LightningModule (``validate`` after
        ``fit``) keeps the config the model was converted with; AutoEP has replaced its blocks by
        then, so discovering them again would describe another model.
        """
        module = self.lightning_module
        if module is None:
            raise RuntimeError(say("strategy-argument-invalid", "no-module", "through-trainer"))
        if self.resolved is not None and self._resolved_for is module:
            self.config = dict(self.resolved.config)
            lightning_private.rebuild_config(self)
            return
        self.discovery = discover(module, self.moe_pattern)
        world = World(world_size=self.num_nodes * self.num_processes, devices_per_node=self.num_processes,
                      on_cpu=self._on_cpu, precision=str(self.precision_plugin.precision),
                      accumulate_grad_batches=self._accumulate_grad_batches())
        self.resolved = resolve(self.options, world, self.discovery, auto_stage=self.auto_stage,
                                choose_stage=lambda: self._choose_stage(module),
                                keyword_sections=self._keyword_sections(), user=self.user_config)
        self._resolved_for = module
        for warning in self.resolved.warnings:
            self._once.warn(warning)
        for note in self.resolved.notes:
            self._once.info(note)
        self.config = dict(self.resolved.config)
        lightning_private.rebuild_config(self)  # Lightning adds batch size, accumulation, clipping, precision

    def _keyword_sections(self) -> dict[str, Any]:
        return self.keywords.config_sections(offload_optimizer=self.options.offload_optimizer,
                                             offload_parameters=self.options.offload_parameters)

    def _choose_stage(self, module: Module) -> tuple[int, str]:
        """``stage="auto"``: the lowest ZeRO stage whose model states fit, from the memory planner."""
        if any(hasattr(p, "ds_id") for p in module.parameters()):
            return 3, ("stage=3: the model was built under zero.Init in configure_model and is already "
                       "partitioned, so a lower stage would first have to gather it whole on every rank.")
        from lightning_zeromoe.planner import choose_stage

        return choose_stage(module, world_size=self.num_nodes * self.num_processes,
                            devices_per_node=self.num_processes, ep_size=self.options.ep_size,
                            device_memory_bytes=self._device_memory_bytes(),
                            precision=str(self.precision_plugin.precision))

    def _device_memory_bytes(self) -> float:
        """Memory per device: the GPU's, or on CPU this host's RAM shared by its processes."""
        if not self._on_cpu:
            return float(torch.cuda.get_device_properties(self.root_device).total_memory)
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, self.num_processes)

    def _accumulate_grad_batches(self) -> int:
        trainer = lightning_private.trainer_of(self.lightning_module)
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

    @override
    def _setup_model_and_optimizer(
        self, model: Module, optimizer: torch.optim.Optimizer | None, lr_scheduler: Any = None,
    ) -> tuple["deepspeed.DeepSpeedEngine", torch.optim.Optimizer]:
        from lightning_zeromoe.engine.moe_groups import MoEOptimizerSplit, groups_with_names

        check_offload_optimizer(self.config, type(optimizer) if optimizer is not None else None)
        self._pitfalls_before_engine(model)
        params: Any = [p for p in model.parameters() if p.requires_grad]
        client: Any = optimizer
        split = None
        if optimizer is not None and self._needs_moe_param_groups():
            # ZeRO-1/2 need expert params in their own param groups; AutoEP creates them inside
            # deepspeed.initialize, so the split happens there, on the user's optimizer object.
            split = MoEOptimizerSplit(optimizer, lr_scheduler)
            params, client = groups_with_names(optimizer), split
        config = self.config
        if _autoep_converted(model):  # a second fit in this process: AutoEP must not convert twice
            config = {k: v for k, v in config.items() if k != "expert_parallel"}
        engine, ds_optimizer = self._build_engine(model, config, optimizer=client, params=params,
                                                  lr_scheduler=lr_scheduler)
        if split is not None:
            self._once.info(f"ZeroMoEStrategy: ZeRO stage {self.resolved.stage if self.resolved else '?'} with MoE: "
                            f"split your optimizer into {split.summary}")
        self._pitfalls_after_engine(engine)
        return engine, ds_optimizer

    def _needs_moe_param_groups(self) -> bool:
        found = self.discovery
        has_moe = bool(found and (found.native_moe or (found.blocks and self.resolved and self.resolved.expert_parallel)))
        stage = self.resolved.stage if self.resolved else 3
        return has_moe and stage in (1, 2)

    @override
    def _initialize_deepspeed_inference(self, model: Module) -> None:
        """validate/test/predict: the same builder as training, with ``expert_parallel`` kept."""
        config = inference_config(self.config, already_converted=_autoep_converted(model))
        remove_hooks_defined_in(model, "deepspeed")  # the training engine's, if fit ran before in this process
        self.model, _ = self._build_engine(model, config, optimizer=None, params=[], lr_scheduler=None)

    def _load_checkpoint_for_evaluation(self, checkpoint_path: Any) -> None:
        """``validate/test/predict(ckpt_path=...)``: make the evaluation engine able to load the shards.

        Under ZeRO-3 the trained weights live in the ZeRO partition files, which DeepSpeed restores
        through its ZeRO-3 optimizer (``engine._load_zero_checkpoint`` copies each saved flat fp32
        group into the optimizer's); an engine built without an optimizer has none (and for a
        model without MoE layers DeepSpeed would consolidate with ``zero_to_fp32``, which refuses
        AutoEP checkpoints). So the evaluation engine is rebuilt once with a do-nothing optimizer
        (SGD, lr=0, never stepped) whose parameters are in the order the checkpoint's flat groups
        were saved in (``param_shapes``), and the shards are loaded through it. Same shape as they
        were saved; loading for another world size (``resume``) extends this method.
        """
        if self.model is None or not self.zero_stage_3:
            return
        from lightning_zeromoe.checkpoint.resume.reshape import saved_parameter_order

        module = self.lightning_module
        config = inference_config(self.config, already_converted=_autoep_converted(module))
        trainable = dict((n, p) for n, p in module.named_parameters() if p.requires_grad)
        order = [n for n in saved_parameter_order(checkpoint_path) if n in trainable]
        params = [trainable[n] for n in order] + [p for n, p in trainable.items() if n not in set(order)]
        remove_hooks_defined_in(module, "deepspeed")
        self.model, _ = self._build_engine(module, config, optimizer=torch.optim.SGD(params, lr=0.0), params=params,
                                           lr_scheduler=None)

    def _build_engine(self, model: Module, config: dict[str, Any], *, optimizer: Any, params: Any,
                      lr_scheduler: Any) -> tuple["deepspeed.DeepSpeedEngine", Any]:
        """The one ``deepspeed.initialize`` call, for training and evaluation, on CPU and GPU."""
        import deepspeed

        converts = False
        if self.discovery is not None and not _autoep_converted(model):
            config, converts = self._prove_conversion(config)
        with lend_root_config(model, self.discovery.root_config if self.discovery else None):
            engine, ds_optimizer, _, _ = deepspeed.initialize(
                args=argparse.Namespace(device_rank=self._device_rank()), config=config, model=model,
                model_parameters=params, optimizer=optimizer, lr_scheduler=lr_scheduler, dist_init_required=False)
        if converts and self.discovery is not None:
            from lightning_zeromoe.conversion.check import match_output_contract, restore_router_logits

            restore_router_logits(self.lightning_module, self.discovery)
            for block in self.discovery.blocks:  # (hidden, router_logits) blocks without HF recorders: hand-written
                match_output_contract(self.lightning_module.get_submodule(block.path), block.returns_tuple)
        return engine, ds_optimizer

    def _prove_conversion(self, config: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Before AutoEP converts: probe each conversion, narrow the AutoEP section to the blocks
        that compute what the original does, mark the rest as ZeRO-3 leaf modules, and say so in
        one line. Returns the config to use and whether AutoEP will convert anything (see
        :mod:`lightning_zeromoe.conversion.check`)."""
        from lightning_zeromoe.conversion.check import (check_conversion, narrowed_config, probe_summary,
                                                        register_fallback_leaves)

        found, module = self.discovery, self.lightning_module
        if found is None or module is None:
            return config, False
        ep_size = self.resolved.ep_size if self.resolved else self.options.ep_size
        ep_section = config.get("expert_parallel")
        # AutoEP converts: expert parallelism, or grouped_experts at ep_size=1 (ResolvedConfig.expert_parallel).
        ep = bool(found.blocks) and isinstance(ep_section, dict) and bool(ep_section.get("enabled"))
        if ep:
            section = dict(found.autoep)
            found, checks = check_conversion(module, found, section=ep_section)
            for check in checks:
                if not check.passed:
                    self._once.warn(check.message(section))
            self._once.info(probe_summary(checks, grouped_configured=bool(ep_section.get("use_grouped_mm")),
                                          on_cpu=self._on_cpu))
            self.discovery = found
            ep = bool(found.blocks)
        # Also when nothing is probed (every block fell back at fit, and validate builds the
        # evaluation engine from the full config again): AutoEP converts only the blocks that passed.
        config = narrowed_config(config, found)
        leaves = register_fallback_leaves(module, found, ep_converts=ep) if self.zero_stage_3 else []
        if found.blocks or found.fallback:
            leaf_note = f"; {len(leaves)} registered as ZeRO-3 leaf modules" if leaves else ""
            self._once.info(f"ZeroMoEStrategy: {found.summary(ep_enabled=ep_size > 1)}{leaf_note}")
        no_ep = found.no_ep_warning(ep_size, leaves)  # the same rule and words for every kind of model
        if no_ep:
            self._once.warn(no_ep)
        return config, ep

    # ------------------------------------------------------------------ ZeRO-3 pitfalls

    def _pitfalls_before_engine(self, model: Module) -> None:
        """Before ``deepspeed.initialize``: see :meth:`lightning_zeromoe.engine.pitfalls.ZeroPitfalls.before_engine`."""
        self.pitfalls.before_engine(model, self.root_device)

    def _pitfalls_after_engine(self, engine: "deepspeed.DeepSpeedEngine") -> None:
        """After ``deepspeed.initialize``: see :meth:`lightning_zeromoe.engine.pitfalls.ZeroPitfalls.after_engine`."""
        self.pitfalls.after_engine(engine, self.root_device, self.zero_stage_3)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._pitfalls_after_step()
        return output

    def _pitfalls_after_step(self) -> None:
        """After each ``optimizer_step`` call (one per micro-batch under DeepSpeed): see
        :meth:`lightning_zeromoe.engine.pitfalls.ZeroPitfalls.after_step`, which counts optimizer steps."""
        self.pitfalls.after_step(self.model)

    @override
    def teardown(self) -> None:
        # Lightning's teardown moves the module to the CPU: lift the guard first, drop audit hooks.
        self.pitfalls.teardown()
        super().teardown()

    # ------------------------------------------------------------------ checkpoints

    @override
    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any | None = None) -> None:
        """DeepSpeed's sharded checkpoint, plus ``zeromoe_meta.json`` for ``lightning_zeromoe.export``."""
        engine = self.model
        if engine is not None and hasattr(engine, "checkpoint_engine") and engine.checkpoint_engine is None:
            # validate/test/predict built an engine without an optimizer: DeepSpeed gives it no
            # checkpoint engine, and its save would fail deep inside with an AttributeError.
            raise RuntimeError(
                say("save-after-evaluation", "no-optimizer-engine", "save-before-evaluating", filepath=str(filepath)))
        # Lightning's save, but ``latest`` is written only once every rank's files are complete
        # (lightning_zeromoe.checkpoint.commit): a save killed half-way never looks complete.
        filepath = self.broadcast(filepath)
        if storage_options is not None:
            raise TypeError("trainer.save_checkpoint(..., storage_options=...) is not supported by ZeroMoEStrategy: "
                            "DeepSpeed writes the checkpoint itself, without a CheckpointIO.")
        from lightning_zeromoe.checkpoint.commit import DISK_FULL, begin_save, commit_save, is_disk_full

        if self.is_global_zero:
            begin_save(filepath)  # the other ranks wait in DeepSpeed's first barrier
        state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        try:
            engine.save_checkpoint(filepath, client_state=state, tag="checkpoint", save_latest=False,
                                   exclude_frozen_parameters=self.exclude_frozen_parameters)
        except Exception as err:
            if is_disk_full(err):
                raise OSError(say(DISK_FULL, "save-failed", "free-space", rank=self.global_rank, filepath=filepath,
                                  error_type=type(err).__name__, err=err)) from err
            raise
        if self.is_global_zero:
            self._write_export_meta(filepath)
            commit_save(filepath, "checkpoint")
        self.barrier("zeromoe_checkpoint_committed")

    def _block_layouts(self) -> dict[str, Any]:
        """Discovery's ``BlockLayout`` of every block it keeps for EP, by path: the model's own names."""
        blocks = self.discovery.blocks if self.discovery is not None else []
        return {b.path: b.layout for b in blocks if b.layout is not None}

    def _write_export_meta(self, filepath: Any) -> None:
        """Record, while the model is in memory, how AutoEP's names map back to the model's own.

        A failure here must not cost the user the checkpoint DeepSpeed has just written: it is
        reported as a warning, and the export of this checkpoint will then say what is missing.
        """
        from lightning_zeromoe.checkpoint import META_FILE, build_meta, write_meta

        try:
            meta = build_meta(self.lightning_module, self.config, world_size=self.world_size,
                              blocks=self._block_layouts())
            write_meta(meta, filepath)
        except Exception as err:  # noqa: BLE001 - the DeepSpeed checkpoint is already safe on disk
            rank_zero_warn(f"ZeroMoEStrategy: could not write {META_FILE} into {filepath} ({type(err).__name__}: "
                           f"{err}); the checkpoint resumes normally but `zeromoe-export` cannot convert it.")

    # ------------------------------------------------------------------ resume (lightning_zeromoe.checkpoint.resume.reshape)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Resume (or evaluate) a DeepSpeed checkpoint, on another world size / ``ep_size`` too.

        ``validate/test/predict(ckpt_path=...)`` first gets an engine that can read ZeRO-3 shards
        (:meth:`_load_checkpoint_for_evaluation`). The same shape loads as Lightning does. Another
        shape goes through DeepSpeed's universal checkpoint: rank 0 converts it once into
        ``<checkpoint>.universal`` (reused later), the other ranks wait, and every rank
        re-partitions weights and optimizer state for itself.
        """
        if self.load_full_weights and self.zero_stage_3:
            return super().load_checkpoint(checkpoint_path, weights_only)
        from lightning.pytorch.trainer.states import TrainerFn

        if self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            self._load_checkpoint_for_evaluation(checkpoint_path)

        from lightning_zeromoe.checkpoint.resume import reshape as resume

        lightning_private.validate_checkpoint_directory(checkpoint_path)
        saved = resume.read_saved(checkpoint_path)
        stage = int(self.config.get("zero_optimization", {}).get("stage", self.options.stage))
        # The engine's own AutoEP layers say which ep_size runs (a config's autoep_size, or none when
        # every block fell back), not the ep_size asked for.
        target = resume.Shape(world_size=self.world_size, ep_size=resume.engine_ep_size(self.deepspeed_engine.module),
                              stage=stage)
        blocks = {b.path: b.num_experts for b in (self.discovery.blocks if self.discovery else [])}
        trainable = [n for n, p in self.deepspeed_engine.module.named_parameters() if p.requires_grad]
        if not resume.plan_resume(saved, target, blocks, trainable):
            return super().load_checkpoint(checkpoint_path, weights_only)
        return resume.load_on_new_shape(
            self.deepspeed_engine, saved, target, ep_section=self.config.get("expert_parallel"),
            layouts=self._block_layouts(), is_global_zero=self.is_global_zero, broadcast=self.broadcast,
            agree=lambda ok: self.reduce_boolean_decision(ok, all=True),
            fitting=self.lightning_module.trainer.state.fn == TrainerFn.FITTING,
            strict=self.lightning_module.strict_loading, info=rank_zero_info, warn=rank_zero_warn)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """``load_full_weights=True``: every rank loads its own experts from the full state dict.

        Lightning loads on global rank 0 only and lets ``GatheredParameters`` broadcast, but an
        expert parameter is broadcast from the first rank of its expert-data-parallel group, which
        holds other experts than rank 0 (and Lightning drops the size mismatch silently). Here each
        rank cuts its own experts from the state dict (which every rank has read) before the same
        gather-load-broadcast, and missing or unexpected keys are an error when ``strict``.
        """
        from lightning_zeromoe.checkpoint.full_weights import load_gathered, to_autoep_state_dict

        if not (self.load_full_weights and self.zero_stage_3):
            return super().load_model_state_dict(checkpoint, strict=strict)
        self.model_to_device()
        state = to_autoep_state_dict(checkpoint["state_dict"], self.lightning_module,
                                     self.config.get("expert_parallel", {}), self._block_layouts())
        load_gathered(self.lightning_module, state, strict=strict)


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


def _autoep_converted(model: Module) -> bool:
    """Whether AutoEP has already replaced MoE blocks in ``model`` (``fit`` ran in this process)."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    return any(isinstance(m, AutoEPMoELayer) for m in model.modules())


def _register_by_name() -> None:
    """Make ``Trainer(strategy="zero_moe")`` work once this module is imported."""
    from lightning.pytorch.strategies import StrategyRegistry

    if ZeroMoEStrategy.strategy_name not in StrategyRegistry:
        ZeroMoEStrategy.register_strategies(StrategyRegistry)


_register_by_name()

__all__ = ["ZeroMoEStrategy", "ZeroMoEConfigError", "MoEPattern", "apply_timeout_to_all_groups", "group_timeout",
           "lend_root_config"]
