"""The numbers in a CUDA out-of-memory message, and what they say about the cause.

Why: the OOM message carries the facts that decide the fix. If the memory PyTorch reserved but
left unallocated could hold the failed request, the bytes were there but not in one piece, so
the fix is the allocator setting (fragmentation); otherwise the job needs less memory (smaller
micro-batch, checkpointing, ...). The message forms parsed here, from torch's caching allocator
(``c10/cuda/CUDACachingAllocator.cpp``) over the versions users still run:

* torch >= 2.1: ``Tried to allocate 3.39 GiB. GPU 1 has a total capacity of 79.32 GiB of which
  2.40 GiB is free. [Process N | Including non-PyTorch memory, this process] has 76.92 GiB memory
  in use. Of the allocated memory 73.28 GiB is allocated by PyTorch, and 1.59 GiB is reserved by
  PyTorch but unallocated.``
* torch 1.4-2.0: ``Tried to allocate 978.00 MiB (GPU 0; 4.00 GiB total capacity; 1.68 GiB
  already allocated; 0 bytes free; 2.72 GiB reserved in total by PyTorch)``
* torch < 1.4: ``(GPU 0; 31.72 GiB total capacity; 25.59 GiB already allocated; 5.39 GiB free;
  14.59 MiB cached)``, where "cached" is the cached memory not allocated (it can be smaller than
  "allocated", as in deepspeedai/DeepSpeed#237), so reserved = allocated + cached.

Before it raises, the allocator frees every cached segment that holds no live tensor and retries
(``release_cached_blocks``), so the "reserved but unallocated" bytes left in the message sit in
segments that still hold tensors: when they are at least the request, the request failed for
want of a contiguous block, which is what fragmentation means.

Sizes are printed by torch's ``format_size`` in bytes, KiB, MiB or GiB (powers of 1024).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["OomNumbers", "format_bytes", "parse_oom", "parse_size"]

_UNITS = {"b": 1, "byte": 1, "bytes": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE = r"(\d+(?:\.\d+)?) ?(bytes|byte|[KMGT]i?B|B)\b"
_HEAD = re.compile(r"CUDA out of memory\.? Tried to allocate " + _SIZE, re.IGNORECASE)
_FIELDS = {
    "total": (r"total capacity of " + _SIZE, _SIZE + r" total capacity"),
    "free": (r"of which " + _SIZE + r" is free", r";\s*" + _SIZE + r" free\b"),
    "allocated": (_SIZE + r" is allocated by PyTorch", _SIZE + r" already allocated"),
    "reserved": (_SIZE + r" reserved in total by PyTorch",),
    "unallocated": (_SIZE + r" is reserved by PyTorch but unallocated",),
    "cached": (_SIZE + r" cached\)",),
}
#: How far past "Tried to allocate" the numbers of one message are looked for (one message).
_WINDOW = 800


def parse_size(number: str, unit: str) -> int:
    """``("3.39", "GiB")`` -> bytes (binary units as torch prints them; KB/MB/GB are decimal)."""
    return round(float(number) * _UNITS[unit.lower()])


def format_bytes(value: int) -> str:
    """Bytes the way torch prints them (GiB / MiB / KiB with two decimals, or bytes)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value} bytes"


@dataclass(frozen=True)
class OomNumbers:
    """The sizes of one CUDA OOM message, in bytes; None where that message form omits one."""

    requested: int | None
    total: int | None
    free: int | None
    allocated: int | None
    reserved: int | None

    @property
    def reserved_unallocated(self) -> int | None:
        """Memory PyTorch's cache holds but no tensor uses (reserved - allocated)."""
        if self.reserved is None or self.allocated is None:
            return None
        return max(0, self.reserved - self.allocated)

    @property
    def fragmentation(self) -> bool:
        """True only when the cache held at least the requested bytes, just not in one block."""
        spare = self.reserved_unallocated
        return bool(spare and self.requested and spare >= self.requested)

    def summary(self) -> str:
        """One plain sentence with the numbers and what they mean."""
        parts = []
        if self.requested is not None:
            parts.append(f"a request for {format_bytes(self.requested)} failed")
        if self.free is not None:
            parts.append(f"{format_bytes(self.free)} of the GPU was free"
                         + (f" (of {format_bytes(self.total)})" if self.total is not None else ""))
        elif self.total is not None:
            parts.append(f"the GPU has {format_bytes(self.total)}")
        if self.allocated is not None:
            parts.append(f"PyTorch had {format_bytes(self.allocated)} allocated")
        spare = self.reserved_unallocated
        if spare is not None:
            parts.append(f"{format_bytes(spare)} reserved but unallocated")
        text = ", ".join(parts) if parts else "a CUDA allocation failed"
        text = text[0].upper() + text[1:]
        if self.fragmentation:
            verdict = ("the cache held enough memory for the request but not in one block: "
                       "this is fragmentation")
        elif spare is not None and self.requested is not None:
            verdict = ("the unallocated cache is smaller than the request, so the cache could "
                       "not have served it: the job needs less memory")
        else:
            verdict = "the message does not say how much PyTorch reserved, so fragmentation cannot be told"
        return f"{text}; {verdict}."


def _field(window: str, patterns: tuple[str, ...]) -> int | None:
    for pattern in patterns:
        hit = re.search(pattern, window, re.IGNORECASE)
        if hit:
            return parse_size(hit.group(1), hit.group(2))
    return None


def parse_oom(text: str) -> OomNumbers | None:
    """The numbers of the last CUDA OOM message in ``text``; None when there is none.

    A message without "Tried to allocate" (``CUDA error: out of memory``, a cuBLAS failure)
    carries no numbers, so it gives None too.
    """
    heads = list(_HEAD.finditer(text))
    if not heads:
        return None
    head = heads[-1]
    end = text.find("\n", head.end())
    window = text[head.end(): end if end != -1 else len(text)][:_WINDOW]
    values = {name: _field(window, patterns) for name, patterns in _FIELDS.items()}
    allocated, reserved = values["allocated"], values["reserved"]
    if reserved is None and allocated is not None:
        spare = values["unallocated"] if values["unallocated"] is not None else values["cached"]
        if spare is not None:
            reserved = allocated + spare
    return OomNumbers(requested=parse_size(head.group(1), head.group(2)), total=values["total"],
                      free=values["free"], allocated=allocated, reserved=reserved)
