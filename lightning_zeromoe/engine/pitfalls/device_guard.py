"""Device and dtype moves on a ZeRO-3 model (:class:`DeviceMoveGuard`); buffers left behind by ``zero.Init``.

What DeepSpeed 0.19.8 does with them is described in :mod:`lightning_zeromoe.engine.pitfalls`.
"""

from __future__ import annotations

import inspect
import os
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from lightning_zeromoe._private import torch as torch_private
from lightning_zeromoe.knowledge import say


def move_buffers_to_device(root: nn.Module, device: torch.device | str) -> list[str]:
    """Move every buffer (never a parameter) that is not on ``device`` there; return their names.

    Under ``zero.Init`` DeepSpeed skips ``module.to(device)`` (it places parameters itself), so a
    buffer created on the CPU stays there and forward fails with "Expected all tensors to be on
    the same device". Buffers are not partitioned, so moving them is safe. A buffer shared by
    several modules is moved once and stays shared; persistence flags are untouched.
    """
    device = torch.device(device)
    moved_by_id: dict[int, torch.Tensor] = {}
    names = []
    for mod_name, module in root.named_modules(remove_duplicate=False):
        buffers = torch_private.own_buffers(module)
        for key, buf in list(buffers.items()):
            if buf is None or _same_device(buf.device, device):
                continue
            new = moved_by_id.get(id(buf))
            if new is None:
                new = moved_by_id[id(buf)] = buf.to(device)
                names.append(f"{mod_name}.{key}" if mod_name else key)
            buffers[key] = new
    return names


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Same type, and same index where both name one (``cuda`` means the current cuda device)."""
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        if a.type == "cuda" and torch.cuda.is_available():
            cur = torch.cuda.current_device()
            return (a.index if a.index is not None else cur) == (b.index if b.index is not None else cur)
        return True
    return a.index == b.index


class ZeroDeviceMoveError(RuntimeError):
    """A module tried to move or cast its ZeRO-3 parameters during training. The message starts
    with ``[zero3-module-move] ``, its troubleshooter knowledge-base entry."""

    entry_id = "zero3-module-move"


MOVE_METHODS = ("to", "cuda", "cpu", "half", "float", "bfloat16", "double", "type")
_ORIGINALS: dict[str, Callable[..., Any]] = {}
#: module -> (guard, path). Weak, so a guard never keeps a model alive.
_GUARDED: "weakref.WeakKeyDictionary[nn.Module, tuple[DeviceMoveGuard, str]]" = weakref.WeakKeyDictionary()
_SKIP_FRAMES = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, os.path.abspath(__file__))
#: Library overrides of ``.to``/``.half``/... that end in ``nn.Module``'s: not the user's call site.
_SKIP_SUFFIXES = (os.path.join("utilities", "device_dtype_mixin.py"), os.path.join("transformers", "modeling_utils.py"))


def _requested(method: str, args: tuple, kwargs: dict) -> tuple[torch.device | None, torch.dtype | None, bool]:
    """What a move call asks for: (device or None, dtype or None, whether anything else changes)."""
    if method == "to":
        device, dtype, _non_blocking, memory_format = torch_private.parse_to(*args, **kwargs)
        return device, dtype, memory_format is not None
    if method == "cuda":
        index = args[0] if args else kwargs.get("device")
        return torch.device("cuda", index) if isinstance(index, int) else torch.device(index or "cuda"), None, False
    if method == "cpu":
        return torch.device("cpu"), None, False
    if method == "type":
        dst = args[0] if args else kwargs["dst_type"]
        if isinstance(dst, torch.dtype):
            return None, dst, False
        try:
            probe = torch.empty(0).type(dst)
        except Exception:  # an unknown or unavailable tensor type: certainly a change
            return None, None, True
        return probe.device, probe.dtype, False
    return None, {"half": torch.float16, "float": torch.float32, "bfloat16": torch.bfloat16,
                  "double": torch.float64}[method], False


def _call_site() -> str:
    """``file:line`` of the first frame outside torch, this module and the library overrides."""
    for frame in inspect.stack(context=0)[2:]:
        name = os.path.abspath(frame.filename)
        if name.startswith(_SKIP_FRAMES) or name.endswith(_SKIP_SUFFIXES):
            continue
        return f"{frame.filename}:{frame.lineno}"
    return "<unknown>"


def _patched(method: str) -> Callable[..., Any]:
    original = _ORIGINALS[method]

    def guarded(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        entry = _GUARDED.get(self)
        if entry is None:
            return original(self, *args, **kwargs)
        guard, path = entry
        return guard.check(self, path, method, original, args, kwargs)

    guarded.__name__ = guarded.__qualname__ = method
    guarded.__doc__ = original.__doc__
    guarded.__wrapped__ = original  # type: ignore[attr-defined]
    return guarded


def _patch_module_methods() -> None:
    """Route ``nn.Module.to``/``cuda``/... through :class:`DeviceMoveGuard` (once per process).

    Patched on ``nn.Module`` rather than per instance, so guarded modules keep their class
    (``type(m) is nn.Linear`` still holds) and stay picklable and deep-copyable. Modules that are
    not guarded pay one dictionary lookup. Subclass overrides that call ``super()`` (Lightning's
    and Hugging Face's) are covered; an override that never reaches ``nn.Module`` is not.
    """
    if _ORIGINALS:
        return
    for method in MOVE_METHODS:
        _ORIGINALS[method] = getattr(nn.Module, method)
        setattr(nn.Module, method, _patched(method))


def _unpatch_module_methods() -> None:
    if _GUARDED or not _ORIGINALS:
        return
    for method, original in _ORIGINALS.items():
        setattr(nn.Module, method, original)
    _ORIGINALS.clear()


@dataclass
class DeviceMoveGuard:
    """Intercept ``.to()``/``.cuda()``/``.cpu()``/``.half()``/``.float()``/``.bfloat16()``/``.double()``/
    ``.type()`` on a ZeRO-3 model and its submodules once the engine exists.

    * Same device, no dtype change: nothing to do. Inside forward it becomes a no-op with one warning
      per module, call and call site, on each rank where it happens (the call is redundant work every
      step); outside forward it runs as before.
    * Another device, or another dtype, on a module that holds ZeRO-3 parameters: raises
      :class:`ZeroDeviceMoveError`, inside forward or outside it (a callback calling ``model.half()``
      breaks training just the same). Modules without ZeRO parameters move freely.

    ``remove()`` restores everything; the strategy calls it at teardown, before Lightning moves
    the module to the CPU.
    """

    root: nn.Module
    device: torch.device
    warned: set[tuple[str, str, str]] = field(default_factory=set)
    _depth: int = 0
    _hooks: list[Any] = field(default_factory=list)

    def install(self) -> "DeviceMoveGuard":
        _patch_module_methods()
        for path, module in self.root.named_modules():
            _GUARDED[module] = (self, path or "<root>")
        self._hooks = [
            self.root.register_forward_pre_hook(self._enter),
            self.root.register_forward_hook(self._leave, always_call=True),
        ]
        return self

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for module in list(_GUARDED.keys()):
            if _GUARDED.get(module, (None,))[0] is self:
                del _GUARDED[module]
        _unpatch_module_methods()

    @property
    def in_forward(self) -> bool:
        return self._depth > 0

    def _enter(self, *_: Any) -> None:
        self._depth += 1

    def _leave(self, *_: Any) -> None:
        self._depth = max(0, self._depth - 1)

    def check(self, module: nn.Module, path: str, method: str, original: Callable[..., Any],
              args: tuple, kwargs: dict) -> Any:
        device, dtype, other = _requested(method, args, kwargs)
        floats = {p.dtype for p in module.parameters() if p.is_floating_point()}
        moves = device is not None and not _same_device(device, self.device)
        casts = dtype is not None and dtype.is_floating_point and bool(floats) and floats != {dtype}
        zero_params = any(hasattr(p, "ds_id") for p in module.parameters())
        call = f".{method}({', '.join([*map(repr, args), *(f'{k}={v!r}' for k, v in kwargs.items())])})"
        if (moves or casts or other) and zero_params:
            raise ZeroDeviceMoveError(self._explain(path, module, call, device if moves else None,
                                                    dtype if casts else None))
        if moves or casts or other or not self.in_forward:
            return original(module, *args, **kwargs)
        site = _call_site()
        if (path, call, site) not in self.warned:
            self.warned.add((path, call, site))
            warnings.warn(say("zero3-noop-move", "in-forward", "remove-call", call=call, path=path,
                              module_type=type(module).__name__, site=site, device=self.device,
                              dtype=' in ' + str(next(iter(floats))) if len(floats) == 1 else ''), stacklevel=3)
        return module

    def _explain(self, path: str, module: nn.Module, call: str, device: torch.device | None,
                 dtype: torch.dtype | None) -> str:
        want = " and ".join(x for x in (f"move it to {device}" if device else "",
                                       f"cast it to {dtype}" if dtype else "") if x) or "change its tensors"
        where = "during forward" if self.in_forward else "after the DeepSpeed engine was set up"
        return say("zero3-module-move", "moved", "cast-activations", "trainer-precision", call=call, path=path,
                   module_type=type(module).__name__, site=_call_site(), where=where, want=want, device=self.device)
