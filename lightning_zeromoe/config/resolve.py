"""One pass from (options, Lightning keywords, user config, model description, world) to the config.

The strategy calls :func:`resolve` once, in ``setup`` (after ``configure_model``, when the model
exists). Every check reads the **merged** config, so what a user writes in ``config=`` is what is
checked and used:

* the ZeRO stage is ``zero_optimization.stage`` of the merged config (the user's value wins over
  ``stage=`` and over ``stage="auto"``), decided in :func:`effective_stage` only;
* the expert-parallel size is ``expert_parallel.autoep_size`` when the user sets it, and a user
  ``expert_parallel.enabled: false`` together with ``ep_size > 1`` is refused, never silently
  applied (:func:`effective_ep_size`);
* AutoEP's layer without expert parallelism (``grouped_experts=True``, or a user section with
  ``enabled: true`` at ``autoep_size`` 1) is decided in :func:`effective_grouped_experts`, which
  refuses the contradictions (``enabled: false``, ``use_grouped_mm: false``).

The user's raw dict is merged and checked here, at the edge; the result is parsed once into the typed
:class:`~lightning_zeromoe.config.schema.DeepSpeedConfig` that everything downstream reads.

Pure: numbers, dicts and the discovery result in; a typed :class:`ResolvedConfig` out.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

from lightning_zeromoe.config.deepspeed import ZeroOptions, build_config, converts_blocks, merge_config
from lightning_zeromoe.discovery.find import Discovery
from lightning_zeromoe.config.native_moe import check_one_kind, native_auto_stage, native_ep
from lightning_zeromoe.config.schema import BatchSection, DeepSpeedConfig, OffloadSection
from lightning_zeromoe.config.validation import Layout, ZeroMoEConfigError, check_batch_arithmetic, check_layout
from lightning_zeromoe.knowledge import say


@dataclass(frozen=True)
class World:
    """What Lightning will launch, and how it computes."""

    world_size: int
    devices_per_node: int
    on_cpu: bool
    precision: str = "32-true"
    accumulate_grad_batches: int = 1


@dataclass
class ResolvedConfig:
    """The merged DeepSpeed config, typed, and the facts resolution found besides it."""

    ds_config: DeepSpeedConfig
    #: The expert-parallel size that runs: the config's ``autoep_size`` (AutoEP), or native MoE
    #: layers' own (no ``expert_parallel`` section then), or ``ep_size=``.
    ep_size: int
    #: AutoEP's layer at ep_size=1 (``grouped_experts``; see :func:`effective_grouped_experts`).
    grouped_experts: bool = False
    #: Validation warnings (rank 0 warns each once).
    warnings: list[str] = field(default_factory=list)
    #: Info lines: overrides from the user's config, the stage choice.
    notes: list[str] = field(default_factory=list)

    @property
    def stage(self) -> int:
        """The ZeRO stage that runs (``zero_optimization.stage`` of the merged config)."""
        return self.ds_config.stage

    @property
    def config(self) -> dict[str, Any]:
        """The merged config as the dict handed to Lightning (``strategy.config``) and DeepSpeed."""
        return self.ds_config.to_dict()

    @property
    def expert_parallel(self) -> bool:
        """Whether AutoEP converts blocks (with ``ep_size > 1`` or ``grouped_experts``)."""
        return self.ds_config.converts_blocks


def user_section(user: Mapping[str, Any] | None, name: str) -> Mapping[str, Any]:
    section = (user or {}).get(name)
    return section if isinstance(section, Mapping) else {}


def effective_ep_size(ep_size: int, user: Mapping[str, Any] | None) -> int:
    """The expert-parallel size the merged config will have. Needs no model: also used at launch."""
    section = user_section(user, "expert_parallel")
    if section.get("enabled") is False:
        if ep_size > 1:
            raise ZeroMoEConfigError(
                say("ep-disabled-by-config", "ep-size", "drop-expert-parallel-section", "ep-size-1", ep_size=ep_size))
        return 1
    if "autoep_size" in section:
        size = section["autoep_size"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ZeroMoEConfigError(
                say("merged-config-invalid", "autoep-size", "fix-or-remove-key", size=size))
        return size
    return ep_size


def effective_grouped_experts(grouped_experts: bool, ep_size: int, user: Mapping[str, Any] | None) -> bool:
    """Whether the blocks get AutoEP's layer at ``ep_size`` 1. Needs no model: also used at construction.

    True with ``grouped_experts=True``, or when the user's own section says ``enabled: true`` while
    the effective ``autoep_size`` is 1 (what AutoEP does with that section). Refused: asking for it
    while the section says ``enabled: false`` (AutoEP would be skipped) or ``use_grouped_mm: false``
    (the grouped GEMM it is asked for would be switched off).
    """
    section = user_section(user, "expert_parallel")
    if grouped_experts and section.get("enabled") is False:
        raise ZeroMoEConfigError(
            say("ep-disabled-by-config", "grouped-experts", "drop-enabled-or-grouped-false", ep_size=ep_size))
    if grouped_experts and section.get("use_grouped_mm") is False:
        raise ZeroMoEConfigError(
            say("merged-config-invalid", "use-grouped-mm-off", "remove-use-grouped-mm"))
    return grouped_experts or (ep_size == 1 and section.get("enabled") is True)


def effective_stage(stage: int, auto: bool, user: Mapping[str, Any] | None,
                    choose: Callable[[], tuple[int, str]] | None) -> tuple[int, str | None]:
    """The one ZeRO stage: the user's ``zero_optimization.stage``, else ``stage=``, else the planner's.

    ``choose`` runs the memory planner (``stage="auto"``); it is only called when needed. Returns
    the stage and a line saying why, when there is something to say.
    """
    user_stage = user_section(user, "zero_optimization").get("stage")
    if user_stage is not None:
        if user_stage not in (0, 1, 2, 3):
            raise ZeroMoEConfigError(
                say("merged-config-invalid", "zero-stage", "fix-or-remove-key", user_stage=user_stage))
        why = f"ZeroMoEStrategy: zero_optimization.stage={user_stage} from your config"
        return int(user_stage), why + (" (stage='auto' not consulted)" if auto else "")
    if auto and choose is not None:
        chosen, reason = choose()
        return chosen, f"ZeroMoEStrategy(stage='auto'): {reason}"
    return stage, None


def grouped_mm_applies(on_cpu: bool, precision: str) -> bool:
    """Whether AutoEP's grouped-GEMM path can run: ``torch._grouped_mm`` takes bf16 on CUDA only.

    torch 2.13's ``_meta_grouped_mm_common`` (mirroring ``_grouped_mm_cuda`` in Blas.cpp) checks
    ``mat_a.dtype == mat_b.dtype == torch.bfloat16``; ``GroupedExperts`` casts to the input's
    dtype, which is the module's compute dtype. fp32 and fp16 use AutoEP's per-expert loop.
    """
    return not on_cpu and precision.startswith("bf16")


def resolve(options: ZeroOptions, world: World, found: Discovery | None, *, auto_stage: bool = False,
            choose_stage: Callable[..., tuple[int, str]] | None = None,
            keyword_sections: Mapping[str, Any] | None = None,
            user: Mapping[str, Any] | None = None, ep_size_given: bool = True) -> ResolvedConfig:
    """Build, merge and validate the DeepSpeed config. Raises :class:`ZeroMoEConfigError` on bad input.

    ``choose_stage(ep_size)`` runs the memory planner for ``stage="auto"``; for a model of native MoE
    layers it is called as ``choose_stage(ep_size, native=True)`` and must answer 1 or 2
    (:func:`~lightning_zeromoe.config.native_moe.native_auto_stage`).
    ``ep_size_given``: whether the user passed ``ep_size`` (False: left unset, and a model of native
    ``deepspeed.moe.layer.MoE`` layers trains with their own size; see :mod:`lightning_zeromoe.config.native_moe`).
    """
    found = found or Discovery(source="none")
    notes: list[str] = []
    ep_size = effective_ep_size(options.ep_size, user)
    # stage="auto" plans for the ep_size that will run (a config's autoep_size wins over ep_size=).
    choose = (lambda: choose_stage(ep_size)) if choose_stage is not None else None
    sizes = found.native_ep_sizes
    native_of = functools.partial(native_ep, sizes, asked=ep_size if ep_size_given else None,
                                  world_size=world.world_size, user_expert_parallel=user_section(user, "expert_parallel"))
    if choose_stage is not None and sizes:  # native layers: their own ep_size, and never stage 3
        choose = lambda: native_auto_stage(native_of(), sizes, choose_stage)  # noqa: E731
    stage, why = effective_stage(options.stage, auto_stage, user, choose)
    if why:
        notes.append(why)
    native = None
    if stage != 3:  # under stage 3, check_layout refuses native MoE outright ([native-moe-zero3])
        native = native_of()
    if native is not None:
        ep_size = native.ep_size
        if native.note:
            notes.append(native.note)
    asked = options.grouped_experts
    grouped = effective_grouped_experts(asked, ep_size, user)
    try:
        options = dataclasses.replace(options, stage=stage, ep_size=ep_size, grouped_experts=grouped)
    except ValueError as err:
        raise ZeroMoEConfigError(say("merged-config-invalid", "options", error=err)) from None
    if native is not None:
        check_one_kind(found, ep_size, converts_blocks(options))
    layout = Layout(world_size=world.world_size, devices_per_node=world.devices_per_node, ep_size=ep_size,
                    stage=stage, precision=world.precision, grouped_experts=grouped)
    warnings = check_layout(layout, found)
    # Native MoE layers set up their own expert groups: no AutoEP section then (native_moe.py).
    locate = found.autoep if (found.blocks and converts_blocks(options) and not found.native_moe) else None
    use_grouped_mm = grouped_mm_applies(world.on_cpu, world.precision)
    if grouped and ep_size == 1:
        notes.append(grouped_note(asked, use_grouped_mm))
    base = build_config(options, locate, use_grouped_mm=use_grouped_mm)
    base, _ = merge_config(base, keyword_sections)
    merged, overrides = merge_config(base, user)
    notes += [f"ZeroMoEStrategy config override: {line}" for line in overrides]
    ds_config = DeepSpeedConfig.from_dict(merged)
    check_batch_arithmetic(ds_config.batch, world.world_size, world.accumulate_grad_batches)
    ds_config = without_accumulation(ds_config)
    assert ds_config.stage == stage, "the stage is decided in effective_stage only"
    return ResolvedConfig(ds_config=ds_config, ep_size=ep_size, grouped_experts=grouped, warnings=warnings,
                          notes=notes)


def without_accumulation(ds_config: DeepSpeedConfig) -> DeepSpeedConfig:
    """Lightning sets ``gradient_accumulation_steps`` itself and refuses a config that has it."""
    extra = {k: v for k, v in ds_config.extra.items() if k != "gradient_accumulation_steps"}  # one written as null
    return ds_config.replace(batch=dataclasses.replace(ds_config.batch, gradient_accumulation_steps=None),
                             extra=MappingProxyType(extra))


def grouped_note(asked: bool, use_grouped_mm: bool) -> str:
    """The info line for AutoEP's layer at ep_size=1: why it is on and which expert path it runs."""
    why = "grouped_experts=True" if asked else "expert_parallel.enabled: true at autoep_size 1 in your config"
    path = ("its grouped GEMM (torch._grouped_mm)" if use_grouped_mm else
            "its per-expert loop (torch's grouped GEMM is used for bf16 on CUDA only)")
    return (f"ZeroMoEStrategy: {why}: the MoE blocks become AutoEP layers without expert parallelism "
            f"(autoep_size=1, every rank holds every expert, no all-to-all); the experts run {path}.")


def inference_config(config: DeepSpeedConfig, *, already_converted: bool) -> DeepSpeedConfig:
    """The config for an engine without optimizer (validate/test/predict), from the training config.

    Keeps precision, the ZeRO section (stage 3 partitions parameters for inference too; lower
    stages only shard optimizer state, so there is nothing to keep), and the ``expert_parallel``
    section, so an unconverted model is converted exactly as for training. A model AutoEP already
    converted (``validate`` after ``fit`` in the same process) must not be converted twice: its
    section is dropped and its expert layers keep their groups.
    """
    micro = config.batch.train_micro_batch_size_per_gpu
    order = ("train_micro_batch_size_per_gpu", "fp16", "bf16", "zero_allow_untested_optimizer", "zero_optimization",
             "expert_parallel")
    kept = {k: config.extra[k] for k in ("zero_allow_untested_optimizer", "train_micro_batch_size_per_gpu")
            if k in config.extra}  # the micro batch there only when written as null: kept as written
    zero = None
    if config.stage == 3 and config.zero is not None:
        zero = dataclasses.replace(config.zero, offload_optimizer=None,
                                   extra=MappingProxyType({k: v for k, v in config.zero.extra.items()
                                                           if k != "offload_optimizer"}))
    if micro is None and "train_micro_batch_size_per_gpu" not in kept:
        micro = 1
    return DeepSpeedConfig(zero=zero, expert_parallel=None if already_converted else config.expert_parallel,
                           precision=config.precision, batch=BatchSection(train_micro_batch_size_per_gpu=micro),
                           extra=MappingProxyType(kept), order=order)


def check_offload_optimizer(config: DeepSpeedConfig, optimizer_class: type | None) -> None:
    """ZeRO-Offload of the optimizer needs DeepSpeed's CPU optimizer, not a torch one.

    DeepSpeed refuses a torch optimizer only deep inside ``deepspeed.initialize`` (with
    ``zero_force_ds_cpu_optimizer``, on by default); this says so before any engine exists.
    """
    offload = config.offload_optimizer or OffloadSection()
    if optimizer_class is None or not offload.active:
        return
    if not config.force_ds_cpu_optimizer:
        return
    module = optimizer_class.__module__ or ""
    if module.startswith("deepspeed."):
        return
    raise ZeroMoEConfigError(
        say("offload-needs-ds-cpu-optimizer", "torch-optimizer", "use-deepspeed-cpu-adam",
            device=offload.device, module=module, qualname=optimizer_class.__qualname__))


def zero_init_config(options: ZeroOptions, *, auto_stage: bool, keyword_sections: Mapping[str, Any] | None = None,
                     user: Mapping[str, Any] | None = None) -> DeepSpeedConfig:
    """The config ``zero.Init`` sees while ``configure_model`` builds the model (before :func:`resolve`).

    Only its ZeRO section matters there (``zero.Init`` is on for stage 3). ``stage="auto"`` cannot
    ask the planner about a model that does not exist yet, so it builds under ZeRO-3: a model too
    big for one rank must never be built whole. :func:`resolve` replaces this config in ``setup``.
    """
    stage, _ = effective_stage(options.stage, auto_stage, user, choose=None)
    if auto_stage and user_section(user, "zero_optimization").get("stage") is None:
        stage = 3
    base = build_config(dataclasses.replace(options, stage=stage, ep_size=1), None, use_grouped_mm=False)
    base, _ = merge_config(base, keyword_sections)
    merged, _ = merge_config(base, user)
    return without_accumulation(DeepSpeedConfig.from_dict(merged))
