"""``ZeroMoEStrategy``: DeepSpeed ZeRO (stage 3 by default) plus expert parallelism via AutoEP.

A thin subclass of Lightning's ``DeepSpeedStrategy``: its hooks, in lifecycle order, call the
packages of ``lightning_zeromoe`` (``config`` before any process exists; ``discovery``, ``config``
and ``conversion`` once ``configure_model`` has built the model; ``engine`` around
``deepspeed.initialize``; ``checkpoint`` for save, resume and export). The same code runs on CPU
processes (gloo) and GPUs (NCCL).
"""

from __future__ import annotations

import dataclasses
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
from lightning_zeromoe._private.torch import remove_hooks_defined_in
from lightning_zeromoe.config import (DEFAULT_BUCKET_SIZE, DeepSpeedConfig, ResolvedConfig, World, ZeroMoEConfigError,
                                      builds_in_configure_model, check_ep_divides_world, check_offload_optimizer,
                                      effective_ep_size, effective_stage, inference_config, native_ep, native_ep_sizes,
                                      native_plan_counts, options_before_model, resolve, strategy_settings,
                                      user_section, zero_init_config)
from lightning_zeromoe.discovery import Discovery, MoEPattern, discover
from lightning_zeromoe.engine import flight_recorder as flight_recorder_
from lightning_zeromoe.engine import (apply_timeout_to_all_groups, autoep_converted, device_memory_bytes, group_timeout,
                                      initialize, release_cpu_allreduce_buffer, stop_launched_ranks,
                                      use_deepspeed_cpu_accelerator)
from lightning_zeromoe.knowledge import say

if TYPE_CHECKING:
    import deepspeed

    from lightning_zeromoe.planner.plan_for import PlanFor

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
            count. 1 disables expert parallelism (AutoEP is not applied, unless
            ``grouped_experts``). An ``expert_parallel.autoep_size`` in ``config`` wins (and is what
            is validated). Unset (``None``): 1, or, for a model of DeepSpeed's native
            ``deepspeed.moe.layer.MoE`` layers, the ``ep_size`` they were built with (logged once).
            Native layers set their expert parallelism themselves (``MoE(..., ep_size=N)``): the
            strategy writes no AutoEP section for them and refuses an ``ep_size`` other than theirs
            (:mod:`lightning_zeromoe.config.native_moe`). ``"auto"``: once the model exists,
            :func:`lightning_zeromoe.planner.choose_ep_size` picks the divisor of the world size and
            of every layer's expert count (inside one node) whose predicted step time is the
            shortest where the stage fits (with ``stage="auto"``, stage and ep_size together).
        grouped_experts: At ``ep_size=1``, still replace each MoE block with AutoEP's layer
            (``autoep_size=1``: every rank holds every expert, no all-to-all), for its grouped-GEMM
            experts (``torch._grouped_mm``, bf16 on CUDA; elsewhere its per-expert loop): one GPU
            or one node without expert parallelism. The blocks are probed, checkpointed, exported
            and resumed exactly as expert-parallel ones. Refused with ``expert_parallel.enabled:
            false`` or ``use_grouped_mm: false`` in ``config``. At ``ep_size > 1`` the blocks get
            that layer anyway.
        stage: ZeRO stage, 3 by default (parameters, gradients and optimizer states sharded), or
            ``"auto"``: once the model exists, :func:`lightning_zeromoe.planner.choose_stage` picks
            the stage predicted fastest among those whose memory fits the device (ties: the lower
            stage; :mod:`lightning_zeromoe.planner.step_time`) and logs why. A model built in
            ``configure_model`` does not exist yet when ``zero.Init`` is entered: with ``plan_for``
            the stage is planned from it first, and the model is built under ``zero.Init`` only if
            that stage is 3; without, it is built under ``zero.Init`` and keeps stage 3 (logged).
            A ``zero_optimization.stage`` in ``config`` wins over both. Stages 1 and 2 split
            the optimizer from ``configure_optimizers`` into MoE and non-MoE param groups.
        offload_optimizer: Keep optimizer states in CPU memory. A last resort: it trades GPU
            memory for PCIe traffic and CPU Adam time. Needs ``DeepSpeedCPUAdam`` from
            ``configure_optimizers`` (a torch optimizer is refused before any engine exists).
        offload_parameters: Keep parameters in CPU memory (stage 3 only). Slower still.
        pin_memory: Pin offloaded buffers (needs a large enough ``ulimit -l``).
        overlap_comm: Overlap gradient reduction with backward.
        contiguous_gradients: Copy gradients into one buffer as they are produced (less
            fragmentation).
        reduce_bucket_size: Gradient reduction bucket, in elements (not bytes); 5e7 by default.
        allgather_bucket_size: Stage 1/2 parameter all-gather bucket, in elements; 5e7 by default.
        prefetch_bucket_size: Stage 3 parameter prefetch bucket, in elements; 5e7 by default.
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
        comm_stats: Count the bytes of every collective per optimizer step, by collective and process
            group, and log them (``comm/<collective>/<group>_MB``): installs a
            :class:`~lightning_zeromoe.observe.comm_ledger.CommLedger` (``strategy.comm_ledger``).
        flight_recorder: Turn on torch's Flight Recorder for every process group (``True``: a ring buffer of
            :data:`~lightning_zeromoe.engine.flight_recorder.DEFAULT_BUFFER` collectives per group; an int:
            that many; ``False``: off). Each rank writes its trace to ``<default_root_dir>/flight_recorder``
            when a Trainer call raises (a collective timeout, a dead peer) and on ``SIGUSR1``
            (``troubleshooter hang-dump``); ``troubleshooter explain`` on that directory names the first
            collective where the ranks diverged. Your own ``TORCH_FR_BUFFER_SIZE`` wins.
        end_groups_at_exit: When the process exits, wait for the other ranks and destroy the process
            groups (the world group, DeepSpeed's, ours), so a finished script exits 0 instead of
            aborting in C++ static destruction (:mod:`lightning_zeromoe.engine.group_exit`). The groups
            stay up between ``fit``, ``validate``, ``test`` and ``predict``.
        plan_for: With ``stage="auto"`` only: the model ``configure_model`` will build, to plan the
            stage before it exists: the directory ``from_pretrained`` loads (or its ``config.json``),
            a hub id ``"org/name"`` (its ``config.json`` alone is fetched), or a ``PretrainedConfig``.
            Built from its config on the meta device and counted when the strategy is constructed:
            no weights are read (:mod:`lightning_zeromoe.planner.plan_for`).
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
        ep_size: int | str | None = None,
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
        comm_stats: bool = False,
        flight_recorder: bool | int = True,
        end_groups_at_exit: bool = True,
        plan_for: "PlanFor | None" = None,
        **kwargs: Any,
    ) -> None:
        settings = strategy_settings(plan_for=plan_for,
            ep_size=ep_size, stage=stage, grouped_experts=grouped_experts, offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters, config=config, moe_pattern=moe_pattern, lightning_keywords=kwargs,
            pin_memory=pin_memory, overlap_comm=overlap_comm, contiguous_gradients=contiguous_gradients,
            reduce_bucket_size=reduce_bucket_size, allgather_bucket_size=allgather_bucket_size,
            prefetch_bucket_size=prefetch_bucket_size, param_persistence_threshold=param_persistence_threshold,
            gather_16bit_weights_on_save=gather_16bit_weights_on_save)
        if settings.note:
            rank_zero_info(settings.note)
        self.options, self.auto_stage, self.ep_size_given = settings.options, settings.auto_stage, settings.ep_size_given
        self.auto_ep = settings.auto_ep
        self.keywords, self.user_config, self.moe_pattern = settings.keywords, settings.user_config, settings.moe_pattern
        #: ``plan_for=``'s model counted on the meta device (``CountedModel``), or None.
        self.plan_for = settings.plan_for
        self.discovery: Discovery | None = None
        #: The merged, validated config and the facts read from it; built once, in ``setup``.
        self.resolved: ResolvedConfig | None = None
        self._resolved_for: Module | None = None
        self._once = WarningCache()
        # ZeRO-3 pitfalls (lightning_zeromoe.engine.pitfalls): one typed object, called at each hook.
        from lightning_zeromoe.engine.pitfalls import PitfallOptions, ZeroPitfalls

        self.pitfalls = ZeroPitfalls(
            PitfallOptions(register_tied_parameters=register_tied_parameters,
                           shared_parameters={k: list(v) for k, v in (shared_parameters or {}).items()},
                           guard_device_moves=guard_device_moves, grad_audit_steps=int(grad_audit_steps)),
            info=rank_zero_info, warn=rank_zero_warn)
        #: ``comm_stats=True``: a :class:`~lightning_zeromoe.observe.comm_ledger.CommLedger` joins the
        #: Trainer's callbacks in ``setup`` (bytes per step by collective and group, logged as ``comm/...``).
        from lightning_zeromoe.observe.comm_ledger import CommLedger

        self.comm_ledger = CommLedger() if comm_stats else None
        #: The Flight Recorder (this rank's once the groups exist: ``flight.recorder``) and the groups' end at exit.
        self.flight = flight_recorder_.Flight(flight_recorder, end_groups_at_exit)
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
    def connect(self, model: Any) -> None:
        # Each rank, before setup_environment creates the process group: native MoE layers built in
        # the LightningModule's __init__ can be checked against ep_size now (one built in
        # configure_model is checked in setup, before deepspeed.initialize creates its expert groups).
        super().connect(model)
        if not self.auto_stage and effective_stage(self.options.stage, False, self.user_config, None)[0] == 3:
            return  # refused in setup with [native-moe-zero3], whatever the sizes
        native_ep(native_ep_sizes(model), asked=effective_ep_size(self.options.ep_size, self.user_config)
                  if self.ep_size_given else None, world_size=self.num_nodes * self.num_processes,
                  user_expert_parallel=user_section(self.user_config, "expert_parallel"))

    @override
    def setup_environment(self) -> None:
        if self._on_cpu:
            use_deepspeed_cpu_accelerator()
        # configure_model() runs next, under zero.Init for stage 3: it needs the ZeRO section now
        # (stage="auto": planned from plan_for, else 3; config/before_model.py). The full config
        # (discovery, validation, stage="auto" from the model) waits for the model, in setup().
        if self.resolved is None:
            options, note = options_before_model(
                self.options, auto_stage=self.auto_stage, user=self.user_config, plan_for=self.plan_for,
                world=self._launch(), builds_later=builds_in_configure_model(self.lightning_module),
                device_memory_bytes=lambda: self._planner_inputs()["device_memory_bytes"])
            if note:
                self._once.info(note)
            if self.plan_for is not None:  # its choice is the one decision: setup does not plan again
                self.options, self.auto_stage = options, False
            self.config = zero_init_config(options, auto_stage=False,  # to Lightning: a dict
                                           keyword_sections=self._keyword_sections(), user=self.user_config).to_dict()
            lightning_private.rebuild_config(self)
        self.flight.before_groups(lightning_private.trainer_of(self.lightning_module))  # before any group exists
        # Skip DeepSpeedStrategy.setup_environment: it refuses every accelerator but CUDA.
        DDPStrategy.setup_environment(self)  # creates the process groups (setup_distributed)
        self.flight.after_groups(self.global_rank, self.world_size, lightning_private.collective_timeout(self))
        if self._on_cpu:
            release_cpu_allreduce_buffer(self.global_rank)

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
        if self.comm_ledger is not None and self.comm_ledger not in trainer.callbacks:
            trainer.callbacks.append(self.comm_ledger)  # installs itself at on_fit_start
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
        module, and PEFT's LoRA initialisation runs on gathered parameters
        (:func:`lightning_zeromoe.loading.while_building`).
        """
        from lightning_zeromoe.loading import while_building

        with super().model_sharded_context(), while_building(self.ds_config if self.zero_stage_3 else None):
            yield

    @override
    def init_deepspeed(self) -> None:
        super().init_deepspeed()
        # deepspeed.initialize has created the expert-parallel groups by now.
        apply_timeout_to_all_groups(lightning_private.collective_timeout(self))
        self.flight.attach(self.model.module if self.zero_stage_3 else None)  # the module each ZeRO-3 gather serves

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self.flight.failed(exception, self.global_rank)
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
            self.config = self.resolved.config
            lightning_private.rebuild_config(self)
            return
        from lightning_zeromoe.planner import choose_ep_size, choose_stage  # fastest that fits, for the "auto"s

        self.discovery = discover(module, self.moe_pattern)
        if self.auto_ep:  # the planner's fastest ep_size that fits; a config's autoep_size still wins in resolve
            ep_size, why = choose_ep_size(module, [b.num_experts for b in self.discovery.blocks],
                                          stage=None if self.auto_stage else self.options.stage, **self._planner_inputs())
            self.options = dataclasses.replace(self.options, ep_size=ep_size)
            self._once.info(f"ZeroMoEStrategy(ep_size='auto'): {why}")
        self.resolved = resolve(self.options, self._launch(), self.discovery, auto_stage=self.auto_stage,
                                choose_stage=lambda ep_size, native=False: choose_stage(  # native: layers' own shares
                                    module, ep_size=ep_size, **self._planner_inputs(),
                                    **({"counts": native_plan_counts(module, ep_size)} if native else {})),
                                keyword_sections=self._keyword_sections(), user=self.user_config,
                                ep_size_given=self.ep_size_given)
        self._resolved_for = module
        for warning in self.resolved.warnings:
            self._once.warn(warning)
        for note in self.resolved.notes:
            self._once.info(note)
        self.config = self.resolved.config  # the dict Lightning owns and completes
        lightning_private.rebuild_config(self)  # Lightning adds batch size, accumulation, clipping, precision

    def _keyword_sections(self) -> dict[str, Any]:
        return self.keywords.config_sections(offload_optimizer=self.options.offload_optimizer,
                                             offload_parameters=self.options.offload_parameters)

    def _launch(self) -> World:
        """What Lightning launches: ranks, devices per node, where and how they compute."""
        return World(world_size=self.num_nodes * self.num_processes, devices_per_node=self.num_processes,
                     on_cpu=self._on_cpu, precision=str(self.precision_plugin.precision),
                     accumulate_grad_batches=int(getattr(lightning_private.trainer_of(self.lightning_module),
                                                         "accumulate_grad_batches", 1) or 1))

    def _planner_inputs(self) -> dict[str, Any]:
        """What the planner reads of this run, for ``stage="auto"`` and ``ep_size="auto"``."""
        return dict(world_size=self.num_nodes * self.num_processes, devices_per_node=self.num_processes,
                    precision=str(self.precision_plugin.precision),
                    device_memory_bytes=device_memory_bytes(self._on_cpu, self.root_device, self.num_processes))

    @property
    def ds_config(self) -> DeepSpeedConfig:
        """``self.config`` typed: the resolved config as Lightning completed it (batch, clipping, precision)."""
        return DeepSpeedConfig.from_dict(self.config)

    @property
    def _stage(self) -> int:
        """The ZeRO stage that runs: the resolved one once ``setup`` has run (a config's
        ``zero_optimization.stage``, ``stage=``, or the planner's), before that what ``zero.Init`` uses."""
        if self.resolved is not None:
            return self.resolved.stage
        return effective_stage(self.options.stage, False, self.user_config, None)[0]

    @property
    def _ep_size(self) -> int:
        """The expert-parallel size that runs: the resolved one once ``setup`` has run (a config's
        ``autoep_size``, ``ep_size=``, or native MoE layers' own), before that the config's or ``ep_size=``."""
        if self.resolved is not None:
            return self.resolved.ep_size
        return effective_ep_size(self.options.ep_size, self.user_config)

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

        ds_config = self.ds_config
        check_offload_optimizer(ds_config, type(optimizer) if optimizer is not None else None)
        self.pitfalls.before_engine(model, self.root_device)  # tied weights, buffers (engine.pitfalls)
        params: Any = [p for p in model.parameters() if p.requires_grad]
        client: Any = optimizer
        split = None
        if optimizer is not None and self._needs_moe_param_groups():
            # ZeRO-1/2 need expert params in their own param groups; AutoEP creates them inside
            # deepspeed.initialize, so the split happens there, on the user's optimizer object.
            split = MoEOptimizerSplit(optimizer, lr_scheduler)
            params, client = groups_with_names(optimizer), split
        if autoep_converted(model):  # a second fit in this process: AutoEP must not convert twice
            ds_config = ds_config.replace(expert_parallel=None)
        engine, ds_optimizer = self._build_engine(model, ds_config, optimizer=client, params=params,
                                                  lr_scheduler=lr_scheduler)
        if split is not None:
            self._once.info(f"ZeroMoEStrategy: ZeRO stage {self._stage} with MoE: split your optimizer into "
                            f"{split.summary}")
        self.pitfalls.after_engine(engine, self.root_device, self.zero_stage_3)  # guards, audit
        return engine, ds_optimizer

    def _needs_moe_param_groups(self) -> bool:
        found = self.discovery
        has_moe = bool(found and (found.native_moe or (found.blocks and self.resolved and self.resolved.expert_parallel)))
        return has_moe and self._stage in (1, 2)

    @override
    def _initialize_deepspeed_inference(self, model: Module) -> None:
        """validate/test/predict: the same builder as training, with ``expert_parallel`` kept."""
        config = inference_config(self.ds_config, already_converted=autoep_converted(model))
        remove_hooks_defined_in(model, "deepspeed")  # the training engine's, if fit ran before in this process
        self.model, _ = self._build_engine(model, config, optimizer=None, params=[], lr_scheduler=None)

    def _load_checkpoint_for_evaluation(self, checkpoint_path: Any) -> None:
        """``validate/test/predict(ckpt_path=...)`` under ZeRO-3: rebuild the evaluation engine with a
        do-nothing optimizer that can load the shards
        (:func:`lightning_zeromoe.checkpoint.resume.load.evaluation_parameters`)."""
        if self.model is None or not self.zero_stage_3:
            return
        from lightning_zeromoe.checkpoint.resume.load import evaluation_parameters

        module = self.lightning_module
        config = inference_config(self.ds_config, already_converted=autoep_converted(module))
        params = evaluation_parameters(module, checkpoint_path)
        remove_hooks_defined_in(module, "deepspeed")
        self.model, _ = self._build_engine(module, config, optimizer=torch.optim.SGD(params, lr=0.0), params=params,
                                           lr_scheduler=None)

    def _build_engine(self, model: Module, config: DeepSpeedConfig, *, optimizer: Any, params: Any,
                      lr_scheduler: Any) -> tuple["deepspeed.DeepSpeedEngine", Any]:
        """The one engine builder, for training and evaluation, on CPU and GPU: each conversion is
        proven first (:mod:`lightning_zeromoe.conversion.prove`), then ``deepspeed.initialize``
        (:func:`lightning_zeromoe.engine.build.initialize`)."""
        from lightning_zeromoe.conversion.prove import after_conversion, prove

        found, module = self.discovery, self.lightning_module
        converts = False
        if found is not None and module is not None and not autoep_converted(model):
            proof = prove(module, found, config, ep_size=self._ep_size, on_cpu=self._on_cpu,
                          zero_stage_3=self.zero_stage_3)
            for warning in proof.warnings:
                self._once.warn(warning)
            for note in proof.notes:
                self._once.info(note)
            self.discovery, config, converts = proof.found, proof.config, proof.converts
        engine, ds_optimizer = initialize(model, config, device_rank=self._device_rank(),
                                          root_config=self.discovery.root_config if self.discovery else None,
                                          optimizer=optimizer, params=params, lr_scheduler=lr_scheduler)
        if converts:
            after_conversion(self.lightning_module, self.discovery)
        return engine, ds_optimizer

    # ------------------------------------------------------------------ training

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.pitfalls.after_step(self.model)  # once per micro-batch call; it counts optimizer steps
        return output

    @override
    def teardown(self) -> None:
        # Lightning's teardown moves the module to the CPU: lift the guard first, drop audit hooks.
        self.pitfalls.teardown()
        self.flight.detach()
        super().teardown()

    # ------------------------------------------------------------------ checkpoints

    @override
    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any | None = None) -> None:
        """DeepSpeed's sharded checkpoint, committed only when complete, with what ``zeromoe-export``
        needs (:mod:`lightning_zeromoe.checkpoint.engine_save`)."""
        from lightning_zeromoe.checkpoint import engine_save

        engine_save.refuse_engine_without_optimizer(self.model, filepath)
        filepath = self.broadcast(filepath)
        if storage_options is not None:
            raise TypeError(say("strategy-argument-invalid", "storage-options", "drop-storage-options"))
        ctx = engine_save.SaveContext(
            global_rank=self.global_rank, is_global_zero=self.is_global_zero, world_size=self.world_size,
            zero_stage_3=self.zero_stage_3, exclude_frozen_parameters=self.exclude_frozen_parameters,
            module=self.lightning_module, config=self.ds_config, layouts=self._block_layouts())
        state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        #: The frozen-experts file this rank wrote at the last save (None: none, or another rank of its group).
        self.frozen_experts_written = engine_save.save(self.model, filepath, state, ctx, barrier=self.barrier,
                                                       warn=rank_zero_warn)

    def _block_layouts(self) -> dict[str, Any]:
        """Discovery's ``BlockLayout`` of every block it keeps for EP, by path: the model's own names."""
        blocks = self.discovery.blocks if self.discovery is not None else []
        return {b.path: b.layout for b in blocks if b.layout is not None}

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

        from lightning_zeromoe.checkpoint.resume import load

        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if not fitting:
            self._load_checkpoint_for_evaluation(checkpoint_path)
        lightning_private.validate_checkpoint_directory(checkpoint_path)
        ctx = load.ResumeContext(
            world_size=self.world_size, stage=self._stage, is_global_zero=self.is_global_zero,
            ep_section=self.ds_config.expert_parallel_dict(), layouts=self._block_layouts(),
            experts={b.path: b.num_experts for b in (self.discovery.blocks if self.discovery else [])},
            fitting=fitting, strict=self.lightning_module.strict_loading)
        return load.load(self.deepspeed_engine, checkpoint_path, ctx,
                         load_same_shape=lambda: super(ZeroMoEStrategy, self).load_checkpoint(checkpoint_path,
                                                                                              weights_only),
                         broadcast=self.broadcast, agree=lambda ok: self.reduce_boolean_decision(ok, all=True),
                         info=rank_zero_info, warn=rank_zero_warn)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """``load_full_weights=True``: every rank loads its own experts from the full state dict, not
        rank 0 alone as Lightning does (:mod:`lightning_zeromoe.checkpoint.full_weights`)."""
        from lightning_zeromoe.checkpoint.full_weights import load_gathered, to_autoep_state_dict

        if not (self.load_full_weights and self.zero_stage_3):
            return super().load_model_state_dict(checkpoint, strict=strict)
        self.model_to_device()
        state = to_autoep_state_dict(checkpoint["state_dict"], self.lightning_module,
                                     self.ds_config.expert_parallel_dict(), self._block_layouts())
        load_gathered(self.lightning_module, state, strict=strict)


def _register_by_name() -> None:
    """Make ``Trainer(strategy="zero_moe")`` work once this module is imported."""
    from lightning.pytorch.strategies import StrategyRegistry

    if ZeroMoEStrategy.strategy_name not in StrategyRegistry:
        ZeroMoEStrategy.register_strategies(StrategyRegistry)


_register_by_name()

__all__ = ["ZeroMoEStrategy", "ZeroMoEConfigError", "MoEPattern", "apply_timeout_to_all_groups", "group_timeout"]
