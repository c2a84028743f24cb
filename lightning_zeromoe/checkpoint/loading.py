"""Reading shard files without running code from them.

``torch.load(weights_only=True)`` rebuilds tensors and plain containers only. DeepSpeed 0.19 and
Lightning put a few other globals into a shard; those on the allow-list below are mapped to inert
stand-ins, so nothing from the file is imported or executed and export needs neither DeepSpeed
nor Lightning. Anything else (a class in a LightningModule's hyper-parameters, say) stops the
export with an error that names it: only ``trust_checkpoint=True`` (``--trust-checkpoint``)
allows the full unpickle, which can run arbitrary code from the file.

Files are memory-mapped: loading one reads its pickle, not its tensor data.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

from lightning_zeromoe.checkpoint.errors import SHARD_CORRUPT, UNTRUSTED_OBJECT, ExportError
from lightning_zeromoe.knowledge import say


class _Inert:
    """Stand-in for an allow-listed object in a shard: keeps its state, runs nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _InertDict(dict):
    """Stand-in for dict subclasses (Lightning's ``AttributeDict``)."""


def _enum_value(value: Any = None) -> Any:
    return value


#: The non-tensor globals DeepSpeed 0.19.8 and Lightning 2.6 write into shards, as inert stand-ins.
SAFE_GLOBALS: list[tuple[Any, str]] = [
    (_enum_value, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_Inert, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_Inert, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_InertDict, "lightning.fabric.utilities.data.AttributeDict"),
    (_InertDict, "lightning_fabric.utilities.data.AttributeDict"),
    (_Inert, "argparse.Namespace"),
    (_Inert, "pathlib.PosixPath"),
    (_Inert, "pathlib.WindowsPath"),
]


def load_shard(path: Path, *, trust_checkpoint: bool = False) -> dict[str, Any]:
    """One shard file, memory-mapped, safely (see the module docstring)."""
    import torch

    try:
        try:
            with torch.serialization.safe_globals(SAFE_GLOBALS):
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as err:
            found = unsafe_global(err)
            if found is None:
                raise
            if not trust_checkpoint:
                raise ExportError(say(UNTRUSTED_OBJECT, "unknown-object", "trust-checkpoint", "plain-hparams",
                                      path=path, found=found)) from None
            return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except ExportError:
        raise
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, ValueError, AttributeError, ImportError) as err:
        reason = (str(err).splitlines() or [type(err).__name__])[0].split(". ")[0][:200]
        raise ExportError(say(SHARD_CORRUPT, "unreadable", "copy-again", path=path, reason=reason)) from None


def unsafe_global(err: Exception) -> str | None:
    """The ``module.Name`` a ``weights_only`` load refused, or None for other unpickling errors."""
    found = re.search(r"GLOBAL ([\w.]+)", str(err)) or re.search(r"Unsupported global: ([\w.]+)", str(err))
    return found.group(1) if found else None
