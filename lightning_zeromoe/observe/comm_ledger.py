"""``CommLedger``: bytes per optimizer step, by collective and by process group, counted at the
``torch.distributed`` call boundary.

Why at that boundary: DeepSpeed's own collectives (ZeRO's gradient reductions and parameter
gathers, AutoEP's all-to-all) never pass through our code, but every one of them ends in a
``torch.distributed`` function. For the duration of ``fit`` the ledger replaces these functions in
``torch.distributed`` and ``torch.distributed.distributed_c10d`` (torch's own helpers and
DeepSpeed's coalesced gathers look them up there), and the two references DeepSpeed's torch
backend took at ``init_distributed`` (``all_gather_function`` and ``reduce_scatter_function``, which
``deepspeed.comm.all_gather_into_tensor`` / ``reduce_scatter_tensor`` call) with counting wrappers;
the originals are put back at ``teardown`` and on an exception. Wrapping is not calling: every
collective of this package still goes through :mod:`lightning_zeromoe.engine.collectives`.

Counted (``torch.distributed`` name -> ledger collective):

* ``all_gather``, ``all_gather_into_tensor``, ``all_gather_single`` -> ``all_gather``
* ``reduce_scatter``, ``reduce_scatter_tensor``, ``reduce_scatter_single`` -> ``reduce_scatter``
  (torch 2.13 deprecates the ``*_tensor`` names for the ``*_single`` ones, which they call: the
  outer call counts)
* ``all_reduce``, ``all_reduce_coalesced`` -> ``all_reduce``
* ``all_to_all``, ``all_to_all_single`` -> ``all_to_all``
* ``broadcast`` -> ``broadcast``; ``reduce`` -> ``reduce`` (ZeRO-1/2 can reduce to one rank)

Bytes, per rank and call: the size of the *full* buffer of the collective, the convention of
``nccl-tests``: ``all_reduce``, ``broadcast``, ``reduce``: the tensor; ``all_gather``: the gathered
output (group size x the shard this rank sends); ``reduce_scatter``: the input (group size x the
shard this rank receives); ``all_to_all``: the input this rank sends (its own slice included).
What actually crosses the wire is that times ``(n - 1) / n`` (all-gather, reduce-scatter,
all-to-all) or ``2 (n - 1) / n`` (ring all-reduce) for a group of ``n`` ranks, which is why every
record keeps the group size; a group of one rank moves nothing. When one counted function calls
another (``all_gather_object`` is not counted, but torch's fallbacks are), only the outermost
call counts.

Groups: ``expert_parallel`` / ``expert_data_parallel`` when the group *is* one of DeepSpeed's
expert groups (by identity, so an expert-parallel group spanning every rank is still expert
parallel), ``world`` for the default group or any group of every rank (DeepSpeed's data-parallel
clone of it), ``other`` otherwise.

Per optimizer step, rank 0 logs ``comm/<collective>/<group>_MB`` (10^6 bytes) and
``comm/total_MB`` to every Lightning logger; every rank keeps its own :attr:`CommLedger.steps`.
Collectives between two optimizer steps (other callbacks', validation's) count towards the next.

Without Lightning (another training loop, the Hugging Face ``Trainer``): ``with ledger.counting():``
installs the wrappers and takes them out again; the loop calls :meth:`CommLedger.begin` once its
engine is built and :meth:`CommLedger.close_step` after each optimizer step.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import lightning as L
import torch
from typing_extensions import override

#: ``torch.distributed`` function name -> ledger collective.
COUNTED = {
    "all_gather": "all_gather", "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_to_all": "all_to_all", "all_to_all_single": "all_to_all",
    "broadcast": "broadcast", "reduce": "reduce",
}
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "reduce")
GROUPS = ("world", "expert_parallel", "expert_data_parallel", "other")
MB = 10**6


def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors or ())


#: Which argument (position, keyword) holds the buffer the bytes are read from, per function.
_SIZED_BY: dict[str, tuple[int, str]] = {
    "all_gather": (0, "tensor_list"), "all_gather_into_tensor": (0, "output_tensor"),
    "all_gather_single": (0, "output_tensor"),
    "reduce_scatter": (1, "input_list"), "reduce_scatter_tensor": (1, "input"), "reduce_scatter_single": (1, "input"),
    "all_reduce": (0, "tensor"), "all_reduce_coalesced": (0, "tensors"),
    "all_to_all": (1, "input_tensor_list"), "all_to_all_single": (1, "input"),
    "broadcast": (0, "tensor"), "reduce": (0, "tensor"),
}
#: The ``group`` argument's position, per function (keyword ``group`` everywhere).
_GROUP_AT = {"all_gather": 2, "all_gather_into_tensor": 2, "all_gather_single": 2, "reduce_scatter": 3,
             "reduce_scatter_tensor": 3, "reduce_scatter_single": 3,
             "all_reduce": 2, "all_reduce_coalesced": 2, "all_to_all": 2, "all_to_all_single": 4, "broadcast": 2,
             "reduce": 3}


def call_bytes(name: str, args: tuple, kwargs: dict) -> int:
    """Bytes of one call of ``torch.distributed.<name>`` (see the module docstring)."""
    pos, key = _SIZED_BY[name]
    buf = kwargs[key] if key in kwargs else args[pos] if len(args) > pos else None
    return _nbytes(buf)


def call_group(name: str, args: tuple, kwargs: dict) -> Any:
    if "group" in kwargs:
        return kwargs["group"]
    at = _GROUP_AT[name]
    return args[at] if len(args) > at else None


@dataclass
class StepComm:
    """One optimizer step on one rank: bytes and calls per (collective, group)."""

    step: int
    bytes: dict[tuple[str, str], int] = field(default_factory=dict)
    calls: dict[tuple[str, str], int] = field(default_factory=dict)
    #: Ranks in the group of each (collective, group) key (the largest seen).
    group_sizes: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, collective: str, group: str, nbytes: int, group_size: int) -> None:
        key = (collective, group)
        self.bytes[key] = self.bytes.get(key, 0) + nbytes
        self.calls[key] = self.calls.get(key, 0) + 1
        self.group_sizes[key] = max(self.group_sizes.get(key, 0), group_size)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def metrics(self, prefix: str = "comm") -> dict[str, float]:
        out = {f"{prefix}/{c}/{g}_MB": b / MB for (c, g), b in sorted(self.bytes.items())}
        out[f"{prefix}/total_MB"] = self.total / MB
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "bytes": {f"{c}/{g}": b for (c, g), b in self.bytes.items()},
                "calls": {f"{c}/{g}": n for (c, g), n in self.calls.items()},
                "group_sizes": {f"{c}/{g}": n for (c, g), n in self.group_sizes.items()}}


class _Patches:
    """The wrapped functions and where they came from, so that uninstalling restores exactly them."""

    def __init__(self) -> None:
        self.saved: list[tuple[Any, str, Any]] = []

    def replace(self, owner: Any, attr: str, wrapper: Callable) -> None:
        self.saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, wrapper)

    def restore(self) -> None:
        while self.saved:
            owner, attr, original = self.saved.pop()
            setattr(owner, attr, original)


class CommLedger(L.Callback):
    """Counts the bytes of every ``torch.distributed`` collective per optimizer step (see the module
    docstring for what is counted and how bytes are defined) and logs them on rank 0.

    Args:
        log_every_n_steps: Log every this many optimizer steps (the records keep every step).
        prefix: Metric name prefix.
    """

    def __init__(self, log_every_n_steps: int = 1, prefix: str = "comm") -> None:
        if log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps={log_every_n_steps} must be >= 1")
        self.log_every_n_steps = log_every_n_steps
        self.prefix = prefix
        #: One record per finished optimizer step, on every rank.
        self.steps: list[StepComm] = []
        #: What ran before the first training batch (engine setup, sanity checks).
        self.setup_comm = StepComm(step=-1)
        self._current = self.setup_comm
        self._patches = _Patches()
        self._depth = threading.local()
        self._last_step = -1
        self._logged = -1
        self._group_label: dict[int, tuple[str, int]] = {}

    # ------------------------------------------------------------------ install / uninstall

    @property
    def installed(self) -> bool:
        return bool(self._patches.saved)

    def install(self) -> None:
        """Wrap the counted functions (idempotent)."""
        if self.installed:
            return
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        from lightning_zeromoe._private.deepspeed import comm_backend

        wrappers: dict[int, Callable] = {}
        for name in COUNTED:
            for owner in (dist, c10d):
                original = getattr(owner, name, None)
                if original is None:
                    continue
                wrapper = wrappers.setdefault(id(original), self._wrap(name, original))
                self._patches.replace(owner, name, wrapper)
        backend = comm_backend()
        for attr, name in (("all_gather_function", "all_gather_into_tensor"),
                           ("reduce_scatter_function", "reduce_scatter_tensor")):
            original = getattr(backend, attr, None)
            if original is not None:
                self._patches.replace(backend, attr, wrappers.get(id(original)) or self._wrap(name, original))

    def uninstall(self) -> None:
        self._patches.restore()

    @contextmanager
    def counting(self) -> Iterator["CommLedger"]:
        """Count for the duration of the ``with`` block, outside Lightning (install, then uninstall,
        also on an exception). Enter it after the process group exists (DeepSpeed's backend is
        wrapped too when it is initialised)."""
        self.install()
        try:
            yield self
        finally:
            self.uninstall()

    def begin(self, step: int = 0) -> None:
        """Start the record of optimizer step ``step + 1``; what was counted so far stays in
        :attr:`setup_comm` (Lightning's ``on_train_start`` calls it with the trainer's step)."""
        self._last_step = step
        self._current = StepComm(step=step + 1)

    def _wrap(self, name: str, original: Callable) -> Callable:
        collective = COUNTED[name]
        depth = self._depth

        def counted(*args: Any, **kwargs: Any) -> Any:
            outer = getattr(depth, "n", 0) == 0
            if outer and self.installed:
                group = call_group(name, args, kwargs)
                label, size = self._label(group)
                self._current.add(collective, label, call_bytes(name, args, kwargs), size)
            depth.n = getattr(depth, "n", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                depth.n -= 1

        counted.__wrapped__ = original  # type: ignore[attr-defined]
        counted.__name__ = name
        return counted

    def _label(self, group: Any) -> tuple[str, int]:
        import torch.distributed as dist

        key = id(group)
        if key not in self._group_label:
            from lightning_zeromoe._private.deepspeed import expert_groups

            world = dist.get_world_size()
            size = world if group is None else dist.get_world_size(group)
            found = expert_groups()
            if any(group is g for g in found["expert_parallel"]):
                label = "expert_parallel"
            elif any(group is g for g in found["expert_data_parallel"]):
                label = "expert_data_parallel"
            elif group is None or group is dist.group.WORLD or size == world:
                label = "world"
            else:
                label = "other"
            if group is None or label != "other" or found["expert_parallel"]:
                self._group_label[key] = (label, size)  # settled; an unknown group may become an expert one
            return label, size
        return self._group_label[key]

    # ------------------------------------------------------------------ hooks

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.install()

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.install()  # when added after the setup hooks ran (ZeroMoEStrategy(comm_stats=True))

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.begin(trainer.global_step)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.sync(trainer)
        if trainer.is_global_zero:
            for record in self.steps:
                if record.step > self._logged and record.step % self.log_every_n_steps == 0:
                    for logger in trainer.loggers:
                        logger.log_metrics(record.metrics(self.prefix), step=record.step)
        self._logged = max(self._logged, self.steps[-1].step if self.steps else -1)

    def sync(self, trainer: L.Trainer) -> None:
        """Close the current record if the optimizer has stepped since the last one (idempotent, so
        another callback, the expert monitor, can call it first and read a complete window)."""
        step = trainer.global_step
        if step != self._last_step:
            self._last_step = step
            self.close_step(step)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.uninstall()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.uninstall()

    # ------------------------------------------------------------------ reading

    def close_step(self, step: int) -> StepComm:
        """End the record of optimizer step ``step`` (what was counted since the last one) and start
        the next; the hooks call it, and so can a loop without Lightning (after :meth:`install`)."""
        record, self._current = self._current, StepComm(step=step + 1)
        record.step = step
        self.steps.append(record)
        return record

    def window_metrics(self, after_step: int, prefix: str | None = None) -> dict[str, float]:
        """Mean bytes per step over the recorded steps after ``after_step``, as metrics (the expert
        monitor's window)."""
        recent = [s for s in self.steps if s.step > after_step]
        if not recent:
            return {}
        keys = {k for s in recent for k in s.bytes}
        pre = prefix or self.prefix
        out = {f"{pre}/{c}/{g}_MB": sum(s.bytes.get((c, g), 0) for s in recent) / len(recent) / MB for c, g in keys}
        out[f"{pre}/total_MB"] = sum(s.total for s in recent) / len(recent) / MB
        return out


def find_ledger(trainer: L.Trainer) -> CommLedger | None:
    return next((c for c in trainer.callbacks if isinstance(c, CommLedger)), None)


__all__ = ["COLLECTIVES", "COUNTED", "GROUPS", "CommLedger", "StepComm", "call_bytes", "find_ledger"]
