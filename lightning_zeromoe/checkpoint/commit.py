"""A DeepSpeed checkpoint is complete when, and only when, its ``latest`` file exists.

DeepSpeed 0.19.8 (``runtime/engine.py``, ``save_checkpoint``) has rank 0 write ``latest`` right
after rank 0's *own* files, before the barrier that waits for the other ranks. A rank killed in the
middle of its write then leaves ``latest`` pointing at a partial save. Saving again into the same
directory (``last.ckpt``, a fixed path) is worse: the old ``latest`` keeps pointing at shards that
are being overwritten. The strategy therefore saves with ``save_latest=False`` and:

1. :func:`begin_save`: before any rank writes, rank 0 removes the directory's ``latest``;
2. DeepSpeed writes every rank's files and ends with a barrier;
3. :func:`commit_save`: rank 0 writes ``latest`` (atomically), after ``zeromoe_meta.json``.

A save killed at any point leaves no ``latest``: resuming or exporting it is refused with a message
that says so, and saving again to the same path works.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

LATEST = "latest"
#: Knowledge-base entry of a save or a conversion that ran out of disk space.
DISK_FULL = "checkpoint-disk-full"
_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def begin_save(ckpt_dir: str | os.PathLike) -> None:
    """Rank 0, before any rank writes: the directory stops looking complete."""
    latest = Path(ckpt_dir) / LATEST
    if latest.is_file():
        latest.unlink()


def commit_save(ckpt_dir: str | os.PathLike, tag: str) -> None:
    """Rank 0, after every rank's files are written: the directory is complete."""
    latest = Path(ckpt_dir) / LATEST
    tmp = latest.with_name(LATEST + ".partial")
    tmp.write_text(tag)
    os.replace(tmp, latest)


#: How torch 2.13's zip writer (``torch.save``) reports a write the filesystem refused: a
#: ``RuntimeError`` without an errno. Measured with a file-size limit: "basic_ios::clear: iostream
#: error", then "unexpected pos 3264 vs 3156" from ``write_end_of_file``.
_WRITE_FAILED = ("No space left", "File too large", "Disk quota exceeded", "failed writing file",
                 "iostream error", "unexpected pos")


def is_disk_full(err: BaseException) -> bool:
    """Whether a failed save is the filesystem refusing a write (full disk, quota, file-size limit),
    by errno or by torch's wording, anywhere in the exception's chain."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _FULL:
            return True
        if any(text in str(seen) for text in _WRITE_FAILED):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


__all__ = ["DISK_FULL", "LATEST", "begin_save", "commit_save", "is_disk_full"]
