"""The only place that touches transformers' private names (read from 5.22 to 5.24).

* ``modeling_utils._load_state_dict_into_zero3_model``: the ZeRO-3 loader ``from_pretrained`` calls;
  replaced for the duration of ``configure_model`` by the partition-aware one.
* ``integrations.deepspeed._hf_deepspeed_config_weak_ref``: what ``is_deepspeed_zero3_enabled()``
  reads; saved and put back around that.
* ``integrations.deepspeed._apply_weight_conversions_to_state_dict``: transformers' own checkpoint
  conversions (fusing per-expert tensors), run one layer at a time. A dict up to 5.22, a generator
  of dicts from 5.23: :func:`apply_weight_conversions` returns one dict either way.
* ``modeling_utils.load_state_dict`` (public, but patched): from 5.23 ``from_pretrained`` reads the
  checkpoint to "meta" on every rank but 0 under ZeRO-3; :func:`checkpoint_read_on_every_rank`.
* ``model._weight_conversions``: the conversions a load used, which ``save_pretrained`` reverts.
* ``tensor._is_hf_initialized``: the flag by which ``_init_weights`` skips a loaded tensor. A
  rename would silently re-initialise every loaded weight: :func:`missing` checks that
  ``modeling_utils`` still reads it.
* ``config._name_or_path``: where a model was loaded from, recorded in the export metadata.
* ``config._experts_implementation``: how a model's MoE experts run (``"eager"``: a loop over the
  slices of the fused expert tensors; ``"grouped_mm"``, the default where it dispatches), which the
  planner's step time reads (:func:`experts_implementation`).
* ``PreTrainedModel._can_record_outputs``: which submodules' outputs ``output_router_logits`` records.
* ``utils.output_capturing._CAN_RECORD_REGISTRY``: each model class's ``_can_record_outputs``, keyed
  by ``str(cls)``. A plain ``dict`` up to 5.22; from 5.23 a ``dict`` subclass whose ``get(model)`` and
  ``[model] = ...`` take the model, not the key. AutoEP (deepspeed 0.19.8) reads and writes it by key:
  :func:`key_tolerant_registry` lets it, for the duration of ``deepspeed.initialize``.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from typing import Any, Callable, Iterator

NAMES = ("_load_state_dict_into_zero3_model", "_hf_deepspeed_config_weak_ref", "_apply_weight_conversions_to_state_dict",
         "_weight_conversions", "_is_hf_initialized", "_name_or_path", "_experts_implementation", "_can_record_outputs",
         "_CAN_RECORD_REGISTRY")


def missing() -> list[str]:
    """The private transformers names this installation lacks (empty when everything is there)."""
    from transformers import PretrainedConfig, PreTrainedModel, core_model_loading, modeling_utils
    from transformers.integrations import deepspeed as hf_ds

    gone = []
    if not callable(getattr(modeling_utils, "_load_state_dict_into_zero3_model", None)):
        gone.append("modeling_utils._load_state_dict_into_zero3_model")
    for name in ("_hf_deepspeed_config_weak_ref", "_apply_weight_conversions_to_state_dict"):
        if not hasattr(hf_ds, name):
            gone.append(f"integrations.deepspeed.{name}")
    if "_is_hf_initialized" not in inspect.getsource(modeling_utils):
        gone.append("modeling_utils reads tensor._is_hf_initialized")
    if "model._weight_conversions" not in inspect.getsource(core_model_loading):
        gone.append("core_model_loading keeps model._weight_conversions")
    if not hasattr(PretrainedConfig(), "_name_or_path"):
        gone.append("PretrainedConfig._name_or_path")
    if not isinstance(getattr(PretrainedConfig, "_experts_implementation", None), property):
        gone.append("PretrainedConfig._experts_implementation")
    if not hasattr(PreTrainedModel, "_can_record_outputs"):
        gone.append("PreTrainedModel._can_record_outputs")
    if not isinstance(output_capture_registry(), dict):
        gone.append("utils.output_capturing._CAN_RECORD_REGISTRY")
    return gone


def zero3_loader() -> Callable[..., Any]:
    """``from_pretrained``'s ZeRO-3 state-dict loader now in place."""
    from transformers import modeling_utils

    return modeling_utils._load_state_dict_into_zero3_model


def set_zero3_loader(loader: Callable[..., Any]) -> None:
    """Make ``from_pretrained`` load ZeRO-3 models with ``loader``."""
    from transformers import modeling_utils

    modeling_utils._load_state_dict_into_zero3_model = loader


@contextmanager
def checkpoint_read_on_every_rank() -> Iterator[None]:
    """While ``from_pretrained`` runs under ZeRO-3: every rank reads the checkpoint's tensors.

    From 5.23 ``_load_pretrained_model`` reads the files with ``map_location="meta"`` on every rank
    but 0 ("only rank 0 copies checkpoint values into the model"), which suits transformers' own
    gather-and-copy loader. Ours copies each rank's slice into its own partition, with no collective
    (:func:`lightning_zeromoe.loading.hf_zero3.load_into_partitions`), so each rank needs the data:
    "meta" becomes "cpu". Safetensors files are memory-mapped, so a rank only touches the pages of
    what it copies. Up to 5.22 every rank already read to "cpu" and this changes nothing.
    """
    from transformers import modeling_utils

    original = modeling_utils.load_state_dict

    def read(checkpoint_file: Any, map_location: Any = "cpu", *args: Any, **kwargs: Any) -> Any:
        return original(checkpoint_file, "cpu" if str(map_location) == "meta" else map_location, *args, **kwargs)

    modeling_utils.load_state_dict = read
    try:
        yield
    finally:
        modeling_utils.load_state_dict = original


def deepspeed_config_ref() -> Any:
    """What ``is_deepspeed_zero3_enabled()`` reads now (a weak reference, or ``None``)."""
    from transformers.integrations import deepspeed as hf_ds

    return hf_ds._hf_deepspeed_config_weak_ref


def set_deepspeed_config_ref(ref: Any) -> None:
    """Put back a reference returned by :func:`deepspeed_config_ref`."""
    from transformers.integrations import deepspeed as hf_ds

    hf_ds._hf_deepspeed_config_weak_ref = ref


def apply_weight_conversions(model: Any, state_dict: dict[str, Any], weight_mapping: Any) -> dict[str, Any]:
    """transformers' own checkpoint conversions on part of a state dict, as one dict.

    Up to 5.22 transformers returns a dict; from 5.23 a generator of dicts, one per converted tensor
    and then the unconverted rest (and it pops the keys it reads from ``state_dict``). The callers
    pass one layer's keys at a time, so collecting that layer's results costs no more than 5.22 did.
    """
    from collections.abc import Mapping

    from transformers.integrations.deepspeed import _apply_weight_conversions_to_state_dict

    result = _apply_weight_conversions_to_state_dict(model, state_dict, weight_mapping)
    if isinstance(result, Mapping):
        return dict(result)
    merged: dict[str, Any] = {}
    for part in result:
        merged.update(part)
    return merged


def keep_weight_conversions(model: Any, weight_mapping: Any) -> None:
    """Record on ``model`` the conversions its checkpoint went through (``save_pretrained`` reverts them)."""
    model._weight_conversions = weight_mapping


def mark_loaded(tensor: Any) -> None:
    """Tell ``from_pretrained`` not to initialise ``tensor``: it was loaded."""
    tensor._is_hf_initialized = True


def name_or_path(config: Any) -> str:
    """Where a model's config was loaded from ("" when built from scratch)."""
    return getattr(config, "_name_or_path", "") or ""


def experts_implementation(config: Any) -> str | None:
    """How a transformers model's MoE experts run (``"eager"``, ``"grouped_mm"``, ...); None when the
    config does not say (not a transformers config, or a version without it)."""
    value = getattr(config, "_experts_implementation", None)
    return value if isinstance(value, str) else None


def recorded_outputs(model: Any) -> dict[str, Any]:
    """``_can_record_outputs`` of a model class: output name -> what records it (empty when none)."""
    return dict(getattr(model, "_can_record_outputs", None) or {})


def output_capture_registry() -> dict | None:
    """transformers' registry of each model class's ``_can_record_outputs`` (``None`` when it has none)."""
    from transformers.utils import output_capturing

    registry = getattr(output_capturing, "_CAN_RECORD_REGISTRY", None)
    return registry if isinstance(registry, dict) else None


_NO_ENTRY = object()


def registry_is_key_addressed(registry: dict) -> bool:
    """Whether ``registry.get(key, default)`` and ``registry[key] = value`` work as on a plain dict
    keyed by ``str(cls)`` (transformers <= 5.22), judged by calling them on a key no class has."""
    if type(registry).__setitem__ is not dict.__setitem__:
        return False
    try:
        return registry.get("<zeromoe probe>", _NO_ENTRY) is _NO_ENTRY
    except TypeError:
        return False


@functools.lru_cache(maxsize=None)
def _key_tolerant(cls: type) -> type:
    """``cls`` that also accepts AutoEP's string keys: ``get(key[, default])`` and ``[key] = value``
    act on that very key, as a plain dict does; a model (anything not a ``str``) keeps ``cls``'s meaning."""

    class KeyTolerantRegistry(cls):  # type: ignore[misc, valid-type]
        def get(self, key: Any, *default: Any) -> Any:
            if isinstance(key, str):
                return dict.get(self, key, *default)
            return super().get(key, *default)

        def __setitem__(self, key: Any, value: Any) -> None:
            if isinstance(key, str):
                dict.__setitem__(self, key, value)
            else:
                super().__setitem__(key, value)

    KeyTolerantRegistry.__qualname__ = KeyTolerantRegistry.__name__ = f"KeyTolerant{cls.__name__}"
    return KeyTolerantRegistry


@contextmanager
def key_tolerant_registry(registry: dict) -> Iterator[None]:
    """While the block runs, ``registry`` (the same object, so every holder of it sees the change)
    also answers ``get(key, default)`` and stores ``[key] = value`` under ``key``; its class is put
    back afterwards. Nothing changes for a registry that already does (see :func:`registry_is_key_addressed`)."""
    if registry_is_key_addressed(registry):
        yield
        return
    original = type(registry)
    registry.__class__ = _key_tolerant(original)
    try:
        yield
    finally:
        registry.__class__ = original
