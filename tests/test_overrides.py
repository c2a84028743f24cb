"""Every method of ours that overrides a Lightning method says so with ``@override``.

The walk imports every module of ``lightning_zeromoe`` and looks at each class that subclasses a
class defined in ``lightning`` (a Strategy, a Callback, a LightningModule, a LightningDataModule...).
A method defined in that class whose name a Lightning base also defines must carry ``@override``
(``typing_extensions.override`` sets ``__override__``), so a hook renamed upstream is noticed.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import lightning_zeromoe


def _lightning_subclasses() -> list[type]:
    found = {}
    for info in pkgutil.walk_packages(lightning_zeromoe.__path__, "lightning_zeromoe."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__:
                continue
            if any(base.__module__.startswith("lightning.") for base in cls.__mro__[1:]):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    for name in lightning_zeromoe.__all__:  # public classes built on first access (TinyMoEModule)
        cls = getattr(lightning_zeromoe, name)
        if inspect.isclass(cls) and any(base.__module__.startswith("lightning.") for base in cls.__mro__[1:]):
            found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return list(found.values())


def _lightning_names(cls: type) -> set[str]:
    return {name for base in cls.__mro__[1:] if base.__module__.startswith("lightning.") for name in vars(base)}


def test_every_override_of_a_lightning_method_is_marked():
    classes = _lightning_subclasses()
    names = {c.__name__ for c in classes}
    # The walk must see the classes we know subclass Lightning, or it checks nothing.
    assert {"ZeroMoEStrategy", "ExpertUtilizationMonitor", "ExpertBiasBalancer", "TinyMoEModule"} <= names, names
    missing = []
    for cls in classes:
        inherited = _lightning_names(cls)
        for name, value in vars(cls).items():
            if name.startswith("__") or name not in inherited:
                continue
            func = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            if callable(func) and not getattr(func, "__override__", False):
                missing.append(f"{cls.__module__}.{cls.__qualname__}.{name}")
    assert not missing, "add @override (from typing_extensions) to: " + ", ".join(missing)
