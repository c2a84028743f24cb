"""Giving memory back to the operating system while a model is built and loaded into ZeRO-3 partitions.

Three things keep a rank's resident set above its partitions while ``configure_model`` runs, each
measured in ``benchmarks/load_memory.py`` (344 M Mixtral, 2 CPU ranks):

* **glibc's heap.** Under ``zero.Init`` each module allocates its full parameters, DeepSpeed copies
  this rank's slice into ``ds_tensor`` and frees the full tensor. Blocks of a few MB to 32 MB come
  from the heap once glibc's mmap threshold has adapted to them, and free memory in the middle of
  the heap is not returned: one rank held 1141 MiB where its partitions were 669 MiB, until the
  first trim. :func:`trim_after_each_partition` trims after every partitioned module instead.
* **Pages of a memory-mapped checkpoint.** safetensors 0.8 touches the first page of every tensor
  when it hands the tensor out, and the kernel maps the neighbouring cached pages with it (fault
  around, 64 KiB): 56 MiB for a 995-tensor checkpoint before any weight is copied.
  :meth:`FilePages.release_mappings` drops them; :meth:`FilePages.release` drops one tensor's
  pages once it is copied.
* **Freed conversion buffers** (fused experts): :func:`trim_heap` after each layer.

Pages are dropped with ``madvise(MADV_DONTNEED)``, only in private mappings of regular files: they
are re-read from the page cache or the file when touched again. A page this process wrote to (a
private copy) would be lost, so :meth:`FilePages.release_mappings` leaves a mapping alone when any of its
pages was written. Everything here is a no-op where ``/proc``, ``madvise`` or ``malloc_trim`` is
missing (not Linux/glibc).
"""

from __future__ import annotations

import bisect
import ctypes
import os
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch
from torch import nn

_MADV_DONTNEED = 4  # Linux
#: A partitioned module whose largest parameter has at least this many elements freed a block big
#: enough to be worth a trim (1 MiB in fp32); smaller ones (norms, routers) are left to the next.
_TRIM_MIN_NUMEL = 1 << 18


class FilePages:
    """The private mappings of regular files in this process, taken once, to drop tensors' pages.

    Read ``/proc/self/maps`` once (a loader calls :meth:`release` thousands of times); tensors
    mapped later are not seen.
    """

    def __init__(self) -> None:
        self.mappings = [(lo, hi) for lo, hi, path in _private_file_mappings() if os.path.isfile(path)]
        self._starts = [lo for lo, _ in self.mappings]

    def mapping_of(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """The ``(start, end)`` of the file mapping that holds all of ``tensor``, if any."""
        if tensor.device.type != "cpu" or tensor.numel() == 0:
            return None
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        i = bisect.bisect_right(self._starts, start) - 1
        if i >= 0 and end <= self.mappings[i][1]:
            return self.mappings[i]
        return None

    def release(self, tensor: torch.Tensor) -> None:
        """Drop the whole pages behind ``tensor`` if it lives in one of the mappings.

        For a memory-mapped checkpoint (safetensors 0.8 maps each file privately, ``rw-p``) this
        takes the file pages just read out of the process's resident set. Only pages this process
        wrote to would be lost (a private mapping's copy-on-write pages); the loader calls this on
        tensors it has only read. (``MADV_PAGEOUT`` would not do: it skips pages another rank maps
        too.) Anonymous memory and shared mappings are left alone.
        """
        mapping = self.mapping_of(tensor)
        if mapping is None:
            return
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        page = os.sysconf("SC_PAGE_SIZE")
        lo, hi = max(mapping[0], -(-start // page) * page), min(mapping[1], end // page * page)
        if hi > lo:
            _libc().madvise(lo, hi - lo, _MADV_DONTNEED)

    def release_mappings(self, tensors: Iterable[torch.Tensor]) -> int:
        """Drop every resident page of the mappings that hold any of ``tensors``.

        Called before a checkpoint is copied, to undo what handing the tensors out touched. A
        mapping with a page this process has written to is skipped. Returns the bytes released.
        """
        hit = {m for m in map(self.mapping_of, tensors) if m is not None}
        released = 0
        for lo, hi in sorted(hit):
            if not _any_page_written(lo, hi):
                _libc().madvise(lo, hi - lo, _MADV_DONTNEED)
                released += hi - lo
        return released


def trim_heap() -> None:
    """Give freed heap memory back to the system (glibc ``malloc_trim``)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@contextmanager
def trim_after_each_partition(enabled: bool = True) -> Iterator[None]:
    """While active, trim the heap each time a module that ZeRO-3 has just partitioned is attached to
    its parent (the full tensors it was built with are freed by then).

    Uses torch's global module-registration hook, so it covers any model built under ``zero.Init``,
    from transformers or not.
    """
    if not enabled:
        yield
        return
    handle = nn.modules.module.register_module_module_registration_hook(_trim_if_partitioned)
    try:
        yield
    finally:
        handle.remove()


def _trim_if_partitioned(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    if submodule is None:
        return None
    if any(getattr(p, "ds_tensor", None) is not None and int(getattr(p, "ds_numel", 0)) >= _TRIM_MIN_NUMEL
           for p in submodule.parameters(recurse=False)):
        trim_heap()
    return None


def _private_file_mappings() -> list[tuple[int, int, str]]:
    """``(start, end, path)`` of every private mapping with a path in this process, sorted."""
    out = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) > 5 else ""
                if fields[1].endswith("p") and path.startswith("/"):
                    lo, _, hi = fields[0].partition("-")
                    out.append((int(lo, 16), int(hi, 16), path))
    except OSError:
        return []
    return sorted(out)


def _any_page_written(lo: int, hi: int) -> bool:
    """Whether a resident page of ``[lo, hi)`` is this process's private copy (written to).

    ``/proc/self/pagemap`` has one 64-bit entry per page: bit 63 "present", bit 61 "file page or
    shared anonymous"; a present page without bit 61 in a file mapping is a copy-on-write copy.
    When pagemap cannot be read, the answer is "yes", so nothing is released.
    """
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(lo // page * 8)
            data = f.read((hi - lo) // page * 8)
    except OSError:
        return True
    if not data:
        return False
    entries = torch.frombuffer(bytearray(data), dtype=torch.int64)  # bit 63 set: negative
    return bool(((entries < 0) & ((entries & (1 << 61)) == 0)).any())


_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _LIBC.madvise.restype = ctypes.c_int
    return _LIBC


__all__ = ["FilePages", "trim_after_each_partition", "trim_heap"]
