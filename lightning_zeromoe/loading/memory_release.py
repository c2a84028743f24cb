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
are re-read from the page cache or the file when touched again. A page this process wrote to is a
private copy, the only place that write exists, and ``MADV_DONTNEED`` would throw it away, so
:meth:`FilePages.release_mappings` leaves a whole mapping alone, and :meth:`FilePages.release` a
tensor's pages, when any of them was written (:func:`written_pages`: resident as an anonymous copy,
or swapped out, which only a copy can be). Everything here is a no-op where it cannot work: not
Linux, no ``/proc/self/pagemap``, no C library to call (Windows: ``ctypes.CDLL(None)`` raises), no
``madvise`` or no ``malloc_trim`` (musl).
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import os
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

_MADV_DONTNEED = 4  # Linux
#: A partitioned module whose largest parameter has at least this many elements freed a block big
#: enough to be worth a trim (1 MiB in fp32); smaller ones (norms, routers) are left to the next.
_TRIM_MIN_NUMEL = 1 << 18
_MAPS = "/proc/self/maps"
_PAGEMAP = "/proc/self/pagemap"

#: Bits of a ``/proc/<pid>/pagemap`` entry (one 64-bit word per virtual page, host byte order;
#: the kernel's Documentation/admin-guide/mm/pagemap.rst).
PAGE_PRESENT = 1 << 63
PAGE_SWAPPED = 1 << 62
#: Since Linux 3.5. Clear for a present page of a private file mapping: the page is an anonymous
#: copy-on-write copy, made when this process wrote to it.
PAGE_FILE_OR_SHARED_ANON = 1 << 61


class FilePages:
    """The private mappings of regular files in this process, taken once, to drop tensors' pages.

    Read ``/proc/self/maps`` once (a loader calls :meth:`release` thousands of times); tensors
    mapped later are not seen. Holds no mappings, so every method does nothing, where pages cannot
    be released safely (see :func:`can_release_pages`).
    """

    def __init__(self) -> None:
        mappings = _private_file_mappings() if can_release_pages() else []
        self.mappings = [(lo, hi) for lo, hi, path in mappings if os.path.isfile(path)]
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
        """Drop the whole pages behind ``tensor`` if it lives in one of the mappings and none of
        those pages was written.

        For a memory-mapped checkpoint (safetensors 0.8 maps each file privately, ``rw-p``) this
        takes the file pages just read out of the process's resident set. A tensor this process
        wrote to (a user who edits the mapped tensors and passes them to ``from_pretrained`` as
        ``state_dict=``) is left alone: its written pages are private copies that hold the only
        version of the edit. (``MADV_PAGEOUT`` would not do: it skips pages another rank maps too.)
        Anonymous memory and shared mappings are left alone.
        """
        mapping = self.mapping_of(tensor)
        if mapping is None:
            return
        start = tensor.data_ptr()
        lo, hi = whole_pages(start, start + tensor.numel() * tensor.element_size(), os.sysconf("SC_PAGE_SIZE"))
        _drop_unless_written(max(lo, mapping[0]), min(hi, mapping[1]))

    def release_mappings(self, tensors: Iterable[torch.Tensor]) -> int:
        """Drop every resident page of the mappings that hold any of ``tensors``.

        Called before a checkpoint is copied, to undo what handing the tensors out touched. A
        mapping with a page this process has written to is skipped. Returns the bytes released.
        """
        hit = {m for m in map(self.mapping_of, tensors) if m is not None}
        return sum(_drop_unless_written(lo, hi) for lo, hi in sorted(hit))


def written_pages(entries: bytes) -> torch.Tensor:
    """Which pages of a private file mapping hold data written by this process, from their
    ``/proc/self/pagemap`` entries (8 bytes each, host byte order): a bool per entry.

    A page of a private file mapping that was only read is the page cache's page (present, with
    :data:`PAGE_FILE_OR_SHARED_ANON`) or not mapped at all (entry 0). Writing to it gives the
    process an anonymous copy: present without that bit or, once swapped out, a swap entry
    (:data:`PAGE_SWAPPED`; a clean file page is never swapped, only dropped). A swap entry with the
    file bit (a file page the kernel is migrating) counts as written too: dropping it is not worth
    the guess. The soft-dirty bit (55) is no help: it is set on every page of a new mapping until
    something writes to ``/proc/<pid>/clear_refs``.
    """
    if not entries:
        return torch.zeros(0, dtype=torch.bool)
    words = torch.frombuffer(bytearray(entries), dtype=torch.int64)
    present = (words & _as_int64(PAGE_PRESENT)) != 0
    swapped = (words & _as_int64(PAGE_SWAPPED)) != 0
    file_page = (words & _as_int64(PAGE_FILE_OR_SHARED_ANON)) != 0
    return swapped | (present & ~file_page)


def whole_pages(start: int, end: int, page: int) -> tuple[int, int]:
    """The page-aligned ``[lo, hi)`` of the pages that lie entirely inside ``[start, end)``
    (``lo >= hi`` when there is none)."""
    return -(-start // page) * page, end // page * page


def can_release_pages() -> bool:
    """Whether pages can be dropped here: Linux, with ``/proc/self/pagemap`` (to see which pages were
    written) and ``madvise`` in the C library."""
    return sys.platform.startswith("linux") and os.path.exists(_PAGEMAP) and _libc_function("madvise") is not None


def trim_heap() -> None:
    """Give freed heap memory back to the system (glibc ``malloc_trim``); nothing without it."""
    trim = _libc_function("malloc_trim")
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
        with open(_MAPS) as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) > 5 else ""
                if fields[1].endswith("p") and path.startswith("/"):
                    lo, _, hi = fields[0].partition("-")
                    out.append((int(lo, 16), int(hi, 16), path))
    except OSError:
        return []
    return sorted(out)


def _drop_unless_written(lo: int, hi: int) -> int:
    """``MADV_DONTNEED`` on the page-aligned ``[lo, hi)`` unless one of its pages was written;
    the bytes dropped."""
    if hi <= lo or _any_page_written(lo, hi):
        return 0
    madvise = _libc_function("madvise")
    if madvise is None or madvise(lo, hi - lo, _MADV_DONTNEED) != 0:
        return 0
    return hi - lo


def _any_page_written(lo: int, hi: int) -> bool:
    """Whether a page of the page-aligned ``[lo, hi)`` is this process's own copy
    (:func:`written_pages`). When pagemap cannot be read, the answer is "yes", so nothing is released.
    """
    page = os.sysconf("SC_PAGE_SIZE")
    count = (hi - lo) // page
    try:
        with open(_PAGEMAP, "rb") as f:
            f.seek(lo // page * 8)
            data = f.read(count * 8)
    except OSError:
        return True
    if len(data) != count * 8:
        return True
    return bool(written_pages(data).any())


def _as_int64(mask: int) -> int:
    """An unsigned 64-bit mask as the signed value with the same bits (for int64 tensors)."""
    return mask - (1 << 64) if mask >= 1 << 63 else mask


@functools.lru_cache(maxsize=None)
def _libc() -> Any:
    """This process's C library, or ``None`` where ctypes cannot open it (Windows: ``CDLL(None)``
    raises ``TypeError``)."""
    try:
        return ctypes.CDLL(None, use_errno=True)
    except (OSError, TypeError):
        return None


@functools.lru_cache(maxsize=None)
def _libc_function(name: str) -> Callable[..., int] | None:
    """``name`` from the C library with its C signature set, or ``None`` where there is none."""
    function = getattr(_libc(), name, None)  # None when there is no library or no such symbol
    if function is None:
        return None
    if name == "madvise":
        function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    elif name == "malloc_trim":
        function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function


__all__ = ["FilePages", "trim_after_each_partition", "trim_heap"]
