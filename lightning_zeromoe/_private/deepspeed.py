"""The only place that touches DeepSpeed's private names (deepspeed 0.19.8 is what they were read from).

* ``module._external_params``: ZeRO-3's registry of parameters a module uses but does not hold
  (``runtime/zero/partition_parameters.py``, ``_init_external_params`` /
  ``register_external_parameter``); read to report what ZeRO-3 will fetch with each module.
* ``AutoEPMoELayer._is_autoep_layer``: AutoEP's class marker for its layers.
* ``engine._config.load_universal_checkpoint``: the flag ``DeepSpeedEngine.load_universal_checkpoint()``
  reads, set for one load of a universal checkpoint by an engine built without it.
* ``runtime.config._REMOVED_TOP_LEVEL_CONFIG_KEYS`` / ``_REMOVED_ZERO_CONFIG_KEYS``: the keys
  DeepSpeed removed, with its own message, for ``lint``.

DeepSpeed is imported inside each function: ``troubleshooter``'s start path must not load it.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from typing import Any, Iterator

NAMES = ("_external_params", "_init_external_params", "_is_autoep_layer", "_config",
         "_REMOVED_TOP_LEVEL_CONFIG_KEYS", "_REMOVED_ZERO_CONFIG_KEYS")


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
    return gone + autoep_api_changes()


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

        raise RuntimeError(f"deepspeed {deepspeed.__version__} has no DeepSpeedConfig.load_universal_checkpoint; "
                           "resume on another shape needs deepspeed with universal checkpoints (0.19.8 is tested).")
    previous = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        yield
    finally:
        config.load_universal_checkpoint = previous


def removed_config_keys() -> tuple[dict[str, str], dict[str, str]]:
    """DeepSpeed's own tables of removed top-level and ``zero_optimization`` keys, with its messages."""
    from deepspeed.runtime import config as ds_config

    return (dict(getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {})),
            dict(getattr(ds_config, "_REMOVED_ZERO_CONFIG_KEYS", {})))
