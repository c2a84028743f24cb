"""The only place that touches torch's private ``distributed_c10d`` API.

DeepSpeed creates its expert-parallel groups with ``new_group(ranks)`` and no timeout, and torch
has no public way to change a group's timeout afterwards or to list the groups that exist. These
helpers wrap the private pieces that do it (present in torch 2.3 - 2.13):

* ``distributed_c10d._set_pg_timeout(timeout, group)``: change one group's collective timeout;
* ``distributed_c10d._world.pg_map``: every group this process created;
* ``distributed_c10d._rank_not_in_group(group)``: whether this rank is outside a group;
* ``ProcessGroup._get_backend(device).options._timeout``: read a group's timeout back.

``tests/test_torch_private.py`` checks each one exists, so a torch upgrade that removes one fails
there, by name, instead of silently leaving expert groups on the backend default.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

#: The private names this module needs, for the upgrade test and for error messages.
REQUIRED_C10D = ("_set_pg_timeout", "_world", "_rank_not_in_group")


def _c10d() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d


def missing_private_api() -> list[str]:
    """The private c10d names this torch lacks (empty when everything is there)."""
    c10d = _c10d()
    missing = [name for name in REQUIRED_C10D if not hasattr(c10d, name)]
    if hasattr(c10d, "_world") and not hasattr(c10d._world, "pg_map"):
        missing.append("_world.pg_map")
    return missing


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
