"""The user's own context for a walkthrough: their DeepSpeed config and the error they got.

Why: a walkthrough that lints and patches a built-in example config tells the user nothing about
their run. When the failing cell used a ``ZeroMoEStrategy`` (or a Trainer holding one) or a config
dict, or the notebook linted one with ``%ds_lint``, the walkthrough works on THAT config, and says
where it came from; otherwise it says plainly that it shows an example. The error text is kept so
a step can read the numbers in it (a CUDA OOM message's allocated and reserved sizes) instead of
measuring the tiny CPU model and pretending that is the user's GPU.

Finding the config reads objects by duck typing (a ``config`` dict on a strategy, a ``strategy``
on a trainer): importing Lightning here would make the extension slow to load.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from troubleshooter.oom_numbers import OomNumbers, parse_oom

__all__ = ["UserContext", "config_in", "looks_like_ds_config"]

#: Top-level keys of a DeepSpeed config; a dict with one of them is taken for one.
DS_KEYS = frozenset({"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                     "zero_optimization", "bf16", "fp16", "optimizer", "scheduler", "expert_parallel",
                     "moe", "gradient_clipping"})
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class UserContext:
    """What a walkthrough knows about the user's run. ``config`` None: none was found."""

    config: Mapping[str, Any] | None = None
    config_label: str = ""  # where the config came from, e.g. "trainer.strategy.config"
    error_text: str = ""
    world_size: int | None = None
    entry_id: str = ""  # the knowledge-base entry the diagnosis matched
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def has_config(self) -> bool:
        return self.config is not None

    @property
    def oom(self) -> OomNumbers | None:
        """The sizes in a CUDA OOM message of the error, when it has them."""
        return parse_oom(self.error_text) if self.error_text else None

    def config_or(self, example: Mapping[str, Any]) -> tuple[dict[str, Any], str, bool]:
        """(config, its label, whether it is the example) for a step to lint and patch."""
        if self.config is not None:
            return dict(self.config), self.config_label, False
        return dict(example), "example ds_config.json", True


def looks_like_ds_config(value: Any) -> bool:
    return isinstance(value, Mapping) and bool(DS_KEYS & set(map(str, value)))


def _strategy_config(strategy: Any, name: str) -> tuple[Mapping, str] | None:
    """A DeepSpeed strategy's config: ``config`` once setup merged it; before that (empty until
    ``setup``) ZeroMoEStrategy's ``user_config``, the part the user wrote."""
    for attr in ("config", "user_config"):
        value = getattr(strategy, attr, None)
        if looks_like_ds_config(value):
            return value, f"{name}.{attr}"
    return None


def _config_of(name: str, value: Any) -> tuple[Mapping, str] | None:
    """(config, label) when ``value`` is a DeepSpeed config, a strategy holding one, or a trainer."""
    if looks_like_ds_config(value):
        return value, name
    if isinstance(value, type):
        return None
    try:
        if type(value).__name__.endswith("Strategy"):
            return _strategy_config(value, name)
        if type(value).__name__ == "Trainer":
            return _strategy_config(getattr(value, "strategy", None), f"{name}.strategy")
    except Exception:  # noqa: BLE001 - a property of a user object may raise; it is just not a config
        return None
    return None


def config_in(namespace: Mapping[str, Any], cell: str = "", linted: tuple[str, Mapping] | None = None
              ) -> tuple[Mapping, str] | None:
    """The user's DeepSpeed config: one the failing ``cell`` names (in the order it names them),
    else the last ``%ds_lint`` target (``linted``: label, config), else the last DeepSpeed-looking
    dict, strategy or trainer in ``namespace``; None when there is none."""
    seen: set[str] = set()
    for name in _NAME_RE.findall(cell):
        if name in seen or name not in namespace or name.startswith("_"):
            continue
        seen.add(name)
        found = _config_of(name, namespace[name])
        if found:
            return found
    if linted is not None:
        return linted[1], linted[0]
    for name in reversed([n for n in namespace if not n.startswith("_")]):
        found = _config_of(name, namespace[name])
        if found:
            return found
    return None
