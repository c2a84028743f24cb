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
import dataclasses
import os
import subprocess
import time
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
        stage: ZeRO stage, 3 by default (parameters, gradients and optimizer states sharded), or
            ``"auto"``: :func:`lightning_zeromoe.planner.choose_stage` picks the lowest stage whose
            model states fit the device memory (following the advice "don't use ZeRO-3 when memory
            allows less") and logs why.
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
        **kwargs: Passed to Lightning's ``DeepSpeedStrategy`` (accelerator, parallel_devices,
            cluster_environment, precision_plugin, process_group_backend, logging_level, ...).
    """

    strategy_name = "zero_moe"

    def __init__(
        self,
        ep_size: int = 1,
        stage: int | str = 3,
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
        register_tied_parameters: bool = True,
        shared_parameters: Mapping[str, list[str] | tuple[str, ...]] | None = None,
        guard_device_moves: bool = True,
        grad_audit_steps: int = 3,
        **kwargs: Any,
    ) -> None:
        if isinstance(stage, str) and stage != "auto":
            raise ValueError(f"stage={stage!r}: use 0, 1, 2, 3 or 'auto' (the memory planner picks the lowest that fits).")
        self.auto_stage = stage == "auto"
        self.options = ZeroOptions(
            stage=3 if self.auto_stage else int(stage), ep_size=ep_size, offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters, pin_memory=pin_memory, overlap_comm=overlap_comm,
            contiguous_gradients=contiguous_gradients, reduce_bucket_size=int(reduce_bucket_size),
            allgather_bucket_size=int(allgather_bucket_size), prefetch_bucket_size=int(prefetch_bucket_size),
            param_persistence_threshold=int(param_persistence_threshold),
            gather_16bit_weights_on_save=gather_16bit_weights_on_save)
        self.user_config = load_user_config(config)
        self.moe_pattern = MoEPattern(**moe_pattern) if isinstance(moe_pattern, Mapping) else moe_pattern
        self.discovery: Discovery | None = None
        self._said: set[str] = set()
        # ZeRO-3 pitfalls (lightning_zeromoe.pitfalls): see _pitfalls_before_engine / _after_engine.
        if grad_audit_steps < 0:
            raise ValueError(f"grad_audit_steps={grad_audit_steps} must be >= 0 (0 turns the gradient audit off).")
        self.register_tied_parameters = register_tied_parameters
        self.shared_parameters = {k: list(v) for k, v in (shared_parameters or {}).items()}
        self.guard_device_moves = guard_device_moves
        self.grad_audit_steps = int(grad_audit_steps)
        self.pitfall_state: dict[str, Any] = {}
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

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        stop_launched_ranks(self.launcher, grace=min(10.0, self._timeout.total_seconds() if self._timeout else 10.0))

    def init_deepspeed(self) -> None:
        super().init_deepspeed()
        # deepspeed.initialize has created the expert-parallel groups by now.
        apply_timeout_to_all_groups(self._timeout)

    # ------------------------------------------------------------------ config

    def prepare(self) -> None:
        """Discover MoE blocks, validate, and build the DeepSpeed config. Idempotent, no communication."""
        module = self.lightning_module
        if module is None:
            raise RuntimeError("ZeroMoEStrategy needs a LightningModule: use it through Trainer.fit/validate/test.")
        self.discovery = discover(module, self.moe_pattern)
        if self.auto_stage:
            self._choose_stage(module)
        layout = Layout(world_size=self.num_nodes * self.num_processes, devices_per_node=self.num_processes,
                        ep_size=self.options.ep_size, stage=self.options.stage,
                        precision=str(self.precision_plugin.precision))
        for warning in check_layout(layout, self.discovery):
            self._say(warning, warn=True)
        self.config = self._merged_config()
        check_batch_arithmetic(self.config, layout.world_size, self._accumulate_grad_batches())
        # Lightning sets gradient_accumulation_steps itself and refuses a config that has it.
        self.config.pop("gradient_accumulation_steps", None)
        self._config_initialized = False

    def _choose_stage(self, module: Module) -> None:
        """``stage="auto"``: the lowest ZeRO stage whose model states fit, from the memory planner."""
        from lightning_zeromoe.planner import choose_stage

        stage, reason = choose_stage(module, world_size=self.num_nodes * self.num_processes,
                                     devices_per_node=self.num_processes, ep_size=self.options.ep_size,
                                     device_memory_bytes=self._device_memory_bytes(),
                                     precision=str(self.precision_plugin.precision))
        self.options = dataclasses.replace(self.options, stage=stage)
        self._say(f"ZeroMoEStrategy(stage='auto'): {reason}")

    def _device_memory_bytes(self) -> float:
        """Memory per device: the GPU's, or on CPU this host's RAM shared by its processes."""
        if not self._on_cpu:
            return float(torch.cuda.get_device_properties(self.root_device).total_memory)
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, self.num_processes)

    def _merged_config(self) -> dict[str, Any]:
        found = self.discovery
        locate = found.autoep if (found and found.blocks and self.options.ep_size > 1) else None
        base = build_config(self.options, locate, use_grouped_mm=not self._on_cpu)
        merged, overrides = merge_config(base, self.user_config)
        for line in overrides:
            self._say(f"ZeroMoEStrategy config override: {line}")
        return merged

    def _say(self, message: str, warn: bool = False) -> None:
        """Log on rank 0, once: ``prepare`` runs in both setup_environment and setup."""
        if message in self._said:
            return
        self._said.add(message)
        (rank_zero_warn if warn else rank_zero_info)(message)

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

        self._pitfalls_before_engine(model)
        ep_converts = self._prove_conversion()
        params = [p for p in model.parameters() if p.requires_grad]
        with lend_root_config(model, self.discovery.root_config if self.discovery else None):
            engine, ds_optimizer, _, _ = deepspeed.initialize(
                args=argparse.Namespace(device_rank=self._device_rank()), config=self.config, model=model,
                model_parameters=params, optimizer=optimizer, lr_scheduler=lr_scheduler, dist_init_required=False)
        if ep_converts and self.discovery is not None:
            from lightning_zeromoe.conversion_check import restore_router_logits

            restore_router_logits(self.lightning_module, self.discovery)
        self._pitfalls_after_engine(engine)
        return engine, ds_optimizer

    def _prove_conversion(self) -> bool:
        """Before ``deepspeed.initialize``: probe each conversion, narrow the AutoEP section to the
        blocks that compute what the original does, mark the rest as ZeRO-3 leaf modules, and say
        so in one line. Returns whether AutoEP will convert anything (see ``conversion_check``)."""
        from lightning_zeromoe.conversion_check import check_conversion, narrowed_config, register_fallback_leaves

        found, module = self.discovery, self.lightning_module
        if found is None or module is None:
            return False
        ep = self.options.ep_size > 1 and bool(found.blocks) and "expert_parallel" in self.config
        if ep:
            section = dict(found.autoep)
            found, checks = check_conversion(module, found)
            for check in checks:
                if not check.passed:
                    self._say(check.message(section), warn=True)
            self.discovery = found
            self.config = narrowed_config(self.config, found)
            ep = bool(found.blocks)
        leaves = register_fallback_leaves(module, found, ep_converts=ep) if self.options.stage == 3 else []
        if found.blocks or found.fallback:
            leaf_note = f"; {len(leaves)} registered as ZeRO-3 leaf modules" if leaves else ""
            self._say(f"ZeroMoEStrategy: {found.summary(ep_enabled=self.options.ep_size > 1)}{leaf_note}")
        return ep

    # ------------------------------------------------------------------ ZeRO-3 pitfalls

    def _pitfalls_before_engine(self, model: Module) -> None:
        """Before ``deepspeed.initialize``: move buffers to the root device, find tied parameters.

        Buffers: under ``zero.Init`` the engine skips ``module.to(device)``, so a buffer created on
        the CPU would stay there; buffers are not partitioned, so moving them is safe. Parameters
        are left to DeepSpeed. Tied parameters are logged once (rank 0) and re-checked after setup.
        """
        from lightning_zeromoe.pitfalls import describe_sharing, find_tied_parameters, move_buffers_to_device

        moved = move_buffers_to_device(model, self.root_device)
        if moved:
            rank_zero_info(f"ZeroMoEStrategy: moved {len(moved)} buffer(s) to {self.root_device} (zero.Init leaves "
                           f"buffers where they were created): {', '.join(moved[:10])}{' ...' if len(moved) > 10 else ''}")
        tied = find_tied_parameters(model)
        self.pitfall_state.update(buffers_moved=moved, tied=tied)
        for line in describe_sharing(tied):
            rank_zero_info(f"ZeroMoEStrategy: {line}")

    def _pitfalls_after_engine(self, engine: "deepspeed.DeepSpeedEngine") -> None:
        """After ``deepspeed.initialize`` (ZeRO-3 only): check ties, register declared shared
        parameters, guard device/dtype moves, start the gradient audit.

        Options (constructor): ``register_tied_parameters`` registers ``shared_parameters``
        (``{module_path: [parameter_path, ...]}``, names as ``named_modules()`` of the
        LightningModule print them) with ``deepspeed.zero.register_external_parameter``; tied
        parameters that modules hold themselves need no registration. ``guard_device_moves``
        installs :class:`~lightning_zeromoe.pitfalls.DeviceMoveGuard`. ``grad_audit_steps`` (0 = off)
        runs :class:`~lightning_zeromoe.pitfalls.GradAudit` for that many optimizer steps; it is
        driven from :meth:`optimizer_step` rather than a callback, so the user's callback list is
        never touched and the hooks live and die with the engine.
        """
        from lightning_zeromoe.pitfalls import DeviceMoveGuard, GradAudit, broken_ties, register_shared_parameters

        if not self.zero_stage_3:
            return
        module = engine.module
        broken = broken_ties(module, self.pitfall_state.get("tied", []))
        if broken:
            raise RuntimeError("ZeroMoEStrategy: deepspeed.initialize broke tied parameters, so each side would train "
                               f"separately: {'; '.join(broken)}")
        declared = register_shared_parameters(module, self.shared_parameters) if self.register_tied_parameters else []
        self.pitfall_state["declared"] = declared
        if self.guard_device_moves:
            self.pitfall_state["guard"] = DeviceMoveGuard(module, self.root_device).install()
        if self.grad_audit_steps:
            self.pitfall_state["audit"] = GradAudit(module, self.grad_audit_steps, device=self.root_device).install()
        self.pitfall_state["steps"] = 0

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._pitfalls_after_step()
        return output

    def _pitfalls_after_step(self) -> None:
        """After step 1: log the shared parameters DeepSpeed found at run time. After step K: the
        gradient audit's warnings. Nothing is left installed after step K."""
        from lightning_zeromoe.pitfalls import describe_sharing, find_external_uses

        state = self.pitfall_state
        if "steps" not in state or self.model is None:
            return
        state["steps"] += 1
        if state["steps"] == 1:
            uses = find_external_uses(self.model.module, state.get("declared", []))
            state["external"] = uses
            for line in describe_sharing([], uses):
                rank_zero_info(f"ZeroMoEStrategy: {line}")
        audit = state.get("audit")
        if audit is not None and audit.report is None:
            report = audit.step()
            if report is not None:
                for message in report.messages():
                    rank_zero_warn(f"ZeroMoEStrategy: {message}")

    def teardown(self) -> None:
        # Lightning's teardown moves the module to the CPU: lift the guard first, drop audit hooks.
        guard, audit = self.pitfall_state.pop("guard", None), self.pitfall_state.get("audit")
        if guard is not None:
            guard.remove()
        if audit is not None:
            audit.remove()
        super().teardown()

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

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any | None = None) -> None:
        """DeepSpeed's sharded checkpoint, plus ``zeromoe_meta.json`` for ``lightning_zeromoe.export``."""
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if self.is_global_zero:
            self._write_export_meta(filepath)

    def _write_export_meta(self, filepath: Any) -> None:
        """Record, while the model is in memory, how AutoEP's names map back to the model's own.

        A failure here must not cost the user the checkpoint DeepSpeed has just written: it is
        reported as a warning, and the export of this checkpoint will then say what is missing.
        """
        from lightning_zeromoe.checkpoint import META_FILE, build_meta, write_meta

        try:
            meta = build_meta(self.lightning_module, self.config, world_size=self.world_size)
            write_meta(meta, filepath)
        except Exception as err:  # noqa: BLE001 - the DeepSpeed checkpoint is already safe on disk
            rank_zero_warn(f"ZeroMoEStrategy: could not write {META_FILE} into {filepath} ({type(err).__name__}: "
                           f"{err}); the checkpoint resumes normally but `zeromoe-export` cannot convert it.")


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


def apply_timeout_to_all_groups(timeout: timedelta | None) -> int:
    """Give every process group this rank belongs to the strategy's collective timeout.

    DeepSpeed creates the expert-parallel and expert-data-parallel groups with
    ``torch.distributed.new_group(ranks)`` and no timeout, so they get the backend default
    (torch 2.13: 30 min for gloo, 10 min for NCCL), not the world group's. A rank stuck in an
    expert all-to-all would then wait for that default instead of ``timeout``. Returns how many
    groups were updated.
    """
    if timeout is None or not torch.distributed.is_initialized():
        return 0
    from torch.distributed import distributed_c10d as c10d

    set_timeout = getattr(c10d, "_set_pg_timeout", None)
    if set_timeout is None:  # private API; present in torch 2.3 - 2.13
        rank_zero_warn("This torch has no distributed_c10d._set_pg_timeout: expert-parallel groups keep the "
                       "backend's default collective timeout instead of ZeroMoEStrategy(timeout=...).")
        return 0
    groups = [pg for pg in list(c10d._world.pg_map) if not c10d._rank_not_in_group(pg)]
    for group in groups:
        set_timeout(timeout, group)
    return len(groups)


def stop_launched_ranks(launcher: Any, grace: float) -> None:
    """When the launching rank fails, stop the ranks it started instead of leaving them behind.

    Lightning's script launcher kills its child ranks only on Ctrl+C. After any other error in
    rank 0 the children sit in a collective until the timeout, and DeepSpeed's CPU shared-memory
    comm op can spin forever waiting for a peer that is gone. Children that exit on their own
    within ``grace`` seconds (with their own error message) are left to do so.
    """
    procs = getattr(launcher, "procs", None) or []
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def group_timeout(group: Any) -> timedelta | None:
    """The collective timeout a process group's backend will use (for tests and the doctor)."""
    for device in (torch.device("cuda"), torch.device("cpu")):
        try:
            backend = group._get_backend(device)
        except RuntimeError:
            continue
        options = getattr(backend, "options", None)
        if options is not None:
            return options._timeout
    return None


def _use_deepspeed_cpu_accelerator() -> None:
    """Point DeepSpeed at its CPU accelerator (gloo), even on a machine that has GPUs."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())
    if "LOCAL_SIZE" not in os.environ:
        # Without it, the CPU accelerator runs `numactl --hardware` in a subprocess every time it
        # counts devices: 5 times per ZeRO-3 step (measured, ~0.7 ms each). Count once, keep it.
        os.environ["LOCAL_SIZE"] = str(get_accelerator().device_count())


def _register_by_name() -> None:
    """Make ``Trainer(strategy="zero_moe")`` work once this module is imported."""
    from lightning.pytorch.strategies import StrategyRegistry

    if ZeroMoEStrategy.strategy_name not in StrategyRegistry:
        ZeroMoEStrategy.register_strategies(StrategyRegistry)


_register_by_name()

__all__ = ["ZeroMoEStrategy", "ZeroMoEConfigError", "MoEPattern", "apply_timeout_to_all_groups", "group_timeout",
           "lend_root_config"]
