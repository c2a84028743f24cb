"""Stale parameter copies: no gradient in the first K optimizer steps, attributes aliasing gathered weights.

What DeepSpeed 0.19.8 does with them is described in :mod:`lightning_zeromoe.engine.pitfalls`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from lightning_zeromoe.engine import collectives
from lightning_zeromoe._private import torch as torch_private
from lightning_zeromoe.engine.pitfalls.sharing import parameter_paths
from lightning_zeromoe.knowledge import say

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
                say("zero3-no-gradient", "stale", "freeze-on-purpose", parameter=s.name, steps=self.steps, ranks=ranks))
        for a in self.aliases:
            out.append(
                say("zero3-aliased-weight", "aliased", "use-the-parameter", attribute=a.attribute, numel=a.numel,
                    parameter=a.parameter))
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
            params = {id(p) for p in torch_private.own_parameters(module).values() if p is not None}
            buffers = {id(b) for b in torch_private.own_buffers(module).values() if b is not None}
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
            collectives.all_reduce(flags)  # one collective, once, on the backend's device
            flags = flags.cpu()
        stale = [StaleParameter(name, int(n), world) for (name, _), n in zip(self._params, flags.tolist()) if n < world]
        self.report = AuditReport(self.steps, stale, sorted(self._aliases.values(), key=lambda a: a.attribute))
        return self.report
