"""DeepSpeed ZeRO-3 + expert parallelism (AutoEP) for PyTorch Lightning.

``from lightning_zeromoe import ZeroMoEStrategy`` loads Lightning and DeepSpeed; importing the
package itself, or its light modules (``compat``, ``config.*``, ``planner``), does not.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what static tools (IDEs, pyright, mypy) see; at runtime __getattr__ imports on first use
    from lightning_zeromoe.balance.balancer import ExpertBiasBalancer
    from lightning_zeromoe.balance.rules import router_z_loss
    from lightning_zeromoe.discovery.find import MoEPattern
    from lightning_zeromoe.observe.comm_ledger import CommLedger
    from lightning_zeromoe.observe.monitor import ExpertUtilizationMonitor
    from lightning_zeromoe.planner import plan
    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoELM, TinyMoEModule
    from lightning_zeromoe.strategy import ZeroMoEStrategy

__version__ = "0.1.0"

# name -> module that defines it; resolved on first access so light submodules stay light.
_LAZY = {
    "ZeroMoEStrategy": "lightning_zeromoe.strategy",
    "MoEPattern": "lightning_zeromoe.discovery.find",
    "TinyMoEConfig": "lightning_zeromoe.reference.models",
    "TinyMoELM": "lightning_zeromoe.reference.models",
    "TinyMoEModule": "lightning_zeromoe.reference.models",
    "plan": "lightning_zeromoe.planner",
    "ExpertUtilizationMonitor": "lightning_zeromoe.observe.monitor",
    "ExpertBiasBalancer": "lightning_zeromoe.balance.balancer",
    "CommLedger": "lightning_zeromoe.observe.comm_ledger",
    "router_z_loss": "lightning_zeromoe.balance.rules",
}

__all__ = ["CommLedger", "ExpertBiasBalancer", "ExpertUtilizationMonitor", "MoEPattern", "TinyMoEConfig", "TinyMoELM",
           "TinyMoEModule", "ZeroMoEStrategy", "plan", "router_z_loss"]  # a literal, for static tools; == sorted(_LAZY)


def __dir__() -> list[str]:
    """The module's own names and the lazy exports, which exist before their first use."""
    return sorted(set(globals()) | set(__all__))


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_zeromoe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


# ``Trainer(strategy="zero_moe")`` needs the name in Lightning's StrategyRegistry. Registering means
# importing Lightning (~5 s), which the troubleshooter's start path must not pay; so register now if
# Lightning's strategies are already loaded, else the moment they finish loading.
_STRATEGIES = "lightning.pytorch.strategies"


def _register(registry: Any) -> None:
    strategy = sys.modules.get("lightning_zeromoe.strategy")
    if strategy is not None and not hasattr(strategy, "ZeroMoEStrategy"):
        return  # lightning_zeromoe.strategy is importing Lightning right now; it registers itself at its end
    from lightning_zeromoe.strategy import ZeroMoEStrategy

    if ZeroMoEStrategy.strategy_name not in registry:
        ZeroMoEStrategy.register_strategies(registry)


class _RegisterOnLightningImport(importlib.abc.MetaPathFinder):
    """Runs :func:`_register` right after ``lightning.pytorch.strategies`` executes."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _STRATEGIES:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            _register(module.StrategyRegistry)

        spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


if _STRATEGIES in sys.modules:
    _register(sys.modules[_STRATEGIES].StrategyRegistry)
elif not any(isinstance(f, _RegisterOnLightningImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterOnLightningImport())
