"""What the loading code's import hooks share: finding a module the way the import would without them.

Two hooks wrap the execution of a module found by the other finders: ``hf_zero3.ImportOutsideZeroInit``
(transformers' model modules, imported with ``zero.Init``'s class patching lifted) and
``peft_zero3._WhenImported`` (peft's LoRA layer module, patched once executed).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Sequence


def spec_without(hook: importlib.abc.MetaPathFinder, name: str, path: Sequence[str] | None,
                 target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
    """The spec the finders on ``sys.meta_path`` other than ``hook`` give for ``name`` (None: not found)."""
    for finder in sys.meta_path:
        if finder is hook or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(name, path, target)
        if spec is not None:
            return spec
    return None


__all__ = ["spec_without"]
