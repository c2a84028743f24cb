"""The numbers in a CUDA out-of-memory message: what was requested, allocated and reserved.

Minimal version on the ``jupyter`` branch (the ``tsexplain`` branch owns this module; its version
replaces this one with the same interface). Both wordings of torch are read: torch >= 2.x
("Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.50 GiB is free.
... Of the allocated memory 75.10 GiB is allocated by PyTorch, and 1.90 GiB is reserved by PyTorch
but unallocated.") and torch 1.x ("(GPU 0; 79.15 GiB total capacity; 75.10 GiB already allocated;
1.50 GiB free; 77.00 GiB reserved in total by PyTorch)").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["OomNumbers", "parse_oom"]

_SIZE = r"([\d.]+) ?([KMGT]?i?B)"
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_FIELDS = {
    "requested": [rf"Tried to allocate {_SIZE}"],
    "total": [rf"total capacity of {_SIZE}", rf"{_SIZE} total capacity"],
    "free": [rf"of which {_SIZE} is free", rf"{_SIZE} free"],
    "allocated": [rf"{_SIZE} is allocated by PyTorch", rf"{_SIZE} already allocated"],
    "reserved": [rf"{_SIZE} reserved in total by PyTorch"],
}
_UNALLOCATED = re.compile(rf"{_SIZE} is reserved by PyTorch but unallocated", re.IGNORECASE)


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit.upper()])


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True)
class OomNumbers:
    """Sizes in bytes read from the message; None where the message did not say."""

    requested: int | None = None
    total: int | None = None
    free: int | None = None
    allocated: int | None = None
    reserved: int | None = None

    @property
    def reserved_unallocated(self) -> int | None:
        """Held by the caching allocator but not in use by a tensor."""
        if self.reserved is None or self.allocated is None:
            return None
        return max(0, self.reserved - self.allocated)

    @property
    def fragmentation(self) -> bool:
        """The request would fit in what the allocator holds unused: the free space is fragmented."""
        spare = self.reserved_unallocated
        return spare is not None and self.requested is not None and spare >= self.requested

    def summary(self) -> str:
        parts = [f"requested {_gib(self.requested)}"]
        if self.allocated is not None:
            parts.append(f"allocated {_gib(self.allocated)}")
        if self.reserved is not None:
            parts.append(f"reserved {_gib(self.reserved)} ({_gib(self.reserved_unallocated)} unused)")
        if self.free is not None:
            parts.append(f"free {_gib(self.free)}" + (f" of {_gib(self.total)}" if self.total else ""))
        verdict = ("fragmentation: the request fits in reserved but unused memory" if self.fragmentation
                   else "not fragmentation: the memory is in use by tensors")
        return ", ".join(parts) + f"; {verdict}"


def parse_oom(text: str) -> OomNumbers | None:
    """The numbers of the last CUDA out-of-memory message in ``text``; None when there is none."""
    at = text.rfind("out of memory")
    if at < 0:
        return None
    tail = text[at:at + 2000]
    values: dict[str, int] = {}
    for name, patterns in _FIELDS.items():
        for pattern in patterns:
            m = re.search(pattern, tail, re.IGNORECASE)
            if m:
                values[name] = _bytes(*m.groups())
                break
    m = _UNALLOCATED.search(tail)
    if m and "reserved" not in values and "allocated" in values:
        values["reserved"] = values["allocated"] + _bytes(*m.groups())
    return OomNumbers(**values) if values else None
