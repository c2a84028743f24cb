"""Collectives that run on every backend: the one place our code calls ``torch.distributed`` collectives.

A process group runs tensor collectives only on the device types its backend serves. A bare
``"nccl"`` group serves CUDA alone, so an all-reduce of a CPU tensor raises "No backend type
associated with device type cpu"; a ``"gloo"`` group is the CPU one. Code that builds a small CPU
tensor of flags or counters (and is proven on CPU ranks over gloo) would crash on GPUs over NCCL.
The wrappers here move the tensor to a device the group's backend serves, run the collective there,
and hand the result back on the caller's device with the caller's dtype.

The device choice is :func:`device_for_backend`, a pure function of the backend string (what
``torch.distributed.get_backend(group)`` returns) and, where it needs them, the current CUDA index
and the machine's accelerator type. :func:`backend_device` feeds it the live values.

Object collectives (:func:`all_gather_object`, :func:`broadcast_object_list`) are routed through
here too so there is one place, but torch already picks their device. In torch 2.13
(``distributed_c10d._get_object_coll_device``) it reads ``group._device_types``: the one device type
the group serves if there is only one (``"nccl"``: ``"cuda"``, and the pickled bytes are moved with
``.to("cuda")``, which is the *current* CUDA device, so ``torch.cuda.set_device`` must have been
called, as Lightning and DeepSpeed do); ``"cpu"`` when the group serves none yet or when ``"cpu"``
is among several (a gloo group lists ``cuda`` and ``cpu``; ``"cpu:gloo,cuda:nccl"`` uses gloo);
otherwise the first one listed. The bytes are unpickled from a CPU copy, but a tensor *inside* an
object is restored on the device it was pickled from (a rank's ``cuda:1`` tensor arrives on the
receiver as ``cuda:1``): send plain Python values or CPU tensors through object collectives.

:func:`barrier` passes ``device_ids`` for a CUDA-only group, so NCCL's barrier (an all-reduce of a
one-element tensor) uses this rank's current device instead of guessing from the global rank.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from lightning_zeromoe.knowledge import say

#: Device types each well-known single backend runs tensor collectives on, preferred first. Gloo
#: accepts some CUDA tensors too, but not for every collective, so its tensors go through the CPU;
#: MPI serves CUDA only when built CUDA-aware, which cannot be told from the name.
KNOWN_BACKENDS: Mapping[str, tuple[str, ...]] = {
    "nccl": ("cuda",),
    "gloo": ("cpu",),
    "mpi": ("cpu",),
    "ucc": ("cpu", "cuda"),
    "xccl": ("xpu",),
}


class UnknownBackendError(ValueError):
    """The backend string names no device type we can run a collective on."""


def _device_backend_pairs(backend: str) -> dict[str, str]:
    """``"cpu:gloo,cuda:nccl"`` -> ``{"cpu": "gloo", "cuda": "nccl"}`` (torch's mixed backend string)."""
    pairs: dict[str, str] = {}
    for part in backend.split(","):
        device, sep, name = part.strip().partition(":")
        if not sep or not device.strip() or not name.strip() or ":" in name:
            raise UnknownBackendError(say("collective-backend", "unreadable", backend=backend, part=part))
        pairs[device.strip()] = name.strip()
    return pairs


def backend_device_types(backend: str, *, accelerator: str | None = None,
                         default_device_backend_map: Mapping[str, str] | None = None,
                         backend_capability: Mapping[str, Sequence[str]] | None = None) -> tuple[str, ...]:
    """The device types a group created with ``backend`` runs tensor collectives on, preferred first.

    * ``"nccl"``, ``"gloo"``, ``"mpi"``, ``"ucc"``, ``"xccl"``: :data:`KNOWN_BACKENDS`;
    * a mixed string such as ``"cpu:gloo,cuda:nccl"``: the device types it names, ``cpu`` first
      (a small CPU tensor then needs no copy; torch's object collectives prefer it the same way);
    * ``"undefined"`` (``init_process_group()`` without a backend): torch initialises only the
      backend of the ``accelerator`` type (``"cpu"`` when None), if it has a default one;
    * any other name (``"hccl"``, ``"ccl"``, a registered plugin, ``"fake"``): the device types whose
      default backend it is in ``default_device_backend_map``, then the ones it declared in
      ``backend_capability`` (both default to ``torch.distributed.Backend``'s tables).

    Raises :class:`UnknownBackendError` when that leaves nothing.
    """
    name = str(backend).strip().lower()
    if ":" in name:
        types = list(_device_backend_pairs(name))
        return tuple(sorted(types, key=lambda t: t != "cpu"))
    if name in KNOWN_BACKENDS:
        return KNOWN_BACKENDS[name]
    if default_device_backend_map is None or backend_capability is None:
        registry = getattr(getattr(torch, "distributed", None), "Backend", None)
        if default_device_backend_map is None:
            default_device_backend_map = getattr(registry, "default_device_backend_map", None) or {}
        if backend_capability is None:
            backend_capability = getattr(registry, "backend_capability", None) or {}
    if name == "undefined":
        device_type = accelerator or "cpu"
        if device_type in default_device_backend_map:
            return (device_type,)
        raise UnknownBackendError(say("collective-backend", "no-default", "pass-backend", device_type=device_type))
    types = [t for t, b in default_device_backend_map.items() if str(b).lower() == name]
    types += [t for t in backend_capability.get(name, ()) if t not in types]
    if not types:
        raise UnknownBackendError(say("collective-backend", "no-device-type", "name-devices", backend=backend,
                                      name=name))
    return tuple(types)


def device_for_backend(backend: str, tensor_device: torch.device | str | None = None, *,
                       cuda_index: int | None = None, accelerator: str | None = None,
                       default_device_backend_map: Mapping[str, str] | None = None,
                       backend_capability: Mapping[str, Sequence[str]] | None = None) -> torch.device:
    """Where a collective on a group with this ``backend`` string should run (pure; no GPU needed).

    The tensor's own device when the backend serves its type (no copy); otherwise the first of
    :func:`backend_device_types`. A CUDA device chosen that way gets ``cuda_index`` (the current
    CUDA device; ``torch.device("cuda")`` without an index when None); other accelerators get no
    index, which torch resolves to their current device. Other arguments: as for
    :func:`backend_device_types`.
    """
    types = backend_device_types(backend, accelerator=accelerator,
                                 default_device_backend_map=default_device_backend_map,
                                 backend_capability=backend_capability)
    if tensor_device is not None:
        tensor_device = torch.device(tensor_device)
        if tensor_device.type in types:
            return tensor_device
    chosen = types[0]
    if chosen == "cuda" and cuda_index is not None:
        return torch.device("cuda", cuda_index)
    return torch.device(chosen)


def _accelerator_type() -> str | None:
    """This machine's accelerator type (torch >= 2.6 ``torch.accelerator``), None when there is none.

    ``current_accelerator()`` names the type torch was *built* for: a CUDA build on a machine without
    a GPU says ``cuda`` (measured: torch 2.15.0+cu132 from PyPI on a CPU machine, where
    ``torch.cuda.current_device()`` then raises "Found no NVIDIA driver"), so availability is asked first.
    """
    accel = getattr(torch, "accelerator", None)
    current = getattr(accel, "current_accelerator", None)
    available = getattr(accel, "is_available", None)
    if available is not None and not available():
        return None
    if current is not None:
        device = current()
        return device.type if device is not None else None
    return "cuda" if torch.cuda.is_available() else None


def _with_current_index(device: torch.device) -> torch.device:
    """``device`` with the current index of its type filled in (cuda -> ``torch.cuda.current_device()``)."""
    if device.type == "cpu" or device.index is not None:
        return device
    module = getattr(torch, device.type, None)
    current = getattr(module, "current_device", None)
    return torch.device(device.type, current()) if current is not None else device


def backend_device(group: Any = None, tensor: torch.Tensor | None = None) -> torch.device:
    """The device a collective on ``group`` (default: the world group) should run ``tensor`` on.

    :func:`device_for_backend` of ``torch.distributed.get_backend(group)``; the current device
    index is read only when the choice is an accelerator, so a CPU-only run on a GPU machine never
    touches CUDA.
    """
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    accelerator = _accelerator_type() if backend.lower() == "undefined" else None
    device = device_for_backend(backend, tensor.device if tensor is not None else None, accelerator=accelerator)
    return _with_current_index(device)


def is_initialized() -> bool:
    """Whether ``torch.distributed`` is available and its default process group exists."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _not_in(group: Any) -> bool:
    """Whether this rank is outside ``group`` (torch's collectives then warn and return)."""
    import torch.distributed as dist

    return group is not None and dist.get_rank(group) < 0


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` itself when it is already a contiguous tensor on ``device``, else a contiguous copy there."""
    return tensor.to(device).contiguous()


def all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` over ``group`` in place (``op``: a ``ReduceOp``, SUM when None) and return it.

    The collective runs on :func:`backend_device`; when that is not where ``tensor`` lives, a copy
    is reduced there and written back, so ``tensor`` keeps its device and dtype.
    """
    import torch.distributed as dist

    if _not_in(group):
        return tensor
    work = _on(tensor, backend_device(group, tensor))
    dist.all_reduce(work, op=dist.ReduceOp.SUM if op is None else op, group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def broadcast(tensor: torch.Tensor, src: int = 0, group: Any = None) -> torch.Tensor:
    """Overwrite ``tensor`` with global rank ``src``'s, in place, and return it (device and dtype kept)."""
    import torch.distributed as dist

    if _not_in(group):
        return tensor
    work = _on(tensor, backend_device(group, tensor))
    dist.broadcast(work, src=src, group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def all_gather(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape and dtype on all ranks), in group-rank order, on ``tensor``'s device."""
    import torch.distributed as dist

    if _not_in(group):
        return []
    work = _on(tensor, backend_device(group, tensor))
    out = [torch.empty_like(work) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, work, group=group)
    return [t.to(tensor.device) for t in out]


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's picklable ``obj``, in group-rank order (torch picks the device; see the module doc)."""
    import torch.distributed as dist

    if _not_in(group):
        return []
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object_list(objects: list[Any], src: int = 0, group: Any = None) -> list[Any]:
    """Fill ``objects`` in place with global rank ``src``'s list (same length on every rank) and return it."""
    import torch.distributed as dist

    if not _not_in(group):
        dist.broadcast_object_list(objects, src=src, group=group)
    return objects


def barrier(group: Any = None, timeout: Any = None) -> None:
    """Wait until every rank of ``group`` gets here (``timeout``: a ``timedelta``, the group's when None).

    On a CUDA-only group (NCCL) the barrier is pinned to this rank's current CUDA device, unless
    the group was bound to one by ``init_process_group(device_id=...)``.
    """
    import torch.distributed as dist

    if _not_in(group):
        return
    device = backend_device(group)
    pg = group if group is not None else dist.group.WORLD
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    if device.type == "cuda" and getattr(pg, "bound_device_id", None) is None:
        kwargs["device_ids"] = [device.index]
    dist.barrier(group=group, **kwargs)


def end_all_groups(wait: bool, timeout: Any = None) -> None:
    """Destroy every process group of this process (the world group, DeepSpeed's, ours).

    ``wait``: first a barrier on the world group (``timeout``: a ``timedelta``), so no rank closes its
    connections while a peer still reads from them. Nothing happens when no group is up.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if wait:
        barrier(timeout=timeout)
    dist.destroy_process_group()


__all__ = ["KNOWN_BACKENDS", "UnknownBackendError", "all_gather", "all_gather_object", "all_reduce", "backend_device",
           "backend_device_types", "barrier", "broadcast", "broadcast_object_list", "device_for_backend", "end_all_groups",
           "is_initialized"]
