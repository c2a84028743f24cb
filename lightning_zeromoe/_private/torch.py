"""The only place that touches torch's private names: ``distributed_c10d``, ``nn.Module``'s tables,
``torch._C._nn._parse_to``, chained LR schedulers.

DeepSpeed creates its expert-parallel groups with ``new_group(ranks)`` and no timeout, and torch
has no public way to change a group's timeout afterwards or to list the groups that exist. These
helpers wrap the private pieces that do it (present in torch 2.3 - 2.13):

* ``distributed_c10d._set_pg_timeout(timeout, group)``: change one group's collective timeout;
* ``distributed_c10d._world.pg_map``: every group this process created;
* ``distributed_c10d._rank_not_in_group(group)``: whether this rank is outside a group;
* ``ProcessGroup._get_backend(device).options._timeout``: read a group's timeout back.

Lightning's ``remove_module_hooks`` (run before an evaluation engine is built on a model a
training engine used) empties every hook table of every module, so Hugging Face's output-capture
hooks (``output_router_logits``), AutoEP's retargeted recorders and the user's own hooks go with
DeepSpeed's. :func:`remove_hooks_defined_in` removes only the hooks a package defined, through
``nn.Module``'s private tables (``_forward_hooks`` and the others in :data:`HOOK_TABLES`).

``nn.Module``'s own tables (``_parameters``, ``_buffers``, ``_modules``,
``_non_persistent_buffers_set``, ``_load_from_state_dict``): what a module holds itself, without
its children, and loading one module of a state dict at a time. ``torch._C._nn._parse_to``: the
parser ``nn.Module.to`` itself uses, so a guard reads ``.to(...)`` arguments exactly as torch does.
``_schedulers``: the children of ``ChainedScheduler`` / ``SequentialLR``.
``torch._C._distributed_c10d._dump_fr_trace``: the Flight Recorder's entries (every group's recent
collectives), the one way to read them from Python on gloo (NCCL also dumps them itself on a timeout).

:func:`missing` checks each one exists (``tests/test_private_api.py``), so a torch upgrade that
removes one fails there, by name, instead of silently leaving expert groups on the backend default.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

#: The private names this module needs, for the upgrade test and for error messages.
REQUIRED_C10D = ("_set_pg_timeout", "_world", "_rank_not_in_group", "_get_default_group")
#: ``nn.Module``'s own tables.
MODULE_TABLES = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


#: ``nn.Module``'s hook tables (dicts of handle id -> hook), present in torch 2.0 - 2.13.
HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
               "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")
#: Per-hook flags keyed by the same handle ids.
HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _c10d() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d


#: Every private name this module touches (``tests/test_private_api.py``).
NAMES = (*REQUIRED_C10D, "_get_backend", "_timeout", *HOOK_TABLES, *HOOK_FLAGS, "_is_full_backward_hook",
         *MODULE_TABLES, "_load_from_state_dict", "_metadata", "_C", "_nn", "_parse_to", "_schedulers",
         "_distributed_c10d", "_dump_fr_trace")


def missing() -> list[str]:
    """The private torch names this torch lacks (empty when everything is there)."""
    c10d = _c10d()
    gone = [f"distributed_c10d.{name}" for name in REQUIRED_C10D if not hasattr(c10d, name)]
    if hasattr(c10d, "_world") and not hasattr(c10d._world, "pg_map"):
        gone.append("distributed_c10d._world.pg_map")
    if not hasattr(torch.distributed.ProcessGroup, "_get_backend"):
        gone.append("ProcessGroup._get_backend")
    module = torch.nn.Linear(1, 1)
    gone += [f"nn.Module.{name}" for name in HOOK_TABLES + HOOK_FLAGS + ("_is_full_backward_hook",) + MODULE_TABLES
             + ("_load_from_state_dict",) if not hasattr(module, name)]
    if not hasattr(module.state_dict(), "_metadata"):
        gone.append("state_dict()._metadata")
    if not hasattr(getattr(getattr(torch, "_C", None), "_nn", None), "_parse_to"):
        gone.append("torch._C._nn._parse_to")
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    chained = torch.optim.lr_scheduler.ChainedScheduler([torch.optim.lr_scheduler.ConstantLR(optimizer)])
    if not isinstance(getattr(chained, "_schedulers", None), list):
        gone.append("ChainedScheduler._schedulers")
    return gone + flight_recorder_missing()


def missing_private_api() -> list[str]:
    """The private c10d names a group timeout needs that this torch lacks (empty when all are there)."""
    return [name for name in missing() if name.startswith(("distributed_c10d.", "ProcessGroup."))]


def own_parameters(module: torch.nn.Module) -> dict[str, Any]:
    """The parameters ``module`` holds itself (not its children's), by local name; the live table."""
    return module._parameters


def own_buffers(module: torch.nn.Module) -> dict[str, Any]:
    """The buffers ``module`` holds itself, by local name; the live table (assignable)."""
    return module._buffers


def child_table(module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s direct children, by name; the live table (a child can be replaced in place)."""
    return module._modules


def non_persistent_buffers(module: torch.nn.Module) -> set[str]:
    """Local names of ``module``'s own buffers that are not in its state dict."""
    return module._non_persistent_buffers_set


def load_own_state(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, metadata: dict[str, Any],
                   missing_keys: list[str], unexpected_keys: list[str], errors: list[str]) -> None:
    """Load ``module``'s own tensors (not its children's) from ``state_dict``, as ``load_state_dict``
    does for each module (strict bookkeeping into the three lists)."""
    module._load_from_state_dict(state_dict, prefix, metadata, True, missing_keys, unexpected_keys, errors)


def state_dict_metadata(state_dict: Any) -> dict[str, Any] | None:
    """The per-module versions ``nn.Module.state_dict`` attaches to its result, if any."""
    return getattr(state_dict, "_metadata", None)


def parse_to(*args: Any, **kwargs: Any) -> tuple[Any, Any, bool, Any]:
    """``(device, dtype, non_blocking, memory_format)`` of a ``.to(...)`` call, parsed as torch does."""
    return torch._C._nn._parse_to(*args, **kwargs)


def chained_schedulers(scheduler: Any) -> list[Any]:
    """The schedulers a ``ChainedScheduler`` / ``SequentialLR`` drives (empty for any other)."""
    return list(getattr(scheduler, "_schedulers", None) or [])


def default_group() -> Any:
    """The world process group object (``distributed_c10d._get_default_group``)."""
    return _c10d()._get_default_group()


def _defined_in(hook: Any, package: str) -> bool:
    """Whether ``hook`` (a function, bound method, partial or torch's ``_WrappedHook``) comes from ``package``."""
    for _ in range(4):  # unwrap: _WrappedHook.hook, partial.func, bound method.__func__
        inner = getattr(hook, "hook", None) or getattr(hook, "func", None) or getattr(hook, "__func__", None)
        if inner is None:
            break
        hook = inner
    module = getattr(hook, "__module__", None) or ""
    return module == package or module.startswith(package + ".")


def remove_hooks_defined_in(model: torch.nn.Module, package: str) -> int:
    """Remove from every submodule of ``model`` the hooks whose function ``package`` defined.

    Every other hook stays, in its order. Returns how many were removed.
    """
    removed = 0
    for module in model.modules():
        for table in HOOK_TABLES:
            hooks = getattr(module, table, None)
            for handle_id, hook in list((hooks or {}).items()):
                if _defined_in(hook, package):
                    del hooks[handle_id]
                    for flags in HOOK_FLAGS:
                        getattr(module, flags, {}).pop(handle_id, None)
                    removed += 1
        if not module._backward_hooks:
            module._is_full_backward_hook = None
    return removed


def groups_of_this_rank() -> list[Any]:
    """Every process group created in this process that this rank belongs to."""
    c10d = _c10d()
    return [pg for pg in list(c10d._world.pg_map) if not c10d._rank_not_in_group(pg)]


def set_group_timeout(timeout: timedelta, group: Any) -> None:
    """Change ``group``'s collective timeout (``_set_pg_timeout``)."""
    _c10d()._set_pg_timeout(timeout, group)


def group_timeout(group: Any) -> timedelta | None:
    """The collective timeout a process group's backend will use, or None if it cannot be read."""
    for device in (torch.device("cuda"), torch.device("cpu")):
        try:
            backend = group._get_backend(device)
        except RuntimeError:
            continue
        options = getattr(backend, "options", None)
        if options is not None:
            return options._timeout
    return None


def flight_recorder_missing() -> list[str]:
    """The Flight Recorder names this torch lacks (empty when it can dump)."""
    c10d = getattr(getattr(torch, "_C", None), "_distributed_c10d", None)
    return [] if hasattr(c10d, "_dump_fr_trace") else ["torch._C._distributed_c10d._dump_fr_trace"]


def dump_flight_recorder() -> bytes:
    """This process's Flight Recorder entries, every group, with Python stacks: torch's pickle format
    (what ``torch.distributed.flight_recorder.fr_trace`` reads)."""
    return torch._C._distributed_c10d._dump_fr_trace(True, True, False)
