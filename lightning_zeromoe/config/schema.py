"""The DeepSpeed config as one typed, frozen tree: what the strategy reads, and what DeepSpeed gets.

:func:`DeepSpeedConfig.from_dict` parses a config dict (the merged one :func:`~lightning_zeromoe.config.resolve.resolve`
builds, the one Lightning completes, one saved in a checkpoint) and checks the types of the keys
the strategy reads, with a ``[merged-config-invalid]`` error naming the key. Sections:

* :class:`ZeroSection`: ``zero_optimization`` (its ``stage``, the two offload sub-sections);
* :class:`ExpertParallelSection`: AutoEP's ``expert_parallel``;
* :class:`PrecisionSection`: the top-level ``fp16`` / ``bf16`` sections;
* :class:`BatchSection`: the top-level batch keys and ``gradient_clipping``;
* ``extra``: every other top-level key (optimizer, scheduler, activation_checkpointing, ...).

Nothing the config holds is lost: each section keeps the keys it does not type verbatim in its own
``extra``, and the order keys were written in, so ``from_dict(d).to_dict() == d`` and the dict
comes back in the same key order. :meth:`DeepSpeedConfig.to_dict` is called only where the config
leaves this package (``deepspeed.initialize``, ``zero.Init`` through Lightning, transformers).

Pure: no torch, no DeepSpeed.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

from lightning_zeromoe.config.validation import ZeroMoEConfigError
from lightning_zeromoe.knowledge import say

ZERO = "zero_optimization"
EXPERT_PARALLEL = "expert_parallel"
PRECISION_KEYS = ("fp16", "bf16")
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
              "gradient_clipping")


def _invalid(key: str, value: Any, expected: str) -> ZeroMoEConfigError:
    return ZeroMoEConfigError(say("merged-config-invalid", "wrong-type", "fix-type-or-remove", key=key, value=value,
                                  expected=expected))


def _frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(copy.deepcopy(dict(mapping)))


def _mapping(value: Any, key: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _invalid(key, value, "a JSON object (a dict)")
    return value


def _int_or_auto(value: Any, key: str) -> int | str:
    if value == "auto":
        return value
    if not isinstance(value, int) or isinstance(value, bool):
        raise _invalid(key, value, "an integer or 'auto'")
    return value


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise _invalid(key, value, "true or false")
    return value


def _str(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise _invalid(key, value, "a string")
    return value


def _number(value: Any, key: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise _invalid(key, value, "a number")
    return value


@dataclass(frozen=True, kw_only=True)
class Section:
    """Keys a section types (``TYPED``) are fields; the rest stay in ``extra``, in ``order`` as written.

    A typed field that is None is absent from :meth:`to_dict` (a key written as ``null`` is kept
    in ``extra``, so it comes back as written). Subclasses parse their typed keys in ``_parse``.
    """

    TYPED: ClassVar[tuple[str, ...]] = ()

    #: The keys this section does not type, verbatim (read-only; to_dict gives copies).
    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    #: Every key as written, in order (typed ones included): to_dict keeps it.
    order: tuple[str, ...] = ()

    @classmethod
    def _parse(cls, key: str, value: Any, where: str) -> Any:
        raise NotImplementedError

    @classmethod
    def _fields_of(cls, mapping: Mapping[str, Any], where: str) -> dict[str, Any]:
        typed = {k: cls._parse(k, v, f"{where}{k}") for k, v in mapping.items() if k in cls.TYPED and v is not None}
        rest = {k: v for k, v in mapping.items() if k not in typed}
        return {**typed, "extra": _frozen(rest), "order": tuple(mapping)}

    @classmethod
    def from_dict(cls, mapping: Any, where: str = "") -> Any:
        """Parse one section (``where``: its dotted name and a dot, for the error message)."""
        return cls(**cls._fields_of(_mapping(mapping, where.rstrip(".") or "config"), where))

    def _items(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.TYPED}

    def to_dict(self) -> dict[str, Any]:
        """The section as written: typed values and ``extra``, in the order they came in."""
        values = self._items()
        out: dict[str, Any] = {}
        for key in (*self.order, *values, *self.extra):
            if key in out:
                continue
            if values.get(key) is not None:
                value = values[key]
                out[key] = value.to_dict() if isinstance(value, Section) else copy.deepcopy(value)
            elif key in self.extra:
                out[key] = copy.deepcopy(self.extra[key])
        return out


@dataclass(frozen=True, kw_only=True)
class OffloadSection(Section):
    """``zero_optimization.offload_optimizer`` / ``offload_param``."""

    TYPED: ClassVar[tuple[str, ...]] = ("device",)
    device: str | None = None

    @classmethod
    def _parse(cls, key: str, value: Any, where: str) -> Any:
        return _str(value, where)

    @property
    def active(self) -> bool:
        """Whether it offloads at all (DeepSpeed's ``device: none`` does not)."""
        return self.device not in (None, "none")


@dataclass(frozen=True, kw_only=True)
class ZeroSection(Section):
    """``zero_optimization``."""

    TYPED: ClassVar[tuple[str, ...]] = ("stage", "offload_optimizer", "offload_param")
    stage: int | None = None
    offload_optimizer: OffloadSection | None = None
    offload_param: OffloadSection | None = None

    @classmethod
    def _parse(cls, key: str, value: Any, where: str) -> Any:
        if key == "stage":
            if value not in (0, 1, 2, 3) or isinstance(value, bool):
                raise ZeroMoEConfigError(say("merged-config-invalid", "zero-stage", "fix-or-remove-key",
                                             user_stage=value))
            return value  # as written (2.0 stays 2.0 for DeepSpeed); DeepSpeedConfig.stage reads it as int
        return OffloadSection.from_dict(value, where + ".")


@dataclass(frozen=True, kw_only=True)
class ExpertParallelSection(Section):
    """AutoEP's ``expert_parallel`` (the keys that locate the blocks other than these stay in ``extra``)."""

    TYPED: ClassVar[tuple[str, ...]] = ("enabled", "autoep_size", "use_grouped_mm", "preset_model",
                                        "moe_layer_pattern")
    enabled: bool | None = None
    autoep_size: int | None = None
    use_grouped_mm: bool | None = None
    preset_model: str | None = None
    moe_layer_pattern: str | None = None

    @classmethod
    def _parse(cls, key: str, value: Any, where: str) -> Any:
        if key == "autoep_size":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ZeroMoEConfigError(say("merged-config-invalid", "autoep-size", "fix-or-remove-key", size=value))
            return value
        if key in ("enabled", "use_grouped_mm"):
            return _bool(value, where)
        return _str(value, where)


@dataclass(frozen=True, kw_only=True)
class FlagSection(Section):
    """A section switched by ``enabled`` (``fp16``, ``bf16``)."""

    TYPED: ClassVar[tuple[str, ...]] = ("enabled",)
    enabled: bool | None = None

    @classmethod
    def _parse(cls, key: str, value: Any, where: str) -> Any:
        return _bool(value, where)


@dataclass(frozen=True)
class PrecisionSection:
    """The top-level ``fp16`` and ``bf16`` sections (None: not in the config)."""

    fp16: FlagSection | None = None
    bf16: FlagSection | None = None

    @property
    def items(self) -> dict[str, FlagSection]:
        """The sections present, by their key."""
        return {k: v for k, v in (("fp16", self.fp16), ("bf16", self.bf16)) if v is not None}


@dataclass(frozen=True)
class BatchSection:
    """The top-level batch keys (None: not in the config; "auto" is kept as written)."""

    train_batch_size: int | str | None = None
    train_micro_batch_size_per_gpu: int | str | None = None
    gradient_accumulation_steps: int | str | None = None
    gradient_clipping: float | None = None

    @staticmethod
    def parse(key: str, value: Any) -> Any:
        if key == "gradient_clipping":
            return _number(value, key)
        return _int_or_auto(value, key)


@dataclass(frozen=True)
class DeepSpeedConfig:
    """The whole DeepSpeed config, typed where the strategy reads it, verbatim elsewhere."""

    zero: ZeroSection | None = None
    expert_parallel: ExpertParallelSection | None = None
    precision: PrecisionSection = PrecisionSection()
    batch: BatchSection = BatchSection()
    #: Every other top-level key (optimizer, scheduler, activation_checkpointing, ...), verbatim.
    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    #: The top-level keys in the order written.
    order: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, config: Any) -> DeepSpeedConfig:
        """Parse and type-check ``config``; raises :class:`ZeroMoEConfigError` (``[merged-config-invalid]``)."""
        config = _mapping(config, "config")
        extra: dict[str, Any] = {}
        precision: dict[str, FlagSection] = {}
        batch: dict[str, Any] = {}
        zero = expert_parallel = None
        for key, value in config.items():
            if key == ZERO:
                zero = ZeroSection.from_dict(value, ZERO + ".")
            elif key == EXPERT_PARALLEL:
                expert_parallel = ExpertParallelSection.from_dict(value, EXPERT_PARALLEL + ".")
            elif key in PRECISION_KEYS:
                precision[key] = FlagSection.from_dict(value, key + ".")
            elif key in BATCH_KEYS and value is not None:
                batch[key] = BatchSection.parse(key, value)
            else:
                extra[key] = value
        return cls(zero=zero, expert_parallel=expert_parallel, precision=PrecisionSection(**precision),
                   batch=BatchSection(**batch), extra=_frozen(extra), order=tuple(config))

    def _top_level(self) -> dict[str, Any]:
        values: dict[str, Any] = {ZERO: self.zero, EXPERT_PARALLEL: self.expert_parallel, **self.precision.items}
        values.update({k: getattr(self.batch, k) for k in BATCH_KEYS})
        return values

    def to_dict(self) -> dict[str, Any]:
        """The plain dict, for where the config leaves this package. ``from_dict(d).to_dict() == d``."""
        values = self._top_level()
        out: dict[str, Any] = {}
        for key in (*self.order, *values, *self.extra):
            if key in out:
                continue
            if values.get(key) is not None:
                value = values[key]
                out[key] = value.to_dict() if isinstance(value, Section) else value
            elif key in self.extra:
                out[key] = copy.deepcopy(self.extra[key])
        return out

    # ------------------------------------------------------------------ the readers

    @property
    def stage(self) -> int:
        """The ZeRO stage DeepSpeed runs (``zero_optimization.stage``; 0 when unset, as DeepSpeed)."""
        return int(self.zero.stage) if self.zero is not None and self.zero.stage is not None else 0

    @property
    def converts_blocks(self) -> bool:
        """Whether AutoEP converts blocks: an ``expert_parallel`` section with ``enabled: true``."""
        return self.expert_parallel is not None and bool(self.expert_parallel.enabled)

    @property
    def autoep_size(self) -> int:
        """The expert-parallel size AutoEP applies: ``autoep_size`` (1 unset) when enabled, else 1."""
        if not self.converts_blocks:
            return 1
        return self.expert_parallel.autoep_size or 1  # type: ignore[union-attr]

    @property
    def offload_optimizer(self) -> OffloadSection | None:
        return self.zero.offload_optimizer if self.zero is not None else None

    @property
    def force_ds_cpu_optimizer(self) -> bool:
        """DeepSpeed's ``zero_force_ds_cpu_optimizer`` (on unless the config turns it off)."""
        return bool(self.extra.get("zero_force_ds_cpu_optimizer", True))

    def expert_parallel_dict(self) -> dict[str, Any]:
        """The ``expert_parallel`` section as DeepSpeed reads it ({} without one), for code that
        consumes AutoEP's own key names (checkpoint names, resume)."""
        return self.expert_parallel.to_dict() if self.expert_parallel is not None else {}

    def replace(self, **changes: Any) -> DeepSpeedConfig:
        """A copy with top-level fields changed (``expert_parallel=None`` drops the section)."""
        return dataclasses.replace(self, **changes)


__all__ = ["BatchSection", "DeepSpeedConfig", "ExpertParallelSection", "FlagSection", "OffloadSection",
           "PrecisionSection", "Section", "ZeroSection"]
