"""The only place that touches DeepSpeed's private names (deepspeed 0.19.8 is what they were read from).

* ``module._external_params``: ZeRO-3's registry of parameters a module uses but does not hold
  (``runtime/zero/partition_parameters.py``, ``_init_external_params`` /
  ``register_external_parameter``); read to report what ZeRO-3 will fetch with each module.
* ``AutoEPMoELayer._is_autoep_layer``: AutoEP's class marker for its layers.
* ``engine._config.load_universal_checkpoint``: the flag ``DeepSpeedEngine.load_universal_checkpoint()``
  reads, set for one load of a universal checkpoint by an engine built without it.
* ``runtime.config._REMOVED_TOP_LEVEL_CONFIG_KEYS`` / ``_REMOVED_ZERO_CONFIG_KEYS``: the keys
  DeepSpeed removed, with its own message, for ``lint``.
* ``DeepSpeedEngine._autoep_expert_parameter_names`` and ``checkpoint.ds_to_universal
  ._autoep_expert_param_info``: the AutoEP expert names DeepSpeed's ZeRO-3 save and its universal
  converter expect in the optimizer's shards; frozen experts (which the strategy saves itself,
  :mod:`lightning_zeromoe.checkpoint.frozen_experts`) are left out of them for one save or one
  conversion (:func:`frozen_experts_presented`, :func:`frozen_experts_left_out_of_conversion`).
* ``module_inject.auto_ep_presets.base._install_instance_transformers_output_recorders``: where
  AutoEP saves, updates and restores transformers' output-capture registry by key
  (``registry.get(key, default)``, ``registry[key] = entry``); run on a scratch registry by
  :func:`autoep_mishandles_registry` to learn whether AutoEP needs :func:`autoep_output_capture_shim`.
* ``runtime.zero.muon.muon_optimizer``: the module ``deepspeed.initialize`` imports on every ZeRO
  engine (``is_zero_supported_optimizer``, ``DeepSpeedZeroOptimizer_Stage3.__init__``), whose import
  decorates three kernels with ``torch.compile`` and so imports torch's inductor (measured: 2-6 s and
  ~40 MB per rank at start, whatever the optimizer). :func:`import_muon_compiling_on_first_use`
  imports it beforehand with those decorations deferred to the kernels' first call.
* ``utils.groups._get_expert_parallel_group_dict`` / ``_get_expert_data_parallel_group_dict``: the
  expert process groups DeepSpeed built, so the communication ledger can say which group a
  collective ran on.

DeepSpeed is imported inside each function: ``troubleshooter``'s start path must not load it.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Mapping

NAMES = ("_external_params", "_init_external_params", "_is_autoep_layer", "_config",
         "_autoep_expert_parameter_names", "_autoep_expert_param_info",
         "_install_instance_transformers_output_recorders",
         "_get_expert_parallel_group_dict", "_get_expert_data_parallel_group_dict",
         "_REMOVED_TOP_LEVEL_CONFIG_KEYS", "_REMOVED_ZERO_CONFIG_KEYS")


#: DeepSpeed's Muon optimizer module (imported by ``deepspeed.initialize``; see the module docstring).
MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def missing() -> list[str]:
    """The private DeepSpeed names this installation lacks (empty when everything is there)."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero import partition_parameters

    gone = []
    init = getattr(partition_parameters, "_init_external_params", None)
    if init is None or "_external_params" not in inspect.getsource(init):
        gone.append("partition_parameters._init_external_params sets module._external_params")
    if getattr(AutoEPMoELayer, "_is_autoep_layer", None) is not True:
        gone.append("AutoEPMoELayer._is_autoep_layer")
    if "self._config.load_universal_checkpoint" not in inspect.getsource(DeepSpeedEngine.load_universal_checkpoint):
        gone.append("DeepSpeedEngine._config.load_universal_checkpoint")
    gone += [f"runtime.config.{name}" for name in NAMES[-2:] if not isinstance(getattr(ds_config, name, None), dict)]
    from deepspeed.utils import groups

    gone += [f"utils.groups.{name}" for name in ("_get_expert_parallel_group_dict", "_get_expert_data_parallel_group_dict")
             if not callable(getattr(groups, name, None))]
    import importlib.util

    if importlib.util.find_spec(MUON_MODULE) is None:
        gone.append(MUON_MODULE)
    return gone + frozen_expert_hooks_missing() + autoep_api_changes()


def frozen_expert_hooks_missing() -> list[str]:
    """What :func:`frozen_experts_presented` and :func:`frozen_experts_left_out_of_conversion` rely on
    and the installed DeepSpeed lacks (empty: both work)."""
    from deepspeed.checkpoint import ds_to_universal
    from deepspeed.runtime.engine import DeepSpeedEngine

    gone = []
    if not isinstance(DeepSpeedEngine.__dict__.get("_autoep_expert_parameter_names"), staticmethod):
        gone.append("DeepSpeedEngine._autoep_expert_parameter_names (a staticmethod)")
    if not callable(getattr(ds_to_universal, "_autoep_expert_param_info", None)):
        gone.append("deepspeed.checkpoint.ds_to_universal._autoep_expert_param_info")
    return gone


#: What the conversion probe calls of AutoEP (``module_inject/auto_ep*.py``, 0.19.8): a class or
#: function, and the parameters it must accept.
AUTOEP_API = (("deepspeed.module_inject.auto_ep", "AutoEP", ("model", "config")),
              ("deepspeed.module_inject.auto_ep", "AutoEP.ep_parser", ()),
              ("deepspeed.module_inject.auto_ep_config", "parse_autoep_config", ()),
              ("deepspeed.module_inject.auto_ep_layer", "AutoEPMoELayer",
               ("spec", "source_module", "ep_size", "ep_rank", "config")))


@functools.lru_cache(maxsize=None)
def _api_changes(api: tuple) -> tuple[str, ...]:
    return tuple(_changes(api))


def autoep_api_changes() -> list[str]:
    """What of :data:`AUTOEP_API` the installed DeepSpeed lacks or calls differently (empty: all there)."""
    return list(_api_changes(AUTOEP_API))


def _changes(api: tuple) -> list[str]:
    import importlib

    changes = []
    for module_name, qualname, params in api:
        try:
            target: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                target = getattr(target, part)
        except (ImportError, AttributeError):
            changes.append(f"{module_name}.{qualname} is gone")
            continue
        try:
            accepted = inspect.signature(target).parameters
        except (TypeError, ValueError):
            continue
        lost = [p for p in params if p not in accepted]
        if lost:
            changes.append(f"{module_name}.{qualname} no longer takes {', '.join(lost)}")
    return changes


def check_autoep_api() -> None:
    """Raise, naming the DeepSpeed version, when AutoEP's API is not the one the probe calls: an
    upgrade must fail loudly, not read as "AutoEP refused every block" and train without EP."""
    changes = autoep_api_changes()
    if changes:
        import deepspeed

        from lightning_zeromoe.knowledge import say

        raise RuntimeError(say("stack-versions", "autoep-api-changed", "tested-deepspeed-or-no-ep",
                               version=deepspeed.__version__, changes="; ".join(changes)))


def external_params(module: Any) -> dict[Any, Any]:
    """ZeRO-3's registry of the parameters ``module`` uses without holding them (empty for a module
    ZeRO-3 never registered one on; ZeRO-3 creates the registry on first registration)."""
    return getattr(module, "_external_params", None) or {}


def is_autoep_layer(module: Any) -> bool:
    """Whether ``module`` is one of AutoEP's MoE layers."""
    return bool(getattr(type(module), "_is_autoep_layer", False))


@contextmanager
def universal_checkpoint_loading(engine: Any) -> Iterator[None]:
    """Let an engine built without ``checkpoint.load_universal`` load one universal checkpoint."""
    config = engine._config
    if not hasattr(config, "load_universal_checkpoint"):
        import deepspeed

        from lightning_zeromoe.knowledge import say

        raise RuntimeError(say("resume-shape-unsupported", "no-universal-loading", "tested-deepspeed-universal",
                               version=deepspeed.__version__))
    previous = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        yield
    finally:
        config.load_universal_checkpoint = previous


@contextmanager
def frozen_experts_presented(params: Mapping[str, Any], *, saving: bool) -> Iterator[None]:
    """Let DeepSpeed 0.19.8 save (or load on the same shape) a ZeRO-3 engine whose AutoEP experts are
    frozen; ``params``: those expert parameters by name. Nothing trains or computes in between.

    DeepSpeed refuses the save (``runtime/engine.py``, ``_save_moe_checkpoint``: "AutoEP with ZeRO
    Stage 3 checkpointing does not support frozen expert parameters yet") because its format keeps
    AutoEP experts only in the optimizer's shards, which never hold frozen parameters. The strategy
    writes them itself (:mod:`lightning_zeromoe.checkpoint.frozen_experts`); for the duration:

    * each parameter's ``requires_grad`` reads True: the refusal's check passes, DeepSpeed leaves
      them out of its frozen fragments on save (they are the strategy's to save) and out of the
      frozen fragments it looks up on load (which would fail with a ``KeyError``);
    * ``saving``: ``DeepSpeedEngine._autoep_expert_parameter_names`` leaves their names out, so the
      save's cross-check against the optimizer's ``param_shapes`` (which never held them) passes.
      (Not on load: there the names are the expert keys the module state may lack, which it does.)

    The flags and the method are put back on exit, also when DeepSpeed raises. No forward or
    backward runs inside: the optimizer's groups, built at ``deepspeed.initialize``, never see them.
    """
    if not params:
        yield
        return
    from deepspeed.runtime.engine import DeepSpeedEngine

    gone = frozen_expert_hooks_missing()
    if gone:
        import deepspeed

        from lightning_zeromoe.knowledge import say

        raise RuntimeError(say("autoep-frozen-experts", "hooks-missing", "tested-deepspeed-or-train-experts",
                               version=deepspeed.__version__, missing=", ".join(gone)))
    hidden = frozenset(params)
    original = DeepSpeedEngine.__dict__["_autoep_expert_parameter_names"]

    def without_frozen(autoep_layers: Any, model: Any) -> set[str]:
        return set(original.__func__(autoep_layers, model)) - hidden

    flipped = [p for p in params.values() if not p.requires_grad]
    if saving:
        DeepSpeedEngine._autoep_expert_parameter_names = staticmethod(without_frozen)
    try:
        for p in flipped:
            p.requires_grad_(True)
        yield
    finally:
        for p in flipped:
            p.requires_grad_(False)
        DeepSpeedEngine._autoep_expert_parameter_names = original


@contextmanager
def frozen_experts_left_out_of_conversion(names: Iterable[str]) -> Iterator[None]:
    """Let ``ds_to_universal`` convert a checkpoint whose AutoEP experts ``names`` were frozen.

    Its ``_validate_autoep_expert_shapes`` requires every AutoEP expert weight in the optimizer's
    ``param_shapes`` ("AutoEP expert parameters are missing from rank R ZeRO param_shapes"); frozen
    ones never are (the strategy saved them beside the shards). For the duration, the converter's
    list of expert weights (``_autoep_expert_param_info``) leaves them out; everything else it
    converts as before.
    """
    hidden = frozenset(names)
    if not hidden:
        yield
        return
    from deepspeed.checkpoint import ds_to_universal

    original = ds_to_universal._autoep_expert_param_info

    def without_frozen(autoep_metadata: Any) -> dict[str, Any]:
        return {k: v for k, v in original(autoep_metadata).items() if k not in hidden}

    ds_to_universal._autoep_expert_param_info = without_frozen
    try:
        yield
    finally:
        ds_to_universal._autoep_expert_param_info = original


def is_frozen_expert_refusal(err: BaseException) -> bool:
    """Whether ``err`` is DeepSpeed's refusal to save (or convert) frozen AutoEP experts under ZeRO-3."""
    text = str(err)
    return "does not support frozen expert" in text or "frozen expert parameters cannot be converted" in text


def removed_config_keys() -> tuple[dict[str, str], dict[str, str]]:
    """DeepSpeed's own tables of removed top-level and ``zero_optimization`` keys, with its messages."""
    from deepspeed.runtime import config as ds_config

    return (dict(getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {})),
            dict(getattr(ds_config, "_REMOVED_ZERO_CONFIG_KEYS", {})))


#: The last DeepSpeed release whose AutoEP is known to address transformers' output-capture registry
#: by key (measured: 0.19.8). Consulted only where the behaviour cannot be probed.
_REGISTRY_BY_KEY_UP_TO = (0, 19, 8)


def _registry_installer() -> Any:
    from deepspeed.module_inject.auto_ep_presets import base

    return getattr(base, "_install_instance_transformers_output_recorders", None)


def autoep_mishandles_registry(registry_class: type) -> bool:
    """Whether AutoEP's registry round trip (save an entry, write the retargeted one, restore) fails
    on a registry of ``registry_class``: raises, or leaves anything but the original entry behind.
    Run on a scratch instance, never on transformers' own registry. Where that code is gone from
    the installed DeepSpeed, its version decides (0.19.8 and older do)."""
    import types

    from torch import nn

    install = _registry_installer()
    try:
        scratch = registry_class()
    except TypeError:
        install = None
    if install is None:
        import deepspeed

        from lightning_zeromoe.compat import version_tuple

        return version_tuple(deepspeed.__version__) <= _REGISTRY_BY_KEY_UP_TO
    key, original, retargeted = "<class 'zeromoe.Probe'>", {"router_logits": "original"}, {"router_logits": "new"}
    dict.__setitem__(scratch, key, original)
    capturing = types.SimpleNamespace(_CAN_RECORD_REGISTRY=scratch, maybe_install_capturing_hooks=lambda model: None)
    try:
        install(nn.Module(), {key: retargeted}, capturing, lambda model: 0)
    except TypeError:
        return True
    return dict(scratch) != {key: original}


@contextmanager
def autoep_output_capture_shim() -> Iterator[None]:
    """Around ``deepspeed.initialize``: when the installed transformers' output-capture registry is
    one AutoEP cannot read or restore by key (transformers >= 5.23 with deepspeed 0.19.8: ``TypeError:
    _CanRecordRegistry.get() takes 2 positional arguments but 3 were given``), let it, for the
    duration of the block only. Nothing happens without transformers, with transformers <= 5.22, or
    with a DeepSpeed whose AutoEP handles the registry (probed, see :func:`autoep_mishandles_registry`)."""
    try:
        from lightning_zeromoe._private import transformers as hf_private

        registry = hf_private.output_capture_registry()
    except ImportError:
        registry = None
    if (registry is None or hf_private.registry_is_key_addressed(registry)
            or not autoep_mishandles_registry(type(registry))):
        yield
        return
    with hf_private.key_tolerant_registry(registry):
        yield


def import_muon_compiling_on_first_use() -> None:
    """Import DeepSpeed's Muon optimizer module now, with each function its import hands to
    ``torch.compile`` compiled on that function's first call instead of at import.

    ``deepspeed.initialize`` imports the module for every ZeRO engine to learn whether the optimizer
    is Muon; its import runs ``torch.compile`` on three Newton-Schulz kernels, and ``torch.compile``
    imports torch's inductor even for a function it never runs. The kernels run only when the
    optimizer is DeepSpeed's Muon; then the first call compiles them exactly as the import would have
    (same function, same arguments). Nothing happens when the module is already imported (a user of
    Muon imported it to build the optimizer) or does not exist (a DeepSpeed without it).
    """
    import importlib
    import importlib.util
    import sys

    if MUON_MODULE in sys.modules or importlib.util.find_spec(MUON_MODULE) is None:
        return
    import torch

    compile_now = torch.compile

    def compile_on_first_use(model: Any = None, **kwargs: Any) -> Any:
        if not inspect.isfunction(model):  # a module, or torch.compile(**options) as a decorator factory
            return compile_now(**kwargs) if model is None else compile_now(model, **kwargs)
        compiled: list[Any] = []

        @functools.wraps(model)
        def first_call_compiles(*args: Any, **call_kwargs: Any) -> Any:
            if not compiled:
                compiled.append(compile_now(model, **kwargs))
            return compiled[0](*args, **call_kwargs)

        return first_call_compiles

    torch.compile = compile_on_first_use
    try:
        importlib.import_module(MUON_MODULE)
    finally:
        torch.compile = compile_now


def expert_groups() -> dict[str, list[Any]]:
    """The expert process groups DeepSpeed has built so far (every ``ep_size_<N>``, AutoEP's and
    native MoE's), by kind: ``expert_parallel`` and ``expert_data_parallel``. Reads only: no group
    is created (DeepSpeed's ``_get_data_parallel_group`` would create one, a collective)."""
    from deepspeed.utils import groups

    return {"expert_parallel": list(groups._get_expert_parallel_group_dict().values()),
            "expert_data_parallel": list(groups._get_expert_data_parallel_group_dict().values())}


def comm_backend() -> Any:
    """``deepspeed.comm``'s backend object (None before ``init_distributed``). Its torch backend
    holds ``all_gather_function`` / ``reduce_scatter_function``: references to
    ``torch.distributed.all_gather_into_tensor`` / ``reduce_scatter_tensor`` taken at init, through
    which ``deepspeed.comm.all_gather_into_tensor`` / ``reduce_scatter_tensor`` call torch."""
    from deepspeed.comm import comm

    return comm.cdb
