"""DeepSpeed ZeRO-3 + expert parallelism (AutoEP) for PyTorch Lightning.

``from lightning_zeromoe import ZeroMoEStrategy`` loads Lightning and DeepSpeed; importing the
package itself, or its light modules (``compat``, ``config``, ``validation``, ``planner``), does not.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> module that defines it; resolved on first access so light submodules stay light.
_LAZY = {
    "ZeroMoEStrategy": "lightning_zeromoe.strategy",
    "MoEPattern": "lightning_zeromoe.discovery",
    "TinyMoEConfig": "lightning_zeromoe.models",
    "TinyMoELM": "lightning_zeromoe.models",
    "TinyMoEModule": "lightning_zeromoe.models",
    "plan": "lightning_zeromoe.planner",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_zeromoe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
