"""ZeRO-3 pitfalls the strategy detects, handles or stops: shared weights, moves in forward, stale copies.

Every function here was written against DeepSpeed 0.19.8's stage-3 code and checked on 2 CPU ranks
(``tests/test_pitfalls.py``). What DeepSpeed does, and where it does it:

* **Shared weights.** ``DeepSpeedZeRoOffload`` (``runtime/zero/parameter_offload.py``) swaps every
  module's ``_parameters`` for a ``ZeROOrderedDict``. While ``DeepSpeedEngine.forward`` runs
  (``_forward_prologue`` sets ``_parameters._in_forward``), reading a parameter that is still
  partitioned through that dict calls ``register_external_parameter(FWD_MODULE_STACK[-1], param)``
  and a *synchronous* ``param.all_gather()``: the parameter is attached to whichever module is
  running. The registration lives in ``module._external_params`` (``ds_external_parameters()``),
  and ``PartitionedParameterCoordinator.fetch_sub_module`` fetches ``named_parameters(recurse=False)``
  plus those external parameters from then on, so after the first step it is prefetched like any
  other. A module that *returns* a parameter gets it registered with ``is_external_param = True``,
  and the coordinator never releases such a parameter. A parameter held by two modules (a tied
  embedding / lm_head) is simply in both modules' ``named_parameters``: no external path at all.
  Measured on the tiny model (``tests/jobs/pitfall_raw.py``, one functionally used parameter):
  explicit registration saves exactly one synchronous gather and one collective, on the first
  step only; from step 2 the counts are identical. For a tied lm_head it changes nothing.
* **Moves in forward.** A ZeRO-3 parameter is a placeholder whose ``.data`` is swapped between an
  empty tensor and a gathered copy; the real storage is ``param.ds_tensor``, a slice of the flat
  partition the optimizer updates. ``Module.to``/``half``/... rebind ``param.data`` only, which
  detaches the module from its partition (:class:`DeviceMoveGuard`). Under ``zero.Init`` the engine
  also skips ``module.to(device)`` (``DeepSpeedEngine._configure_distributed_model``), so buffers
  stay where they were created (:func:`move_buffers_to_device`).
* **Stale copies.** Stage 3 learns that a gradient is ready from a post-accumulate-grad hook on each
  parameter (``DeepSpeedZeroOptimizer_Stage3.create_reduce_and_remove_grad_hooks`` via
  ``deepspeed.utils.torch.register_grad_hook``) and moves it into its grad partition
  (``__param_id_to_grad_partition``), leaving ``param.grad`` empty. :class:`GradAudit` watches the
  same event for the first K optimizer steps, then removes its hooks.
"""

from __future__ import annotations

import inspect
import os
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn


# ---------------------------------------------------------------------------------------------
# 1. Tied and shared weights
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TiedParameter:
    """One parameter reachable under several names (``paths[0]`` is the name ``state_dict`` keeps)."""

    paths: tuple[str, ...]
    numel: int


@dataclass(frozen=True)
class ExternalUse:
    """A parameter that a module's forward uses although another module owns it.

    ``registered_by`` is ``"deepspeed"`` when DeepSpeed found it at run time (its ``ZeROOrderedDict``
    getter or its dangling-output path) and ``"strategy"`` when :func:`register_shared_parameters`
    declared it. ``pinned`` mirrors ``param.is_external_param``: DeepSpeed never releases such a
    parameter, so it stays gathered (full size) for the rest of training.
    """

    module: str
    parameter: str
    registered_by: str
    pinned: bool = False


def _numel(param: torch.Tensor) -> int:
    return int(getattr(param, "ds_numel", param.numel()))


def parameter_paths(root: nn.Module) -> dict[int, list[str]]:
    """Every name under which each parameter is reachable, keyed by ``id(param)``."""
    paths: dict[int, list[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        paths.setdefault(id(param), []).append(name)
    return paths


def find_tied_parameters(root: nn.Module) -> list[TiedParameter]:
    """Parameters registered under more than one module path (e.g. embedding <-> lm_head).

    ``named_parameters()`` de-duplicates, so a tie is invisible to most code; it matters to
    checkpoint conversion (one tensor, two names) and to anything that edits parameters by name.
    """
    found = []
    by_id = {id(p): p for _, p in root.named_parameters(remove_duplicate=False)}
    for pid, names in parameter_paths(root).items():
        if len(names) > 1:
            found.append(TiedParameter(tuple(names), _numel(by_id[pid])))
    return found


def find_external_uses(root: nn.Module, registered_by_strategy: Iterable[tuple[str, str]] = ()) -> list[ExternalUse]:
    """Parameters registered on a module (in DeepSpeed's registry) that the module does not hold itself.

    Reads DeepSpeed's own registry, ``module._external_params`` (filled by
    ``register_external_parameter``), so it reports exactly what ZeRO-3 will fetch with each module.
    The registry is filled at run time, during the first forward: call this after one step.
    Returns nothing for a model that is not wrapped by ZeRO-3.
    """
    declared = set(registered_by_strategy)
    paths = parameter_paths(root)
    uses = []
    for mod_name, module in root.named_modules():
        registry = getattr(module, "_external_params", None)
        if not registry:
            continue
        own = {id(p) for p in module._parameters.values() if p is not None}
        for param in registry.values():
            if id(param) in own:
                continue  # the module holds it itself (registered as well): not an outside use
            owner = paths.get(id(param), ["<not a parameter of this model>"])[0]
            who = "strategy" if (mod_name, owner) in declared else "deepspeed"
            uses.append(ExternalUse(mod_name or "<root>", owner, who, bool(getattr(param, "is_external_param", False))))
    return uses


def register_shared_parameters(root: nn.Module, shared: Mapping[str, Sequence[str]]) -> list[tuple[str, str]]:
    """Register ``{module_path: [parameter_path, ...]}`` with ``deepspeed.zero.register_external_parameter``.

    Use it for a parameter that a module reads from another module inside its forward (a functional
    ``F.linear(h, self.embed.weight)`` head). Without it DeepSpeed discovers the use during the
    first forward and gathers the parameter synchronously there; with it, the using module fetches
    the parameter from the first step on. Measured with DeepSpeed 0.19.8 on 2 CPU ranks: one
    synchronous gather and one collective fewer on step 1, identical counts afterwards. A
    parameter the module already holds (a tied lm_head) needs nothing: registering it is a no-op.
    Returns the ``(module, parameter)`` pairs registered. Raises ``KeyError`` with the valid names
    when a path does not exist.
    """
    import deepspeed

    modules = dict(root.named_modules())
    params = dict(root.named_parameters(remove_duplicate=False))
    done = []
    for mod_name, names in shared.items():
        if mod_name not in modules:
            raise KeyError(f"shared_parameters: no module named {mod_name!r}; modules include "
                           f"{sorted(modules)[:12]}")
        for pname in names:
            if pname not in params:
                raise KeyError(f"shared_parameters[{mod_name!r}]: no parameter named {pname!r}")
            deepspeed.zero.register_external_parameter(modules[mod_name], params[pname])
            done.append((mod_name, pname))
    return done


def broken_ties(root: nn.Module, tied: Iterable[TiedParameter]) -> list[str]:
    """Tied groups whose names no longer resolve to one and the same parameter object.

    A tie is broken when something replaced one side (``load_state_dict(assign=True)``, a module
    swap, a ``.to()`` that rebinds): the two names would then train separately.
    """
    params = dict(root.named_parameters(remove_duplicate=False))
    broken = []
    for group in tied:
        objs = {id(params[p]) for p in group.paths if p in params}
        missing = [p for p in group.paths if p not in params]
        if missing or len(objs) != 1:
            broken.append(" = ".join(group.paths) + (f" (missing: {missing})" if missing else " (now separate tensors)"))
    return broken


def describe_sharing(tied: Sequence[TiedParameter], external: Sequence[ExternalUse] = ()) -> list[str]:
    """Log lines for the shared weights found, saying what DeepSpeed does with each kind."""
    lines = []
    for group in tied:
        lines.append(f"tied parameter: {' = '.join(group.paths)} ({group.numel} elements). Each module that holds it "
                     "fetches it itself under ZeRO-3; no registration needed (measured: same gathers with and without).")
    for use in external:
        how = ("declared with shared_parameters: fetched with the module from step 1" if use.registered_by == "strategy"
               else "found by DeepSpeed during the first forward and gathered synchronously there once; fetched with "
                    "the module since. Declare it with shared_parameters={...} to skip that first-step gather")
        pinned = " It is returned from a module, so DeepSpeed never releases it (kept full size)." if use.pinned else ""
        lines.append(f"shared parameter: {use.parameter} is used in the forward of {use.module} ({how}).{pinned}")
    return lines


# ---------------------------------------------------------------------------------------------
# 2. Device and dtype moves inside forward; buffers left behind by zero.Init
# ---------------------------------------------------------------------------------------------


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
        for key, buf in list(module._buffers.items()):
            if buf is None or _same_device(buf.device, device):
                continue
            new = moved_by_id.get(id(buf))
            if new is None:
                new = moved_by_id[id(buf)] = buf.to(device)
                names.append(f"{mod_name}.{key}" if mod_name else key)
            module._buffers[key] = new
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
        device, dtype, _non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
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
            warnings.warn(f"[zero3-noop-move] ZeroMoEStrategy: {call} on module '{path}' ({type(module).__name__}) at {site} runs inside "
                          f"forward, but the module is already on {self.device}"
                          f"{' in ' + str(next(iter(floats))) if len(floats) == 1 else ''}: ignored (a no-op). "
                          "Remove the call; it would otherwise walk every parameter each step.", stacklevel=3)
        return module

    def _explain(self, path: str, module: nn.Module, call: str, device: torch.device | None,
                 dtype: torch.dtype | None) -> str:
        want = " and ".join(x for x in (f"move it to {device}" if device else "",
                                       f"cast it to {dtype}" if dtype else "") if x) or "change its tensors"
        where = "during forward" if self.in_forward else "after the DeepSpeed engine was set up"
        return (f"[zero3-module-move] {call} on module '{path}' ({type(module).__name__}) at {_call_site()} {where} would {want}. "
                "ZeRO-3 cannot allow this: each parameter's storage is a partition of a flat buffer owned by the "
                "DeepSpeed optimizer (param.ds_tensor); the tensor the module sees in forward is a temporary gathered "
                "copy. Moving or casting the module rebinds param.data (or, between devices torch cannot swap in place, "
                "replaces the Parameter object), detaching the module from its partition: the optimizer would keep "
                "updating the partition while the module used a stale copy, or the next gather would fail. Cast activations instead (x.to(dtype)), choose the precision on the Trainer "
                f"(precision='bf16-true'), and leave device placement to the strategy (parameters are on {self.device}).")


# ---------------------------------------------------------------------------------------------
# 3. Stale parameter copies: no gradient in the first K steps, attributes aliasing gathered weights
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StaleParameter:
    name: str
    ranks_with_grad: int
    world_size: int


@dataclass(frozen=True)
class AliasedAttribute:
    """A module attribute that is a full-size view of a ZeRO-3 parameter's gathered storage."""

    attribute: str
    parameter: str
    numel: int


@dataclass
class AuditReport:
    steps: int
    stale: list[StaleParameter] = field(default_factory=list)
    aliases: list[AliasedAttribute] = field(default_factory=list)

    def messages(self) -> list[str]:
        out = []
        for s in self.stale:
            ranks = "" if s.world_size == 1 else f" (on {s.world_size - s.ranks_with_grad} of {s.world_size} ranks)"
            out.append(
                f"[zero3-no-gradient] parameter {s.name} requires grad but received no gradient in the first {self.steps} optimizer "
                f"steps{ranks}, so it is not training. Likely causes: forward uses a cached `.data` or a detached "
                "copy of it instead of the parameter (under ZeRO-3 such a copy also pins the full, unpartitioned "
                "weight), or it sits in a branch that did not run (an unused head, an expert that got no tokens, "
                "code under torch.no_grad()). Set requires_grad=False if it is meant to be frozen.")
        for a in self.aliases:
            out.append(
                f"[zero3-aliased-weight] module attribute {a.attribute} holds a full-size tensor ({a.numel} elements) aliasing the gathered "
                f"storage of ZeRO-3 parameter {a.parameter}. DeepSpeed frees the gathered copy after each use; this "
                "reference keeps the whole unpartitioned weight alive, it never sees optimizer updates, and "
                "gradients through it never reach the parameter. Use the parameter itself in forward.")
        return out


def _tensors_in(value: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors held directly, or one level down in a list/tuple/dict attribute."""
    if isinstance(value, torch.Tensor):
        yield "", value
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            if isinstance(v, torch.Tensor):
                yield f"[{i}]", v
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, torch.Tensor):
                yield f"[{k!r}]", v


class GradAudit:
    """For the first ``steps`` optimizer steps, record which parameters receive a gradient, and which
    module attributes alias a ZeRO-3 parameter's gathered storage. Then remove every hook.

    * Gradients: a post-accumulate-grad hook per trainable parameter, the event DeepSpeed's stage-3
      optimizer itself uses to take a gradient into its partition (so ``param.grad`` being empty
      afterwards is normal and not looked at). Counts are summed over ranks once, at the end.
    * Aliases: a forward hook per module, run *before* DeepSpeed's release hook (``prepend=True``)
      while the module's parameters are gathered; attributes that start at the gathered tensor's
      address with its full size are aliases. Only ZeRO-3 parameters (``ds_id``) are checked.

    Call :meth:`step` after each optimizer step; it returns the report once, at step ``steps``.
    """

    def __init__(self, root: nn.Module, steps: int = 3, *, device: torch.device | str | None = None) -> None:
        if steps < 1:
            raise ValueError(f"grad audit steps={steps} must be >= 1 (0 disables the audit in the strategy)")
        self.root = root
        self.steps = steps
        self.device = torch.device(device) if device is not None else None
        self.done = 0
        self.report: AuditReport | None = None
        self._params: list[tuple[str, nn.Parameter]] = []
        self._seen: set[int] = set()
        self._aliases: dict[tuple[str, str], AliasedAttribute] = {}
        self._names: dict[int, str] = {}
        self._hooks: list[Any] = []

    @property
    def active(self) -> bool:
        return bool(self._hooks)

    def install(self) -> "GradAudit":
        self._names = {pid: names[0] for pid, names in parameter_paths(self.root).items()}
        seen_ids = set()
        for name, param in self.root.named_parameters():
            if param.requires_grad and id(param) not in seen_ids:
                seen_ids.add(id(param))
                index = len(self._params)
                self._params.append((name, param))
                self._hooks.append(param.register_post_accumulate_grad_hook(lambda _p, i=index: self._seen.add(i)))
        for path, module in self.root.named_modules():
            self._hooks.append(module.register_forward_hook(self._alias_hook(path), prepend=True))
        return self

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _alias_hook(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, _inputs: Any, _output: Any) -> None:
            gathered = {}
            external = module.ds_external_parameters() if hasattr(module, "ds_external_parameters") else ()
            for _, p in [*module.named_parameters(recurse=False), *external]:
                if hasattr(p, "ds_id") and p.data.numel() == p.ds_numel and p.data.numel() > 0:
                    gathered[p.data.data_ptr()] = p
            if not gathered:
                return
            params = {id(p) for p in module._parameters.values() if p is not None}
            buffers = {id(b) for b in module._buffers.values() if b is not None}
            for attr, value in vars(module).items():
                for suffix, t in _tensors_in(value):
                    if id(t) in params or id(t) in buffers or t.numel() == 0:
                        continue
                    p = gathered.get(t.data_ptr())
                    if p is not None and t is not p and t.numel() == p.ds_numel:
                        where = f"{path}.{attr}{suffix}" if path else f"{attr}{suffix}"
                        name = self._names.get(id(p), f"ds_id={p.ds_id}")
                        self._aliases.setdefault((where, name), AliasedAttribute(where, name, int(p.ds_numel)))
        return hook

    def step(self) -> AuditReport | None:
        """Count one optimizer step; at step ``steps`` build the report, remove the hooks, return it."""
        if self.report is not None:
            return None
        self.done += 1
        if self.done < self.steps:
            return None
        self.remove()
        flags = torch.tensor([1 if i in self._seen else 0 for i in range(len(self._params))], dtype=torch.int64)
        world = 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            world = torch.distributed.get_world_size()
            if self.device is not None:
                flags = flags.to(self.device)
            torch.distributed.all_reduce(flags)  # one collective, once
            flags = flags.cpu()
        stale = [StaleParameter(name, int(n), world) for (name, _), n in zip(self._params, flags.tolist()) if n < world]
        self.report = AuditReport(self.steps, stale, sorted(self._aliases.values(), key=lambda a: a.attribute))
        return self.report


__all__ = [
    "AliasedAttribute", "AuditReport", "DeviceMoveGuard", "ExternalUse", "GradAudit", "StaleParameter",
    "TiedParameter", "ZeroDeviceMoveError", "broken_ties", "describe_sharing", "find_external_uses",
    "find_tied_parameters", "move_buffers_to_device", "parameter_paths", "register_shared_parameters",
]
