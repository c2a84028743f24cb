"""``lightning_zeromoe.loading.memory_release`` never throws away what this process wrote (issue 17).

``MADV_DONTNEED`` on a private file mapping drops the process's copy-on-write copies: a page that was
written reads the file's bytes again afterwards. These tests write into real memory-mapped
safetensors tensors and call the real ``madvise``; the swapped-out case turns on a small swap file
for a moment when the machine has no swap (root only; skipped otherwise).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import struct
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import torch

from lightning_zeromoe.loading import memory_release
from lightning_zeromoe.loading.memory_release import PAGE_FILE_OR_SHARED_ANON, PAGE_PRESENT, PAGE_SWAPPED, FilePages

pytestmark = pytest.mark.skipif(not memory_release.can_release_pages(),
                                reason="pages are only released on Linux with /proc/self/pagemap and madvise")

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MADV_PAGEOUT = 21  # Linux 5.4
_SOFT_DIRTY = 1 << 55
_EXCLUSIVE = 1 << 56


def _mapped(directory: Path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` saved as safetensors and read back as memory-mapped views of the file."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "x.safetensors")
    with safe_open(directory / "x.safetensors", framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _page_of(tensor: torch.Tensor, index: int) -> int:
    """The address of the page holding ``tensor.view(-1)[index]``."""
    return (tensor.data_ptr() + index * tensor.element_size()) // PAGE * PAGE


def _entries(lo: int, hi: int) -> bytes:
    """The raw ``/proc/self/pagemap`` entries of the pages of ``[lo, hi)``."""
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(lo // PAGE * 8)
        return f.read((hi - lo) // PAGE * 8)


def _entry(address: int) -> int:
    return struct.unpack("=Q", _entries(address, address + PAGE))[0]


def _resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s pages present in this process (pagemap bit 63)."""
    lo = tensor.data_ptr() // PAGE * PAGE
    hi = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size()) // PAGE) * PAGE
    return sum(1 for (e,) in struct.iter_unpack("=Q", _entries(lo, hi)) if e & PAGE_PRESENT) * PAGE


def _madvise(address: int, length: int, advice: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(address, length, advice)


def test_written_pages_classifies_pagemap_entries(tmp_path):
    """A pure-function unit test of the classifier, on entries read from this process's real
    ``/proc/self/pagemap`` (read-only, untouched and written pages of a private file mapping) and on
    crafted 64-bit swap entries, which a test cannot make the kernel produce without swap space
    (the kernel's own swap entries are checked in the swap test below, where the machine allows)."""
    big = _mapped(tmp_path, {"a": torch.zeros(1 << 20)})["a"]  # 4 MiB
    read, untouched, written = 4096, (1 << 19), (1 << 20) - 4096  # element indices, far apart (> 64 KiB)
    assert big[read].item() == 0.0
    big[written] = 1.0
    real = _entries(_page_of(big, read), _page_of(big, read) + PAGE) + \
        _entries(_page_of(big, untouched), _page_of(big, untouched) + PAGE) + \
        _entries(_page_of(big, written), _page_of(big, written) + PAGE)
    read_entry, untouched_entry, written_entry = (e for (e,) in struct.iter_unpack("=Q", real))
    assert read_entry & PAGE_PRESENT and read_entry & PAGE_FILE_OR_SHARED_ANON, hex(read_entry)
    assert not untouched_entry & PAGE_PRESENT, hex(untouched_entry)
    assert written_entry & PAGE_PRESENT and not written_entry & PAGE_FILE_OR_SHARED_ANON, hex(written_entry)
    assert memory_release.written_pages(real).tolist() == [False, False, True]

    crafted = [
        PAGE_SWAPPED | (12345 << 5) | 1,  # swapped out: only a written (anonymous) copy is ever swapped
        PAGE_SWAPPED | PAGE_FILE_OR_SHARED_ANON | _SOFT_DIRTY,  # a file page being migrated: kept, to be safe
        PAGE_PRESENT | PAGE_FILE_OR_SHARED_ANON | _SOFT_DIRTY | _EXCLUSIVE | 77,  # soft-dirty alone is no write
        PAGE_PRESENT | _EXCLUSIVE,  # the anonymous copy, with its frame number hidden (unprivileged reader)
        0,
    ]
    assert memory_release.written_pages(struct.pack(f"={len(crafted)}Q", *crafted)).tolist() == \
        [True, True, False, True, False]
    assert memory_release.written_pages(b"").numel() == 0


def test_whole_pages_are_those_inside_the_range():
    assert memory_release.whole_pages(1, 3 * 4096 + 5, 4096) == (4096, 3 * 4096)
    assert memory_release.whole_pages(4096, 3 * 4096, 4096) == (4096, 3 * 4096)
    lo, hi = memory_release.whole_pages(10, 4000, 4096)
    assert lo >= hi


def test_release_keeps_a_tensor_the_process_wrote_to(tmp_path):
    """A memory-mapped tensor edited by the user (then passed to ``from_pretrained`` as
    ``state_dict=``) keeps the edit through :meth:`FilePages.release`; its clean neighbour in the same
    file is still released."""
    mapped = _mapped(tmp_path, {"edited": torch.zeros(1 << 18), "clean": torch.ones(1 << 18)})  # 1 MiB each
    edited, clean = mapped["edited"], mapped["clean"]
    edited[1 << 17] = 42.0  # a page in the middle: a private copy now holds the only 42
    clean.sum()
    pages = FilePages()
    assert pages.mapping_of(edited) is not None and pages.mapping_of(clean) == pages.mapping_of(edited)
    resident = _resident_bytes(edited)

    pages.release(edited)
    assert edited[1 << 17].item() == 42.0
    assert _resident_bytes(edited) == resident, "a tensor with a written page is left alone"

    assert _resident_bytes(clean) > (1 << 20) - 2 * PAGE
    pages.release(clean)
    assert _resident_bytes(clean) <= 2 * PAGE
    assert torch.equal(clean, torch.ones(1 << 18))


def test_nothing_is_released_when_pagemap_cannot_be_read(tmp_path, monkeypatch):
    """Unreadable pagemap: no way to tell written pages from clean ones, so nothing is dropped."""
    tensor = _mapped(tmp_path, {"a": torch.ones(1 << 18)})["a"]
    tensor.sum()
    monkeypatch.setattr(memory_release, "_PAGEMAP", str(tmp_path))  # exists, but open() fails
    pages = FilePages()
    assert pages.mapping_of(tensor) is not None
    before = _resident_bytes(tensor)
    assert before > (1 << 20) - 2 * PAGE
    pages.release(tensor)
    assert pages.release_mappings([tensor]) == 0
    assert _resident_bytes(tensor) == before


@pytest.mark.parametrize("gate", ["not linux", "no pagemap", "no madvise"])
def test_everything_is_a_no_op_where_pages_cannot_be_released(tmp_path, monkeypatch, gate):
    tensor = _mapped(tmp_path, {"a": torch.ones(1 << 18)})["a"]
    tensor.sum()
    if gate == "not linux":
        monkeypatch.setattr(sys, "platform", "win32")
    elif gate == "no pagemap":
        monkeypatch.setattr(memory_release, "_PAGEMAP", str(tmp_path / "absent"))
    else:
        monkeypatch.setattr(memory_release, "_libc_function", lambda name: None)
    assert not memory_release.can_release_pages()
    pages = FilePages()
    assert pages.mappings == [] and pages.mapping_of(tensor) is None
    before = _resident_bytes(tensor)
    pages.release(tensor)
    assert pages.release_mappings([tensor]) == 0
    memory_release.trim_heap()
    assert _resident_bytes(tensor) == before and torch.equal(tensor, torch.ones(1 << 18))


@contextmanager
def _swap_space(directory: Path) -> Iterator[None]:
    """Swap space while the block runs: the machine's own if it has some, else a 16 MiB swap file
    turned on with ``swapon`` and off again afterwards (skips the test where that is not allowed)."""
    if _swap_total_kib() > 0:
        yield
        return
    if os.geteuid() != 0 or not (shutil.which("mkswap") and shutil.which("swapon") and shutil.which("swapoff")):
        pytest.skip("no swap space, and no root with mkswap/swapon to add a swap file")
    path = directory / "swapfile"
    with open(path, "wb") as f:  # written out, not fallocated: swapon refuses files with holes
        f.write(bytes(16 << 20))
    path.chmod(0o600)
    for command in (["mkswap", str(path)], ["swapon", str(path)]):
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            path.unlink()
            pytest.skip(f"{' '.join(command)} failed here ({proc.stderr.strip() or proc.returncode}): "
                        "cannot add swap space on this machine/filesystem")
    try:
        yield
    finally:
        subprocess.run(["swapoff", str(path)], capture_output=True, check=True)
        path.unlink()


def _swap_total_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("SwapTotal:"):
                return int(line.split()[1])
    return 0


@pytest.mark.parametrize("method", ["release", "release_mappings"])
def test_a_written_page_that_was_swapped_out_is_kept(tmp_path, method):
    """The copy of a written page, swapped out (pagemap bit 62, bit 63 clear), is still the only place
    the write lives: neither :meth:`FilePages.release` nor :meth:`FilePages.release_mappings` drops it.
    The page is pushed to swap with ``MADV_PAGEOUT``."""
    tensor = _mapped(tmp_path / "m", {"a": torch.zeros(1 << 18)})["a"]
    index = 1 << 17
    tensor[index] = 42.0
    page = _page_of(tensor, index)
    with _swap_space(tmp_path):
        if _madvise(page, PAGE, _MADV_PAGEOUT) != 0:
            pytest.skip(f"MADV_PAGEOUT failed (errno {ctypes.get_errno()}): kernel older than 5.4?")
        entry = _entry(page)
        if not entry & PAGE_SWAPPED:
            pytest.skip(f"the kernel kept the written page resident (pagemap entry {entry:#x})")
        assert not entry & PAGE_PRESENT
        pages = FilePages()
        if method == "release":
            pages.release(tensor)
        else:
            assert pages.release_mappings([tensor]) == 0
        after = _entry(page)  # still swapped, or back in as the anonymous copy (swapoff elsewhere)
        assert after & PAGE_SWAPPED or (after & PAGE_PRESENT and not after & PAGE_FILE_OR_SHARED_ANON), \
            f"the written copy was dropped (pagemap entry {after:#x})"
        assert tensor[index].item() == 42.0
    assert memory_release.written_pages(struct.pack("=Q", entry)).tolist() == [True]
